"""The Kafka topics, each declared once: what it holds, how it is kept, who writes and reads it.

    Topic → topic creation (streams/common/topics.py), the ACLs (streams/common/principals.py),
    the AsyncAPI document (streams/cli/schemas.py), ``vmstream tail``, the worker's and the
    applier's topics, the harness

Names here are logical (``commands``); the shell adds the configured prefix
(``kafka.topic_prefix``, ``vmstream.`` by default: :meth:`KafkaSettings.topic`). Nothing
else in handlers/ or streams/ spells a topic's name: tests/test_facts.py fails if it does.
``sends`` and ``receives`` say which vmstream process writes and reads a topic, and why; the
published AsyncAPI operations are exactly these, so the document can only say what the code
is declared to do — and the ACL table derives from the same two fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from handlers.contracts.delivery import DeliveryRecord
from handlers.contracts.events import DELIVERY_TYPE
from handlers.contracts.messages import (
    INTENT_MODELS,
    AuditRecord,
    Command,
    CommandResult,
    DeadLetter,
    GPUClassStatus,
    Intent,
    Notification,
    WatchEvent,
)

# The long-running vmstream processes, as the AsyncAPI document tags them.
Process = Literal["worker", "applier", "watch-bridge", "api", "notify"]
PROCESSES: tuple[Process, ...] = get_args(Process)

DAY_MS = 24 * 3600 * 1000
INTENT_TIMESTAMP_BEFORE_MS = 5 * 60 * 1000  # how far in the past an intent's timestamp may lie

_VM_OR_NODE = "`vm/<namespace>/<name>` or `node/<name>`"
# An intent's key is the one its type is decided under (handlers/contracts/messages.py ``decided_under``).
_INTENT_KEYS = " or ".join(dict.fromkeys(f"`{model.decided_under.pattern}`" for model in INTENT_MODELS))


@dataclass(frozen=True, slots=True, eq=False)  # each is one object, compared by identity
class Topic:
    """One topic. ``value`` is the pydantic type of a record's value (``None``: several kinds
    of record, internal); ``internal`` topics are vmstream's own, not a contract."""

    name: str  # logical; the prefix is the shell's
    title: str
    key: str  # what a record's key is
    value: Any
    purpose: str
    configs: Mapping[str, str]
    sends: Mapping[Process, str]  # process → what it writes here
    receives: Mapping[Process, str]  # process → what it reads here for
    internal: bool = False


