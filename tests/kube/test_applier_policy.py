"""A hostile publisher against the applier (real broker, real kube-apiserver): commands
written straight onto the commands topic, forged results on the results topic.

* Commands without the worker's seal — an SSH key injected into a kube-system VM and its
  owner changed, bob's VM relabelled into another project, a VM created in kube-system, a
  control-plane node cordoned, a kube-system VMI deleted; unsealed, or sealed with a key the
  applier does not hold — are each refused with a result and an audit record, and the API
  server's objects are as they were.
* The same commands sealed with the right key are refused by the applier's own policy.
* A forged result published before the real command, and a forged command under the real
  command's id, do not stop the real command: the VM gets its GPU.

Outcomes are read from the topics by this module's own reader and from the API server.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.rest import ApiException

from handlers.contracts import ids
from handlers.contracts.messages import Command, CommandResult, CommandType, GPUMutation, ObjectRef
from handlers.core.decisions import subject_key
from handlers.rules.gpus import desired_vm, plan_patch
from streams.common.codecs import encode_message
from harness.running import Deployment
from samples.cluster import A100, PROJECT_LABEL
from samples.cluster import vm as vm_object
from streams.common.signing import Keyring
from tests.support.kube_apiserver import as_others_write_it, empty_of_kubevirt, reconciled_vm
from tests.support.waiting import eventually
from tests.kube.test_applying import (  # noqa: F401  (fixtures: this module's own applier process)
    KUBEVIRT,
    Published,
    applier,
    create_vm_command,
    deployment,
    make_node,
    probe_url,
    published,
    api_proxy,
)

pytestmark = [pytest.mark.kube, pytest.mark.kafka]

ALICE, BOB, MALLORY = "alice@example.com", "bob@example.com", "mallory@example.com"
SSH_KEY = {"sshPublicKey": {"source": {"secret": {"secretName": "mallory-key"}},
                            "propagationMethod": {"qemuGuestAgent": {"users": ["root"]}}}}
WRONG_KEY = Keyring({"k-wrong": b"m" * 32}, "k-wrong")
ADD_A100 = GPUMutation(device_name=A100, eviction_strategy="External")


def _created(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    for field in ("uid", "resourceVersion", "generation"):
        obj["metadata"].pop(field, None)
    return obj


def _vmi(namespace: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"domain": {"devices": {}, "memory": {"guest": "128Mi"}}}}


@dataclass
class Targets:
    """What the attacks aim at, made by an administrator, and how to read each back."""

    api: client.ApiClient
    project_a: str  # alice's project namespace (proj-a)
    project_b: str  # bob's (proj-b)
    system_vm: str  # a VM in kube-system
    system_vmi: str  # a VMI in kube-system
    control_plane: str  # a control-plane node
    by_hand: str  # a node an operator cordoned

    def read(self) -> dict[str, Any]:
        custom = client.CustomObjectsApi(self.api)
        core = client.CoreV1Api(self.api)

        def get(namespace: str, plural: str, name: str) -> dict[str, Any] | None:
            try:
                found: dict[str, Any] = custom.get_namespaced_custom_object(*KUBEVIRT, namespace, plural, name)
                return found
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        def node(name: str) -> dict[str, Any]:
            raw: dict[str, Any] = json.loads(core.read_node(name, _preload_content=False).data)
            return raw

        return {
            "system vm": as_others_write_it(get("kube-system", "virtualmachines", self.system_vm)),
            "system vmi": as_others_write_it(get("kube-system", "virtualmachineinstances", self.system_vmi)),
            "bob's vm": as_others_write_it(get(self.project_b, "virtualmachines", "dev-1")),
            "created in kube-system": get("kube-system", "virtualmachines", f"planted-{self.project_a}"),
            "created in proj-a": get(self.project_a, "virtualmachines", "planted"),
            "control-plane node": as_others_write_it(node(self.control_plane)),
            "cordoned by hand": as_others_write_it(node(self.by_hand)),
        }


@pytest.fixture
def targets(api: client.ApiClient, make_node: Callable[..., str]) -> Iterator[Targets]:
    core = client.CoreV1Api(api)
    custom = client.CustomObjectsApi(api)
    suffix = uuid.uuid4().hex[:8]
    project_a, project_b = f"proj-a-{suffix}", f"proj-b-{suffix}"
    for namespace, project in ((project_a, "proj-a"), (project_b, "proj-b")):
        core.create_namespace({"metadata": {"name": namespace, "labels": {PROJECT_LABEL: project}}})
    # Halted, so that KubeVirt's writes to them end (reconciled_vm): the attacks are planned on them.
    custom.create_namespaced_custom_object(*KUBEVIRT, project_b, "virtualmachines", _created(
        vm_object(project_b, "dev-1", project="proj-b", owner=BOB, run_strategy="Halted")))
    system_vm, system_vmi = f"sys-{suffix}", f"sys-vmi-{suffix}"  # apart: virt-controller adopts a VMI named as its VM
    custom.create_namespaced_custom_object(*KUBEVIRT, "kube-system", "virtualmachines",
                                           _created(vm_object("kube-system", system_vm, project="proj-a", owner=ALICE,
                                                              run_strategy="Halted")))
    custom.create_namespaced_custom_object(*KUBEVIRT, "kube-system", "virtualmachineinstances",
                                           _vmi("kube-system", system_vmi))
    control_plane = make_node()
    core.patch_node(control_plane, {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}})
    by_hand = make_node()
    core.patch_node(by_hand, {"spec": {"unschedulable": True}})
    reconciled_vm(api, project_b, "dev-1")
    reconciled_vm(api, "kube-system", system_vm)
    try:
        yield Targets(api, project_a, project_b, system_vm, system_vmi, control_plane, by_hand)
    finally:
        for plural, name in (("virtualmachines", system_vm), ("virtualmachineinstances", system_vmi),
                             ("virtualmachines", f"planted-{project_a}")):
            try:
                custom.delete_namespaced_custom_object(*KUBEVIRT, "kube-system", plural, name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        for namespace in (project_a, project_b):
            empty_of_kubevirt(api, namespace)
            core.delete_namespace(namespace)


# ------------------------------------------------------------------------- the attacks


def _command(type_: CommandType, target: ObjectRef, **fields: Any) -> Command:
    cause = f"attack-{uuid.uuid4().hex[:12]}"
    return Command(command_id=ids.command_id(cause, type_, subject_key(target)), type=type_, target=target,
                   cause=cause, issued_at=datetime.now(UTC), requested_by=fields.pop("requested_by", MALLORY),
                   **fields)


def attacks(targets: Targets) -> dict[str, Command]:
    """The commands of the issue's report, each planned against the live object."""
    live = targets.read()
    system_vm = live["system vm"]
    bobs_vm = client.CustomObjectsApi(targets.api).get_namespaced_custom_object(
        *KUBEVIRT, targets.project_b, "virtualmachines", "dev-1")
    planted = create_vm_command(targets.project_a, "planted").manifest
    assert planted is not None
    in_system = copy.deepcopy(planted)
    in_system["metadata"].update(namespace="kube-system", name=f"planted-{targets.project_a}")
    other_project = copy.deepcopy(planted)
    other_project["metadata"]["labels"][PROJECT_LABEL] = "proj-b"
    system_rv = client.CustomObjectsApi(targets.api).get_namespaced_custom_object(
        *KUBEVIRT, "kube-system", "virtualmachines", targets.system_vm)["metadata"]["resourceVersion"]
    assert system_vm is not None
    return {
        "ssh key and owner in kube-system": _command(
            "patch_vm", ObjectRef(kind="VirtualMachine", namespace="kube-system", name=targets.system_vm),
            base_resource_version=system_rv, patch=[
                {"op": "add", "path": "/spec/template/spec/accessCredentials", "value": [SSH_KEY]},
                {"op": "replace", "path": "/metadata/annotations/vmstream.io~1owner", "value": MALLORY}]),
        "bob's vm into another project": _command(
            "patch_vm", ObjectRef(kind="VirtualMachine", namespace=targets.project_b, name="dev-1"),
            base_resource_version=bobs_vm["metadata"]["resourceVersion"], patch=[
                {"op": "replace", "path": f"/metadata/labels/{PROJECT_LABEL.replace('/', '~1')}",
                 "value": "proj-a"}]),
        "create in kube-system": _command(
            "create_vm", ObjectRef(kind="VirtualMachine", namespace="kube-system",
                                   name=f"planted-{targets.project_a}"), manifest=in_system),
        "create labelled for another project": _command(
            "create_vm", ObjectRef(kind="VirtualMachine", namespace=targets.project_a, name="planted"),
            manifest=other_project),
        "cordon a control-plane node": _command("cordon_node", ObjectRef(kind="Node", name=targets.control_plane)),
        "uncordon an operator's cordon": _command("uncordon_node", ObjectRef(kind="Node", name=targets.by_hand)),
        "delete a kube-system vmi": _command(
            "delete_vmi", ObjectRef(kind="VirtualMachineInstance", namespace="kube-system", name=targets.system_vmi)),
    }


