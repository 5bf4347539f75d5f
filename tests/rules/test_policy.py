"""The applier's policy (handlers/rules/policy.py) and the seal on commands, results and audit
records (streams/common/signing.py), as pure functions: one test per rule."""

from __future__ import annotations

import copy
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from handlers.contracts.messages import AuditInput, AuditRecord, Command, CommandResult, GPUMutation, ObjectRef
from handlers.rules import policy
from handlers.rules.gpus import desired_vm, plan_patch
from samples.cluster import A100, PROJECT_LABEL, vm
from streams.common.codecs import encode_message
from streams.common.signing import Keyring, KeyringError, Purpose, canonical, open_sealed

NOW = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
KEYS = Keyring({"k1": b"k" * 32, "k2": b"q" * 32}, "k1")
PROJECT_NS = {PROJECT_LABEL: "proj-a"}
ADD_A100 = GPUMutation(device_name=A100, eviction_strategy="External")
REMOVE = GPUMutation(device_name=None, eviction_strategy="External")


def plain_vm() -> dict[str, Any]:
    return vm("spx-proj-a", "vm-1", project="proj-a", owner="alice@example.com")


def command(type_: str, target: ObjectRef, **fields: Any) -> Command:
    return Command(command_id="cmd-1", type=type_, target=target, cause="it-1", issued_at=NOW, **fields)


VM = ObjectRef(kind="VirtualMachine", namespace="spx-proj-a", name="vm-1")
NODE = ObjectRef(kind="Node", name="gpu-node-1")


# ------------------------------------------------------------------------ the seal


def test_a_sealed_command_verifies_after_the_wire() -> None:
    sealed = encode_message(command("patch_vm", VM, patch=[{"op": "add", "path": "/x", "value": 1.5}]), keyring=KEYS)
    parsed, problem = open_sealed(Command, sealed, "command", KEYS)
    assert problem is None and parsed is not None
    assert json.loads(sealed)["mac"]["kid"] == "k1"


def test_the_wire_is_the_message_and_its_mac_each_key_once() -> None:
    value = command("patch_vm", VM, patch=[{"op": "add", "path": "/x", "value": "é"}])
    sealed = encode_message(value, keyring=KEYS)
    body = json.loads(sealed)
    assert body == {**value.model_dump(mode="json", exclude_none=True), "mac": KEYS.seal("command", value)}
    assert sealed.count(b'"mac":') == 1 and "é".encode() in sealed  # UTF-8 as it is, not escaped
    carried = Command.model_validate(body)  # a message that carries a mac already (an extra field)
    assert encode_message(carried, keyring=KEYS) == sealed  # replaced, not written twice


# Any JSON a message dumps to (model_dump(mode="json")), floats aside: text of any code point
# but lone surrogates (which no UTF-8 writer takes), integers of any size, nesting.
_CODE_POINTS = st.characters(exclude_categories=["Cs"])
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(_CODE_POINTS),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(_CODE_POINTS, max_size=8), inner, max_size=4),
    max_leaves=20,
)


@given(_JSON_VALUES)
def test_the_wire_is_written_as_json_dumps_writes_it(patch_value: Any) -> None:
    value = command("patch_vm", VM, patch=[{"op": "add", "path": "/x", "value": patch_value}])
    body = {**value.model_dump(mode="json", exclude_none=True), "mac": KEYS.seal("command", value)}
    assert encode_message(value, keyring=KEYS) == json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize("tamper", [
    lambda v: v["target"].update(namespace="kube-system"),
    lambda v: v.update(requested_by="mallory@example.com"),
    lambda v: v.update(extra_field="anything"),
    lambda v: v["patch"].append({"op": "add", "path": "/y", "value": 2}),
])
def test_any_change_to_a_sealed_command_breaks_its_mac(tamper: Any) -> None:
    value = json.loads(encode_message(command("patch_vm", VM, patch=[]), keyring=KEYS))
    tamper(value)
    _, problem = open_sealed(Command, json.dumps(value).encode(), "command", KEYS)
    assert problem == "its MAC does not match"


def test_an_unsealed_or_foreign_mac_is_refused() -> None:
    plain = encode_message(command("cordon_node", NODE))
    assert open_sealed(Command, plain, "command", KEYS)[1] == "it carries no MAC"
    other = Keyring({"k1": b"z" * 32}, "k1")  # same key id, another secret
    assert open_sealed(Command, encode_message(command("cordon_node", NODE), keyring=other), "command",
                       KEYS)[1] == "its MAC does not match"
    unknown = Keyring({"k9": b"k" * 32}, "k9")
    assert "unknown" in (open_sealed(Command, encode_message(command("cordon_node", NODE), keyring=unknown),
                                     "command", KEYS)[1] or "")


