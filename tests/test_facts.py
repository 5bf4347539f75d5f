"""One declaration per fact: topics, watched kinds, intent types, command types and the
CloudEvents identity.

Each is declared once — topics in handlers/contracts/topics.py, watched kinds, intent and command
types in handlers/contracts/messages.py, the CloudEvents types and sources in handlers/contracts/events.py — and
everything else derives from the declaration or is checked against it here: no source file
in handlers/ or streams/ spells a topic's name or a CloudEvents type or source, the folds and
the watch bridge's RBAC cover exactly the watched kinds, the engine has a rule for exactly the
intent types and the applier a handler for exactly the command types.
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

import pytest
import yaml

from handlers.contracts import events, topics
from handlers.contracts.messages import (
    COMMAND_TYPES,
    INTENT_MODELS,
    INTENT_TYPES,
    IntentBase,
    PLAN_INTENT_TYPES,
    VM_INTENT_TYPES,
    WATCHED_KINDS,
    Command,
    CommandType,
    ObjectRef,
)
from handlers.core.cluster import OWNER_ANNOTATION, RULE_PATHS
from handlers.decide import intents, observing
from handlers.rules import gpus, judgment, policy
from handlers.rules.results import Tries
from handlers.rules.vms import MANAGED_BY_LABEL
from streams.cli import requesting
from streams.kube import watching
from streams.kube.applying import api

ROOT = Path(__file__).resolve().parent.parent
DECLARATION = ROOT / "handlers" / "contracts" / "topics.py"
WATCH_RBAC = ROOT / "deploy" / "base" / "rbac-watch.yaml"
CONTRACTS = ROOT / "docs" / "contracts.md"
START = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
PREFIX = "vmstream."  # the default prefix: the core never spells it before a topic's name

# Topic names that are ordinary words too (an audit record's ``commands`` field, a table of
# ``notifications``): as a bare string they are a topic only where a topic is expected.
TOPIC_NAMES = {topic.name for topic in topics.TOPICS} | {topics.TIMER, topics.RESIDENTS}
DISTINCT = {name for name in TOPIC_NAMES if "-" in name}


def _sources() -> Iterator[Path]:
    for folder in ("handlers", "streams"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != DECLARATION:
                yield path


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of docstring nodes: prose about a topic is not a copy of its name."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _is_topic_name(text: str) -> bool:
    return text in DISTINCT or (text.startswith(PREFIX) and text.removeprefix(PREFIX) in TOPIC_NAMES)


def _topic_call(node: ast.Call) -> bool:
    """A call that takes a topic's name: ``kafka.topic(...)``, ``self._topic(...)``,
    ``Output(...)``, ``Source(...)``, ``AuditInput(topic=...)``."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return "topic" in name.lower() or name in ("Output", "Source")


