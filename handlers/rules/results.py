"""Command results: what the applier did, recorded once and told to whom it concerns.

command + what the API server answered → :class:`CommandResult`, one audit record, and —
when it failed — a ``command_failed`` notification to whoever asked and the VM's owner.
Or not yet: :class:`RetryLater`, which records nothing and holds the command for another try.
The applier calls this; the ids derive from the command's id, so a command applied again
after a crash records the same result ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from handlers.contracts import ids
from handlers.contracts.messages import AuditInput, AuditRecord, Command, CommandResult, Notification
from handlers.contracts.topics import COMMANDS
from handlers.core.decisions import subject_key

Outcome = Literal["applied", "noop", "conflict_retried", "failed"]
COMMANDS_TOPIC = COMMANDS.name  # what a result records as its input, without the shell's prefix


@dataclass(frozen=True, slots=True)
class RetryLater:
    """No result yet: the command is tried again after ``after`` seconds, read afresh.

    Held where it stands (the commands of its key wait behind it, and nothing is committed
    past it), so it is never published: a held command has no result to record. ``reason``
    is what the last try met, and what its failure says once the tries run out.
    """

    after: float
    reason: str
    cause: Literal["conflict", "transient"] = "transient"


@dataclass(frozen=True, slots=True)
class Tries:
    """The tries a command has had, by what each met: a conflict (the object changed under
    it) and a transient failure (the API server unavailable) have budgets of their own, so
    an outage's retries never spend the tries a busy VM's conflicts need."""

    conflicts: int = 0
    transients: int = 0

    @property
    def first(self) -> bool:
        return self.conflicts == self.transients == 0

    def after(self, held: RetryLater) -> Tries:
        """The tries once ``held``'s try is counted."""
        if held.cause == "conflict":
            return Tries(self.conflicts + 1, self.transients)
        return Tries(self.conflicts, self.transients + 1)


@dataclass(frozen=True, slots=True)
class ResultDecision:
    result: CommandResult
    audit: AuditRecord
    notification: Notification | None


def decide_result(
    command: Command,
    *,
    outcome: Outcome,
    now: datetime,
    error: str | None = None,
    resource_version: str | None = None,
    owner: str | None = None,
    topic: str = COMMANDS_TOPIC,
) -> ResultDecision:
    """Record what applying ``command`` came to; tell people when it failed."""
    result = CommandResult(
        command_id=command.command_id,
        outcome=outcome,
        error=error,
        at=now,
        type=command.type,
        target=command.target,
        resource_version=resource_version,
        cause=command.cause,
        requested_by=command.requested_by,
    )
    notification = None
    if outcome == "failed":
        recipients = sorted({p for p in (command.requested_by, owner) if p})
        target = command.target
        where = f"{target.namespace}/{target.name}" if target.namespace else target.name
        message = f"vmstream could not {command.type.replace('_', ' ')} {target.kind} {where}: {error}."
        if command.type == "cancel_evacuation":
            # Told plainly: the owner was told the stop is off, and the mark is still there.
            message = (f"KubeVirt still marks VMI {where} for eviction from node {command.evacuation_node}: "
                       f"vmstream could not cancel the mark ({error}). vmstream will not stop the VM on that "
                       "mark; until it is removed (virtctl evacuate-cancel) KubeVirt refuses any new eviction of "
                       "it as already in progress.")
        notification = Notification(
            notification_id=ids.notification_id("command_failed", subject_key(target), command.command_id),
            type="command_failed",
            recipients=recipients,
            subject=target,
            severity="critical",
            message=message,
            details={"command_id": command.command_id, "cause": command.cause, "error": error},
            at=now,
        )
    audit = AuditRecord(
        audit_id=ids.audit_id(topic, command.command_id, outcome),
        at=now,
        input=AuditInput(topic=topic, key=subject_key(command.target), ref=command.command_id),
        outcome="failed" if outcome == "failed" else "applied",
        reason=error if outcome == "failed" else (None if outcome == "applied" else outcome),
        commands=[command.command_id],
        notifications=[notification.notification_id] if notification else [],
    )
    return ResultDecision(result, audit, notification)