def test_a_sealed_command_does_not_pass_for_a_result() -> None:
    """The purpose is in the MAC: a command's seal does not vouch for anything else."""
    result = CommandResult(command_id="cmd-1", outcome="applied", at=NOW)
    sealed = json.loads(encode_message(result, keyring=KEYS))
    sealed["mac"]["value"] = KEYS.mac("command", result, "k1")
    assert open_sealed(CommandResult, json.dumps(sealed).encode(), "command-result", KEYS)[1] == "its MAC does not match"
    assert open_sealed(CommandResult, encode_message(result, keyring=KEYS), "command-result", KEYS)[1] is None


def test_an_audit_record_is_sealed_and_its_seal_vouches_for_nothing_else() -> None:
    """The worker and the applier seal their audit records as they seal commands and results:
    a forged record (a ``rejected`` beside the real ``accepted``) carries no valid MAC, and a
    command's or result's seal does not make one."""
    audit = AuditRecord(audit_id="aud-1", at=NOW, input=AuditInput(topic="vmstream.intents", key="vm/a/b", ref="it-1"),
                        outcome="accepted", commands=["cmd-1"])
    sealed = encode_message(audit, keyring=KEYS)
    assert json.loads(sealed)["mac"] == KEYS.seal("audit", audit)
    assert open_sealed(AuditRecord, sealed, "audit", KEYS)[1] is None
    forged = audit.model_copy(update={"outcome": "rejected", "reason": "forged", "commands": []})
    assert open_sealed(AuditRecord, encode_message(forged), "audit", KEYS)[1] == "it carries no MAC"
    altered = {**json.loads(sealed), "outcome": "rejected"}
    assert open_sealed(AuditRecord, json.dumps(altered).encode(), "audit", KEYS)[1] == "its MAC does not match"
    borrowed = {**json.loads(sealed), "mac": {**json.loads(sealed)["mac"], "value": KEYS.mac("command-result", audit, "k1")}}
    assert open_sealed(AuditRecord, json.dumps(borrowed).encode(), "audit", KEYS)[1] == "its MAC does not match"


@pytest.mark.parametrize("forged", ["é" * 43, "A" * 42 + "\u202e", "\x00" * 43])
def test_a_mac_value_that_is_not_ascii_does_not_match_it_never_raises(forged: str) -> None:
    """Anyone who can write a topic can put any string in ``mac.value`` under a known key
    id: the applier's ledger and its commands are read through this check, so raising here
    would stop the applier on that record at every start."""
    for value in (command("cordon_node", NODE), CommandResult(command_id="cmd-1", outcome="applied", at=NOW)):
        purpose: Purpose = "command" if isinstance(value, Command) else "command-result"
        body = json.loads(encode_message(value, keyring=KEYS))
        body["mac"]["value"] = forged
        assert open_sealed(type(value), json.dumps(body).encode(), purpose, KEYS)[1] == "its MAC does not match"


def test_rotation_any_held_key_verifies_the_active_one_seals() -> None:
    old = Keyring({"k1": b"k" * 32}, "k1")
    assert open_sealed(Command, encode_message(command("cordon_node", NODE), keyring=old), "command", KEYS)[1] is None
    new = Keyring(KEYS.keys, "k2")
    assert json.loads(encode_message(command("cordon_node", NODE), keyring=new))["mac"]["kid"] == "k2"


def test_keys_are_long_enough_and_the_active_one_is_held() -> None:
    with pytest.raises(KeyringError):
        Keyring({"k1": b"short"}, "k1")
    with pytest.raises(KeyringError):
        Keyring({"k1": b"k" * 32}, "k2")
    assert "k" * 32 not in repr(KEYS)


def test_canonical_bytes_ignore_spelling() -> None:
    one = command("patch_vm", VM, patch=[{"op": "add", "path": "/a", "value": {"b": 1, "a": 2}}])
    again = Command.model_validate_json(json.dumps(json.loads(one.model_dump_json()), indent=2))
    assert canonical(one) == canonical(again)


# ------------------------------------------------------------------------ VM changes


def test_the_gpu_patches_vmstream_plans_are_allowed() -> None:
    before = plain_vm()
    with_gpu = desired_vm(before, ADD_A100)
    assert policy.patch_refusal(before, plan_patch(before, with_gpu)) is None
    assert policy.patch_refusal(with_gpu, plan_patch(with_gpu, desired_vm(with_gpu, REMOVE))) is None