def topic_literals(path: Path, root: Path = ROOT) -> list[str]:
    """Where a file spells a topic's name as a string, outside its docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if _is_topic_name(node.value):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Call):
            args = [*(node.args if _topic_call(node) else ()), *(k.value for k in node.keywords if k.arg == "topic")]
            for arg in args:
                if isinstance(arg, ast.Constant) and arg.value in TOPIC_NAMES:
                    found.append(f"{path.relative_to(root)}:{node.lineno}: {arg.value!r} passed as a topic")
    return found


def test_no_topic_name_is_spelled_outside_its_declaration() -> None:
    found = [hit for path in _sources() for hit in topic_literals(path)]
    assert not found, "use handlers/contracts/topics.py's declarations:\n" + "\n".join(found)


def test_the_check_sees_a_copied_topic_name(tmp_path: Path) -> None:
    """The test above would fail on the copies it exists to prevent."""
    copy = tmp_path / "copy.py"
    copy.write_text('"""Reads vmstream.commands."""\n'
                    'RESULTS = "command-results"\n'
                    'FULL = "vmstream.intents"\n'
                    'def f(kafka, ctx):\n'
                    '    return kafka.topic("audit"), Output("dlq", "k", None), ctx.decide(topic="timer")\n',
                    encoding="utf-8")
    hits = sorted(topic_literals(copy, tmp_path), key=lambda hit: int(hit.split(":")[1]))
    assert [hit.split(": ", 1)[1] for hit in hits] == [
        "'command-results'", "'vmstream.intents'", "'audit' passed as a topic", "'dlq' passed as a topic",
        "'timer' passed as a topic"]


def test_every_topic_name_is_declared_once() -> None:
    names = [topic.name for topic in topics.TOPICS]
    assert len(names) == len(set(names)) and set(topics.BY_NAME) == set(names)
    assert not {topics.TIMER, topics.RESIDENTS} & set(names)  # audit sources, not topics
    assert all(topic.sends or topic is topics.INTENTS for topic in topics.TOPICS)  # intents: written upstream


# -------------------------------------------------------------- the CloudEvents identity

EVENTS = ROOT / "handlers" / "contracts" / "events.py"
# The type domain, a source's root, and the spellings one scheme replaced: a webhook's
# ``net.superphenix.vmstream.notification.<type>`` from ``urn:vmstream``.
EVENT_SPELLINGS = (events.TYPE_PREFIX, events.SOURCE_PREFIX, "superphenix.vmstream", "urn:vmstream")


def event_literals(path: Path, root: Path = ROOT) -> list[str]:
    """Where a file spells a CloudEvents type or source as a string, outside its docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    return [f"{path.relative_to(root)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and any(spelling in node.value for spelling in EVENT_SPELLINGS)]


def test_no_cloudevents_type_or_source_is_spelled_outside_its_declaration() -> None:
    found = [hit for path in _sources() if path != EVENTS for hit in event_literals(path)]
    assert not found, "use handlers/contracts/events.py's scheme:\n" + "\n".join(found)


def test_the_check_sees_a_copied_type_or_source(tmp_path: Path) -> None:
    copy = tmp_path / "copy.py"
    copy.write_text('"""Sends io.vmstream.audit from /vmstream/worker/…"""\n'
                    'TYPE = "io.vmstream.notification." + kind\n'
                    'SOURCE = f"/vmstream/{process}/{app_id}"\n'
                    'WEBHOOK = ("net.superphenix.vmstream.notification.", "urn:vmstream")\n', encoding="utf-8")
    assert [hit.split(": ", 1)[1] for hit in event_literals(copy, tmp_path)] == [
        "'io.vmstream.notification.'", "'/vmstream/'", "'net.superphenix.vmstream.notification.'", "'urn:vmstream'"]


def test_the_type_domain_is_the_domain_of_vmstream_s_annotations() -> None:
    """One domain: ``vmstream.io`` names vmstream's annotations and, reversed as CloudEvents
    advise, its event types; no annotation key is renamed for it."""
    assert events.TYPE_PREFIX == "io.vmstream." and events.DOMAIN == "vmstream.io"
    keys = (OWNER_ANNOTATION, gpus.PRE_GPU_ANNOTATION, policy.CORDONED_ANNOTATION, judgment.RESTART_ANNOTATION)
    assert keys == ("vmstream.io/owner", "vmstream.io/pre-gpu", "vmstream.io/cordoned-by", "vmstream.io/restart")
    assert all(key.startswith(f"{events.DOMAIN}/") for key in keys)


def test_no_long_running_process_reads_audit_records() -> None:
    """Audit records are read by people's tools only — ``vmstream intent --wait`` and
    ``vmstream replay``, which count only sealed ones — never by a process that acts or
    answers on them: ``vmstream api`` serves the worker's tables, and a forged record on the
    audit topic cannot change what it serves."""
    assert dict(topics.AUDIT.receives) == {}
    assert all(topics.AUDIT not in topics.read_by(process) for process in topics.PROCESSES)
    assert [topic.name for topic in topics.read_by("api")] == [topics.GPU_CLASSES.name]


# ------------------------------------------------------------------------ watched kinds


def test_the_watch_bridge_watches_the_declared_kinds() -> None:
    assert watching.KINDS is WATCHED_KINDS


def test_every_watched_kind_is_folded_and_viewed() -> None:
    names = {kind.kind for kind in WATCHED_KINDS}
    assert len(names) == len(WATCHED_KINDS)
    assert set(observing.FOLDS) == names  # every event of a watched kind changes the state, under its key
    assert set(RULE_PATHS) == names  # and an oversized one keeps what the rules read


def _rules(path: Path, role: str) -> list[dict[str, Any]]:
    for document in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if document and document.get("kind") == "ClusterRole" and document["metadata"]["name"] == role:
            rules: list[dict[str, Any]] = document["rules"]
            return rules
    raise AssertionError(f"no ClusterRole {role} in {path}")


def test_the_watch_bridge_may_list_and_watch_exactly_the_watched_kinds() -> None:
    granted = set()
    for rule in _rules(WATCH_RBAC, "vmstream-watch"):
        assert sorted(rule["verbs"]) == ["list", "watch"], rule
        granted |= {(group, resource) for group in rule["apiGroups"] for resource in rule["resources"]}
    assert granted == {(kind.group, kind.plural) for kind in WATCHED_KINDS}


# --------------------------------------------------------------------------- intent types


def test_intent_types_derive_from_the_union() -> None:
    assert INTENT_TYPES == ("create_vm", "set_gpu", "restart_vm", "drain_node", "undrain_node", "plan_maintenance",
                            "reschedule_maintenance", "maintenance_ready", "cancel_maintenance")
    assert [get_args(model.model_fields["type"].annotation) for model in INTENT_MODELS] == [
        (name,) for name in INTENT_TYPES]


def test_vm_intents_are_those_of_vm_intent_models() -> None:
    assert VM_INTENT_TYPES == ("create_vm", "set_gpu", "restart_vm")


def test_plan_intents_are_those_decided_under_a_plan_s_key() -> None:
    assert PLAN_INTENT_TYPES == ("plan_maintenance", "reschedule_maintenance", "maintenance_ready", "cancel_maintenance")


def test_the_engine_has_a_rule_for_exactly_the_intent_types() -> None:
    assert tuple(intents.RULES) == INTENT_MODELS


@pytest.mark.parametrize("model", INTENT_MODELS, ids=lambda model: model.__name__)
def test_every_intent_type_declares_the_key_it_is_decided_under(model: type[IntentBase]) -> None:
    key = model.decided_under
    assert key.fields and all(field.split(".")[0] in model.model_fields for field in key.fields)
    [row] = [line for line in CONTRACTS.read_text().splitlines() if line.startswith("| `vmstream.intents` |")]
    assert f"`{key.pattern}`" in row  # the contract names it (the AsyncAPI document derives it)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action.choices


def test_the_cli_asks_for_exactly_the_intent_types() -> None:
    parser = argparse.ArgumentParser()
    requesting.add_parser(parser.add_subparsers())
    offered = {sub.get_default("intent_type") for command in subcommands(parser).values()
               for sub in subcommands(command).values()}
    assert offered == set(INTENT_TYPES)


# -------------------------------------------------------------------------- command types


def test_command_types_derive_from_the_literal() -> None:
    assert set(COMMAND_TYPES) == {"patch_vm", "create_vm", "restart_vm", "start_vm", "stop_vm", "delete_vmi",
                                  "cordon_node", "uncordon_node", "cancel_evacuation"}


def test_the_applier_policy_knows_the_target_kind_of_every_command_type() -> None:
    assert set(policy.KINDS) == set(COMMAND_TYPES)


class _Recording(api.KubeApplier):
    """The applier with each change recorded instead of made."""

    def __init__(self) -> None:  # no API client: nothing is sent
        self.made: list[str] = []

    def _made(self, what: str) -> api.Applied:
        self.made.append(what)
        return api.Applied("applied")

    def _patch_vm(self, action: judgment.PatchVM) -> api.Applied:
        return self._made("patch")

    def _create_vm(self, action: judgment.CreateVM) -> api.Applied:
        return self._made("create")

    def _subresource(self, action: judgment.PutSubresource) -> api.Applied:
        return self._made(action.action)

    def _delete_vmi(self, action: judgment.DeleteVMI) -> api.Applied:
        return self._made("delete VMI")

    def _patch_node(self, action: judgment.PatchNode) -> api.Applied:
        return self._made("cordon" if action.body["spec"]["unschedulable"] else "uncordon")

    def _cancel_mark(self, action: judgment.CancelMark) -> api.Applied:
        return self._made("cancel eviction mark")


def _let_through(command_type: CommandType) -> tuple[Command, judgment.Observed]:
    """A command of ``command_type`` and objects as the policy lets it through, with a change to make."""
    kind = policy.KINDS[command_type]
    target = ObjectRef(kind=kind, namespace=None if kind == "Node" else "ns", name="n")
    manifest = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
                "metadata": {"namespace": "ns", "name": "n", "labels": {MANAGED_BY_LABEL: "vmstream", "p": "x"},
                             "annotations": {OWNER_ANNOTATION: "alice"}}}
    command = Command(command_id="c", type=command_type, target=target, cause="i", issued_at=datetime.now(UTC),
                      patch=[{"op": "add", "path": "/spec/template/spec/domain/devices/gpus", "value": []}],
                      base_resource_version="1", manifest=manifest, evacuation_node="node-1")
    cordoned = command_type == "uncordon_node"
    return command, judgment.Observed(
        namespace={"p": "x"}, vmi={"status": {"evacuationNodeName": "node-1"}},
        vm=None if command_type == "create_vm" else {
            "metadata": {"resourceVersion": "1"}, "spec": {"template": {"spec": {"domain": {"devices": {}}}}}},
        node={"metadata": {"annotations": {policy.CORDONED_ANNOTATION: "c"} if cordoned else {}},
              "spec": {"unschedulable": cordoned}})


def test_the_applier_makes_one_distinct_change_per_command_type() -> None:
    """``judgment.judge`` has a case for each command type and ``KubeApplier._act`` one for
    each action (mypy checks both, by ``assert_never``), and no two types make the same change."""
    applier = _Recording()
    for command_type in COMMAND_TYPES:
        command, seen = _let_through(command_type)
        judged = judgment.judge(command, seen, project_label="p")
        assert applier._act(command, judged, seen, Tries()) == api.Applied("applied"), (command_type, judged)
    assert applier.made == ["patch", "create", "restart", "start", "stop", "delete VMI", "cordon", "uncordon",
                            "cancel eviction mark"]
