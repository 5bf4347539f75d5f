"""What a rule made of its input, as a type: accepted, refused (and why), ignored (and why).

Rules used to answer ``str | None``, and ``None`` meant "go ahead" for an intent's rule but
"not ignored" for a watch event: the reader had to know which. A :class:`Judgement` says
it. The engine writes one into the audit record (its ``outcome``: ``accepted``,
``rejected``, ``duplicate``, ``ignored``, and its ``reason``), and a
:class:`~handlers.engine.Result` reads its judgement back off that record: one source of
truth, the same for a result decided now and one the worker's journal gives back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from handlers.messages import AuditRecord


@dataclass(frozen=True, slots=True)
class Accepted:
    """Decided as asked; ``reason`` only qualifies it (nothing to change: already so)."""

    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """Not done, and the requester is told ``reason``; a malformed input is refused too."""

    reason: str


@dataclass(frozen=True, slots=True)
class Ignored:
    """Nothing to decide: a kind not watched, an intent decided already (``duplicate``),
    a node update that changed nothing anybody is told."""

    reason: str
    duplicate: bool = False


Judgement = Accepted | Refused | Ignored
ACCEPTED = Accepted()
NO_EFFECT = Ignored("no effect")  # a node's resident update that led to nothing to tell or do

AuditVerdict = Literal["accepted", "rejected", "ignored", "duplicate"]


def audit_outcome(judgement: Judgement) -> AuditVerdict:
    """The audit record's ``outcome`` for a judgement."""
    if isinstance(judgement, Accepted):
        return "accepted"
    if isinstance(judgement, Refused):
        return "rejected"
    return "duplicate" if judgement.duplicate else "ignored"


def judgement_of(audit: AuditRecord | None) -> Judgement:
    """The judgement an audit record tells (a result read back from the journal)."""
    if audit is None:
        return NO_EFFECT
    reason = audit.reason or ""
    if audit.outcome == "rejected":
        return Refused(reason)
    if audit.outcome in ("ignored", "duplicate"):
        return Ignored(reason, duplicate=audit.outcome == "duplicate")
    return Accepted(audit.reason)
