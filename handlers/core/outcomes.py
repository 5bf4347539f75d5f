"""What a rule made of its input, as a type: accepted, refused (and why), ignored (and why).

Rules used to answer ``str | None``, and ``None`` meant "go ahead" for an intent's rule but
"not ignored" for a watch event: the reader had to know which. A :class:`Judgement` says
it. The engine writes one into the audit record (its ``outcome``: ``accepted``,
``rejected``, ``unauthenticated``, ``duplicate``, ``ignored``, and its ``reason``), and a
:class:`~handlers.decide.engine.Result` reads its judgement back off that record: one source of
truth, the same for a result decided now and one the worker's journal gives back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from handlers.contracts.messages import AuditRecord

AuditVerdict = Literal["accepted", "rejected", "unauthenticated", "ignored", "duplicate"]


@dataclass(frozen=True, slots=True)
class Accepted:
    """Decided as asked; ``reason`` only qualifies it (nothing to change: already so)."""

    reason: str | None = None
    outcome: ClassVar[AuditVerdict] = "accepted"  # what the audit record says


@dataclass(frozen=True, slots=True)
class Refused:
    """Not done, and the requester is told ``reason``; a malformed input is refused too."""

    reason: str
    outcome: ClassVar[AuditVerdict] = "rejected"


@dataclass(frozen=True, slots=True)
class Unproven(Refused):
    """Refused for who asks: the intent's credential is missing, forged, expired or not its
    own (docs/auth.md). Audited apart from a refusal of what was asked, and never taken for
    a duplicate: an unsigned copy of a decided intent's id is a forgery attempt."""

    outcome: ClassVar[AuditVerdict] = "unauthenticated"


@dataclass(frozen=True, slots=True)
class Ignored:
    """Nothing to decide: a kind not watched, a node update that changed nothing anybody
    is told."""

    reason: str
    outcome: ClassVar[AuditVerdict] = "ignored"


@dataclass(frozen=True, slots=True)
class Duplicate(Ignored):
    """Ignored because the same intent was decided already (its ``intent_id``)."""

    outcome: ClassVar[AuditVerdict] = "duplicate"


Judgement = Accepted | Refused | Ignored
ACCEPTED = Accepted()
NO_EFFECT = Ignored("no effect")  # a node's resident update that led to nothing to tell or do

_BY_OUTCOME: dict[str, type[Refused] | type[Ignored]] = {
    "rejected": Refused, "unauthenticated": Unproven, "ignored": Ignored, "duplicate": Duplicate,
}


def judgement_of(audit: AuditRecord | None) -> Judgement:
    """The judgement an audit record tells (a result read back from the journal)."""
    if audit is None:
        return NO_EFFECT
    kind = _BY_OUTCOME.get(audit.outcome)
    return Accepted(audit.reason) if kind is None else kind(audit.reason or "")
