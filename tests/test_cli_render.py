"""The CLI's pure parts: intents built from arguments and checked before anything is sent,
and every topic's messages rendered as the line a person reads."""

from __future__ import annotations

import argparse
import json
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from handlers.contracts.messages import SetGPUIntent, parse_intent
from streams.cli import requesting
from streams.cli import tailing
from streams.cli.requesting import InvalidRequest, build_intent, encode_intent, intent_key
from streams.common.settings import KafkaSettings
from streams.common.settings import load_kafka_settings
from streams.cli.tailing import json_line, render, resolve_topic

ROOT = Path(__file__).resolve().parent.parent
NOW = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
VM = ["--namespace", "spx-proj-a", "--name", "web-1"]
ALICE = ["--by", "alice@example.com", "--project", "proj-a"]
OPS = ["--by", "ops@example.com"]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vmstream")
    commands = parser.add_subparsers(dest="command", required=True)
    requesting.add_parser(commands)
    tailing.add_parser(commands)
    return parser.parse_args(argv)


def problems(*argv: str) -> list[str]:
    with pytest.raises(InvalidRequest) as caught:
        build_intent(parse(*argv), now=NOW)
    return caught.value.problems


# --------------------------------------------------------------------- building intents


def test_set_gpu_builds_a_keyed_intent_with_a_fresh_uuid() -> None:
    intent = build_intent(parse("intent", "set-gpu", *ALICE, *VM, "--gpu-class", "nvidia-a100"), now=NOW)
    assert isinstance(intent, SetGPUIntent)
    assert intent.spec.gpu_class == "nvidia-a100"
    assert intent.requested_by == "alice@example.com" and intent.project == "proj-a"
    assert intent.requested_at == NOW
    assert uuid.UUID(intent.intent_id).version == 4
    assert intent_key(intent) == "vm/spx-proj-a/web-1"


def test_remove_sends_an_explicit_null_gpu_class() -> None:
    intent = build_intent(parse("intent", "set-gpu", *ALICE, *VM, "--remove", "--id", "it-1"), now=NOW)
    assert isinstance(intent, SetGPUIntent) and intent.spec.gpu_class is None
    wire = json.loads(encode_intent(intent))
    assert "gpu_class" in wire["spec"] and wire["spec"]["gpu_class"] is None  # null means remove
    assert wire["intent_id"] == "it-1"


def test_set_gpu_needs_a_class_or_remove_but_not_both() -> None:
    with pytest.raises(SystemExit) as neither:
        parse("intent", "set-gpu", *ALICE, *VM)
    with pytest.raises(SystemExit) as both:
        parse("intent", "set-gpu", *ALICE, *VM, "--gpu-class", "nvidia-a100", "--remove")
    assert neither.value.code == both.value.code == 2


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["restart", *ALICE, *VM], "vm/spx-proj-a/web-1"),
        (["drain", *OPS, "--node", "gpu-node-1", "--reason", "firmware"], "node/gpu-node-1"),
        (["undrain", *OPS, "--node", "gpu-node-1"], "node/gpu-node-1"),
        (["create-vm", *ALICE, "--namespace", "ns", "--name", "new-1", "--cores", "4", "--memory-gib", "8",
          "--image", "quay.io/containerdisks/fedora:41"], "vm/ns/new-1"),
    ],
)
def test_the_key_is_the_contract_key(argv: list[str], key: str) -> None:
    assert intent_key(build_intent(parse("intent", *argv), now=NOW)) == key


def test_invalid_cores_are_refused_by_field_name() -> None:
    found = problems("intent", "create-vm", *ALICE, "--namespace", "ns", "--name", "new-1",
                     "--cores", "3", "--memory-gib", "8", "--image", "img")
    assert found == ["spec.cores: Input should be 1, 2, 4, 8, 16 or 32"]


