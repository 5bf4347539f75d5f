"""A command told to retry later is held (streams/kube/applying/loop.py, ``Lanes``): the commands
of its key wait behind it, its partition is released no further than it, and it is tried again
after the delay it asked for. And the delays the applier asks after a transient failure
(``RetryPolicy.later``). No broker, no API server: the tries are given."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

from handlers.contracts.messages import Command, ObjectRef
from handlers.rules.results import RetryLater, Tries
from streams.kube.applying.api import RetryPolicy
from streams.kube.applying.loop import Lanes, Outputs

TP = ("vmstream.commands", 0)


def command(command_id: str, name: str) -> Command:
    return Command(command_id=command_id, type="start_vm", cause="it-1", issued_at=datetime.now(UTC),
                   target=ObjectRef(kind="VirtualMachine", namespace="ns", name=name))


def test_a_command_held_for_a_retry_holds_its_key_and_its_partition() -> None:
    tries: list[tuple[str, int]] = []
    retrying, go = threading.Event(), threading.Event()

    def apply(issued: Command, before: Tries) -> Outputs | RetryLater:
        attempt = before.conflicts + before.transients
        tries.append((issued.command_id, attempt))
        if issued.command_id == "a" and attempt == 0:
            return RetryLater(0.0, "the VM changed under the command", cause="conflict")
        if issued.command_id == "a":
            retrying.set()
            assert go.wait(30), "never let go"
        return [], []

    with ThreadPoolExecutor(2) as pool:
        lanes = Lanes(pool, apply)
        lanes.start(TP, 0, "vm/ns/a", command("a", "a"))
        lanes.start(TP, 1, "vm/ns/a", command("a2", "a"))  # a's key: behind it
        lanes.start(TP, 2, "vm/ns/b", command("b", "b"))  # another key: not held
        assert retrying.wait(30), "the held command was never tried again"
        assert lanes.release() == ([], [], {})  # nothing past the held command
        assert ("a2", 0) not in tries
        go.set()
        lanes.wait_until_idle()
        assert lanes.release() == ([], [], {TP: 3})
    assert [t for t in tries if t[0] != "b"] == [("a", 0), ("a", 1), ("a2", 0)]
    assert ("b", 0) in tries


def test_transient_failures_are_tried_again_later_and_later_until_the_tries_are_spent() -> None:
    retry = RetryPolicy(attempts=4, initial_seconds=0.5, max_seconds=1.5)
    delays = [retry.later(attempt, "HTTP 503") for attempt in range(4)]
    assert [d.reason for d in delays if d is not None] == ["HTTP 503"] * 3
    assert [0.5 <= d.after <= 1.0 for d in delays[:1] if d is not None] == [True]
    assert [1.0 <= d.after <= 1.5 for d in delays[1:2] if d is not None] == [True]
    assert [1.5 <= d.after <= 2.0 for d in delays[2:3] if d is not None] == [True]  # at most max_seconds, and jitter
    assert delays[3] is None


def test_conflicts_and_transient_failures_spend_budgets_of_their_own() -> None:
    """An outage's 503 before a busy VM's conflicts does not cut the conflicts' tries short."""
    conflict = RetryLater(0.0, "changed", cause="conflict")
    tries = Tries().after(RetryLater(0.5, "HTTP 503"))
    for _ in range(3):
        tries = tries.after(conflict)
    assert (tries.conflicts, tries.transients, tries.first) == (3, 1, False)
    assert Tries().first


def test_a_held_command_is_tried_again_with_what_each_try_met_counted_apart() -> None:
    seen: list[Tries] = []
    met = iter([RetryLater(0.0, "HTTP 503"), RetryLater(0.0, "changed", cause="conflict"),
                RetryLater(0.0, "changed", cause="conflict")])

    def apply(issued: Command, before: Tries) -> Outputs | RetryLater:
        seen.append(before)
        return next(met, ([], []))

    with ThreadPoolExecutor(1) as pool:
        lanes = Lanes(pool, apply)
        lanes.start(TP, 0, "vm/ns/a", command("a", "a"))
        lanes.wait_until_idle()
    assert seen == [Tries(0, 0), Tries(0, 1), Tries(1, 1), Tries(2, 1)]
