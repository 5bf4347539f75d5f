"""docs/howto.md's worked examples, decided through the engine as the steps leave them
(tests/support/extension_example.py): an intent type about a project, and a watched kind."""

from __future__ import annotations

from typing import Any

from handlers.contracts.messages import parse_intent
from handlers.decide.engine import Engine, Result, Source
from handlers.decide.inputs import WatchInput
from samples.cluster import RTX, node, vm, vmi
from tests.support.extension_example import (
    FOLDS_WITH_EXAMPLE,
    MIGRATIONS,
    RULES_WITH_EXAMPLE,
    DetachProjectGPUsIntent,
)
from tests.support.harness import EVENTS_TOPIC, KEYS, Harness, config

OPS = "ops@example.com"  # an operator of the example config
ALICE = "alice@example.com"


def cluster() -> Harness:
    """Two GPU VMs and one without of proj-a, a GPU VM of proj-b; the engine with the examples."""
    h = Harness()
    h.engine = Engine(config(), KEYS, rules=RULES_WITH_EXAMPLE, folds=FOLDS_WITH_EXAMPLE)
    h.observe_all(
        node("gpu-node-1", gpus={RTX: 4}),
        vm("spx-proj-a", "train-1", project="proj-a", owner=ALICE, gpu=RTX),
        vmi("spx-proj-a", "train-1", node_name="gpu-node-1", gpu=RTX),
        vm("spx-proj-a", "train-2", project="proj-a", owner=ALICE, gpu=RTX, run_strategy="Manual"),
        vm("spx-proj-a", "web-1", project="proj-a", owner=ALICE),
        vm("spx-proj-b", "train-1", project="proj-b", owner="bob@example.com", gpu=RTX),
    )
    return h


def detach(h: Harness, *, by: str = OPS, project: str = "proj-a", key: str | None = None) -> Result:
    value = h.sign({"intent_id": f"detach-{project}-{len(h.results)}", "type": "detach_project_gpus",
                    "requested_by": by, "project": project, "spec": {"reason": "the project's GPU quota ended"}},
                   projects=[project])
    return h.raw_intent(value, key=key or f"project/{project}", offset=len(h.results))


# ------------------------------------------------------------------ an intent type


def test_a_project_intent_is_decided_under_the_key_its_type_declares() -> None:
    h = cluster()
    value = {"intent_id": "i-1", "type": "detach_project_gpus", "requested_by": OPS, "project": "proj-a",
             "spec": {"reason": "r"}}
    assert h.engine.intent_key(value) == "project/proj-a"  # the route stage routes it there
    assert parse_intent(value, {"detach_project_gpus": DetachProjectGPUsIntent}).decision_key() == "project/proj-a"


def test_an_operator_detaches_every_template_gpu_of_the_project_and_no_other() -> None:
    h = cluster()
    result = detach(h)
    assert not result.dead_letters and result.judgement.outcome == "accepted"
    patched = {(c.target.namespace, c.target.name): c for c in result.decision.commands}
    assert set(patched) == {("spx-proj-a", "train-1"), ("spx-proj-a", "train-2")}
    for (namespace, name), command in patched.items():
        assert command.type == "patch_vm" and command.mutation is not None
        assert command.mutation.device_name is None
        assert any("gpus" in op["path"] for op in command.patch or []), command.patch  # the GPU taken out
    # no row of another key: only the intent's own, under its project's key
    assert [change.table for change in result.decision.changes] == ["processed"]


def test_a_project_member_may_not_detach_its_project_gpus() -> None:
    h = cluster()
    result = detach(h, by=ALICE)
    assert result.judgement.outcome == "rejected" and not result.dead_letters
    assert "only operators" in (result.judgement.reason or "")
    assert not result.decision.commands
    [told] = result.decision.notifications
    assert told.type == "intent_rejected" and told.recipients == [ALICE]


def test_a_project_intent_under_another_key_is_dead_lettered() -> None:
    h = cluster()
    result = detach(h, key="vm/spx-proj-a/train-1")
    assert result.dead_letters and not result.decision.commands
    assert "does not match" in result.dead_letters[0].error


def test_without_its_registration_the_type_is_unknown() -> None:
    h = cluster()
    h.engine = Engine(config(), KEYS)  # the product's rules only
    result = detach(h)
    assert result.judgement.outcome == "rejected" and "unknown intent type" in (result.judgement.reason or "")


# ------------------------------------------------------------------ a watched kind


def migration(namespace: str, vmi_name: str, name: str = "move-1") -> dict[str, Any]:
    return {"apiVersion": MIGRATIONS.api_version, "kind": MIGRATIONS.kind,
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
            "spec": {"vmiName": vmi_name}}


def observe(h: Harness, obj: dict[str, Any]) -> Result:
    """The event decided by the engine, keyed on k8s-events as the watch bridge keys it."""
    metadata = obj["metadata"]
    event = {"event_id": f"ev-{metadata['name']}", "type": "ADDED", "kind": obj["kind"], "object": obj,
             "observed_at": h.now.isoformat()}
    source = Source(EVENTS_TOPIC, f"{obj['kind']}/{metadata['namespace']}/{metadata['name']}")
    [result] = h.engine.decide(h.state, WatchInput(event, source, h.now))
    return result


def test_a_watched_kind_is_decided_under_its_declared_key_by_its_fold() -> None:
    h = cluster()
    moving = migration("spx-proj-a", "train-1")
    assert h.engine.event_key(MIGRATIONS.kind, moving) == "vm/spx-proj-a/train-1"  # routed to the VM it moves
    result = observe(h, moving)
    assert result.judgement.outcome == "accepted" and not result.dead_letters
    assert "passed-through GPU" in (result.judgement.reason or "")


def test_a_migration_of_a_vm_without_gpu_is_accepted_without_remark() -> None:
    result = observe(cluster(), migration("spx-proj-a", "web-1"))
    assert result.judgement.outcome == "accepted" and result.judgement.reason is None


def test_without_its_fold_the_kind_is_ignored() -> None:
    h = cluster()
    h.engine = Engine(config(), KEYS)  # the product's folds only
    moving = migration("spx-proj-a", "train-1")
    assert h.engine.event_key(MIGRATIONS.kind, moving) == "cluster/kubevirt"
    assert observe(h, moving).judgement.outcome == "ignored"