def test_every_problem_is_reported_at_once() -> None:
    found = problems("intent", "create-vm", "--by", "alice@example.com", "--namespace", "Bad_NS",
                     "--name", "new-1", "--cores", "4", "--memory-gib", "5", "--image", "img",
                     "--run-strategy", "Sometimes", "--label", "no-equals-sign")
    fields = [problem.split(":")[0] for problem in found]
    assert fields == ["spec.labels", "project", "spec.namespace", "spec.memory_gib", "spec.run_strategy"]


def test_an_invalid_intent_exits_2_and_names_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    # No broker is configured or needed: validation comes before any connection.
    args = parse("intent", "set-gpu", "--by", "alice@example.com", *VM, "--gpu-class", "nvidia-a100")
    assert args.handler(args) == requesting.EXIT_INVALID
    captured = capsys.readouterr()
    assert "nothing published" in captured.err and "project: Field required" in captured.err
    assert captured.out == ""


def test_create_vm_sends_only_what_was_asked() -> None:
    intent = build_intent(parse("intent", "create-vm", *ALICE, "--namespace", "ns", "--name", "new-1",
                                "--cores", "4", "--memory-gib", "8", "--image", "img",
                                "--label", "team=ml", "--label", "app.kubernetes.io/part-of=web"), now=NOW)
    wire = json.loads(encode_intent(intent))
    assert wire["spec"] == {"namespace": "ns", "name": "new-1", "cores": 4, "memory_gib": 8, "image": "img",
                            "labels": {"team": "ml", "app.kubernetes.io/part-of": "web"}}
    assert wire["requested_at"] == "2026-11-30T10:00:00Z"


def test_drain_leaves_the_notice_to_the_worker_unless_given() -> None:
    default = build_intent(parse("intent", "drain", *OPS, "--node", "n1", "--reason", "firmware"), now=NOW)
    given = build_intent(parse("intent", "drain", *OPS, "--node", "n1", "--reason", "firmware",
                               "--notice-seconds", "60"), now=NOW)
    assert "notice_seconds" not in json.loads(encode_intent(default))["spec"]
    assert json.loads(encode_intent(given))["spec"]["notice_seconds"] == 60
    assert "project" not in json.loads(encode_intent(default))  # node intents need no project


def test_what_is_sent_is_what_the_worker_parses() -> None:
    for argv in (["set-gpu", *ALICE, *VM, "--remove"], ["restart", *ALICE, *VM],
                 ["drain", *OPS, "--node", "n1", "--reason", "r", "--notice-seconds", "0"]):
        intent = build_intent(parse("intent", *argv), now=NOW)
        assert parse_intent(encode_intent(intent)) == intent


PLAN = ["--plan", "fw-2026-12"]
WINDOW = ["--earliest-start", "2026-12-01T00:00:00Z", "--latest-end", "2026-12-03T00:00:00Z",
          "--node-duration-seconds", "3600", "--notice-seconds", "86400", "--reason", "firmware"]


def test_a_maintenance_plan_s_intents_are_keyed_by_the_plan_and_read_as_the_worker_reads_them() -> None:
    for argv in (["plan-maintenance", *OPS, *PLAN, "--node", "n1", "--node", "n2", *WINDOW],
                 ["plan-maintenance", *OPS, *PLAN, "--selector", "rack=r1", *WINDOW],
                 ["reschedule-maintenance", *ALICE, *PLAN, *VM, "--start", "2026-12-02T00:00:00Z"],
                 ["reschedule-maintenance", *OPS, *PLAN, "--node", "n1", "--start", "2026-12-02T00:00:00Z"],
                 ["maintenance-ready", *ALICE, *PLAN, *VM],
                 ["cancel-maintenance", *OPS, *PLAN, "--reason", "vendor delay"]):
        intent = build_intent(parse("intent", *argv), now=NOW)
        assert intent_key(intent) == "maintenance/fw-2026-12"
        assert parse_intent(encode_intent(intent)) == intent


