"""Intent ids are remembered for a window (``intents.dedup_window_seconds``), not for ever.

Within it a redelivered intent is a Duplicate whose audit says what it said before; past it
the engine's tick forgets the id (from the ``processed`` rows' :class:`ExpiryIndex`, never a
pass over the table), so the table of decided ids stays as large as a window's intents.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from handlers.contracts.config import Config
from handlers.core.outcomes import Accepted, Duplicate, Refused
from handlers.core.rows import DecidedIntent
from handlers.core.state import Change, MemoryState
from handlers.core.tables import PROCESSED
from handlers.decide import engine as engine_module
from handlers.decide.engine import Engine, Result
from handlers.decide.inputs import DeadlineTick, ForgetTick, IntentInput, Source, WatchInput, forget_value, routed_input
from samples.cluster import RTX, node
from streams.common.codecs import decode_state, encode_state
from streams.worker import tablestate
from tests.support.harness import EVENTS_TOPIC, INTENTS_TOPIC, START, config
from tests.support.worker_state import row_event, worker_table_state

OPS = "ops@example.com"
WINDOW = 3600


class Run:
    """The engine and its state, fed as ``simulate`` feeds them: what is due first."""

    def __init__(self, window: int | None = WINDOW) -> None:
        overrides: dict[str, Any] = {"auth": {"mode": "none"}}
        if window is not None:
            overrides["intents"] = {"dedup_window_seconds": window}
        self.engine = Engine(config(**overrides))
        self.state = MemoryState()
        self.now = START
        self.feed(WatchInput({"event_id": "ev-1", "type": "ADDED", "kind": "Node",
                              "object": node("gpu-node-1", gpus={RTX: 1}), "observed_at": START.isoformat()},
                             Source(EVENTS_TOPIC, None), START))

    def feed(self, input_: Any) -> list[Result]:
        results = []
        if self.engine.due(self.state, self.now):
            results += self.engine.decide(self.state, DeadlineTick(self.now))
        results += self.engine.decide(self.state, input_)
        for result in results:
            self.state.apply(result.decision.changes)
        return results

    def drain(self, intent_id: str = "it-1", *, after: float = 0, reason: str = "PSU") -> Result:
        self.now += timedelta(seconds=after)
        value = {"intent_id": intent_id, "type": "drain_node", "requested_by": OPS,
                 "spec": {"node": "gpu-node-1", "reason": reason, "notice_seconds": 10 * WINDOW}}
        results = self.feed(IntentInput(value, Source(INTENTS_TOPIC, "node/gpu-node-1"), self.now))
        return results[-1]


def test_the_window_is_a_week_by_default() -> None:
    assert Config(az="az1").intents.dedup_window_seconds == 7 * 86_400


def test_an_intent_redelivered_within_the_window_is_a_duplicate_with_the_same_content() -> None:
    run = Run()
    assert isinstance(run.drain().judgement, Accepted)
    early = run.drain(after=1)
    at_the_edge = run.drain(after=WINDOW - 1)  # decided exactly one window ago
    for again in (early, at_the_edge):
        assert again.judgement == Duplicate("intent it-1 was already decided (accepted)")
        assert not again.decision.commands and not again.decision.notifications
    assert early.decision.audit is not None and at_the_edge.decision.audit is not None
    assert early.decision.audit.audit_id == at_the_edge.decision.audit.audit_id
    assert run.state.get(PROCESSED, "it-1") == DecidedIntent("accepted", START, "node/gpu-node-1")


def test_a_refused_intent_is_remembered_as_refused_for_the_window() -> None:
    run = Run()
    value = {"intent_id": "it-9", "type": "restart_vm", "requested_by": "alice@example.com",
             "project": "proj-a", "spec": {"namespace": "spx-proj-a", "name": "nowhere"}}
    source = Source(INTENTS_TOPIC, "vm/spx-proj-a/nowhere")
    [first] = run.feed(IntentInput(value, source, run.now))
    assert isinstance(first.judgement, Refused)
    run.now += timedelta(seconds=WINDOW)
    [again] = run.feed(IntentInput(value, source, run.now))
    assert again.judgement == Duplicate("intent it-9 was already decided (rejected)")


def test_past_the_window_the_tick_forgets_the_id_and_a_redelivery_is_decided_anew() -> None:
    run = Run()
    run.drain()
    run.drain("it-2", after=10)
    run.now += timedelta(seconds=WINDOW)
    assert run.engine.due(run.state, run.now) == [ForgetTick(run.now, ("it-1",))]  # it-2 is 10 s younger
    [forgetting] = run.engine.decide(run.state, DeadlineTick(run.now))
    assert forgetting.decision.changes == [Change(PROCESSED, "it-1", None)]
    assert forgetting.decision.audit is None and not forgetting.outputs()  # housekeeping: nothing is sent
    run.state.apply(forgetting.decision.changes)
    assert run.state.get(PROCESSED, "it-1") is None and run.state.get(PROCESSED, "it-2") is not None
    assert len(run.state.decided) == 1 and run.engine.due(run.state, run.now) == []
    anew = run.drain(after=1)
    assert not isinstance(anew.judgement, Duplicate)  # the drain under way: asked again, decided again
    assert run.state.get(PROCESSED, "it-1") == DecidedIntent("accepted", run.now, "node/gpu-node-1")


def test_a_row_past_the_window_is_no_duplicate_even_before_a_tick_forgot_it() -> None:
    """A state that keeps no index (or a tick not yet come): the row's own time decides."""
    run = Run()
    run.drain()
    run.now += timedelta(seconds=WINDOW + 1)
    [result] = run.engine.decide(run.state, IntentInput(
        {"intent_id": "it-1", "type": "drain_node", "requested_by": OPS, "spec": {"node": "gpu-node-1",
                                                                                  "reason": "PSU"}},
        Source(INTENTS_TOPIC, "node/gpu-node-1"), run.now))
    assert not isinstance(result.judgement, Duplicate)


