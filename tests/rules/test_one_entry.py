"""One entry into the rules: ``Engine.decide`` over typed inputs, typed judgements out, and
the judgements the shell used to make for itself (what is due, is a VM already so)."""

from __future__ import annotations

import copy
import json
import pickle
from datetime import timedelta
from typing import Any

import pytest

from handlers.contracts.messages import AuditInput, AuditRecord, MalformedMessage
from handlers.core.cluster import ENDED_PHASES
from handlers.core.decisions import ResidentUpdate
from handlers.core.outcomes import Accepted, Duplicate, Ignored, Refused, judgement_of
from handlers.core.rows import DrainEpisode, VMTracking
from handlers.core.state import Change, MemoryState, Overlay
from handlers.core.tables import DRAINS, GLOBAL_TABLES, TABLES, TRACKING, VMS, table_named
from handlers.decide.engine import Engine
from handlers.decide.inputs import DeadlineTick, IntentInput, ResidentInput, Source, WatchInput, kind_of, routed_input
from handlers.rules.running import already_so
from samples.cluster import RTX, node, vm, vmi
from streams.common.codecs import encode_resident_update, encode_state
from streams.kube.applying import api
from tests.support.harness import EVENTS_TOPIC, INTENTS_TOPIC, START, config
from tests.support.worker_state import row_event, worker_table_state

ALICE = "alice@example.com"
KEY = "vm/spx-proj-a/w-1"


def engine() -> Engine:
    return Engine(config(auth={"mode": "none"}))


def intent(type_: str, spec: dict[str, Any], intent_id: str = "it-1") -> dict[str, Any]:
    return {"intent_id": intent_id, "type": type_, "requested_by": ALICE, "project": "proj-a", "spec": spec}


def event(obj: dict[str, Any], event_id: str = "ev-1") -> dict[str, Any]:
    return {"event_id": event_id, "type": "ADDED", "kind": obj["kind"], "object": obj,
            "observed_at": START.isoformat()}


def decide_all(e: Engine, state: MemoryState, *inputs: Any) -> list[Any]:
    results = []
    for input_ in inputs:
        for result in e.decide(state, input_):
            state.apply(result.decision.changes)
            results.append(result)
            for update in result.decision.forwards:
                for forwarded in e.decide(state, ResidentInput(update, input_.at)):
                    state.apply(forwarded.decision.changes)
    return results


# ---------------------------------------------------------------- typed judgements


def test_a_refused_intent_carries_its_reason() -> None:
    e, state = engine(), MemoryState()
    [result] = e.decide(state, IntentInput(intent("restart_vm", {"namespace": "spx-proj-a", "name": "w-1"}),
                                           Source(INTENTS_TOPIC, KEY), START))
    assert result.judgement == Refused("VM spx-proj-a/w-1 does not exist")
    assert result.decision.audit is not None and result.decision.audit.outcome == "rejected"
    assert result.decision.audit.reason == "VM spx-proj-a/w-1 does not exist"


def test_a_restart_of_a_vm_that_does_not_run_is_refused_with_why() -> None:
    e, state = engine(), MemoryState()
    decide_all(e, state, WatchInput(event(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE)),
                                    Source(EVENTS_TOPIC, None), START))
    [result] = e.decide(state, IntentInput(intent("restart_vm", {"namespace": "spx-proj-a", "name": "w-1"}),
                                           Source(INTENTS_TOPIC, KEY), START))
    assert result.judgement == Refused("cannot restart VM spx-proj-a/w-1: it is not running")


def test_an_ignored_input_carries_its_reason() -> None:
    e, state = engine(), MemoryState()
    pod = {"kind": "Pod", "metadata": {"name": "p", "namespace": "n"}}
    [result] = e.decide(state, WatchInput(event(pod), Source(EVENTS_TOPIC, None), START))
    assert result.judgement == Ignored("kind Pod is not watched")
    assert result.decision.audit is not None and result.decision.audit.outcome == "ignored"