@pytest.mark.parametrize(("patch", "where"), [
    ([{"op": "add", "path": "/spec/template/spec/accessCredentials", "value": [
        {"sshPublicKey": {"source": {"secret": {"secretName": "mallory"}},
                          "propagationMethod": {"qemuGuestAgent": {"users": ["root"]}}}}]}],
     "/spec/template/spec/accessCredentials"),
    ([{"op": "replace", "path": "/metadata/annotations/vmstream.io~1owner", "value": "mallory@example.com"}],
     "/metadata/annotations/vmstream.io~1owner"),
    ([{"op": "replace", "path": f"/metadata/labels/{PROJECT_LABEL.replace('/', '~1')}", "value": "proj-b"}],
     "/metadata/labels"),
    ([{"op": "replace", "path": "/spec/runStrategy", "value": "Halted"}], "/spec/runStrategy"),
    ([{"op": "add", "path": "/spec/template/spec/domain/devices/hostDevices", "value": [{"name": "x"}]}],
     "/spec/template/spec/domain/devices/hostDevices"),
    ([{"op": "remove", "path": "/spec/template/spec/domain/devices"}], "/spec/template/spec/domain/devices"),
])
def test_a_patch_outside_the_gpu_fields_is_refused(patch: list[dict[str, Any]], where: str) -> None:
    refusal = policy.patch_refusal(plain_vm(), patch)
    assert refusal is not None and where in refusal


def test_a_gpu_path_carrying_more_than_gpu_fields_is_refused() -> None:
    """Adding a whole map where vmstream creates one: only its GPU keys may be in it."""
    before = plain_vm()
    del before["spec"]["template"]["spec"]["domain"]["cpu"]
    ok = [{"op": "add", "path": "/spec/template/spec/domain/cpu", "value": {"model": "host-passthrough"}}]
    assert policy.patch_refusal(before, ok) is None
    sneaky = [{"op": "add", "path": "/spec/template/spec/domain/cpu",
               "value": {"model": "host-passthrough", "dedicatedCpuPlacement": True}}]
    assert "cpu" in (policy.patch_refusal(before, sneaky) or "")


def test_move_and_copy_are_refused() -> None:
    move = [{"op": "move", "from": "/spec/template", "path": "/spec/template/spec/domain/devices/gpus"}]
    assert "unsupported" in (policy.patch_refusal(plain_vm(), move) or "")


# ------------------------------------------------------------------------ namespaces, create, nodes


@pytest.mark.parametrize(("namespace", "labels", "expected"), [
    ("kube-system", {PROJECT_LABEL: "p"}, "system namespace"),
    ("kube-anything", {PROJECT_LABEL: "p"}, "system namespace"),
    ("default", {PROJECT_LABEL: "p"}, "system namespace"),
    ("vmstream", {PROJECT_LABEL: "p"}, "system namespace"),
    ("spx-proj-a", None, "does not exist"),
    ("spx-proj-a", {"team": "a"}, "not a project namespace"),
    ("spx-proj-a", {PROJECT_LABEL: "proj-a"}, None),
])
def test_only_project_namespaces(namespace: str, labels: dict[str, str] | None, expected: str | None) -> None:
    refusal = policy.namespace_refusal(namespace, labels, project_label=PROJECT_LABEL)
    assert (refusal is None) if expected is None else (expected in (refusal or ""))


def test_target_kind_must_fit_the_command() -> None:
    assert policy.target_refusal(command("delete_vmi", VM)) is not None
    assert policy.target_refusal(command("cordon_node", ObjectRef(kind="Node", namespace="x", name="n"))) is not None
    assert policy.target_refusal(command("patch_vm", ObjectRef(kind="VirtualMachine", name="n"))) is not None
    assert policy.target_refusal(command("patch_vm", VM)) is None


def manifest(**metadata: Any) -> dict[str, Any]:
    base = {"name": "vm-1", "namespace": "spx-proj-a",
            "labels": {PROJECT_LABEL: "proj-a", "app.kubernetes.io/managed-by": "vmstream"},
            "annotations": {"vmstream.io/owner": "alice@example.com"}}
    base.update(metadata)
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": base, "spec": {}}


@pytest.mark.parametrize(("changed", "expected"), [
    ({}, None),
    ({"labels": {PROJECT_LABEL: "proj-a"}}, "managed-by"),
    ({"labels": {PROJECT_LABEL: "proj-b", "app.kubernetes.io/managed-by": "vmstream"}}, "namespace's"),
    ({"annotations": {}}, "owner"),
    ({"namespace": "spx-proj-b"}, "target"),
    ({"ownerReferences": []}, "ownerReferences"),
])
def test_create_vm_only_as_vmstream_writes_it(changed: dict[str, Any], expected: str | None) -> None:
    refusal = policy.create_refusal(command("create_vm", VM, manifest=manifest(**changed)), PROJECT_NS,
                                    project_label=PROJECT_LABEL)
    assert (refusal is None) if expected is None else (expected in (refusal or ""))


