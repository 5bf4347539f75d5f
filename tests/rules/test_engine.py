"""The engine's promises: one audit record per input, bad input dead-lettered with its
offset and never raised, undefined GPU classes reported, cluster state folded right."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from handlers.contracts.messages import parse_intent
from handlers.contracts.topics import TIMER
from handlers.core.catalog import Catalog
from handlers.core.cluster import NodeRecord
from handlers.core.tables import KUBEVIRT, RESIDENTS, USAGE
from handlers.rules.capacity import capacity
from samples.cluster import A100, RTX, kubevirt_cr, node, vm, vmi
from tests.support.harness import Harness, config

ALICE = "alice@example.com"


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe\x00", "not JSON"),
        (b"[1, 2]", "not a JSON object but list"),
        (json.dumps({"type": "set_gpu", "spec": {}}).encode(), "intent_id: Field required"),
        (json.dumps({"intent_id": "x", "type": "set_gpu"}).encode(), "requested_by: Field required"),
    ],
)
def test_malformed_intents_go_to_dead_letters_with_their_offset(raw: bytes, error: str) -> None:
    h = Harness()
    result = h.raw_intent(raw, key="vm/a/b", offset=41)
    [letter] = result.dead_letters
    assert error in letter.error
    assert (letter.source.topic, letter.source.partition, letter.source.offset) == ("vmstream.intents", 0, 41)
    if letter.encoding == "base64":
        assert base64.b64decode(letter.original) == raw
    else:
        assert letter.original == raw.decode()
    audit = result.decision.audit
    assert audit is not None and audit.outcome == "rejected" and audit.input.ref == "vmstream.intents:0:41"
    assert [o.topic for o in result.outputs()] == ["dlq", "audit"]


def test_malformed_watch_events_are_dead_lettered_and_the_next_one_is_decided() -> None:
    h = Harness()
    from handlers.decide.engine import Source
    from tests.support.harness import EVENTS_TOPIC

    bad = h.engine.on_event(h.state, b'{"event_id": "e", "type": "ADDED", "kind": "Node"}',
                            Source(EVENTS_TOPIC, "Node/x", 2, 7), h.now)
    assert "object: Field required" in bad.dead_letters[0].error
    good = h.observe(node("gpu-node-1", gpus={RTX: 1}))
    assert good.dead_letters == [] and good.decision.audit is not None
    assert good.decision.audit.outcome == "accepted"


def test_an_unwatched_kind_is_ignored_with_a_reason() -> None:
    h = Harness()
    result = h.observe({"kind": "Pod", "metadata": {"name": "p", "namespace": "n"}})
    assert result.decision.audit is not None
    assert (result.decision.audit.outcome, result.decision.audit.reason) == ("ignored", "kind Pod is not watched")


def test_every_input_yields_exactly_one_audit_record() -> None:
    h = Harness()
    h.observe_all(node("gpu-node-1", gpus={RTX: 2}), vm("p", "v", project="proj-a", owner=ALICE),
                  vmi("p", "v", node_name="gpu-node-1"))
    h.intent("set_gpu", {"namespace": "p", "name": "v", "gpu_class": "nvidia-a100"})
    h.intent("set_gpu", {"namespace": "p", "name": "v", "gpu_class": "bogus"})
    h.raw_intent(b"{", offset=1)
    inputs = [r for r in h.results if r.decision.audit and r.decision.audit.input.topic != TIMER]
    assert len(inputs) == len(h.results) == 6
    assert all(r.decision.audit is not None for r in h.results)


def test_audit_names_the_commands_and_notifications_it_caused() -> None:
    h = Harness()
    h.observe_all(vm("p", "v", project="proj-a", owner=ALICE), vmi("p", "v", node_name="n"))
    result = h.intent("set_gpu", {"namespace": "p", "name": "v", "gpu_class": "nvidia-a100"})
    audit = result.decision.audit
    assert audit is not None
    assert audit.commands == [c.command_id for c in result.decision.commands]
    assert audit.notifications == [n.notification_id for n in result.decision.notifications]
    assert [o.topic for o in result.outputs()] == ["commands", "notifications", "audit"]


def test_validation_errors_name_the_field_and_the_reason() -> None:
    from handlers.contracts.messages import InvalidIntent

    with pytest.raises(InvalidIntent) as caught:
        parse_intent({"intent_id": "i", "type": "drain_node", "requested_by": "o",
                      "spec": {"node": "n", "reason": "r", "notice_seconds": -5}})
    assert caught.value.reason == "spec.notice_seconds: Input should be greater than or equal to 0"


def test_an_unknown_intent_type_is_rejected_to_its_requester() -> None:
    h = Harness()
    result = h.raw_intent(h.sign({"intent_id": "i-1", "type": "resize_vm", "requested_by": ALICE, "spec": {}}))
    assert result.dead_letters == []
    [told] = result.decision.notifications
    assert told.type == "intent_rejected" and "unknown intent type 'resize_vm'" in told.details["reason"]


# ----------------------------------------------------------------------- catalog


def test_catalog_ids_are_case_insensitive_and_display_names_fall_back_to_ids() -> None:
    catalog = Catalog.from_config(config(gpu_classes={"NVIDIA-A100": {"device_name": A100}}))
    gpu = catalog.lookup("Nvidia-A100")
    assert (gpu.id, gpu.display_name, gpu.device_name) == ("nvidia-a100", "nvidia-a100", A100)


def test_a_device_without_class_is_reported_as_undefined_not_dropped() -> None:
    gpu = Catalog.from_config(config()).for_device("nvidia.com/GH100_H100_SXM5_80GB")
    assert gpu.undefined and gpu.describe() == {
        "class_id": None, "display_name": "nvidia.com/GH100_H100_SXM5_80GB",
        "device_name": "nvidia.com/GH100_H100_SXM5_80GB", "undefined": True}


def test_a_class_without_device_name_is_invalid_config() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="device_name"):
        config(gpu_classes={"x": {"display_name": "X"}})


def test_drain_notices_about_an_undefined_class_name_the_raw_device() -> None:
    h = Harness()
    h.observe_all(node("n1", gpus={"nvidia.com/H100": 1}),
                  vm("p", "h", project="proj-a", owner=ALICE, gpu="nvidia.com/H100"),
                  vmi("p", "h", node_name="n1", gpu="nvidia.com/H100"))
    h.intent("drain_node", {"node": "n1", "reason": "r"}, by="ops@example.com", project=None)
    [told] = h.notifications("drain_will_stop_gpu_vm")
    assert told.details["gpu"]["undefined"] is True and "nvidia.com/H100" in told.message


# ------------------------------------------------------------------ cluster state


def test_capacity_counts_free_cards_on_schedulable_nodes_only() -> None:
    h = Harness()
    h.observe_all(
        node("a", gpus={RTX: 2}), node("b", gpus={RTX: 2}, unschedulable=True), node("c", gpus={RTX: 1}, ready=False),
        vmi("p", "x", node_name="a", gpu=RTX), vmi("p", "y", node_name="a", gpu=RTX, phase="Succeeded"),
        vmi("p", "z", node_name="b", gpu=RTX),
    )
    cards = capacity(h.state, RTX)
    assert (cards.total, cards.schedulable, cards.used, cards.free) == (5, 2, 1, 1)
    assert capacity(h.state, RTX, excluding_node="a").free == 0


def test_nodes_keep_extended_resources_ready_and_cordon() -> None:
    record = NodeRecord.from_object(node("a", gpus={RTX: 4}, unschedulable=True))
    assert record.gpu_allocatable[RTX] == 4 and "cpu" not in record.gpu_allocatable
    assert record.unschedulable and record.ready and not record.schedulable


def test_the_kubevirt_cr_gives_cluster_cpu_model_and_permitted_devices() -> None:
    h = Harness()
    h.observe(kubevirt_cr())
    record = h.state.get(KUBEVIRT, "cluster")
    assert record is not None
    assert record.cpu_model == "Haswell-noTSX" and record.eviction_strategy == "LiveMigrate"
    assert record.permitted_devices == tuple(sorted((RTX, A100)))


def test_deleted_objects_leave_state() -> None:
    h = Harness()
    h.observe(vm("p", "v", project="proj-a", gpu=RTX))
    h.observe(vmi("p", "v", node_name="n", gpu=RTX))
    assert h.state.get(RESIDENTS, "n") is not None
    h.observe(vmi("p", "v", node_name="n", gpu=RTX), "DELETED")
    h.observe(vm("p", "v", project="proj-a"), "DELETED")
    assert h.state.sizes()["vms"] == h.state.sizes()["vmis"] == 0
    assert h.state.get(RESIDENTS, "n") is None and h.state.get(USAGE, "n") is None


@pytest.mark.parametrize(
    ("obj", "key"),
    [
        (vm("p", "v", project="proj-a"), "vm/p/v"),
        (vmi("p", "v", node_name="n"), "vm/p/v"),
        (node("n1"), "node/n1"),
        ({"kind": "NodeMaintenance", "metadata": {"name": "nm"}, "spec": {"nodeName": "n2"}}, "node/n2"),
        (kubevirt_cr(), "cluster/kubevirt"),
    ],
)
def test_each_event_is_decided_under_its_vm_its_node_or_the_cluster(obj: dict[str, Any], key: str) -> None:
    from handlers.decide.observing import decision_key

    assert decision_key(obj["kind"], obj) == key


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ({"type": "set_gpu", "spec": {"namespace": "p", "name": "v", "gpu_class": None}}, "vm/p/v"),
        ({"type": "drain_node", "spec": {"node": "n1", "reason": "r"}}, "node/n1"),
        ({"type": "undrain_node", "spec": {"node": "n1"}}, "node/n1"),
        ({"type": "restart_vm", "spec": {"namespace": "p"}}, None),  # no name: routed by its Kafka key
        ({"type": "restart_vm", "spec": {"namespace": "p", "name": 7}}, None),
        ({"type": "set_gpu", "spec": "vm/p/v"}, None),
        ({"type": "resize_vm", "spec": {"namespace": "p", "name": "v"}}, None),  # not a type it decides
        ({"type": ["set_gpu"], "spec": {}}, None),
    ],
)
def test_each_intent_is_routed_under_the_key_its_type_declares(value: dict[str, Any], key: str | None) -> None:
    assert Harness().engine.intent_key(value) == key