def test_a_plan_s_selector_is_key_value_pairs_and_a_vm_or_a_node_is_moved_not_both() -> None:
    assert "spec.node_selector: 'rackr1' is not KEY=VALUE" in problems(
        "intent", "plan-maintenance", *OPS, *PLAN, "--selector", "rackr1", *WINDOW)
    assert any("exactly one of node and (namespace, name)" in problem for problem in problems(
        "intent", "reschedule-maintenance", *OPS, *PLAN, "--node", "n1", *VM, "--start", "2026-12-02T00:00:00Z"))


# ---------------------------------------------------------------------------- rendering


def value(data: object) -> bytes:
    return json.dumps(data).encode()


def test_a_notification_reads_as_a_sentence() -> None:
    notification = {
        "notification_id": "n-1", "type": "drain_will_stop_gpu_vm", "recipients": ["alice@example.com"],
        "subject": {"kind": "VirtualMachine", "namespace": "spx-proj-a", "name": "web-1"},
        "severity": "warning", "message": "VM spx-proj-a/web-1 will be stopped for maintenance.",
        "deadline": "2026-11-30T10:15:00Z",
    }
    assert render("notifications", value(notification)) == (
        "[warning] → alice@example.com: VM spx-proj-a/web-1 will be stopped for maintenance. (deadline 10:15Z)"
    )
    several = notification | {"recipients": ["a@x", "project:proj-a"], "deadline": None, "severity": "info"}
    assert render("notifications", value(several)) == (
        "[info] → a@x, project:proj-a: VM spx-proj-a/web-1 will be stopped for maintenance."
    )


def test_an_audit_record_counts_its_effects_and_gives_its_reason() -> None:
    accepted = {"audit_id": "a-1", "at": "2026-11-30T10:00:00Z", "outcome": "accepted",
                "input": {"topic": "vmstream.intents", "key": "vm/ns/name", "ref": "it-1"},
                "commands": ["c-1"], "notifications": ["n-1"]}
    assert render("audit", value(accepted)) == (
        "accepted it-1 (vmstream.intents vm/ns/name): 1 command, 1 notification"
    )
    rejected = accepted | {"outcome": "rejected", "reason": "VM ns/name does not exist", "commands": []}
    assert render("audit", value(rejected)) == (
        "rejected it-1 (vmstream.intents vm/ns/name): 0 commands, 1 notification — VM ns/name does not exist"
    )


def test_commands_and_their_results_name_target_cause_and_id() -> None:
    command = {"command_id": "c-1", "type": "patch_vm", "cause": "it-1", "issued_at": "2026-11-30T10:00:00Z",
               "target": {"kind": "VirtualMachine", "namespace": "ns", "name": "name"}, "patch": []}
    assert render("commands", value(command)) == "patch_vm VirtualMachine ns/name ← it-1 [c-1]"
    applied = {"command_id": "c-1", "outcome": "applied", "at": "2026-11-30T10:00:01Z", "type": "patch_vm",
               "target": command["target"], "resource_version": "42"}
    assert render("command-results", value(applied)) == "applied patch_vm VirtualMachine ns/name [c-1] rv 42"
    failed = {"command_id": "c-2", "outcome": "failed", "at": "2026-11-30T10:00:01Z", "error": "forbidden\nby RBAC"}
    assert render("command-results", value(failed)) == "failed [c-2]: forbidden by RBAC"
    reason = ('virtualmachines.kubevirt.io "name" is forbidden: ValidatingAdmissionPolicy "gpu-guard" with '
              'binding "gpu-guard" denied request: GPUs in this namespace need an approved change ticket first')
    long = failed | {"error": reason}
    assert render("command-results", value(long)) == f"failed [c-2]: {reason}"  # the reason whole
    cordon = command | {"type": "cordon_node", "target": {"kind": "Node", "name": "gpu-node-1"}}
    assert render("commands", value(cordon)) == "cordon_node Node gpu-node-1 ← it-1 [c-1]"