def test_a_row_of_before_the_window_stays_a_duplicate_and_is_kept() -> None:
    """Changelogs outlive upgrades: a row that holds the outcome alone has no time to count from."""
    run = Run()
    old = decode_state(PROCESSED, b'"accepted"')
    assert old == "accepted"
    run.state.apply([Change(PROCESSED, "it-1", old)])
    assert len(run.state.decided) == 0
    again = run.drain(after=100 * WINDOW)
    assert again.judgement == Duplicate("intent it-1 was already decided (accepted)")
    assert run.state.get(PROCESSED, "it-1") == "accepted"


def test_a_decided_row_survives_its_codec() -> None:
    row = DecidedIntent("rejected", datetime(2026, 12, 1, 8, 0, tzinfo=START.tzinfo), "vm/spx-proj-a/w-1")
    assert decode_state(PROCESSED, encode_state(PROCESSED, row)) == row


def test_a_tick_that_names_intent_ids_forgets_only_those_past_the_window() -> None:
    """The worker's tick names the ids (their rows' partition decides it); an id still inside
    the window at the tick's time, or one never decided, is kept or left alone."""
    run = Run()
    run.drain()
    run.drain("it-2", after=10)
    run.now += timedelta(seconds=WINDOW)
    [forgetting] = run.engine.decide(run.state, ForgetTick(run.now, ("it-2", "it-1", "it-unknown")))
    assert forgetting.decision.changes == [Change(PROCESSED, "it-1", None)]
    assert forgetting.decision.audit is None and not forgetting.outputs()
    assert run.engine.decide(run.state, ForgetTick(run.now, ("it-2",))) == []  # inside the window: kept


def test_a_forgetting_tick_reads_back_from_the_routed_topic() -> None:
    tick = ForgetTick(START, ("it-1", "it-2"))
    raw = json.dumps(forget_value(tick)).encode()
    assert routed_input("tick", raw, Source("t.worker-routed", "vm/spx-proj-a/w-1", 0, 7), START) == tick


def test_the_worker_state_indexes_its_decided_ids_as_written_and_after_a_rebalance() -> None:
    """Without its index the worker's timer never asks to forget, and ``processed`` grows for ever."""
    engine = Engine(config(auth={"mode": "none"}, intents={"dedup_window_seconds": WINDOW}))
    state = worker_table_state()
    later = START + timedelta(seconds=WINDOW + 1)
    assert engine.due(state, later) == []
    row = DecidedIntent("accepted", START, "node/gpu-node-1")
    state.write([Change(PROCESSED, "it-1", row)], event=row_event())
    assert engine.due(state, START + timedelta(seconds=WINDOW)) == []  # exactly one window old: kept
    assert engine.due(state, later) == [ForgetTick(later, ("it-1",))]
    state.write([Change(PROCESSED, "it-1", None)], event=row_event())
    assert engine.due(state, later) == []
    state.tables[PROCESSED]["it-3"] = encode_state(PROCESSED, row)  # recovered from the changelog
    state.rebuild_indexes()  # what the worker does on every completed rebalance
    assert engine.due(state, later) == [ForgetTick(later, ("it-3",))]


def test_the_rebuilt_index_is_read_a_slice_at_a_time(monkeypatch: Any) -> None:
    """A week's intents are millions of rows: after a rebalance the index is read back a
    slice per ask, not in one pause of the event loop."""
    monkeypatch.setattr(tablestate, "INDEXED_PER_ASK", 2)
    engine = Engine(config(auth={"mode": "none"}, intents={"dedup_window_seconds": WINDOW}))
    state = worker_table_state()
    for number in range(5):
        state.tables[PROCESSED][f"it-{number}"] = encode_state(PROCESSED, DecidedIntent("accepted", START, None))
    later = START + timedelta(seconds=WINDOW + 1)
    asked = [len(state.decided) for _ in range(4)]
    assert asked == [2, 4, 5, 5]
    [tick] = engine.due(state, later)
    assert isinstance(tick, ForgetTick) and sorted(tick.intent_ids) == [f"it-{n}" for n in range(5)]


def test_a_backlog_of_expired_ids_is_named_a_bounded_batch_at_a_time(monkeypatch: Any) -> None:
    """A first start with a window over a table of old ids: each tick names the oldest few,
    never the whole backlog (a pass over it every second would stall the worker)."""
    monkeypatch.setattr(engine_module, "FORGET_AT_ONCE", 2)
    run = Run()
    for number in range(5):
        run.drain(f"it-{number}", after=1)
    run.now += timedelta(seconds=2 * WINDOW)
    [tick] = run.engine.due(run.state, run.now)
    assert tick == ForgetTick(run.now, ("it-0", "it-1"))
