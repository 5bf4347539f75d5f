"""``inherit_offsets`` (streams/worker/routing.py): the route group is given the Faust group's
offsets of the partitions it never committed, and nothing else; refused writes are tried
again, and if they stay refused the worker does not start. The groups are a stand-in that
keeps both groups' offsets as the broker would (the stage on a real broker:
tests/kafka/test_route_group.py)."""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.errors import CoordinatorNotAvailableError, GroupAuthorizationFailedError

from streams.common.group_reading import Partition
from streams.worker.routing import INHERIT_ATTEMPTS, inherit_offsets, inherit_offsets_patiently

INTENTS, EVENTS, ROUTED = "t.intents", "t.k8s-events", "t.worker-routed"


class Groups:
    """Committed offsets by group, and how many writes to refuse before taking one."""

    def __init__(self, offsets: dict[str, dict[Partition, int]], refuse: int = 0,
                 joined_meanwhile: dict[Partition, int] | None = None) -> None:
        self.offsets = offsets
        self.refuse = refuse
        self.joined_meanwhile = joined_meanwhile  # what another replica gives the group when refused
        self.writes = 0

    def committed(self, group: str) -> dict[Partition, int]:
        return dict(self.offsets.get(group, {}))

    def give(self, group: str, offsets: dict[Partition, int]) -> list[str]:
        self.writes += 1
        if self.refuse:
            self.refuse -= 1
            if self.joined_meanwhile is not None:
                self.offsets.setdefault(group, {}).update(self.joined_meanwhile)
            return ["UNKNOWN_MEMBER_ID"]
        self.offsets.setdefault(group, {}).update(offsets)
        return []


def tp(topic: str, partition: int) -> Partition:
    return Partition(topic, partition)


def test_only_the_inputs_partitions_the_group_never_committed_are_given() -> None:
    groups = Groups({"app": {tp(INTENTS, 0): 10, tp(INTENTS, 1): 20, tp(EVENTS, 0): 5, tp(ROUTED, 0): 99},
                     "app-route": {tp(INTENTS, 1): 25}})
    given = inherit_offsets(groups, "app-route", "app", (INTENTS, EVENTS))
    assert given == {tp(INTENTS, 0): 10, tp(EVENTS, 0): 5}
    # its own offset of intents/1 stays; the routed topic is the Faust group's own
    assert groups.offsets["app-route"] == {tp(INTENTS, 0): 10, tp(INTENTS, 1): 25, tp(EVENTS, 0): 5}


def test_nothing_is_written_once_the_group_has_all() -> None:
    groups = Groups({"app": {tp(INTENTS, 0): 10}, "app-route": {tp(INTENTS, 0): 3}})
    assert inherit_offsets(groups, "app-route", "app", (INTENTS,)) == {}
    assert groups.writes == 0


def test_a_replica_that_joined_meanwhile_with_the_offsets_settles_it() -> None:
    groups = Groups({"app": {tp(INTENTS, 0): 10}}, refuse=1, joined_meanwhile={tp(INTENTS, 0): 10})
    assert inherit_offsets(groups, "app-route", "app", (INTENTS,)) == {}
    assert groups.offsets["app-route"] == {tp(INTENTS, 0): 10}


def test_writes_refused_every_time_stop_the_worker_rather_than_start_from_the_beginning() -> None:
    groups = Groups({"app": {tp(INTENTS, 0): 10}}, refuse=INHERIT_ATTEMPTS)
    with pytest.raises(RuntimeError, match="from the beginning"):
        inherit_offsets(groups, "app-route", "app", (INTENTS,))
    assert groups.writes == INHERIT_ATTEMPTS
    assert "app-route" not in groups.offsets


class Unready(Groups):
    """A fresh broker: no group coordinator for the first few asks."""

    def __init__(self, *args: Any, unready: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.unready = unready

    def committed(self, group: str) -> dict[Partition, int]:
        if self.unready:
            self.unready -= 1
            raise CoordinatorNotAvailableError()
        return super().committed(group)


def test_a_broker_without_a_coordinator_yet_is_asked_again() -> None:
    groups = Unready({"app": {tp(INTENTS, 0): 10}}, unready=2)
    given = inherit_offsets_patiently(groups, "app-route", "app", (INTENTS,), patience=30)
    assert given == {tp(INTENTS, 0): 10}


def test_an_error_that_asking_again_cannot_mend_is_not_waited_out() -> None:
    class Forbidden(Groups):
        def committed(self, group: str) -> dict[Partition, int]:
            raise GroupAuthorizationFailedError()

    with pytest.raises(GroupAuthorizationFailedError):
        inherit_offsets_patiently(Forbidden({}), "app-route", "app", (INTENTS,), patience=30)
