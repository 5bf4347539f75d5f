"""The applier's group member (streams/common/group_reading.py) on a real broker.

What the applier relies on: a topic created a moment ago is read from its first join; a
partition taken away is committed inside the revoke callback, the commit waited for, so the
next owner starts exactly there; and a member that polls 20 ms at a time (the applier does,
while commands are in flight) goes on reading through rebalances. Each record's number is
counted by the test, per member, not by the code under test.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest

from harness.publishing import publish
from streams.common.durable import DurableProducer, Record
from streams.common.group_reading import GroupReader, Partition
from streams.common.settings import KafkaSettings
from tests.support.waiting import eventually

pytestmark = pytest.mark.kafka

PARTITIONS = 6


def records(topic: str, numbers: range) -> list[tuple[str, str, bytes, int]]:
    return [(topic, f"key-{n % 17}", str(n).encode(), int(time.time() * 1000)) for n in numbers]


class Member(threading.Thread):
    """A group member that reads as the applier does, 20 ms polls, and commits what it has
    read only inside the revoke callback: a rebalance or its own close."""

    def __init__(self, kafka: KafkaSettings, group: str, topic: str, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.kafka, self.group, self.topic = kafka, group, topic
        self.read: list[int] = []
        self.assigned: list[Partition] = []
        self.next: dict[Partition, int] = {}
        self.stop = threading.Event()
        self.failure: BaseException | None = None
        self.reader: GroupReader | None = None

    def _revoked(self, partitions: list[Partition]) -> None:
        assert self.reader is not None
        self.reader.commit({tp: self.next.pop(tp) for tp in partitions if tp in self.next}, wait=True)
        self.assigned = []

    def _assigned(self, partitions: list[Partition]) -> None:
        self.assigned = partitions

    def run(self) -> None:
        try:
            self.reader = GroupReader(self.kafka, group_id=self.group, client_id=self.name, topic=self.topic,
                                      on_revoke=self._revoked, on_assign=self._assigned)
            try:
                while not self.stop.is_set():
                    for tp, batch in self.reader.poll(0.02, max_records=50).items():
                        self.read.extend(int(record.value or b"-1") for record in batch)
                        self.next[tp] = batch[-1].offset + 1
            finally:
                self.reader.close()  # the revoke callback commits what is left
        except BaseException as error:  # reported by the test
            self.failure = error


def start(kafka: KafkaSettings, group: str, topic: str, name: str) -> Member:
    member = Member(kafka, group, topic, name)
    member.start()
    return member


def finish(*members: Member) -> None:
    for member in members:
        member.stop.set()
        member.join(30)
        assert not member.is_alive() and member.failure is None, member.failure


def test_a_topic_created_a_moment_ago_is_read_from_the_first_join(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = kafka_topic_factory("fresh", partitions=PARTITIONS)
    publish(kafka, records(topic, range(60)))
    member = start(kafka, f"g-{uuid.uuid4().hex[:8]}", topic, "only")
    try:
        eventually(lambda: len(member.read) == 60 or None, "every record read", timeout=30)
        assert sorted(tp.partition for tp in member.assigned) == list(range(PARTITIONS))
    finally:
        finish(member)


def test_a_topic_that_never_shows_up_is_an_error_not_an_idle_member(kafka_bootstrap: str) -> None:
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    with pytest.raises(TimeoutError, match="has no partitions"):
        GroupReader(kafka, group_id="g-none", client_id="none", topic=f"absent-{uuid.uuid4().hex[:8]}",
                    topic_wait=2.0)


def test_members_joining_and_leaving_hand_over_exactly_where_the_last_owner_stopped(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    """Three rebalances while records keep coming: every record is read once, by one member."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = kafka_topic_factory("handover", partitions=PARTITIONS)
    group = f"g-{uuid.uuid4().hex[:8]}"
    first = start(kafka, group, topic, "first")
    members = [first]
    total = 0
    try:
        def read_so_far() -> int:
            return sum(len(m.read) for m in members)

        def batch_read(upto: int) -> None:
            eventually(lambda: read_so_far() >= upto or None, f"{upto} records read", timeout=60)

        publish(kafka, records(topic, range(0, 200)))
        total = 200
        batch_read(total)
        second = start(kafka, group, topic, "second")  # a rebalance: first gives half away
        members.append(second)
        eventually(lambda: second.assigned or None, "the second member to get partitions", timeout=60)
        publish(kafka, records(topic, range(200, 400)))
        total = 400
        batch_read(total)
        finish(second)  # another: the second's partitions go back to the first
        publish(kafka, records(topic, range(400, 600)))
        total = 600
        third = start(kafka, group, topic, "third")  # and one more
        members.append(third)
        batch_read(total)
    finally:
        finish(*[m for m in members if m.is_alive()])
    everything = [n for m in members for n in m.read]
    assert sorted(everything) == list(range(total)), "each record read once, by one member"
    assert all(m.read for m in members)


