"""A decision as data: the commands, notifications, audit record and state changes one
input leads to — and the small builder the rules use to write one.

input → rule(ctx) → :class:`Decision` → the shell sends its messages and applies its
changes. The builder gives every output a deterministic id, so the same input always
yields byte-identical outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from handlers.contracts import ids
from handlers.contracts.config import Config
from handlers.contracts.messages import (
    AuditOutcome,
    AuditRecord,
    Command,
    CommandType,
    GPUMutation,
    Notification,
    NotificationType,
    ObjectRef,
    Severity,
)
from handlers.contracts.topics import AUDIT, COMMANDS, NOTIFICATIONS
from handlers.core.catalog import Catalog
from handlers.core.cluster import Resident
from handlers.core.state import Change, ObservedFate, Overlay, StateView

OutputTopic = str  # the logical name of a topic the worker writes (handlers/contracts/topics.py)


def subject_key(subject: ObjectRef) -> str:
    """The Kafka key of an output about ``subject`` (``vm/<ns>/<name>``, ``node/<name>``)."""
    if subject.kind in ("VirtualMachine", "VirtualMachineInstance"):
        return f"vm/{subject.namespace}/{subject.name}"
    if subject.kind == "Node":
        return f"node/{subject.name}"
    return f"{subject.kind}/{subject.name}"


def vm_subject(key: str) -> ObjectRef:
    _, namespace, name = key.split("/", 2)
    return ObjectRef(kind="VirtualMachine", namespace=namespace, name=name)


def node_subject(node: str) -> ObjectRef:
    return ObjectRef(kind="Node", name=node)


def subject_of_key(key: str | None, *, fallback: str) -> ObjectRef:
    """The subject an intent key names (``vm/<ns>/<name>``, ``node/<name>``)."""
    kind, _, rest = (key or "").partition("/")
    if kind == "vm" and rest.count("/") == 1:
        return vm_subject(key or "")
    if kind == "node" and rest:
        return node_subject(rest)
    return ObjectRef(kind="Intent", name=fallback)


@dataclass(frozen=True, slots=True)
class Output:
    topic: OutputTopic
    key: str
    value: Command | Notification | AuditRecord | Any


PlanStepKind = Literal["go", "back", "call_off"]


@dataclass(frozen=True, slots=True)
class PlanStep:
    """A step of a maintenance plan between its key and a node's (docs/maintenance.md): the
    plan tells a node its slot started (``go``: drain it) or that the plan is called off
    (``call_off``); the node tells the plan it is back (``back``)."""

    plan: str
    step: PlanStepKind
    reason: str = ""
    requested_by: str | None = None
    told: tuple[str, ...] = ()  # go: the node's VMs whose owners the plan told (by key)


@dataclass(frozen=True, slots=True)
class ResidentUpdate:
    """A VM-keyed decision telling a node-keyed one that a GPU VMI arrived, changed or left.

    In the worker it travels through Kafka to the node's partition; in ``simulate`` it is
    decided right after the decision that sent it.
    """

    node: str
    vm_key: str
    resident: Resident | None  # None: the VMI left the node (or holds no GPU any more)
    cause: str
    # What became of the VM since its GPU VMI left ``node``, once that is seen: it runs
    # elsewhere ("came_back"), its new VMI waits for a card ("waits_for_gpu"), or it stays
    # off ("off"). A drain of ``node`` reports it (drain_completed).
    fate: ObservedFate | None = None
    # Not about a VM: the cards another node's drain counted may be taken, or wanted by a
    # drain before it; ``node``'s drain plans its promises again (``vm_key`` is empty).
    recheck: bool = False
    # Not about a VM either: a maintenance plan's step between the plan's key and ``node``'s.
    plan: PlanStep | None = None

    @property
    def key(self) -> str:
        """The decision key it is decided under: its node's, or (a node back) its plan's."""
        if self.plan is not None and self.plan.step == "back":
            return f"maintenance/{self.plan.plan}"
        return f"node/{self.node}"


@dataclass(slots=True)
class Decision:
    commands: list[Command] = field(default_factory=list)
    notifications: list[Notification] = field(default_factory=list)
    audit: AuditRecord | None = None
    changes: list[Change] = field(default_factory=list)
    forwards: list[ResidentUpdate] = field(default_factory=list)

    @property
    def has_effects(self) -> bool:
        return bool(self.commands or self.notifications)

    @property
    def has_outputs(self) -> bool:
        """Whether :meth:`outputs` would give any, without building them."""
        return bool(self.commands or self.notifications or self.audit is not None)

    def outputs(self) -> list[Output]:
        """Commands, then notifications, then the audit record that names them."""
        out = [Output(COMMANDS.name, subject_key(c.target), c) for c in self.commands]
        out += [Output(NOTIFICATIONS.name, subject_key(n.subject), n) for n in self.notifications]
        if self.audit is not None:
            out.append(Output(AUDIT.name, self.audit.input.key or "", self.audit))
        return out


@dataclass(slots=True)
class Context:
    """What a rule works with: the state (with its own writes), the policy and the time.

    ``cause`` names the input (an intent_id, an event_id, a deadline): every id the rule
    issues derives from it.
    """

    state: Overlay
    config: Config
    catalog: Catalog
    now: datetime
    cause: str
    commands: list[Command] = field(default_factory=list)
    notifications: list[Notification] = field(default_factory=list)
    forwards: list[ResidentUpdate] = field(default_factory=list)
    remarks: list[str] = field(default_factory=list)  # what the audit record must say besides its outcome

    @classmethod
    def open(cls, state: StateView, config: Config, catalog: Catalog, now: datetime, cause: str) -> Context:
        return cls(Overlay(state), config, catalog, now, cause)

    def command(
        self,
        type_: CommandType,
        target: ObjectRef,
        *,
        patch: list[dict[str, Any]] | None = None,
        base_resource_version: str | None = None,
        manifest: dict[str, Any] | None = None,
        mutation: GPUMutation | None = None,
        requested_by: str | None = None,
        evacuation_node: str | None = None,
    ) -> Command:
        command = Command(
            command_id=ids.command_id(self.cause, type_, subject_key(target)),
            type=type_,
            target=target,
            cause=self.cause,
            issued_at=self.now,
            patch=patch,
            base_resource_version=base_resource_version,
            manifest=manifest,
            mutation=mutation,
            requested_by=requested_by,
            evacuation_node=evacuation_node,
        )
        self.commands.append(command)
        return command

    def notify(
        self,
        type_: NotificationType,
        *,
        subject: ObjectRef,
        episode: str,
        recipients: list[str],
        project: str | None,
        severity: Severity,
        message: str,
        details: dict[str, Any] | None = None,
        deadline: datetime | None = None,
    ) -> Notification:
        """A notification named by (type, subject, episode): the same fact, the same id.

        Everyone is told: a notice with nobody to tell — a VM with neither an owner annotation
        nor a project label — goes to the operators, and its details say why."""
        if not recipients:
            recipients = list(self.config.operators)
            details = {**(details or {}), "told_instead": (
                "the operators: no owner (annotation vmstream.io/owner) and no project label names anyone to tell")}
        notification = Notification(
            notification_id=ids.notification_id(type_, subject_key(subject), episode),
            type=type_,
            recipients=recipients,
            project=project,
            subject=subject,
            severity=severity,
            message=message,
            details=details or {},
            deadline=deadline,
            at=self.now,
        )
        self.notifications.append(notification)
        return notification

    def remark(self, text: str) -> None:
        """Something the audit record of this decision says (e.g. a warning told to an owner)."""
        if text not in self.remarks:
            self.remarks.append(text)

    def forward(self, node: str, vm_key: str, resident: Resident | None, *, fate: ObservedFate | None = None) -> None:
        self.forwards.append(ResidentUpdate(node, vm_key, resident, self.cause, fate))

    def step(self, node: str, step: PlanStep) -> None:
        """Send a maintenance plan's step between the plan and ``node`` (:class:`PlanStep`)."""
        self.forwards.append(ResidentUpdate(node, "", None, self.cause, None, False, step))

    def recheck(self, node: str) -> None:
        """Ask ``node``'s drain to plan its promises again (a card it counted may be gone)."""
        update = ResidentUpdate(node, "", None, self.cause, None, True)
        if update not in self.forwards:
            self.forwards.append(update)

    def decide(
        self,
        *,
        topic: str,
        key: str | None,
        outcome: AuditOutcome,
        reason: str | None = None,
    ) -> Decision:
        """Close the decision with its one audit record."""
        if self.remarks:
            reason = "; ".join([*([reason] if reason else []), *self.remarks])
        audit = AuditRecord.model_validate({
            "audit_id": ids.audit_id(topic, self.cause, outcome),
            "at": self.now,
            "input": {"topic": topic, "key": key, "ref": self.cause},
            "outcome": outcome,
            "reason": reason,
            "commands": [c.command_id for c in self.commands],
            "notifications": [n.notification_id for n in self.notifications],
        })
        return Decision(
            list(self.commands), list(self.notifications), audit, self.state.changes(), list(self.forwards)
        )
