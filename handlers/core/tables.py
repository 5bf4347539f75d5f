"""The tables the rules keep, each declared once as a typed handle.

A :class:`Table` names a table and says what it holds: ``state.get(VMS, key)`` is a
:class:`~handlers.core.cluster.VMRecord` (or None) to the type checker, with no annotation at
the call site. The shell derives everything else from these handles: the Faust tables and
their help (streams/worker), the cluster-wide views (``scope="global"``), the codecs
(``value_type``), the read API's changelogs.

A handle *is* its name (a ``str``), so rows keyed by it, changelogs named ``state-<name>``
and journal entries that record the name all stay as they were.

Every table is written by decisions of one *decision key* only (``written under``), so in
the worker a row always lives in the partition of the input that writes it. ``global``
tables are cluster-wide facts: every worker instance reads all of their partitions.
"""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from handlers.core.cluster import (
    InstancetypeRevision,
    KubeVirtRecord,
    MaintenanceRecord,
    NamespaceRecord,
    NodeRecord,
    NodeUsage,
    Resident,
    VMIRecord,
    VMRecord,
)
from handlers.core.maintenance import PlanRecord
from handlers.core.rows import DecidedIntent, DrainEpisode, VMTracking

V = TypeVar("V")

TableName = Literal[
    "vms", "vmis", "tracking", "nodes", "residents", "drains", "maintenances", "processed", "usage", "kubevirt",
    "namespaces", "revisions", "plans",
]
Scope = Literal["partition", "global"]


class Table(str, Generic[V]):
    """A table's handle: its name, what its key is, who writes it, and what a row holds."""

    key: str  # what a key looks like
    written_under: str  # the decision key whose inputs write a row
    scope: Scope
    help: str
    value_type: Any  # for codecs that store rows outside Python

    def __new__(cls, name: TableName, value_type: Any, *, key: str, written_under: str, scope: Scope = "partition",
                help: str) -> Table[V]:
        table = super().__new__(cls, name)
        table.key, table.written_under, table.scope, table.help, table.value_type = (
            key, written_under, scope, help, value_type)
        return table

    @property
    def name(self) -> TableName:
        return str(self)  # type: ignore[return-value]  # built from a TableName only

    @property
    def stored_as(self) -> str:
        """The name the worker keeps it under: its Faust table, whose changelog every
        reader of the whole cluster (streams/common/globalview.py) reads."""
        return f"state-{self}"

    def __repr__(self) -> str:
        return f"Table({str.__repr__(self)})"

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        """Copied or pickled, a handle is the one declared here (``str``'s own would call
        ``Table(name)`` without the rest)."""
        return table_named, (str(self),)


VMS: Table[VMRecord] = Table(
    "vms", VMRecord, key="vm/<ns>/<name>", written_under="that VM",
    help="VM key → last observed VirtualMachine (decided under the VM's key)")
VMIS: Table[VMIRecord] = Table(
    "vmis", VMIRecord, key="vm/<ns>/<name>", written_under="that VM (VMI = VM name)",
    help="VM key → last observed VMI (a VMI is named after its VM)")
TRACKING: Table[VMTracking] = Table(
    "tracking", VMTracking, key="vm/<ns>/<name>", written_under="that VM",
    help="VM key → what the owner was told (pending restart, GPU unavailable)")
NODES: Table[NodeRecord] = Table(
    "nodes", NodeRecord, key="<node>", written_under="that node",
    help="node → last observed Node (decided under the node's key)")
RESIDENTS: Table[dict[str, Resident]] = Table(
    "residents", dict[str, Resident], key="<node>", written_under="that node",
    help="node → the GPU VMIs on it: the node-keyed view drains read")
DRAINS: Table[DrainEpisode] = Table(
    "drains", DrainEpisode, key="<node>", written_under="that node",
    help="node → its drain episode")
MAINTENANCES: Table[MaintenanceRecord] = Table(
    "maintenances", MaintenanceRecord, key="<name>", written_under="its node",
    help="NodeMaintenance name → record (decided under its node's key)")
PROCESSED: Table[DecidedIntent | str] = Table(
    "processed", DecidedIntent | str, key="<intent_id>", written_under="the intent's key",
    help="intent_id → outcome and when (decided under the intent's key; forgotten after the dedup window; "
         "rows of before the window: the outcome alone)")
USAGE: Table[NodeUsage] = Table(
    "usage", NodeUsage, key="<node>", written_under="that node; read by all", scope="global",
    help="node → GPU cards offered and held: cluster-wide, read by every instance")
KUBEVIRT: Table[KubeVirtRecord] = Table(
    "kubevirt", KubeVirtRecord, key="cluster", written_under="the KubeVirt CR; read by all", scope="global",
    help="'cluster' → the KubeVirt CR's configuration: cluster-wide")
NAMESPACES: Table[NamespaceRecord] = Table(
    "namespaces", NamespaceRecord, key="<namespace>", written_under="the cluster; read by all", scope="global",
    help="namespace → the project its label names: cluster-wide, read by every instance")

REVISIONS: Table[dict[str, InstancetypeRevision]] = Table(
    "revisions", dict[str, InstancetypeRevision], key="vm/<ns>/<name>", written_under="that VM (its owner)",
    help="VM key → its instance-type ControllerRevisions by name: the GPUs KubeVirt puts into its VMIs")

PLANS: Table[PlanRecord] = Table(
    "plans", PlanRecord, key="<plan>", written_under="maintenance/<plan>",
    help="maintenance plan id → the plan as last told and where each of its nodes is")

TABLES: tuple[Table[Any], ...] = (
    VMS, VMIS, TRACKING, NODES, RESIDENTS, DRAINS, MAINTENANCES, PROCESSED, USAGE, KUBEVIRT, NAMESPACES, REVISIONS,
    PLANS,
)
GLOBAL_TABLES: tuple[Table[Any], ...] = tuple(table for table in TABLES if table.scope == "global")
BY_NAME: dict[str, Table[Any]] = {table.name: table for table in TABLES}
KUBEVIRT_KEY = "cluster"  # the one key of KUBEVIRT


def table_named(name: str) -> Table[Any]:
    """The handle of a table named in a record (a journal entry); KeyError if none is."""
    return BY_NAME[name]
