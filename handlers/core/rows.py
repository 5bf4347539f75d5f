"""The values of the tables the rules keep for themselves (the rest are observed records,
handlers/core/cluster.py): what an owner was told, drain episodes, and the intents decided."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

DrainSource = Literal["intent", "maintenance", "cordon", "eviction", "plan"]
DrainOutcome = Literal["returns_automatically", "waits_for_gpu", "needs_manual_start"]
DrainScope = Literal["node", "evictions"]
ObservedFate = Literal["came_back", "waits_for_gpu", "off"]


@dataclass(frozen=True, slots=True)
class VMTracking:
    """What vmstream has told a VM's owner, so that each fact is told once."""

    pending_episode: str | None = None  # the pending-restart episode the owner was told of
    unavailable_episode: str | None = None  # the gpu_unavailable episode the owner was told of
    left_node: str | None = None  # its GPU VMI left this node; where it went is not reported yet
    left_fate: str | None = None  # what was last reported to that node (waits_for_gpu)
    left_phase: str | None = None  # the phase its VMI ended in, if it ended (Failed, Succeeded)
    # The GPU rules (handlers/rules/enforcement.py): the VM content a GPU patch was planned from,
    # while it is in flight (or, enforce: notify, the gaps the owner was told of); and the
    # memory-not-pinned episode the owner was told of.
    gpu_rules_episode: str | None = None
    unpinned_episode: str | None = None

    @property
    def empty(self) -> bool:
        return (self.pending_episode is None and self.unavailable_episode is None and self.left_node is None
                and self.gpu_rules_episode is None and self.unpinned_episode is None)


# What a VM without a ``tracking`` row reads: one shared value (frozen), not a new one per rule.
NOTHING_TOLD = VMTracking()


@dataclass(frozen=True, slots=True)
class DrainEpisode:
    """One drain of one node, from its first signal until no GPU VM is left on it."""

    node: str
    episode: str
    source: DrainSource
    cause: str
    reason: str
    requested_by: str | None
    started_at: datetime
    deadline: datetime
    announced: dict[str, DrainOutcome] = field(default_factory=dict)
    stopped: tuple[str, ...] = ()
    deadline_passed: bool = False
    cordon_observed: bool = False
    completed: bool = False  # kept until the episode ends, so a late signal starts no new one
    scope: DrainScope = "node"  # "evictions": only the VMIs KubeVirt was asked to evict
    cordoned: bool = False  # vmstream cordoned the node itself (and so may uncordon it)
    warned: dict[str, tuple[str | None, tuple[str, ...]]] = field(default_factory=dict)  # key: (project, recipients)
    observed: dict[str, ObservedFate] = field(default_factory=dict)  # what became of each announced VM
    # scope "evictions": each announced VM's own deadline (a full notice from its mark); the
    # episode's deadline is the earliest still to come.
    due: dict[str, datetime] = field(default_factory=dict)
    # How many notices each VM was told in this episode (announced, corrected, retracted):
    # each has an id of its own, so a later one is never taken for a repeat of an earlier.
    told: dict[str, int] = field(default_factory=dict)
    # Called off while KubeVirt still marked some of its VMs for eviction from the node: the
    # row stays, completed, until the marks vmstream cancels are seen gone. VM key → the uid
    # of the VMI whose mark is not a new eviction (its owner was told the stop is off).
    called_off: bool = False
    unmarking: dict[str, str] = field(default_factory=dict)
    # The uid of each announced VM: a VM of the same name with another uid was deleted and
    # made again — another VM, announced to its own owner with a notice of its own.
    uids: dict[str, str] = field(default_factory=dict)
    replaced: tuple[str, ...] = ()  # announced VMs that were deleted and made again meanwhile
    told_gpus: dict[str, tuple[str, ...]] = field(default_factory=dict)  # the GPUs each VM was told it comes back with
    plan: str | None = None  # source "plan": the maintenance plan whose slot started it (told back when the node is)
    planned: tuple[str, ...] = ()  # source "plan": the VMs whose owners the plan told, days ahead


@dataclass(frozen=True, slots=True)
class DecidedIntent:
    """An intent id already decided: a redelivery within ``intents.dedup_window_seconds`` of
    ``at`` is a Duplicate; past it, the row is forgotten (handlers/core/state.py ``ExpiryIndex``).

    A row written before the window existed holds the outcome alone (a ``str``): it has no
    time to count from, so it is a Duplicate for ever and never forgotten by itself.
    """

    outcome: Literal["accepted", "rejected"]
    at: datetime
    # The key the intent was decided under (None offline): where a decision that forgets the
    # row must be decided, in the worker the routed partition that holds it.
    key: str | None = None