def publish(deployment: Deployment, command: Command, keyring: Keyring | None) -> None:
    """Straight onto the commands topic, sealed with ``keyring`` (None: not at all)."""
    deployment.publish_raw("commands", subject_key(command.target), encode_message(command, keyring=keyring))


def results_of(published: Published, commands: dict[str, Command]) -> dict[str, dict[str, Any]]:
    """One result per command, once every command has one."""
    def all_there() -> dict[str, dict[str, Any]] | None:
        found = {what: published.results(c.command_id) for what, c in commands.items()}
        if all(found.values()):
            assert all(len(r) == 1 for r in found.values()), found
            return {what: r[0] for what, r in found.items()}
        return None

    return eventually(all_there, "a result for every attack")


# ------------------------------------------------------------------------- tests


@pytest.mark.parametrize("keyring", [None, WRONG_KEY], ids=["unsealed", "sealed-with-another-key"])
def test_commands_not_sealed_by_the_worker_are_refused_and_nothing_changes(
    deployment: Deployment, published: Published, targets: Targets, keyring: Keyring | None
) -> None:
    before = targets.read()
    commands = attacks(targets)
    for command in commands.values():
        publish(deployment, command, keyring)
    results = results_of(published, commands)
    for what, result in results.items():
        assert result["outcome"] == "failed", what
        assert result["refused"] == "unauthenticated", what
        assert result["error"].startswith("refused: the command is not sealed by the worker"), what
        [audit] = published.audits(commands[what].command_id)
        assert audit["outcome"] == "rejected" and audit["commands"] == [], what
        # Whoever the forger named is not told: the requester and the target are claims.
        assert published.notifications(commands[what].command_id) == [], what
    why = "it carries no MAC" if keyring is None else "its MAC key 'k-wrong' is unknown"
    assert {result["error"].rsplit(": ", 1)[1] for result in results.values()} == {why}
    assert targets.read() == before


