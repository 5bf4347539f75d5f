"""Drains at scale: a crowded node's owners are all told by the drain's own decision, and
what lets the engine stay flat — the deadline index and the capacity sums kept along —
answers exactly as a pass over every row would."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any, TypeVar

from handlers.core.cluster import NodeUsage
from handlers.core.state import Change, DeadlineIndex, DrainEpisode, MemoryState, Overlay, StateView
from handlers.core.tables import DRAINS, USAGE, Table
from handlers.decide.engine import TIMER_TOPIC
from handlers.rules.capacity import Capacity, capacity
from handlers.rules.drains import due_deadlines
from samples.cluster import A100, RTX, node, node_maintenance, vm, vmi
from tests.support.harness import START, Harness

OPS = "ops@example.com"
V = TypeVar("V")


def crowded(h: Harness, name: str, vms: int, *, owners: int = 50) -> None:
    """``name`` with ``vms`` RTX cards, each held by a GPU VM of its own; a spare node too."""
    h.observe(node(name, gpus={RTX: vms}))
    for i in range(vms):
        vm_name = f"{name}-vm-{i:03d}"
        h.observe(vm("spx-proj-a", vm_name, project="proj-a", owner=f"user-{i % owners}@example.com",
                     run_strategy="Always" if i % 2 else "Manual", gpu=RTX))
        h.observe(vmi("spx-proj-a", vm_name, node_name=name, gpu=RTX))


def test_a_drain_of_a_node_with_500_gpu_vms_tells_every_owner_in_its_own_decision() -> None:
    h = Harness()
    h.observe(node("spare-node", gpus={RTX: 100}))
    crowded(h, "big-node", 500)
    result = h.intent("drain_node", {"node": "big-node", "reason": "firmware upgrade", "notice_seconds": 600},
                      by=OPS, project=None)
    told = [n for n in result.decision.notifications if n.type == "drain_will_stop_gpu_vm"]
    assert len(told) == 500
    assert len({n.subject.name for n in told}) == 500
    assert {n.recipients[0] for n in told} == {f"user-{i}@example.com" for i in range(50)}
    assert all(n.deadline == START + timedelta(seconds=600) for n in told)
    # 250 restart by themselves and compete for the 100 spare cards: none is promised one.
    outcomes = sorted({n.details["outcome"] for n in told})
    assert outcomes == ["needs_manual_start", "waits_for_gpu"]
    assert {n.details["cards_free"] for n in told if n.details["outcome"] == "waits_for_gpu"} == {100}
    assert [c.type for c in result.decision.commands] == ["cordon_node"]
    assert result.decision.audit is not None and result.decision.audit.outcome == "accepted"
    assert len(result.decision.audit.notifications) == 500


def test_a_node_maintenance_on_50_nodes_tells_each_nodes_owners_in_that_nodes_decision() -> None:
    h = Harness()
    nodes = [f"gpu-node-{n:02d}" for n in range(50)]
    for name in nodes:
        crowded(h, name, 8, owners=8)
    told: dict[str, int] = {}
    for name in nodes:
        result = h.observe(node_maintenance(f"nm-{name}", name, "PSU replacement"))
        told[name] = len([n for n in result.decision.notifications if n.type == "drain_will_stop_gpu_vm"
                          and n.details["node"] == name])
        assert len(result.decision.notifications) == 8
    assert told == {name: 8 for name in nodes}


def test_every_due_deadline_fires_once_in_node_order_whatever_the_number_of_episodes() -> None:
    h = Harness()
    nodes = [f"gpu-node-{n:02d}" for n in range(30)]
    for name in nodes:
        crowded(h, name, 1, owners=1)
    for i, name in enumerate(reversed(nodes)):
        h.intent("drain_node", {"node": name, "reason": "r", "notice_seconds": 60 + (i % 3) * 60},
                 by=OPS, project=None)
    assert h.state.deadlines.due(START + timedelta(seconds=1)) == []
    fired = h.wait(125).tick()
    due_now = sorted(name for i, name in enumerate(reversed(nodes)) if i % 3 < 2)
    assert [r.decision.audit.input.key for r in fired if r.decision.audit] == [f"node/{n}" for n in due_now]
    assert all(r.decision.audit.input.topic == TIMER_TOPIC for r in fired if r.decision.audit)
    assert h.tick() == []  # fired once: the rows say the deadline passed
    assert len(h.wait(60).tick()) == 10
    assert len(h.state.deadlines) == 0


def _episode(node_name: str, minutes: int, **fields: Any) -> DrainEpisode:
    return DrainEpisode(node=node_name, episode=f"ep-{node_name}-{minutes}", source="intent", cause="c",
                        reason="r", requested_by=None, started_at=START,
                        deadline=START + timedelta(minutes=minutes), **fields)


def test_the_deadline_index_answers_as_a_pass_over_every_episode() -> None:
    state = MemoryState()
    steps: list[tuple[str, DrainEpisode | None]] = [
        ("a", _episode("a", 5)), ("b", _episode("b", 1)), ("c", _episode("c", 3)),
        ("b", _episode("b", 7)),  # widened: a new deadline
        ("c", _episode("c", 3, deadline_passed=True)), ("d", _episode("d", 2, completed=True)),
        ("a", None), ("a", _episode("a", 5)), ("e", _episode("e", 1)), ("e", None),
    ]
    for minute in range(10):
        state.apply([Change(DRAINS, *steps[minute])])
        for probe in range(0, 10):
            now = START + timedelta(minutes=probe)
            episodes = state.values(DRAINS)
            scanned = due_deadlines(episodes, now)
            assert state.deadlines.due(now) == scanned
            assert DeadlineIndex.of(episodes).due(now) == scanned


def _usage(node_name: str, schedulable: bool, allocatable: dict[str, int], held: dict[str, int]) -> NodeUsage:
    return NodeUsage(node=node_name, schedulable=schedulable, allocatable=allocatable, held=held)


def _scanned(state: StateView, device: str, excluding: str | None = None) -> Capacity:
    class Plain:  # the same rows, no sums kept: capacity passes over every node
        def get(self, table: Table[V], key: str) -> V | None:
            return state.get(table, key)

        def items(self, table: Table[V]) -> Iterable[tuple[str, V]]:
            return state.items(table)

        def values(self, table: Table[V]) -> Iterable[V]:
            return state.values(table)

    return capacity(Plain(), device, excluding_node=excluding)


def test_capacity_from_the_sums_kept_along_is_the_capacity_summed_over_every_node() -> None:
    state = MemoryState()
    rows = [
        _usage("n1", True, {RTX: 4}, {RTX: 1}),
        _usage("n2", False, {RTX: 2, A100: 1}, {A100: 1}),
        _usage("n3", True, {RTX: 1, A100: 2}, {RTX: 3}),  # over-held: never negative
        _usage("n4", True, {}, {RTX: 1}),
        _usage("n1", True, {RTX: 4}, {RTX: 4}),
        None,
    ]
    for i, row in enumerate(rows):
        key = row.node if row is not None else "n2"
        state.apply([Change(USAGE, key, row)])
        overlay = Overlay(state)
        overlay.put(USAGE, "n3", _usage("n3", i % 2 == 0, {RTX: 2}, {RTX: 1}))
        overlay.put(USAGE, "n5", _usage("n5", True, {A100: 8}, {}))
        for view in (state, overlay):
            for device in (RTX, A100, "other"):
                for excluding in (None, "n1", "n3", "n5"):
                    assert capacity(view, device, excluding_node=excluding) == _scanned(view, device, excluding)
