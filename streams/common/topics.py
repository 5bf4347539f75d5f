"""Creating the Kafka topics of handlers/contracts/topics.py (names, configs), plus the worker's changelogs.

The worker decides only what it read from ``worker-routed``, a topic it partitions itself
(murmur2 of the decision key, by its own producer): intents and watch events are re-keyed
onto it whatever partitioner their producer used (docs/worker.md, "Decision keys").

Creation is idempotent (an existing topic is left as it is) and part of the worker's
start-up and of ``vmstream topics create``. Each topic's retention is declared with it
(handlers/contracts/topics.py): the audit stream is the record and never expires; dead letters wait
weeks for a person.
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import NewTopic

from handlers.contracts import topics
from handlers.contracts.topics import TOPICS as TOPICS  # re-exported: the topics created
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client
from streams.common.settings import KafkaSettings

log = logging.getLogger(__name__)

# On the routed topic: what a record is (intent | event | resident | tick), and for an intent
# or a watch event, where it was first read (JSON: topic, partition, offset, key).
KIND_HEADER = "vmstream-kind"
SOURCE_HEADER = "vmstream-source"
# The route stage's consumer group (streams/worker/routing.py); ``{app_id}`` is the worker's.
ROUTE_GROUP = "{app_id}-route"
# Logical names (strings) of handlers/contracts/topics.py's declarations, for the shell's callers.
ROUTED = topics.WORKER_ROUTED.name
ROUTED_INPUTS = tuple(topic.name for topic in topics.ROUTED_INPUTS)
DELIVERIES = topics.DELIVERIES.name
GPU_CLASSES = topics.GPU_CLASSES.name


def route_group(app_id: str) -> str:
    """The route stage's consumer group of the worker ``app_id``."""
    return ROUTE_GROUP.format(app_id=app_id)


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
    existing = set(client.list_topics(timeout=ADMIN_SECONDS).topics)
    specs = [(kafka.topic(spec), dict(spec.configs)) for spec in TOPICS]
    specs += [(name, {"cleanup.policy": "compact"}) for name in changelogs]
    if not kafka.create_topics:  # the topics are the platform's (Strimzi KafkaTopics): only look
        absent = sorted(name for name, _ in specs if name not in existing)
        if absent:  # or not this principal's to see: ACLs hide the topics it may not describe
            log.warning("kafka.create_topics is false; not created, not visible: %s", ", ".join(absent))
        return []
    wanted = [
        NewTopic(name, num_partitions=kafka.partitions, replication_factor=kafka.replication_factor, config=configs)
        for name, configs in specs
        if name not in existing
    ]
    created = []
    for topic in wanted:  # one at a time: a race with another worker loses nothing
        try:
            # Waited for until the cluster has it: a client that looks next finds its partitions.
            client.create_topics([topic], operation_timeout=ADMIN_SECONDS,
                                 request_timeout=ADMIN_SECONDS)[topic.topic].result()
            created.append(topic.topic)
        except KafkaException as error:
            if error.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    if created:
        log.info("created topics", extra={"topics": created})
    return created


def missing_topics(kafka: KafkaSettings) -> list[str]:
    existing = set(admin_client(kafka).list_topics(timeout=ADMIN_SECONDS).topics)
    return [kafka.topic(spec) for spec in TOPICS if kafka.topic(spec) not in existing]
