"""vmstream's CloudEvents identity: one type and one source scheme for every record it
writes, whatever carries it — the ``ce_*`` headers on Kafka, a structured CloudEvent on a
webhook, the headers ``vmstream intent`` sends with an intent.

    type   = io.vmstream.<what>[.<its own type>]   e.g. io.vmstream.notification.drain_completed
    source = /vmstream/<process>/<app_id>          e.g. /vmstream/worker/vmstream

The domain is vmstream's own, ``vmstream.io``: written the other way round in a type, as
CloudEvents advises (reverse DNS), and the right way round where Kubernetes names things
(the annotations ``vmstream.io/owner``, ``vmstream.io/pre-gpu``, …, handlers/core/cluster.py,
handlers/rules/gpus.py, handlers/rules/policy.py) and in the schemas' ids. ``superphenix.net/projectID``
is the platform's project label, not vmstream's, and names no event.

Everything that spells a type or a source derives it from here: handlers/contracts/tracing.py (the
headers of the worker's and the applier's records), the watch bridge, ``vmstream notify``
(its ledger, its dead letters and the webhooks it calls), ``vmstream api``, ``vmstream
intent`` and the AsyncAPI document (streams/cli/schemas.py). tests/test_facts.py fails when
another file spells the domain.
"""

from __future__ import annotations

from typing import Literal, get_args

DOMAIN = "vmstream.io"
TYPE_PREFIX = ".".join(reversed(DOMAIN.split("."))) + "."  # io.vmstream.
SOURCE_PREFIX = "/vmstream/"

# The writers a source names: the long-running processes by their command (``vmstream watch``
# is "watch", ``vmstream apply`` the applier) and the command line (``vmstream intent``).
Process = Literal["watch", "worker", "applier", "notify", "api", "cli"]
PROCESSES: tuple[Process, ...] = get_args(Process)
_NAMED: dict[str, Process] = {**{process: process for process in PROCESSES}, "watch-bridge": "watch"}  # and
# handlers/contracts/topics.py's name of the watch bridge

# The types of records without a type of their own.
COMMAND_RESULT_TYPE = f"{TYPE_PREFIX}command-result"
AUDIT_TYPE = f"{TYPE_PREFIX}audit"
DEAD_LETTER_TYPE = f"{TYPE_PREFIX}dead-letter"
DELIVERY_TYPE = f"{TYPE_PREFIX}delivery"  # `vmstream notify`'s ledger
GPU_CLASS_TYPE = f"{TYPE_PREFIX}gpu-class"  # `vmstream api`'s records on vmstream.gpu-classes


def watch_event_type(kind: str, type_: str) -> str:
    """``io.vmstream.watch-event.<kind>.<type>`` in lower case (``…virtualmachine.modified``)."""
    return f"{TYPE_PREFIX}watch-event.{kind.lower()}.{type_.lower()}"


def intent_type(type_: str) -> str:
    """``io.vmstream.intent.<type>``: what ``vmstream intent`` sends (upstream services may
    send types of their own: an intent's headers are read for its trace only)."""
    return f"{TYPE_PREFIX}intent.{type_}"


def command_type(type_: str) -> str:
    return f"{TYPE_PREFIX}command.{type_}"


def notification_type(type_: str) -> str:
    """On Kafka and on a webhook alike."""
    return f"{TYPE_PREFIX}notification.{type_}"


# What each kind of record is called, for readers (the AsyncAPI document, docs/integrators.md).
TYPES: dict[str, str] = {
    "Intent": intent_type("<type>"),
    "WatchEvent": watch_event_type("<kind>", "<type>"),
    "Command": command_type("<type>"),
    "CommandResult": COMMAND_RESULT_TYPE,
    "Notification": notification_type("<type>"),
    "AuditRecord": AUDIT_TYPE,
    "DeadLetter": DEAD_LETTER_TYPE,
    "Delivery": DELIVERY_TYPE,
    "GPUClassStatus": GPU_CLASS_TYPE,
}


def process_named(name: str) -> Process:
    """A writer by its name in handlers/contracts/topics.py (``watch-bridge``) or in a source (``watch``)."""
    process = _NAMED.get(name)
    if process is None:
        raise ValueError(f"not a vmstream process: {name!r}")
    return process


def source(process: Process, app_id: str) -> str:
    """The CloudEvents ``source`` of what ``process`` writes for the deployment ``app_id``
    (``worker.app_id``): ``/vmstream/<process>/<app_id>``."""
    return f"{SOURCE_PREFIX}{process}/{app_id}"


def source_process(text: str | None) -> Process | None:
    """The writer a source in this scheme names; None for a source of any other form."""
    if not text or not text.startswith(SOURCE_PREFIX):
        return None
    name, slash, app_id = text[len(SOURCE_PREFIX):].partition("/")
    if not slash or not app_id or "/" in app_id or name not in PROCESSES:
        return None
    return _NAMED[name]
