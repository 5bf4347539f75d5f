"""What one decision did to maintenance plans, counted for the worker's counters: GPU VMs
planned, stops a plan made, VMs left without a card, owners' and operators' answers.

    the state before a decision, the decision (its notifications, commands and rows), the
    intent's type → :func:`plan_counts` → :class:`PlanCounts` → the worker's counters
    (streams/common/metrics.py, ``record_plan_counts``)

Read off what the rules already wrote — the ``maintenance_planned`` notices, the plan's
``stop_vm`` commands, the ``plans`` and ``drains`` rows before and after — never decided
again here. Pure: the shell hands over the state as it was before the decision's changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from handlers.contracts.messages import MalformedMessage, decode_json_object
from handlers.core.decisions import Decision
from handlers.core.maintenance import PlanRecord
from handlers.core.rows import DrainEpisode
from handlers.core.state import StateView
from handlers.core.tables import DRAINS, PLANS

ANSWERS = ("reschedule_maintenance", "maintenance_ready")  # the intents that answer a plan
OUTCOMES = {"accepted": "accepted", "rejected": "refused"}  # audit outcome → the counter's


@dataclass(frozen=True, slots=True)
class PlanCounts:
    planned: int = 0  # GPU VMs newly in a plan: their owner told maintenance_planned
    stops: int = 0  # stops a plan made: its stop_vm commands and its drains' stops
    waits_for_card: int = 0  # GPU VMs whose fate became waits_for_card (newly planned so, or corrected to it)
    answer: tuple[str, str] | None = None  # (intent, accepted | refused) of an answer to a plan

    def __bool__(self) -> bool:
        return bool(self.planned or self.stops or self.waits_for_card or self.answer)


def _waiting(record: PlanRecord | None) -> set[str]:
    return set() if record is None else {entry.uid for entry in record.plan.vms if entry.fate == "waits_for_card"}


def _drain_stops(before: DrainEpisode | None, after: DrainEpisode) -> int:
    if after.plan is None:
        return 0
    return len(set(after.stopped) - set(before.stopped if before is not None else ()))


def plan_counts(before: StateView, decision: Decision, intent: str | None = None) -> PlanCounts:
    """What ``decision`` did to plans; ``before`` the state without its changes, ``intent``
    the type of the intent it decided (None for any other input)."""
    planned = sum(1 for n in decision.notifications if n.type == "maintenance_planned")
    stops = waiting = 0
    writes_plan = False
    for change in decision.changes:
        if change.table == PLANS and isinstance(change.value, PlanRecord):
            writes_plan = True
            waiting += len(_waiting(change.value) - _waiting(before.get(PLANS, change.key)))
        elif change.table == DRAINS and isinstance(change.value, DrainEpisode):
            stops += _drain_stops(before.get(DRAINS, change.key), change.value)
    if writes_plan:  # a plan's decision: its stops are vmstream's stop_vm (an early stop, a VM kept off)
        stops += sum(1 for c in decision.commands if c.type == "stop_vm")
    answer = None
    audit = decision.audit
    if intent in ANSWERS and audit is not None and audit.outcome in OUTCOMES:
        answer = (intent, OUTCOMES[audit.outcome])
    return PlanCounts(planned, stops, waiting, answer)


def plan_intent(key: str | None, raw: object) -> str | None:
    """The type of an intent read under a plan's key (``maintenance/<plan>``), else None: the
    only intents :func:`plan_counts` asks about, so no other intent is read twice."""
    if key is None or not key.startswith("maintenance/"):
        return None
    try:
        kind = decode_json_object(raw).get("type")
    except MalformedMessage:
        return None
    return kind if isinstance(kind, str) else None