def test_an_intent_decided_again_is_ignored_as_a_duplicate_with_its_reason() -> None:
    e, state = engine(), MemoryState()
    decide_all(e, state, WatchInput(event(node("gpu-node-1", gpus={RTX: 1})), Source(EVENTS_TOPIC, None), START))
    drain = IntentInput({**intent("drain_node", {"node": "gpu-node-1", "reason": "PSU"}),
                         "requested_by": "ops@example.com"}, Source(INTENTS_TOPIC, "node/gpu-node-1"), START)
    [first] = decide_all(e, state, drain)
    assert isinstance(first.judgement, Accepted)
    [again] = e.decide(state, drain)
    assert again.judgement == Duplicate("intent it-1 was already decided (accepted)")
    assert isinstance(again.judgement, Ignored)
    assert again.decision.audit is not None and again.decision.audit.outcome == "duplicate"


def test_an_accepted_intent_that_changes_nothing_says_so() -> None:
    e, state = engine(), MemoryState()
    decide_all(e, state, WatchInput(event(vm("spx-proj-a", "w-1", project="proj-a", owner=ALICE)),
                                    Source(EVENTS_TOPIC, None), START))
    [result] = e.decide(state, IntentInput(intent("set_gpu", {"namespace": "spx-proj-a", "name": "w-1",
                                                              "gpu_class": None}),
                                           Source(INTENTS_TOPIC, KEY), START))
    assert result.judgement == Accepted("nothing to change: already as asked")


def test_a_malformed_input_is_refused_with_why_and_dead_lettered() -> None:
    e, state = engine(), MemoryState()
    [result] = e.decide(state, IntentInput(b"{not json", Source(INTENTS_TOPIC, KEY, 0, 9), START))
    assert isinstance(result.judgement, Refused) and result.judgement.reason.startswith("malformed: ")
    assert len(result.dead_letters) == 1


@pytest.mark.parametrize("judgement", [Accepted(), Accepted("nothing to change: already as asked"),
                                       Refused("no"), Ignored("kind Pod is not watched"),
                                       Duplicate("intent it-1 was already decided")])
def test_the_audit_record_says_what_the_judgement_says(judgement: Any) -> None:
    """A result's judgement is read off its audit record (so one the journal gives back says
    the same): every judgement survives the trip."""
    audit = AuditRecord(audit_id="aud-1", at=START, input=AuditInput(topic=INTENTS_TOPIC, key=KEY, ref="it-1"),
                        outcome=judgement.outcome, reason=judgement.reason)
    assert judgement_of(audit) == judgement
    assert judgement_of(None) == Ignored("no effect")


# ---------------------------------------------------------------- one reading of routed records


def test_the_routed_topic_reads_every_kind_into_its_input() -> None:
    source = Source(INTENTS_TOPIC, KEY, 0, 1)
    update = ResidentUpdate("gpu-node-1", KEY, None, "ev-1")
    assert routed_input("intent", b"{}", source, START) == IntentInput(b"{}", source, START)
    assert routed_input("event", b"{}", source, START) == WatchInput(b"{}", source, START)
    assert routed_input("resident", encode_resident_update(update), source, START) == ResidentInput(update, START)
    assert routed_input("tick", json.dumps({"node": "n1"}).encode(), source, START) == DeadlineTick(START, "n1")
    assert [kind_of(routed_input(k, b'{"node": "n"}', source, START)) for k in ("intent", "event", "tick")] == [
        "intent", "event", "tick"]
    with pytest.raises(MalformedMessage, match="without a known vmstream-kind header: 'other'"):
        routed_input("other", b"{}", source, START)


# ---------------------------------------------------------------- what is due


def _episode(name: str, deadline_seconds: int, **changes: Any) -> DrainEpisode:
    return DrainEpisode(node=name, episode=f"ep-{name}", source="intent", cause="it", reason="r",
                        requested_by=None, started_at=START, deadline=START + timedelta(seconds=deadline_seconds),
                        **changes)


class _NoScan(MemoryState):
    def values(self, table: Any) -> Any:
        raise AssertionError("the due deadlines come from the index, not from a pass over every episode")


def test_what_is_due_comes_from_the_deadline_index_without_a_scan() -> None:
    state = _NoScan()
    state.apply([Change(DRAINS, "n1", _episode("n1", 60)), Change(DRAINS, "n2", _episode("n2", 600)),
                 Change(DRAINS, "n3", _episode("n3", 30, deadline_passed=True))])
    e = engine()
    assert e.due(state, START + timedelta(seconds=59)) == []
    assert e.due(state, START + timedelta(seconds=60)) == [DeadlineTick(START + timedelta(seconds=60), "n1")]