def test_a_control_plane_node_is_never_cordoned() -> None:
    refusal = policy.node_refusal(command("cordon_node", NODE), labels={"node-role.kubernetes.io/control-plane": ""},
                                  annotations={}, unschedulable=False)
    assert refusal is not None and "control-plane" in refusal
    assert policy.node_refusal(command("cordon_node", NODE), labels={}, annotations={}, unschedulable=False) is None


def test_only_vmstream_s_own_cordon_is_undone() -> None:
    uncordon = command("uncordon_node", NODE)
    assert "not cordoned by vmstream" in (policy.node_refusal(uncordon, labels={}, annotations={},
                                                              unschedulable=True) or "")
    assert policy.node_refusal(uncordon, labels={}, annotations={policy.CORDONED_ANNOTATION: "cmd-0"},
                               unschedulable=True) is None


def test_an_unauthenticated_command_is_refused_without_telling_its_claimed_people() -> None:
    forged = command("patch_vm", VM, requested_by="victim@example.com")
    decision = policy.unauthenticated(forged, reason="it carries no MAC", now=NOW)
    assert decision.notification is None
    assert decision.result.outcome == "failed" and (decision.result.model_extra or {})["refused"] == "unauthenticated"
    assert decision.audit.outcome == "rejected" and decision.audit.commands == []


def test_the_refusal_of_an_unsealed_command_is_small_whatever_the_command_carries() -> None:
    """A forged command near the topic's size limit, its bulk in a field of its target: the
    refusal must still fit the results topic, or the applier fails its batch on that command
    at every start and applies nothing after it."""
    bulky = json.loads(encode_message(command("cordon_node", NODE)))
    bulky["target"]["padding"] = "x" * 1_000_000
    forged = Command.model_validate_json(json.dumps(bulky))
    decision = policy.unauthenticated(forged, reason="it carries no MAC", now=NOW)
    assert decision.result.target == NODE
    assert len(encode_message(decision.result, keyring=KEYS)) < 4096
    assert len(encode_message(decision.audit, keyring=KEYS)) < 4096


# ---------------------------------------------------------------- applying a patch


def test_a_failed_test_operation_is_a_refusal_naming_its_path() -> None:
    live = plain_vm()
    gpus = "/spec/template/spec/domain/devices/gpus"
    stale: list[dict[str, Any]] = [{"op": "test", "path": gpus, "value": [{"name": "gpu0", "deviceName": A100}]},
                                   {"op": "remove", "path": gpus}]
    assert policy.patch_refusal(live, stale) == f"the patch does not apply to the live VM: {gpus}: test failed"
    current: list[dict[str, Any]] = [{"op": "test", "path": "/metadata/name", "value": "vm-1"}]
    assert policy.patch_refusal(live, current) is None


@pytest.mark.parametrize("patch", [
    [{"op": "replace", "path": "/spec/template/spec/domain/nothing/here", "value": 1}],
    [{"op": "remove", "path": "/spec/template/spec/domain/devices/gpus/7"}],
    [{"op": "add", "path": "/spec/template/spec/domain/devices/gpus/01", "value": {}}],
])
def test_a_path_that_is_not_there_is_a_refusal_naming_it_and_not_the_vm(patch: list[dict[str, Any]]) -> None:
    refusal = policy.patch_refusal(plain_vm(), patch) or ""
    assert refusal == f"the patch does not apply to the live VM: {patch[0]['path']}: no such path"


def test_a_patch_of_the_whole_document_is_refused() -> None:
    assert "not a JSON pointer" in (policy.patch_refusal(plain_vm(), [{"op": "replace", "path": "", "value": {}}]) or "")


def test_a_patch_is_applied_to_a_copy_holding_copies_of_its_values() -> None:
    doc, value = {"a": {"b": [1, 2]}}, {"c": [3]}
    after = policy.apply_patch(doc, [{"op": "add", "path": "/a/b/-", "value": value},
                                     {"op": "add", "path": "/a/d", "value": value}])
    assert after == {"a": {"b": [1, 2, {"c": [3]}], "d": {"c": [3]}}}
    assert doc == {"a": {"b": [1, 2]}}
    after["a"]["d"]["c"].append(4)
    assert value == {"c": [3]}


def test_judging_a_gpu_patch_leaves_the_live_vm_as_it_was() -> None:
    live = plain_vm()
    seen = copy.deepcopy(live)
    patch = plan_patch(live, desired_vm(live, ADD_A100))
    assert policy.patch_refusal(live, patch) is None
    assert live == seen