def test_a_record_arriving_alone_is_returned_without_waiting_for_a_full_batch(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str]
) -> None:
    """One command on its own comes back from a poll that would take 200: librdkafka's
    ``consume()`` waits for all of them or the whole timeout (30 s here), which held each
    command arriving alone for the applier's 0.5 s poll."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = kafka_topic_factory("alone", partitions=1)
    reader = GroupReader(kafka, group_id=f"g-{uuid.uuid4().hex[:8]}", client_id="alone", topic=topic)
    try:
        publish(kafka, records(topic, range(1)))
        got: list[int] = []
        polling = threading.Thread(target=lambda: got.extend(  # joins the group, then finds the record
            int(record.value or b"-1") for batch in reader.poll(30.0, max_records=200).values() for record in batch))
        polling.start()
        eventually(lambda: not polling.is_alive() or None, "the poll to return long before its 30 s", timeout=15)
        assert got == [0]
    finally:
        reader.close()


def read_in_polls(reader: GroupReader, count: int, timeout: float = 60.0) -> list[list[int]]:
    """Poll as the applier does until ``count`` records are in: what each poll returned."""
    polls: list[list[int]] = []
    deadline = time.monotonic() + timeout
    while sum(map(len, polls)) < count:
        assert time.monotonic() < deadline, f"{sum(map(len, polls))} of {count} records read"
        got = [int(record.value or b"-1") for batch in reader.poll(0.02, max_records=200).values() for record in batch]
        if got:
            polls.append(got)
    return polls


COMMAND_GAP_SECONDS = 0.01  # between two commands at a low rate: librdkafka acknowledges in less


@pytest.mark.parametrize("wait_ms", [0, 250])
def test_records_arriving_one_by_one_come_several_to_a_fetch_when_the_broker_may_hold_it(
    kafka_bootstrap: str, kafka_topic_factory: Callable[..., str], wait_ms: int
) -> None:
    """Each record is acknowledged by the broker before the next is sent, as the worker's
    commands come at a low rate. With ``fetch_wait_ms`` the broker holds a fetch until more
    have come, so the 60 records arrive in a few fetches; without it, in many more (each
    fetch is a request the broker pays for). Both read every record, in order."""
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap)
    topic = kafka_topic_factory("held", partitions=1)
    assigned = threading.Event()
    reader = GroupReader(kafka, group_id=f"g-{uuid.uuid4().hex[:8]}", client_id="held", topic=topic,
                         on_assign=lambda _: assigned.set(), fetch_wait_ms=wait_ms)
    sender = DurableProducer(kafka, client_id="held", timeout=30)
    try:
        eventually(lambda: reader.poll(0.05, max_records=1) == {} and assigned.is_set() or None, "the assignment")
        def one_at_a_time() -> None:  # the low rate: a record every few milliseconds, not a burst
            for n in range(60):
                sender.send_all([Record(topic, None, str(n).encode())])
                time.sleep(COMMAND_GAP_SECONDS)

        one_by_one = threading.Thread(target=one_at_a_time)
        one_by_one.start()
        polls = read_in_polls(reader, 60)
        one_by_one.join(30)
    finally:
        sender.close()
        reader.close()
    assert [n for got in polls for n in got] == list(range(60))
    if wait_ms:
        assert len(polls) <= 10, [len(got) for got in polls]
    else:  # what the held fetch is measured against: librdkafka answers at the first record
        assert len(polls) > 10, [len(got) for got in polls]