def test_sealed_commands_outside_the_policy_are_refused_and_nothing_changes(
    deployment: Deployment, published: Published, targets: Targets
) -> None:
    before = targets.read()
    commands = attacks(targets)
    for command in commands.values():
        publish(deployment, command, deployment.signing.keyring())
    results = results_of(published, commands)
    reasons = {what: result["error"] for what, result in results.items()}
    for what, result in results.items():
        assert result["outcome"] == "failed" and result.get("refused") == "policy", (what, result)
        assert result["error"].startswith("refused by the applier's policy: "), what
        [audit] = published.audits(commands[what].command_id)
        assert audit["outcome"] == "failed" and audit["reason"] == result["error"], what
    assert "system namespace" in reasons["ssh key and owner in kube-system"]
    assert "outside the GPU fields" in reasons["bob's vm into another project"]
    assert "system namespace" in reasons["create in kube-system"]
    assert "not the namespace's" in reasons["create labelled for another project"]
    assert "control-plane" in reasons["cordon a control-plane node"]
    assert "not cordoned by vmstream" in reasons["uncordon an operator's cordon"]
    assert "system namespace" in reasons["delete a kube-system vmi"]
    assert targets.read() == before


def test_forged_results_and_commands_do_not_suppress_the_real_command(
    api: client.ApiClient, deployment: Deployment, published: Published, targets: Targets
) -> None:
    custom = client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(
        *KUBEVIRT, targets.project_a, "virtualmachines",
        _created(vm_object(targets.project_a, "vm-1", project="proj-a", owner=ALICE, run_strategy="Halted")))
    live = reconciled_vm(api, targets.project_a, "vm-1")
    real = _command("patch_vm", ObjectRef(kind="VirtualMachine", namespace=targets.project_a, name="vm-1"),
                    requested_by=ALICE, base_resource_version=live["metadata"]["resourceVersion"],
                    patch=plan_patch(live, desired_vm(live, ADD_A100)), mutation=ADD_A100)
    key = subject_key(real.target)
    # Command ids are a public function of the intent: the forger knows this one in advance.
    forged_result = {"command_id": real.command_id, "outcome": "applied", "at": datetime.now(UTC).isoformat()}
    deployment.publish_raw("command-results", key, json.dumps(forged_result).encode())
    sealed_wrong = CommandResult(command_id=real.command_id, outcome="applied", at=datetime.now(UTC))
    deployment.publish_raw("command-results", key, encode_message(sealed_wrong, keyring=WRONG_KEY))
    # And a forged command under the same id: it is refused, and its refusal marks nothing.
    decoy = real.model_copy(update={"patch": [{"op": "add", "path": "/spec/template/spec/accessCredentials",
                                               "value": [SSH_KEY]}]})
    publish(deployment, decoy, None)
    eventually(lambda: [r for r in published.results(real.command_id) if r.get("refused") == "unauthenticated"],
               "the decoy's refusal")

    publish(deployment, real, deployment.signing.keyring())

    kid = deployment.signing.key_id

    def applied() -> dict[str, Any] | None:
        """The result the applier published for it (sealed with the deployment's key)."""
        own = [r for r in published.results(real.command_id)
               if r.get("mac", {}).get("kid") == kid and "refused" not in r]
        return own[0] if own else None

    result = eventually(applied, "the real command's result")
    assert result["outcome"] == "applied"
    stored = custom.get_namespaced_custom_object(*KUBEVIRT, targets.project_a, "virtualmachines", "vm-1")
    assert stored["spec"]["template"]["spec"]["domain"]["devices"]["gpus"] == [
        {"name": "gpu-0", "deviceName": A100}]
    assert "accessCredentials" not in stored["spec"]["template"]["spec"]
