"""The applier's ledger of results (streams/kube/applying/loop.py) on a real broker, and the lines
it logs per command.

The ledger reads the command-results topic to learn which commands are done. The results
this applier wrote itself it knows already: they are skipped by where the broker put them
(the offsets its producer reported), not opened and checked again. Everything else (another
applier's result, a forgery) is judged as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from handlers.contracts import ids
from handlers.contracts.messages import Command, ObjectRef
from handlers.contracts.topics import COMMAND_RESULTS
from handlers.core.decisions import subject_key
from handlers.rules.results import RetryLater, Tries, decide_result
from harness.running import CONFIG, Deployment
from streams.common.codecs import encode_message
from streams.common.durable import Delivered, DurableProducer, Record
from streams.common.group_reading import Received
from streams.common.settings import Settings, load_settings
from streams.common.signing import Keyring, open_sealed
from streams.kube.applying import Applied, Applier, KubeApplier, ResultLedger, loop
from tests.support.waiting import eventually

pytestmark = pytest.mark.kafka

NOW = datetime(2026, 12, 1, tzinfo=UTC)


def command(name: str) -> Command:
    target = ObjectRef(kind="VirtualMachine", namespace="spx-proj-a", name=name)
    return Command(command_id=ids.command_id(f"cause-{name}", "restart_vm", subject_key(target)), type="restart_vm",
                   target=target, cause=f"cause-{name}", issued_at=NOW)


def result_record(settings: Settings, keyring: Keyring, name: str) -> tuple[str, Record]:
    issued = command(name)
    result = decide_result(issued, outcome="applied", now=NOW, topic="commands").result
    return issued.command_id, Record(settings.kafka.topic(COMMAND_RESULTS), subject_key(issued.target).encode(),
                                     encode_message(result, keyring=keyring))


def settings_of(deployment: Deployment) -> Settings:
    return load_settings(CONFIG).model_copy(update={"kafka": deployment.kafka, "signing": deployment.signing})


def read_then(ledger: ResultLedger, check: Callable[[], bool]) -> Callable[[], bool]:
    """``check``, asked once the ledger has taken what has arrived."""
    def probe() -> bool:
        ledger.take_arrived()
        return check()
    return probe


def test_the_ledger_skips_its_own_results_and_judges_the_rest(
        deployment: Deployment, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_of(deployment)
    keyring = settings.signing.keyring()
    opened: list[bytes] = []
    real_open = open_sealed

    def counting_open(model: Any, raw: bytes, purpose: Any, keys: Keyring) -> Any:
        opened.append(raw)
        return real_open(model, raw, purpose, keys)

    monkeypatch.setattr(loop, "open_sealed", counting_open)
    ledger = ResultLedger(settings, keyring=keyring)
    ledger.catch_up()  # as the applier does at start: the first read assigns the partitions
    producer = DurableProducer(settings.kafka, client_id="vmstream-test")
    try:
        own_ids, own = zip(*(result_record(settings, keyring, f"own-{i}") for i in range(5)), strict=True)
        for command_id in own_ids:  # what the applier does as it reads a command
            ledger.add(command_id)
        ledger.wrote(producer.send_all(list(own)))
        other_id, other = result_record(settings, keyring, "other")  # another applier's
        forged_id, forged = result_record(settings, Keyring({"k-x": b"y" * 32}, active="k-x"), "forged")
        producer.send_all([other, forged])
        eventually(read_then(ledger, lambda: other_id in ledger), "the other applier's result to count")
        eventually(read_then(ledger, lambda: ledger.ignored == 1), "the forgery to be read")
    finally:
        producer.close()
        ledger.close()
    assert forged_id not in ledger
    assert set(own_ids) <= ledger.done
    assert other.value is not None and forged.value is not None
    assert sorted(opened) == sorted([other.value, forged.value])  # its own five were never opened
    assert not any(ledger.written.values())  # each offset forgotten once read back: nothing grows


def test_a_result_at_an_offset_not_its_own_is_opened_even_if_its_command_is_known(deployment: Deployment) -> None:
    """Only the broker's word on where a record is counts as "own", never what a record says."""
    settings = settings_of(deployment)
    keyring = settings.signing.keyring()
    ledger = ResultLedger(settings, keyring=keyring)
    ledger.catch_up()  # as the applier does at start: the first read assigns the partitions
    producer = DurableProducer(settings.kafka, client_id="vmstream-test")
    try:
        command_id, record = result_record(settings, Keyring({"k-x": b"y" * 32}, active="k-x"), "known")
        ledger.add(command_id)
        ledger.wrote([])  # it wrote nothing
        producer.send_all([record])
        eventually(read_then(ledger, lambda: ledger.ignored == 1), "the forged result to be judged")
    finally:
        producer.close()
        ledger.close()


class _Answers(KubeApplier):
    """A ``KubeApplier`` that answers each command with a given outcome, sending nothing."""

    def __init__(self, applied: Applied) -> None:  # no API client: nothing is sent
        self.applied, self.cache = applied, None

    def try_once(self, command: Command, tries: Tries = Tries()) -> Applied | RetryLater:
        return self.applied


@pytest.mark.parametrize(("applied", "level"), [
    (Applied("applied", resource_version="2"), logging.DEBUG),
    (Applied("noop", resource_version="2"), logging.DEBUG),
    (Applied("conflict_retried", resource_version="3"), logging.INFO),
    (Applied("failed", error="the API server said no"), logging.INFO),
])
def test_a_command_that_went_as_planned_is_logged_at_debug_the_rest_at_info(
        deployment: Deployment, caplog: pytest.LogCaptureFixture, applied: Applied, level: int) -> None:
    applier = Applier(settings_of(deployment), _Answers(applied))
    with caplog.at_level(logging.DEBUG, logger=loop.__name__):
        applier.apply_one(command("vm-1"))
    lines = [r for r in caplog.records if r.name == loop.__name__ and f": {applied.outcome}" in r.getMessage()]
    assert [r.levelno for r in lines] == [level]


def test_only_offsets_of_its_own_topic_and_partitions_are_kept_and_passed_ones_are_forgotten(
        deployment: Deployment) -> None:
    settings = settings_of(deployment)
    keyring = settings.signing.keyring()
    ledger = ResultLedger(settings, keyring=keyring)
    ledger.catch_up()  # as the applier does at start: the first read assigns the partitions
    producer = DurableProducer(settings.kafka, client_id="vmstream-test")
    try:
        results = settings.kafka.topic(COMMAND_RESULTS)
        ledger.wrote([Delivered(settings.kafka.topic("audit"), 0, 0),  # another topic
                      Delivered(results, settings.kafka.partitions + 3, 0),  # a partition it does not read
                      Delivered(results, 0, -1)])  # an offset the broker did not report
        assert not any(ledger.written.values())
        _, record = result_record(settings, keyring, "passed")
        [place] = producer.send_all([record])
        ledger.wrote([place])
        eventually(read_then(ledger, lambda: not ledger.written[place.partition]), "its own result read back")
        # An offset it wrote that is never read back (compacted away) goes once a later one is read.
        ledger.wrote([Delivered(results, 0, 7), Delivered(results, 0, 9)])
        assert ledger._own(Received(results, 0, 9, None, b"", []))
        assert not ledger.written[0]
    finally:
        producer.close()
        ledger.close()
