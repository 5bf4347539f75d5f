"""Who may do what on Kafka: one principal per process and per upstream service.

    principal → the topics it reads and writes, the groups it joins → ACLs

The table is the specification of docs/security.md ("Kafka ACLs"): tests/kafka/test_acls.py
grants it on a broker with SASL/SCRAM and KRaft's StandardAuthorizer and shows each
process can do its job and nothing more; deploy/components/strimzi ships it as Strimzi
``KafkaUser`` resources, and the test checks they say the same. Topic names are logical
(``commands`` → ``<topic_prefix>commands``); ``{app_id}`` is the worker's application id.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from handlers.contracts.topics import INTENTS, Process, read_by, written_by
from streams.common.settings import KafkaSettings
from streams.common.topics import ROUTE_GROUP

if TYPE_CHECKING:
    from confluent_kafka.admin import AclBinding


@dataclass(frozen=True, slots=True)
class Grants:
    """What one principal may do. ``owned_prefix``: topics (and transactional ids) it owns
    outright under that name prefix — the worker's changelogs and Faust's own topics."""

    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    owned_prefix: str | None = None
    read_prefixed: tuple[str, ...] = ()  # topics read by name prefix (another's changelogs)


# The processes (their Kafka users are named as their ServiceAccounts) and the upstream
# services: each service that asks for changes is a principal of its own with WRITE on
# intents only, so a leaked credential cannot forge commands, results or audit records.
def _grants(process: Process, *, groups: tuple[str, ...] = (), owned_prefix: str | None = None,
            read_prefixed: tuple[str, ...] = ()) -> Grants:
    """A process's topics as handlers/contracts/topics.py declares them: it reads what it receives, writes
    what it sends."""
    return Grants(read=tuple(topic.name for topic in read_by(process)),
                  write=tuple(topic.name for topic in written_by(process)),
                  groups=groups, owned_prefix=owned_prefix, read_prefixed=read_prefixed)


PRINCIPALS: dict[str, Grants] = {
    "vmstream-worker": _grants("worker", groups=("{app_id}", ROUTE_GROUP), owned_prefix="{app_id}-"),
    "vmstream-watch": _grants("watch-bridge"),
    "vmstream-apply": _grants("applier", groups=("{app_id}-applier",)),
    # vmstream notify: notifications in; its ledger of deliveries, and dead letters, out.
    "vmstream-notify": _grants("notify", groups=("vmstream-notify",)),
    # vmstream api: the worker's tables, read-only, and its own compacted figures per class.
    "vmstream-api": _grants("api", read_prefixed=("{app_id}-state-",)),
    "upstream-portal": Grants(write=(INTENTS.name,)),
}
# Each process's principal (its ServiceAccount's name).
PRINCIPAL_OF: dict[Process, str] = {"worker": "vmstream-worker", "watch-bridge": "vmstream-watch",
                                    "applier": "vmstream-apply", "notify": "vmstream-notify", "api": "vmstream-api"}


def acls(principal: str, grants: Grants, kafka: KafkaSettings, *, app_id: str) -> list[AclBinding]:
    """``grants`` as Kafka ACLs for ``User:<principal>`` (librdkafka's admin types)."""
    from confluent_kafka.admin import AclBinding, AclOperation, AclPermissionType, ResourcePatternType, ResourceType

    def allow(operation: AclOperation, kind: ResourceType, name: str,
              pattern: ResourcePatternType = ResourcePatternType.LITERAL) -> AclBinding:
        return AclBinding(kind, name, pattern, f"User:{principal}", "*", operation, AclPermissionType.ALLOW)

    found: list[AclBinding] = []
    # READ and WRITE imply DESCRIBE.
    found += [allow(AclOperation.READ, ResourceType.TOPIC, kafka.topic(topic)) for topic in grants.read]
    found += [allow(AclOperation.WRITE, ResourceType.TOPIC, kafka.topic(topic)) for topic in grants.write]
    found += [allow(AclOperation.READ, ResourceType.TOPIC, prefix.format(app_id=app_id),
                    ResourcePatternType.PREFIXED) for prefix in grants.read_prefixed]
    for group in grants.groups:
        found.append(allow(AclOperation.READ, ResourceType.GROUP, group.format(app_id=app_id)))
    if grants.owned_prefix:
        prefix = grants.owned_prefix.format(app_id=app_id)
        found += [allow(AclOperation.ALL, ResourceType.TOPIC, prefix, ResourcePatternType.PREFIXED),
                  allow(AclOperation.ALL, ResourceType.TRANSACTIONAL_ID, prefix, ResourcePatternType.PREFIXED)]
    return found