def test_a_dead_letter_says_where_from_why_and_what() -> None:
    letter = {"error": "not JSON: Expecting value", "original": "{not json",
              "source": {"topic": "vmstream.intents", "partition": 2, "offset": 17}}
    assert render("dlq", value(letter)) == (
        "dead letter from vmstream.intents[2]@17: not JSON: Expecting value | original: {not json"
    )


def test_intents_are_summarised_and_bad_ones_say_why() -> None:
    set_gpu = {"intent_id": "it-1", "type": "set_gpu", "requested_by": "alice@example.com", "project": "proj-a",
               "spec": {"namespace": "ns", "name": "vm", "gpu_class": None}}
    assert render("intents", value(set_gpu)) == (
        "set_gpu it-1 by alice@example.com (proj-a): vm/ns/vm gpu_class=null (remove the GPU)"
    )
    drain = {"intent_id": "it-2", "type": "drain_node", "requested_by": "ops@example.com",
             "spec": {"node": "gpu-node-1", "reason": "firmware", "notice_seconds": 900}}
    assert render("intents", value(drain)) == (
        "drain_node it-2 by ops@example.com: node/gpu-node-1 'firmware', notice 900s"
    )
    invalid = set_gpu | {"spec": {"namespace": "ns", "name": "vm"}}
    assert render("intents", value(invalid)) == (
        "invalid set_gpu it-1 by alice@example.com: spec.gpu_class: Field required"
    )
    assert render("intents", b"{not json").startswith("malformed intent: not JSON:")


def test_a_watch_event_is_kind_name_version_and_state() -> None:
    event = {"event_id": "ev-1", "type": "MODIFIED", "kind": "VirtualMachineInstance",
             "observed_at": "2026-11-30T10:00:01Z",
             "object": {"metadata": {"namespace": "ns", "name": "vm", "resourceVersion": "7"},
                        "status": {"phase": "Running", "nodeName": "gpu-node-1"}}}
    assert render("k8s-events", value(event)) == (
        "MODIFIED VirtualMachineInstance ns/vm rv 7 Running on gpu-node-1 at 10:00:01Z (ev-1)"
    )


def test_render_never_raises() -> None:
    assert render("audit", b"\xff\xfe").startswith("(unreadable audit: not JSON")
    assert render("audit", value({"audit_id": "a"})).startswith("(unreadable audit: at: Field required")
    assert render("notifications", value([1, 2])).startswith("(unreadable notifications: not a JSON object")
    assert render(None, b"anything\ngoes") == "anything goes"
    assert render("audit", None) == "(tombstone: no value)"


def test_topics_are_named_logically_or_in_full() -> None:
    kafka = KafkaSettings(topic_prefix="t1.")
    assert resolve_topic(kafka, "audit") == ("t1.audit", "audit")
    assert resolve_topic(kafka, "vmstream.command-results") == ("vmstream.command-results", "command-results")
    assert resolve_topic(kafka, "t1.worker-routed") == ("t1.worker-routed", None)


def test_json_output_is_the_simulate_input_format() -> None:
    line = json.loads(json_line("vmstream.intents", b"vm/ns/vm", value({"intent_id": "it-1"}),
                           int(NOW.timestamp() * 1000)))
    assert line == {"topic": "vmstream.intents", "key": "vm/ns/vm", "value": {"intent_id": "it-1"},
                    "timestamp": "2026-11-30T10:00:00.000Z"}
    assert json.loads(json_line("vmstream.intents", None, b"{not json", None))["value"] == "{not json"


def test_clients_read_only_kafka_from_the_worker_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VMSTREAM_KAFKA__TOPIC_PREFIX", "env.")
    kafka = load_kafka_settings(str(ROOT / "examples" / "config.yaml"))  # az, gpu_classes, … ignored
    assert kafka.topic("audit") == "env.audit"