def test_the_worker_state_keeps_its_deadline_index_as_rows_are_written() -> None:
    state, e = worker_table_state(), engine()
    at = START + timedelta(seconds=60)
    assert e.due(state, at) == []
    state.write([Change(DRAINS, "n1", _episode("n1", 60))], event=row_event())
    assert e.due(state, at) == [DeadlineTick(at, "n1")]
    state.write([Change(DRAINS, "n1", _episode("n1", 60, deadline_passed=True))], event=row_event())
    assert e.due(state, at) == []


def test_rows_a_rebalance_brings_are_due_once_the_index_is_rebuilt() -> None:
    state, e = worker_table_state(), engine()
    at = START + timedelta(seconds=60)
    assert e.due(state, at) == []  # the index is built, from no rows
    state.tables[DRAINS]["n2"] = encode_state(DRAINS, _episode("n2", 10))  # recovered from the changelog
    assert e.due(state, at) == []
    state.rebuild_indexes()  # what the worker does on every completed rebalance
    assert e.due(state, at) == [DeadlineTick(at, "n2")]


# ---------------------------------------------------------------- is a VM already so


@pytest.mark.parametrize(("action", "phase", "so"), [
    ("start", "Running", True),
    ("start", "Scheduling", True),
    ("start", "Succeeded", False),
    ("start", "Failed", False),
    ("start", None, False),  # no VMI
    ("stop", "Running", False),
    ("stop", "Succeeded", True),
    ("stop", "Failed", True),
    ("stop", None, True),
    ("restart", "Running", False),  # a restart is never "already so"
])
def test_a_start_or_stop_is_already_so_as_the_vmi_shows(action: str, phase: str | None, so: bool) -> None:
    live = None if phase is None else vmi("spx-proj-a", "w-1", node_name="gpu-node-1", phase=phase)
    assert already_so(action, live) is so


def test_the_applier_judges_with_the_rules_and_their_one_list_of_ended_phases() -> None:
    assert ENDED_PHASES == {"Succeeded", "Failed"}
    assert vars(api)["already_so"] is already_so
    assert not hasattr(api, "ENDED_PHASES")  # no copy of its own


# ---------------------------------------------------------------- typed tables


def test_tables_are_declared_once_with_their_scope() -> None:
    assert [t.name for t in GLOBAL_TABLES] == ["usage", "kubevirt", "namespaces"]
    assert all(table_named(t.name) is t and t.stored_as == f"state-{t.name}" and t.help for t in TABLES)
    change = Change(VMS, "vm/a/1", None)
    assert copy.deepcopy(change).table is VMS and pickle.loads(pickle.dumps(change)).table is VMS


def test_an_overlay_lists_rows_of_any_table_by_key() -> None:
    """Rows without a ``node`` field (VM tracking) list as well as node-keyed ones."""
    state = MemoryState()
    state.apply([Change(TRACKING, "vm/a/1", VMTracking(pending_episode="p1")),
                 Change(TRACKING, "vm/a/2", VMTracking(pending_episode="p2"))])
    overlay = Overlay(state)
    overlay.put(TRACKING, "vm/a/1", VMTracking(pending_episode="p1b"))
    overlay.put(TRACKING, "vm/a/2", None)
    overlay.put(TRACKING, "vm/a/3", VMTracking(pending_episode="p3"))
    assert [t.pending_episode for t in overlay.values(TRACKING)] == ["p1b", "p3"]
    assert overlay.get(VMS, "vm/a/1") is None


def test_a_deadline_moved_and_moved_back_is_due_once() -> None:
    """Its row went t0 → t1 → t0: two current entries in the heap, one node due, one tick."""
    state, e = MemoryState(), engine()
    for seconds in (60, 600, 60):
        state.apply([Change(DRAINS, "n1", _episode("n1", seconds))])
    at = START + timedelta(seconds=60)
    assert state.deadlines.due(at) == ["n1"]
    assert e.due(state, at) == [DeadlineTick(at, "n1")]
    assert state.deadlines.due(at) == ["n1"]  # still indexed, still once