INTENTS = Topic(
    "intents", "Intents", _INTENT_KEYS, Intent,
    "Requests from upstream services and the CLI. Any partitioner will do (murmur2, FNV-1a, CRC32, "
    "explicit partitions): the worker re-keys each intent by its key onto a topic it partitions "
    "itself ({worker-routed}, internal) and decides it there, with its VM's or node's state.",
    # The worker decides an intent at its Kafka timestamp, which the producer chooses: the
    # broker refuses one older than INTENT_TIMESTAMP_BEFORE_MS, so a credential that expired
    # cannot be made current again by back-dating the record (docs/auth.md).
    {"retention.ms": str(30 * DAY_MS), "message.timestamp.before.max.ms": str(INTENT_TIMESTAMP_BEFORE_MS)},
    sends={},
    receives={"worker": "Route each intent by its key to the instance that decides it."},
)
K8S_EVENTS = Topic(
    "k8s-events", "Kubernetes events", "`<Kind>/<namespace>/<name>` (cluster-scoped: `<Kind>/<name>`)", WatchEvent,
    "Watched objects ({watched_kinds}) as the watch bridge sees them. Any partitioner will do: the worker "
    "re-keys each event by the key it is decided under (`vm/<namespace>/<name>`, `node/<name>`) onto "
    "{worker-routed}.",
    {"retention.ms": str(7 * DAY_MS)},
    sends={"watch-bridge": "Publish each change of a watched object."},
    receives={"worker": "Route each event by its decision key; keep the observed state.",
              "watch-bridge": "Read its own last published state back at start, to publish only what changed "
                              "and the deletions it missed."},
)
COMMANDS = Topic(
    "commands", "Commands", f"the target's key: {_VM_OR_NODE}", Command,
    "Changes the worker decided, for the applier to make.",
    {"retention.ms": str(30 * DAY_MS)},
    sends={"worker": "Ask the applier for a change."},
    receives={"applier": "Apply each command to the Kubernetes API."},
)
COMMAND_RESULTS = Topic(
    "command-results", "Command results", "the key of its command", CommandResult,
    "What the applier did with each command.",
    {"retention.ms": str(30 * DAY_MS)},
    sends={"applier": "Report each command's outcome."},
    receives={"applier": "Read the results back, its ledger: a command with a sealed result is not applied again."},
)
NOTIFICATIONS = Topic(
    "notifications", "Notifications", f"the subject's key: {_VM_OR_NODE}", Notification,
    "What VM owners, requesters and operators must be told. `vmstream notify` delivers them and records "
    f"each delivery on {{deliveries}} (ce_type {DELIVERY_TYPE}).",
    {"retention.ms": str(30 * DAY_MS)},
    sends={"worker": "Tell people what will happen or happened.",
           "applier": "Tell whoever asked, and the VM's owner, that a command failed."},
    receives={"notify": "Deliver each notification to its recipients, once."},
)
AUDIT = Topic(
    "audit", "Audit", "the subject's key (the key of the input it records)", AuditRecord,
    "One record per consumed input: the record of every decision.",
    {"retention.ms": "-1", "retention.bytes": "-1"},  # the record: never expires
    sends={"worker": "Record each decision.", "applier": "Record each command it applied or failed."},
    receives={},
)
DLQ = Topic(
    "dlq", "Dead letters", "the original key", DeadLetter,
    "Malformed input, kept whole; it never blocks its partition.",
    {"retention.ms": str(90 * DAY_MS)},  # dead letters wait weeks for a person
    sends={"worker": "Set aside what cannot be read.",
           "applier": "Set aside a command that cannot be read.",
           "watch-bridge": "Set aside an object too large to publish even reduced.",
           "notify": "Set aside a notification that cannot be read or delivered."},
    receives={},
)
WORKER_ROUTED = Topic(
    "worker-routed", "Routed inputs", "the decision key: `vm/<namespace>/<name>` or `node/<name>`", None,
    "The worker's repartition topic: intents and watch events re-keyed by decision key, resident "
    "updates and ticks (docs/worker.md, \"Decision keys\").",
    {"retention.ms": str(7 * DAY_MS)},
    sends={"worker": "Re-key each input onto the partition that decides it."},
    receives={"worker": "Decide each input, in order per decision key."},
    internal=True,
)
GPU_CLASSES = Topic(
    "gpu-classes", "GPU classes", "the class name (the record's `name`)", GPUClassStatus,
    "Compacted: the AZ's GPU classes and their cards, one current record per class, kept by `vmstream api` "
    "(each replica reads the topic and writes a class only when its figures differ from its latest record); "
    "a tombstone (null value) when a class is gone.",
    {"cleanup.policy": "compact"},
    sends={"api": "Write a class whose figures changed; a tombstone for one gone."},
    receives={"api": "Read every class's latest record, from the beginning."},
)
DELIVERIES = Topic(
    "deliveries", "Deliveries", "`<notification_id>|<channel>|<recipient>` (a recipient without an address: "
    "`<notification_id>|none|<recipient>`)", DeliveryRecord,
    "Compacted: `vmstream notify`'s ledger, one record per notification, channel and recipient delivered or "
    "dead-lettered, written before the next delivery starts; notify reads it back when it starts and skips "
    "every delivery on it.",
    {"cleanup.policy": "compact"},
    sends={"notify": "Record each delivery made or given up, before the next."},
    receives={"notify": "Read the ledger to its end before delivering anything."},
)

TOPICS: tuple[Topic, ...] = (
    INTENTS, K8S_EVENTS, COMMANDS, COMMAND_RESULTS, NOTIFICATIONS, AUDIT, DLQ, WORKER_ROUTED, GPU_CLASSES, DELIVERIES,
)
BY_NAME: Mapping[str, Topic] = {topic.name: topic for topic in TOPICS}

# What ``route`` re-keys onto the routed topic: the worker's inputs from outside.
ROUTED_INPUTS: tuple[Topic, ...] = (INTENTS, K8S_EVENTS)

# Not topics: they name, in audit records (``input.topic``), decisions no record caused.
TIMER = "timer"  # a drain deadline firing
RESIDENTS = "residents"  # a node learning that a GPU VMI came or went


def written_by(process: Process) -> tuple[Topic, ...]:
    return tuple(topic for topic in TOPICS if process in topic.sends)


def read_by(process: Process) -> tuple[Topic, ...]:
    return tuple(topic for topic in TOPICS if process in topic.receives)


def outputs(*processes: Process) -> tuple[Topic, ...]:
    """The public topics the given processes write: the worker's decisions, the applier's results."""
    return tuple(topic for topic in TOPICS if not topic.internal and any(p in topic.sends for p in processes))
