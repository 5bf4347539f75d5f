"""The worked examples of docs/howto.md, each made exactly as its steps say, outside the product.

- An intent type with neither VM nor node: ``detach_project_gpus``, every template GPU of a
  project's VMs removed, decided under ``project/<project>`` ("An intent type").
- A notification sink: ``gotify``, a webhook format for a Gotify server ("A notification sink").
- A watched kind: ``VirtualMachineInstanceMigration``, decided under its VM ("A watched kind").

Where a step edits a declaration of the product (the ``Intent`` union, ``RULES``, ``PAYLOADS``,
``FOLDS``), the example declares the same thing here and the tests hand it to the code that
reads the declaration: ``Engine(rules=..., folds=...)``, ``PAYLOADS`` for one test. So
tests/rules/test_extending.py fails as soon as the steps stop being enough.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from handlers.contracts.delivery import Payload, render_email
from handlers.contracts.messages import (
    REASON_MAX,
    DecisionKey,
    GPUMutation,
    IntentBase,
    Notification,
    Spec,
    WatchedKind,
    WatchEvent,
    vm_key,
)
from handlers.core.decisions import Context, vm_subject
from handlers.core.outcomes import ACCEPTED, Refused
from handlers.core.tables import VMS
from handlers.decide.intents import RULES, Rule, RuleOutcome
from handlers.decide.observing import FOLDS, Fold
from handlers.rules.auth import Principal
from handlers.rules.gpus import desired_vm, gpu_devices, plan_patch

# ------------------------------------------------------------------ an intent type


class DetachProjectGPUsSpec(Spec):
    reason: str = Field(min_length=1, max_length=REASON_MAX, description="Why; told in the audit record.")


class DetachProjectGPUsIntent(IntentBase):  # step 1: the model, with the key it is decided under
    type: Literal["detach_project_gpus"]
    project: str = Field(min_length=1)  # the project is what the intent is about
    spec: DetachProjectGPUsSpec
    decided_under = DecisionKey("project/{project}")


def detach_project_gpus(ctx: Context, intent: DetachProjectGPUsIntent, principal: Principal) -> RuleOutcome:
    """Step 2: the rule. Only an operator may take a whole project's GPUs away; each VM with a
    template GPU gets the patch ``set_gpu`` to null would give it, planned on its observed
    object. It writes no row: a decision writes only under its own key."""
    if not principal.operator:
        return Refused(f"{principal.name} may not detach the GPUs of a project: only operators may")
    mutation = GPUMutation(device_name=None, eviction_strategy=ctx.config.gpu_vm.eviction_strategy)
    for vm in sorted(ctx.state.values(VMS), key=lambda vm: vm.key):
        if vm.project != intent.project or not gpu_devices(vm.object):
            continue
        ctx.command("patch_vm", vm_subject(vm.key), patch=plan_patch(vm.object, desired_vm(vm.object, mutation)),
                    base_resource_version=vm.resource_version, mutation=mutation,
                    requested_by=intent.requested_by)
    return ACCEPTED


# Step 2, its entry: the product's rules and this one, for Engine(rules=...).
RULES_WITH_EXAMPLE: Mapping[type[IntentBase], Rule] = {**RULES, DetachProjectGPUsIntent: detach_project_gpus}


# ------------------------------------------------------------------ a notification sink

GOTIFY_PRIORITY = {"info": 2, "warning": 5, "critical": 8}


def gotify_message(notification: Notification, source: str, context: dict[str, str]) -> dict[str, Any]:
    """Step 1: the body a Gotify server's ``POST /message`` takes (its token in the endpoint's headers)."""
    return {"title": render_email(notification).subject, "message": notification.message,
            "priority": GOTIFY_PRIORITY[notification.severity]}


GOTIFY = Payload("application/json", gotify_message)  # step 1, its entry in PAYLOADS under "gotify"


# ------------------------------------------------------------------ a watched kind

# Step 1: the kind and where the API server serves it.
MIGRATIONS = WatchedKind("VirtualMachineInstanceMigration", "kubevirt.io", "v1",
                         "virtualmachineinstancemigrations")


def migration_key(obj: dict[str, Any]) -> str:
    """Step 2, the key: a migration is decided under the VM whose VMI it moves, so its fold
    reads that VM's rows."""
    metadata, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    return vm_key(metadata.get("namespace") or "default", str(spec.get("vmiName")))


def migration_fold(ctx: Context, event: WatchEvent) -> None:
    """Step 2, the fold: a GPU passed through cannot move with its VM, so the audit record of
    a migration of a GPU VM says that KubeVirt will not complete it."""
    vm = ctx.state.get(VMS, migration_key(event.object))
    if event.type != "DELETED" and vm is not None and vm.template_gpus:
        ctx.remark(f"VM {vm.namespace}/{vm.name} has a passed-through GPU: its migration "
                   f"{event.object['metadata']['name']} cannot complete")


FOLDS_WITH_EXAMPLE: Mapping[str, Fold] = {**FOLDS, MIGRATIONS.kind: Fold(migration_key, migration_fold)}
