"""The Kafka topics of docs/contracts.md, plus the worker's own routing topic — created once.

The worker decides only what it read from ``worker-routed``, a topic it partitions itself
(murmur2 of the decision key, by its own producer): intents and watch events are re-keyed
onto it whatever partitioner their producer used (docs/worker.md, "Decision keys").

Creation is idempotent (an existing topic is left as it is) and part of the worker's
start-up and of ``vmstream topics create``. Retention follows what each topic is for: the
audit stream is the record and never expires; dead letters wait weeks for a person.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from streams.common.kafka_clients import admin_client
from streams.common.settings import KafkaSettings

log = logging.getLogger(__name__)

DAY_MS = 24 * 3600 * 1000
INTENT_TIMESTAMP_BEFORE_MS = 5 * 60 * 1000  # how far in the past an intent's timestamp may lie
ROUTED = "worker-routed"  # the worker's repartition topic: inputs under their decision key
# On the routed topic: what a record is (intent | event | resident | tick), and for an intent
# or a watch event, where it was first read (JSON: topic, partition, offset, key).
KIND_HEADER = "vmstream-kind"
SOURCE_HEADER = "vmstream-source"
ROUTED_INPUTS = ("intents", "k8s-events")  # what ``route`` re-keys onto the routed topic
DELIVERIES = "deliveries"  # ``vmstream notify``'s ledger, compacted (docs/notify.md)
GPU_CLASSES = "gpu-classes"  # ``vmstream api``'s figures per GPU class, compacted (docs/api.md)


@dataclass(frozen=True, slots=True)
class TopicSpec:
    name: str  # logical name; the prefix is added from settings
    purpose: str
    configs: dict[str, str]


TOPICS: tuple[TopicSpec, ...] = (
    # The worker decides an intent at its Kafka timestamp, which the producer chooses: the
    # broker refuses one older than INTENT_TIMESTAMP_BEFORE_MS, so a credential that expired
    # cannot be made current again by back-dating the record (docs/auth.md).
    TopicSpec("intents", "requests from upstream services",
              {"retention.ms": str(30 * DAY_MS), "message.timestamp.before.max.ms": str(INTENT_TIMESTAMP_BEFORE_MS)}),
    TopicSpec("k8s-events", "the watch bridge's events", {"retention.ms": str(7 * DAY_MS)}),
    TopicSpec("commands", "what the applier must do", {"retention.ms": str(30 * DAY_MS)}),
    TopicSpec("command-results", "what the applier did", {"retention.ms": str(30 * DAY_MS)}),
    TopicSpec("notifications", "what people are told", {"retention.ms": str(30 * DAY_MS)}),
    TopicSpec("audit", "the record of every decision", {"retention.ms": "-1", "retention.bytes": "-1"}),
    TopicSpec("dlq", "malformed input, kept for a person", {"retention.ms": str(90 * DAY_MS)}),
    TopicSpec(ROUTED, "intents and watch events re-keyed by decision key (internal)",
              {"retention.ms": str(7 * DAY_MS)}),
    TopicSpec(GPU_CLASSES, "each GPU class's cards, one current record per class (key: the class name)",
              {"cleanup.policy": "compact"}),
    TopicSpec(DELIVERIES, "vmstream notify's ledger: one record per notification, channel and recipient "
              "delivered or dead-lettered (docs/notify.md)", {"cleanup.policy": "compact"}),
)


def changelog_topic(app_id: str, table: str) -> str:
    """The name Faust gives a table's changelog."""
    return f"{app_id}-{table}-changelog"


def ensure_topics(kafka: KafkaSettings, *, changelogs: tuple[str, ...] = ()) -> list[str]:
    """Create every missing topic (and the given compacted changelogs); returns those created.

    Changelogs are created here, before the worker starts, because Faust's partition
    assignor skips a topic it does not see yet — and a global table whose changelog was
    skipped at the first assignment is not recovered until the next rebalance.
    """
    client = admin_client(kafka)
    try:
        existing = set(client.list_topics())
        specs = [(kafka.topic(spec.name), spec.configs) for spec in TOPICS]
        specs += [(name, {"cleanup.policy": "compact"}) for name in changelogs]
        if not kafka.create_topics:  # the topics are the platform's (Strimzi KafkaTopics): only look
            absent = sorted(name for name, _ in specs if name not in existing)
            if absent:  # or not this principal's to see: ACLs hide the topics it may not describe
                log.warning("kafka.create_topics is false; not created, not visible: %s", ", ".join(absent))
            return []
        wanted = [
            NewTopic(
                name=name,
                num_partitions=kafka.partitions,
                replication_factor=kafka.replication_factor,
                topic_configs=configs,
            )
            for name, configs in specs
            if name not in existing
        ]
        created = []
        for topic in wanted:  # one at a time: a race with another worker loses nothing
            try:
                client.create_topics([topic])
                created.append(topic.name)
            except TopicAlreadyExistsError:
                pass
        if created:
            log.info("created topics", extra={"topics": created})
        return created
    finally:
        client.close()


def missing_topics(kafka: KafkaSettings) -> list[str]:
    client = admin_client(kafka)
    try:
        existing = set(client.list_topics())
    finally:
        client.close()
    return [kafka.topic(spec.name) for spec in TOPICS if kafka.topic(spec.name) not in existing]
