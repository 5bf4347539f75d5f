"""Node drains and evictions: tell every GPU VM's owner before it is stopped, then stop it.

GPU VMs cannot live-migrate, so a drain stops them. What each signal means
(docs/kubevirt.md cites KubeVirt's source for each):

* a ``drain_node`` intent or a NodeMaintenance: the whole node is drained (scope ``node``);
* a VMI marked for eviction (``status.evacuationNodeName``, condition ``EvictionRequested``):
  with ``evictionStrategy: External`` KubeVirt's eviction webhook only marks the VMI and
  leaves the stop to an external controller — here, vmstream. That one VM must leave
  (scope ``evictions``): the node is not cordoned and the other VMs on it are left alone;
* a cordon alone: the node takes no new VMs. Nothing is stopped; no episode starts.

An *episode*, level-based on every later observation of the node:

1. a ``node`` drain cordons the node (a command, unless it already is);
2. each GPU VM in scope is announced once to its owner, with the deadline and what
   KubeVirt will do once its VMI is deleted (:func:`restarts_by_itself`): it stays off,
   or it starts again by itself — and then competes for the free cards of its class with
   every other VM of the drain that restarts, which the owner is told in numbers;
3. at the deadline the GPU VMIs in scope still there are deleted — for a ``node`` drain
   not before the node is seen cordoned (:func:`nothing_new_can_start`);
4. once none is left and what became of each announced VM was observed (its VM reports it:
   running elsewhere, waiting for a card, or off), whoever asked gets ``drain_completed``.

A drain called off — ``undrain_node``, its NodeMaintenance deleted, the node uncordoned by
someone else — is retracted (:func:`call_off_drain`): nothing more is stopped, every owner
who was warned is told it is off, only vmstream's own cordon is undone, and whoever asked
gets the tally.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from handlers.contracts import ids
from handlers.contracts.messages import ObjectRef
from handlers.core.cluster import NodeRecord, NodeUsage, Resident, VMIRecord, VMRecord, describe_gpus
from handlers.core.decisions import Context, node_subject, vm_subject
from handlers.core.state import (
    DeadlineIndex,
    DrainEpisode,
    DrainOutcome,
    DrainScope,
    DrainSource,
    ObservedFate,
    StateView,
)
from handlers.core.tables import DRAINS, NODES, RESIDENTS
from handlers.rules.capacity import (
    capacity,
    claims_elsewhere,
    drain_claims,
    drained_nodes,
    refresh_usage,
    surely_placed,
    tighter,
)

# What KubeVirt's VM controller does once a VM's VMI is gone (deleted, as a drain does),
# by run strategy: pkg/virt-controller/watch/vm/vm.go, ``Controller.syncRunStrategy``.
#   Always          vmi == nil → startVMI
#   Once            vmi == nil → startVMI (only a VMI that ended and still exists keeps it off)
#   RerunOnFailure  vmi == nil, no start request and status.runStrategy unchanged → nothing
#   Manual          vmi == nil → only a start request starts it
#   Halted          never started
# The deprecated ``spec.running`` maps onto Always (true) and Halted (false, or unset):
# ``VirtualMachine.RunStrategy()`` in staging/src/kubevirt.io/api/core/v1/types.go.
RESTARTS_AFTER_DELETION: dict[str, bool] = {
    "Always": True,
    "Once": True,
    "RerunOnFailure": False,
    "Manual": False,
    "Halted": False,
}

OBSERVED_FATES: tuple[ObservedFate, ...] = ("came_back", "waits_for_gpu", "off")


def restarts_by_itself(run_strategy: str | None) -> bool:
    """Whether KubeVirt starts a new VMI once this VM's VMI is deleted."""
    return RESTARTS_AFTER_DELETION.get(run_strategy or "", False)


def restarts_after_it_ended(run_strategy: str | None, phase: str | None) -> bool:
    """Whether KubeVirt starts a new VMI for a VM whose VMI ended and is still there
    (``Controller.syncRunStrategy``, pkg/virt-controller/watch/vm/vm.go): Always stops it and
    starts another (``vmi.IsFinal()``); RerunOnFailure stops it and, if it Failed, adds a
    start request; Once, Manual and Halted leave it off."""
    if run_strategy == "Always":
        return True
    return run_strategy == "RerunOnFailure" and phase == "Failed"


def kubevirt_starts_it(vm: VMRecord, vmi: VMIRecord | None, *, ended: str | None = None) -> bool:
    """Whether KubeVirt will start a new VMI for ``vm``, whose VMI ended (``vmi``) or is gone
    (None), as ``syncRunStrategy`` decides: by run strategy, and for a VMI gone also on a
    pending start request (RerunOnFailure, Manual) or a run strategy other than the one
    KubeVirt last acted on (RerunOnFailure: "when coming here from a different RunStrategy").

    ``ended`` is the phase the VMI gone was last seen ended in: a RerunOnFailure VMI that
    Failed is deleted (``stopVMI``) before its start request is written (``addStartRequest``),
    and the watch may show the one without the other."""
    if vmi is not None and not vmi.deleting:
        return restarts_after_it_ended(vm.run_strategy, vmi.phase)
    # Gone, or being deleted (a drain's stop): what KubeVirt does once it is gone. A VMI that
    # failed while being deleted gets no start request (syncRunStrategy acts on one that is not).
    if restarts_by_itself(vm.run_strategy) or restarts_after_it_ended(vm.run_strategy, ended):
        return True
    if vm.run_strategy in ("RerunOnFailure", "Manual", "Halted") and vm.start_requested:
        return True
    return (vm.run_strategy == "RerunOnFailure" and vm.status_run_strategy is not None
            and vm.status_run_strategy != vm.run_strategy)


def start_drain(
    ctx: Context,
    *,
    node: str,
    source: DrainSource,
    reason: str,
    requested_by: str | None,
    notice_seconds: int | None = None,
    scope: DrainScope = "node",
    plan: str | None = None,
    planned: tuple[str, ...] = (),
) -> DrainEpisode:
    """Open an episode for ``node`` (or join the one already open) and reconcile it.

    A ``node`` drain joining an open ``evictions`` episode widens it to the whole node.
    ``plan``: the maintenance plan whose slot starts it (source ``plan``), told when the node
    is back. The owners of its ``planned`` VMs were told by the plan, days ahead: the drain
    tells them nothing more and stops them at once; any other VM gets the drain's own notice.
    """
    notice = ctx.config.drain.notice_seconds if notice_seconds is None else notice_seconds
    existing = ctx.state.get(DRAINS, node)
    unmarking = existing.unmarking if existing is not None else {}
    if existing is not None and existing.called_off:
        existing = None  # only its cancelled marks are kept: by the new episode
    if existing is not None and not (existing.scope == "evictions" and existing.completed):
        if scope == "node" and existing.scope == "evictions":
            # No VM told an eviction's deadline is stopped before it; the others get the notice.
            stopped = set(existing.stopped)
            told = [at for key, at in existing.due.items() if key not in stopped]
            deadline = max([ctx.now + timedelta(seconds=notice), *told])
            widened = replace(existing, scope="node", source=source, reason=reason, requested_by=requested_by,
                              deadline=deadline, deadline_passed=False, due={}, plan=plan, planned=planned)
            ctx.state.put(DRAINS, node, _cordon(ctx, widened))
        reconcile_drain(ctx, node)
        return existing
    episode = DrainEpisode(
        node=node,
        episode=ids.episode_id(node, ctx.cause),
        source=source,
        cause=ctx.cause,
        reason=reason,
        requested_by=requested_by,
        started_at=ctx.now,
        deadline=ctx.now + timedelta(seconds=notice),
        scope=scope,
        unmarking=dict(unmarking),
        plan=plan,
        planned=planned,
        # A plan's owners were told days ahead: its VMs stop as soon as the cordon is seen.
        deadline_passed=plan is not None and notice == 0,
    )
    if scope == "node":
        episode = _cordon(ctx, episode)
    ctx.state.put(DRAINS, node, episode)
    reconcile_drain(ctx, node)
    return episode


def _cordon(ctx: Context, episode: DrainEpisode) -> DrainEpisode:
    """Cordon the node unless it already is; remember that vmstream did."""
    observed = ctx.state.get(NODES, episode.node)
    if episode.cordoned or (observed is not None and observed.unschedulable):
        return episode
    ctx.command("cordon_node", node_subject(episode.node), requested_by=episode.requested_by)
    return replace(episode, cordoned=True)


def call_off_drain(ctx: Context, node: str, *, why: str, undo_cordon: bool) -> DrainEpisode | None:
    """Retract the node's episode: stop nothing more, tell the warned, undo only our cordon.

    ``undo_cordon`` is false when the node was uncordoned by someone else already.
    """
    episode = ctx.state.get(DRAINS, node)
    if episode is None or episode.called_off:
        return None
    ctx.state.put(DRAINS, node, None)
    uncordoned = undo_cordon and episode.cordoned
    if uncordoned:
        ctx.command("uncordon_node", node_subject(node), requested_by=episode.requested_by)
    if episode.completed:
        if episode.plan is not None:  # its plan hears when the node is seen back (back_from_plan)
            ctx.state.put(DRAINS, node, replace(episode, called_off=True))
        return episode
    stopped = set(episode.stopped)
    spared = [key for key in sorted(episode.warned) if key not in stopped]
    here = {r.key: r for r in residents_of(ctx, node)}
    # KubeVirt keeps a VMI's eviction mark after the drain that caused it is gone (a
    # NodeMaintenance deleted, a kubectl drain given up): a mark left would be a new eviction.
    # vmstream, the external controller of these evictions, cancels each spared VM's mark.
    marked = {key: here[key].vmi_uid for key in spared if key in here and here[key].evacuating}
    for key in spared:
        project, recipients = episode.warned[key]
        subject = vm_subject(key)
        mark = ""
        if key in marked:
            ctx.command("cancel_evacuation",
                        ObjectRef(kind="VirtualMachineInstance", namespace=subject.namespace, name=subject.name,
                                  uid=marked[key] or None),
                        requested_by=episode.requested_by, evacuation_node=node)
            mark = (f" KubeVirt still marks it for eviction from node {node} (status.evacuationNodeName): "
                    "vmstream cancels that mark, and will not stop it on that mark.")
        ctx.notify(
            "drain_called_off",
            subject=subject,
            episode=_notice_id(episode, key),
            recipients=list(recipients),
            project=project,
            severity="info",
            message=(
                f"The drain of node {node} ({episode.reason}) is called off ({why}): GPU VM "
                f"{subject.namespace}/{subject.name} will not be stopped.{mark}"
            ),
            details={"node": node, "reason": episode.reason, "drain_source": episode.source, "called_off": why,
                     "eviction_mark": "cancelled by vmstream" if key in marked else None},
        )
    if marked or episode.plan is not None:
        # Until the marks are seen gone, they are no new eviction (settle_resident); a plan's
        # hears when the node is seen back (back_from_plan).
        ctx.state.put(DRAINS, node, replace(episode, called_off=True, completed=True, deadline_passed=True,
                                            unmarking={**episode.unmarking, **marked}))
    refresh_usage(ctx.state, node)  # its claims on cards elsewhere are gone
    if uncordoned:
        node_text = "vmstream uncordons the node"
    elif episode.cordoned:
        node_text = "the node is schedulable again"
    else:
        node_text = "the node is left as it is (vmstream did not cordon it)"
    ctx.notify(
        "drain_called_off",
        subject=node_subject(node),
        episode=episode.episode,
        recipients=_requesters(ctx, episode),
        project=None,
        severity="info",
        message=(
            f"The drain of node {node} ({episode.reason}) is called off ({why}): "
            f"{len(spared)} warned GPU VM(s) told it is off, {len(stopped)} already stopped; {node_text}."
        ),
        details={
            "node": node,
            "reason": episode.reason,
            "drain_source": episode.source,
            "called_off": why,
            "told_it_is_off": spared,
            "already_stopped": sorted(stopped),
            "uncordoned": uncordoned,
            "eviction_marks_cancelled": sorted(marked),
        },
    )
    return episode


def cancelled_mark(episode: DrainEpisode | None, resident: Resident) -> bool:
    """Whether ``resident``'s eviction mark is one vmstream cancels (its owner was told the
    stop is off): no new eviction."""
    return episode is not None and episode.unmarking.get(resident.key) == resident.vmi_uid


def _unmarked(episode: DrainEpisode, residents: list[Resident]) -> DrainEpisode:
    """Forget the cancelled marks seen gone (or their VMIs)."""
    here = {r.key: r for r in residents}
    left = {key: uid for key, uid in episode.unmarking.items()
            if key in here and here[key].vmi_uid == uid and here[key].evacuating}
    return episode if left == episode.unmarking else replace(episode, unmarking=left)


def residents_of(ctx: Context, node: str) -> list[Resident]:
    """The GPU VMIs on ``node``, in key order."""
    residents = ctx.state.get(RESIDENTS, node) or {}
    return [residents[key] for key in sorted(residents)]


def in_scope(episode: DrainEpisode, residents: list[Resident]) -> list[Resident]:
    """The residents the episode stops: all of them, or only those marked for eviction (and
    not by a mark vmstream cancels)."""
    if episode.scope == "evictions":
        return [r for r in residents if r.evacuating and not cancelled_mark(episode, r)]
    return residents


def reconcile_drain(ctx: Context, node: str) -> None:
    """Bring the node's episode up to date with what is observed now."""
    episode = ctx.state.get(DRAINS, node)
    if episode is None:
        return
    before = episode
    residents = residents_of(ctx, node)
    episode = _unmarked(episode, residents)
    if episode.called_off:
        if episode != before:
            ctx.state.put(DRAINS, node, episode if episode.unmarking or episode.plan is not None else None)
        return
    observed = ctx.state.get(NODES, node)
    if observed is not None and observed.unschedulable and not episode.cordon_observed:
        episode = replace(episode, cordon_observed=True)
    if episode.scope == "evictions" and not episode.completed:
        retracted = _retract(ctx, episode, residents)
        if retracted is None:
            return  # nothing left of it: closed
        episode = retracted
    episode = _forget_replaced(episode, residents)
    on_node = in_scope(episode, residents)
    newcomers = [r for r in on_node if r.key not in episode.announced]
    if not episode.completed:
        episode = _correct(ctx, episode, on_node)
    if newcomers and not episode.completed:
        episode = _announce(ctx, episode, newcomers)
    if episode.scope == "evictions" or (episode.deadline_passed and nothing_new_can_start(episode, observed)):
        episode = _stop_due(ctx, episode, on_node)
    if not on_node and not episode.completed and all(k in episode.observed for k in episode.announced):
        episode = _complete(ctx, episode)
    if episode != before:  # a node's heartbeat during its drain changes no row
        ctx.state.put(DRAINS, node, episode)
        recheck_others(ctx, node, *refresh_usage(ctx.state, node))


def _retract(ctx: Context, episode: DrainEpisode, residents: list[Resident]) -> DrainEpisode | None:
    """Evictions whose mark went away are off: ``evacuate/cancel`` removes
    ``status.evacuationNodeName`` (pkg/virt-api/rest/evacuate_cancel.go) and virt-controller
    then drops ``EvictionRequested`` (``updateStatus``, pkg/virt-controller/watch/vmi/lifecycle.go).
    The owner is told the stop is off and the VM leaves the episode: a later mark is a new
    eviction, with a notice of its own and a full notice period. An episode left with no VM
    is closed (None)."""
    here = {r.key: r for r in residents}
    stopped = set(episode.stopped)
    off = [key for key in sorted(episode.announced)
           if key not in stopped and key in here and not here[key].evacuating]
    if not off:
        return episode
    told = dict(episode.told)
    for key in off:
        project, recipients = episode.warned.get(key, (None, ()))
        subject = vm_subject(key)
        ctx.notify(
            "drain_called_off", subject=subject, episode=_notice_id(episode, key), recipients=list(recipients),
            project=project, severity="info",
            message=(f"The eviction of GPU VM {subject.namespace}/{subject.name} from node {episode.node} was "
                     "cancelled (KubeVirt no longer marks it for eviction): it will not be stopped."),
            details={"node": episode.node, "reason": episode.reason, "drain_source": episode.source,
                     "scope": episode.scope, "called_off": "the eviction mark went away"},
        )
        told[key] = told.get(key, 0) + 1
    gone = set(off)
    episode = replace(
        episode,
        announced={k: v for k, v in episode.announced.items() if k not in gone},
        warned={k: v for k, v in episode.warned.items() if k not in gone},
        observed={k: v for k, v in episode.observed.items() if k not in gone},
        due={k: v for k, v in episode.due.items() if k not in gone},
        told=told,
    )
    if not episode.announced and not any(r.evacuating for r in residents):
        ctx.state.put(DRAINS, episode.node, None)
        refresh_usage(ctx.state, episode.node)
        return None
    return episode


def _forget_replaced(episode: DrainEpisode, residents: list[Resident]) -> DrainEpisode:
    """A VM announced, deleted and made again under its name (seen by its uid, even when the
    watch bridge only relisted it) is another VM: the old one leaves the episode — what was
    told and done to it is not the new one's — and the new one is announced as a newcomer,
    to its own owner, with a full notice of its own."""
    gone = {r.key for r in residents if r.vm_uid and episode.uids.get(r.key, r.vm_uid) != r.vm_uid}
    if not gone:
        return episode
    return replace(
        episode,
        announced={k: v for k, v in episode.announced.items() if k not in gone},
        warned={k: v for k, v in episode.warned.items() if k not in gone},
        observed={k: v for k, v in episode.observed.items() if k not in gone},
        due={k: v for k, v in episode.due.items() if k not in gone},
        uids={k: v for k, v in episode.uids.items() if k not in gone},
        stopped=tuple(k for k in episode.stopped if k not in gone),
        replaced=tuple(sorted({*episode.replaced, *gone})),
    )


def _notice_id(episode: DrainEpisode, key: str) -> str:
    """The episode part of the id of the next notice about ``key`` in ``episode``."""
    count = episode.told.get(key, 0)
    return episode.episode if count == 0 else f"{episode.episode}/{count}"


def _stop_due(ctx: Context, episode: DrainEpisode, on_node: list[Resident]) -> DrainEpisode:
    """Evictions: stop each marked VM whose own deadline came; the episode's deadline is then
    the next one still to come (none: nothing left to fire)."""
    stopped = set(episode.stopped)
    due = [r for r in on_node if r.key not in stopped and episode.due.get(r.key, episode.deadline) <= ctx.now]
    if due:
        episode = _stop(ctx, episode, due)
    stopped = set(episode.stopped)
    waiting = sorted(episode.due.get(r.key, episode.deadline) for r in on_node if r.key not in stopped)
    if waiting:
        return replace(episode, deadline=waiting[0], deadline_passed=False)
    return replace(episode, deadline_passed=True)


def nothing_new_can_start(episode: DrainEpisode, observed: NodeRecord | None) -> bool:
    """Whether a VMI stopped now cannot be started again on the node itself.

    A whole-node drain stops its GPU VMs only once the node is seen unschedulable (or gone):
    a VM that restarts by itself, stopped while the cordon is still on its way to the API
    server, would be scheduled straight back onto the node being drained and then be left
    there as already stopped. ``kubectl drain`` keeps the same order: cordon, then evict.
    The notice may therefore end after its deadline, when the cordon lands. A single
    eviction cordons nothing and stops at its deadline.
    """
    if episode.scope == "evictions":
        return True
    return observed is None or observed.unschedulable


def observe_fate(ctx: Context, node: str, vm_key: str, fate: ObservedFate) -> None:
    """A VM whose GPU VMI left ``node`` reports what became of it."""
    episode = ctx.state.get(DRAINS, node)
    if episode is None or vm_key not in episode.announced or episode.observed.get(vm_key) == fate:
        return
    if episode.completed:
        return  # the tally is out; a later change is the VM's own business
    ctx.state.put(DRAINS, node, replace(episode, observed={**episode.observed, vm_key: fate}))


def fire_deadline(ctx: Context, node: str) -> None:
    """The notice is over: stop the GPU VMs still on the node."""
    episode = ctx.state.get(DRAINS, node)
    if episode is not None:
        ctx.state.put(DRAINS, node, replace(episode, deadline_passed=True))
    reconcile_drain(ctx, node)


def is_due(episode: DrainEpisode, now: datetime) -> bool:
    """The notice is over and the GPU VMs have not been stopped yet."""
    return not episode.deadline_passed and not episode.completed and episode.deadline <= now


def due_deadlines(episodes: Iterable[DrainEpisode], now: datetime) -> list[str]:
    """Nodes whose notice is over and whose GPU VMs have not been stopped yet."""
    return sorted(e.node for e in episodes if is_due(e, now))


def due_nodes(state: StateView, now: datetime) -> list[str]:
    """The nodes whose deadline may be due at ``now``, in name order: the state's
    :class:`~handlers.core.state.DeadlineIndex` when it keeps one (``MemoryState``, the worker's
    ``TableState``), else every episode looked at. A candidate is fired only if its row
    says so (``Engine.on_tick``)."""
    index: DeadlineIndex | None = getattr(state, "deadlines", None)
    if index is not None:
        return index.due(now)
    return due_deadlines((e for e in state.values(DRAINS) if e is not None), now)


def _requesters(ctx: Context, episode: DrainEpisode) -> list[str]:
    return [episode.requested_by] if episode.requested_by else list(ctx.config.operators)


def _what_it_is(episode: DrainEpisode, subject: ObjectRef) -> str:
    if episode.scope == "evictions":
        return (
            f"KubeVirt was asked to evict GPU VM {subject.namespace}/{subject.name} from node "
            f"{episode.node} ({episode.reason}): it"
        )
    return f"Node {episode.node} is being drained ({episode.reason}): GPU VM {subject.namespace}/{subject.name}"


def _announce(ctx: Context, episode: DrainEpisode, newcomers: list[Resident]) -> DrainEpisode:
    full = ctx.now + timedelta(seconds=ctx.config.drain.notice_seconds)
    # A VM marked for eviction gets a full notice from its mark, whatever the others got; so
    # does a VM made again under an announced one's name, or one come after the deadline.
    late = episode.deadline_passed or episode.deadline <= ctx.now
    own = {r.key: max(full, episode.deadline) for r in newcomers
           if (episode.scope == "evictions" or r.key in episode.replaced or late) and r.key not in episode.planned}
    plans = plan_fates(ctx, episode, newcomers, own)
    announced = dict(episode.announced)
    warned = dict(episode.warned)
    due = {**episode.due, **own}
    counts = dict(episode.told)
    uids = dict(episode.uids)
    told_gpus = dict(episode.told_gpus)
    for resident in newcomers:
        plan = plans[resident.key]
        deadline = own.get(resident.key, episode.deadline)
        if resident.key in episode.planned:  # told by the plan, days ahead (handlers/rules/plans.py)
            announced[resident.key] = plan.fate
            warned[resident.key] = (resident.project, tuple(_recipients(ctx, resident)))
            told_gpus[resident.key] = resident.template_gpus
            if resident.vm_uid:
                uids[resident.key] = resident.vm_uid
            continue
        told = ctx.notify("drain_will_stop_gpu_vm", subject=vm_subject(resident.key),
                          episode=_notice_id(replace(episode, told=counts), resident.key),
                          recipients=_recipients(ctx, resident), project=resident.project, severity="warning",
                          message=_notice_text(ctx, episode, resident, plan, deadline),
                          details=_notice_details(ctx, episode, resident, plan), deadline=deadline)
        announced[resident.key] = plan.fate
        warned[resident.key] = (resident.project, tuple(told.recipients))
        counts[resident.key] = counts.get(resident.key, 0) + 1
        told_gpus[resident.key] = resident.template_gpus
        if resident.vm_uid:
            uids[resident.key] = resident.vm_uid
    return replace(episode, announced=announced, warned=warned, due=due, told=counts, uids=uids,
                   told_gpus=told_gpus)


def _correct(ctx: Context, episode: DrainEpisode, on_node: list[Resident]) -> DrainEpisode:
    """A notice that became false is corrected, once the VM is still to be stopped: its GPUs
    changed (one removed: it comes back at once, without a GPU), its run strategy changed
    what KubeVirt does, or the cards it was promised are taken or wanted first by another
    drain's VMs (it now waits for one). A VM told it waits, that would now find a card, is
    not told again: the numbers move, "may take a while" stays true."""
    stopped = set(episode.stopped)
    # A VM deleted meanwhile is its owner's doing: nothing to correct for it.
    current = [r for r in on_node if r.key in episode.announced and r.key not in stopped and r.has_vm]
    if not current:
        return episode
    plans = plan_fates(ctx, episode, current)
    announced = dict(episode.announced)
    counts = dict(episode.told)
    told_gpus = dict(episode.told_gpus)
    for resident in current:
        plan, was = plans[resident.key], episode.announced[resident.key]
        told = episode.told_gpus.get(resident.key, resident.template_gpus)
        if (plan.fate, resident.template_gpus) == (was, told):
            continue
        if (was, plan.fate) == ("waits_for_gpu", "returns_automatically") and told == resident.template_gpus:
            continue
        if resident.key in episode.planned:  # the plan re-tells its owners (handlers/rules/plans.py)
            announced[resident.key] = plan.fate
            told_gpus[resident.key] = resident.template_gpus
            continue
        deadline = episode.due.get(resident.key, episode.deadline)
        project, recipients = episode.warned.get(resident.key, (resident.project, ()))
        details = _notice_details(ctx, episode, resident, plan)
        details["corrects"] = {"outcome": was, "gpus": [ctx.catalog.for_device(d).describe() for d in told]}
        ctx.notify("drain_will_stop_gpu_vm", subject=vm_subject(resident.key),
                   episode=_notice_id(replace(episode, told=counts), resident.key),
                   recipients=list(recipients) or _recipients(ctx, resident), project=project, severity="warning",
                   message="Correction: " + _notice_text(ctx, episode, resident, plan, deadline),
                   details=details, deadline=deadline)
        announced[resident.key] = plan.fate
        counts[resident.key] = counts.get(resident.key, 0) + 1
        told_gpus[resident.key] = resident.template_gpus
    return replace(episode, announced=announced, told=counts, told_gpus=told_gpus)


def recheck_others(ctx: Context, node: str, before: NodeUsage | None, after: NodeUsage | None) -> None:
    """A card free on ``node`` was taken, or its drain wants more: the other drains, whose
    promises counted on the cards, plan them again (:func:`~handlers.rules.capacity.tighter`)."""
    if tighter(before, after):
        for other in drained_nodes(ctx.state, but=node):
            ctx.recheck(other)


def _recipients(ctx: Context, resident: Resident) -> list[str]:
    return list(resident.recipients) if resident.has_vm else list(ctx.config.operators)


def _display(ctx: Context) -> Callable[[str], str]:
    return lambda device: ctx.catalog.for_device(device).display_name


def _notice_text(ctx: Context, episode: DrainEpisode, resident: Resident, plan: FatePlan, deadline: datetime) -> str:
    subject = vm_subject(resident.key)
    return (f"{_what_it_is(episode, subject)} will be stopped at {deadline.strftime('%Y-%m-%d %H:%M:%S UTC')}, "
            f"and {fate_text(plan, resident, display=_display(ctx), node=episode.node)}.")


def _notice_details(ctx: Context, episode: DrainEpisode, resident: Resident, plan: FatePlan) -> dict[str, object]:
    gpus = resident.template_gpus or resident.gpu_devices
    return {
        "node": episode.node,
        "reason": episode.reason,
        "drain_source": episode.source,
        "scope": episode.scope,
        "outcome": plan.fate,
        "run_strategy": resident.run_strategy,
        "restarts_by_itself": restarts_by_itself(resident.run_strategy),
        "gpu": ctx.catalog.for_device(gpus[0]).describe(),
        "gpus": [ctx.catalog.for_device(d).describe() for d in resident.template_gpus],
        "cards_free": plan.free,
        "restarting_gpu_vms": plan.competing,
        "cards_free_by_device": dict(plan.free_by_device),
        "restarting_gpu_vms_of_other_drains": plan.elsewhere,
    }


@dataclass(frozen=True, slots=True)
class FatePlan:
    """What a drained VM is told will become of it, and the numbers it is told with."""

    fate: DrainOutcome
    free: int | None = None  # free cards elsewhere now of its (first) GPU's device
    competing: int | None = None  # the drain's VMs that restart by themselves and want that device
    free_by_device: tuple[tuple[str, int], ...] = ()  # free cards elsewhere now, by each of its devices
    elsewhere: int = 0  # VMs of drains of other nodes, back in the race before it, that want that device


def fate_text(plan: FatePlan, resident: Resident, *, display: Callable[[str], str], node: str) -> str:
    """What the owner is told will happen after the stop: only what is known now."""
    strategy = resident.run_strategy
    if not resident.has_vm:
        return "it will not come back (a VMI without a VM)"
    if plan.fate == "needs_manual_start":
        return f"it will stay off until it is started again (run strategy {strategy})"
    if not resident.template_gpus:
        return f"it will start again by itself (run strategy {strategy}), without a GPU"
    gpus = resident.template_gpus
    others = (f", and {plan.elsewhere} more leaving other drained nodes no later" if plan.elsewhere else "")
    if len(gpus) == 1:
        wanted = f"a free {display(gpus[0])}"
        cards = (f"{plan.free} card(s) of this class free now for {plan.competing} GPU VM(s) leaving node {node} "
                 f"that restart by themselves{others}")
    else:
        wanted = f"{describe_gpus(gpus, display)} free on one node"
        free = ", ".join(f"{count} {display(device)}" for device, count in plan.free_by_device)
        cards = (f"it needs them all on one node; free now on the other nodes: {free or 'none'}, for "
                 f"{plan.competing} GPU VM(s) leaving node {node} that restart by themselves{others}")
    if plan.fate == "returns_automatically":
        where = f"a free {display(gpus[0])}" if len(gpus) == 1 else wanted
        return f"it will start again by itself (run strategy {strategy}) on another node with {where}: {cards}"
    return (
        f"KubeVirt will start it again (run strategy {strategy}) only once {wanted} is there for it, "
        f"which may take a while: {cards}"
    )


def restarting(residents: Iterable[Resident]) -> dict[str, Resident]:
    """Those of ``residents`` KubeVirt starts again by themselves with GPUs: they compete for cards."""
    return {r.key: r for r in residents if r.has_vm and restarts_by_itself(r.run_strategy) and r.template_gpus}


def plan_fates(ctx: Context, episode: DrainEpisode, residents: list[Resident],
               due: dict[str, datetime] | None = None) -> dict[str, FatePlan]:
    """Each of ``residents``' fate, with the free cards of its GPUs and the VMs they are for;
    ``due`` is each one's deadline (else the episode's).

    Every VM of the drain that KubeVirt restarts by itself with GPUs competes for the free
    cards elsewhere; which of them gets a card is the scheduler's choice, so a VM is told
    it comes back only when it finds its cards, all on one node, whatever the scheduler
    does with the others (:func:`~handlers.rules.capacity.surely_placed`; for VMs of one card:
    a free card for every one of them). Otherwise it waits for them, and is told the
    numbers. Competing too: the drain's own VMs stopped already and still waiting for a
    card, and the VMs of drains of other nodes stopped before this one or with it (their
    ``claims``, cluster-wide). A card is promised once across the AZ.
    """
    on_node = in_scope(episode, residents_of(ctx, episode.node))
    competitors = restarting([*on_node, *residents])
    own: list[tuple[str, tuple[str, ...]]] = [(key, r.template_gpus) for key, r in competitors.items()]
    own += [(claim.vm, claim.gpus) for claim in drain_claims(episode) if claim.vm not in competitors]
    others = claims_elsewhere(ctx.state, episode.node)
    plans: dict[str, FatePlan] = {}
    free_of: dict[str, int] = {}  # the same for every VM of a device: asked once
    for resident in sorted(residents, key=lambda r: r.key):
        if not resident.has_vm or not restarts_by_itself(resident.run_strategy):
            plans[resident.key] = FatePlan("needs_manual_start")
            continue
        if not resident.template_gpus:  # its GPUs were removed: it returns without one
            plans[resident.key] = FatePlan("returns_automatically")
            continue
        mine = (due or {}).get(resident.key, episode.due.get(resident.key, episode.deadline))
        before = [claim for claim in others if claim.due <= mine]  # back in the race first
        wanted: Counter[str] = Counter()
        for key, gpus in own:
            if key != resident.key:
                wanted.update(gpus)
        for claim in before:
            wanted.update(claim.gpus)
        demand = Counter(resident.template_gpus)
        for device in demand:
            if device not in free_of:
                free_of[device] = capacity(ctx.state, device, excluding_node=episode.node).free
        placed = surely_placed(ctx.state, demand, wanted, excluding_node=episode.node)
        first = resident.template_gpus[0]
        plans[resident.key] = FatePlan(
            "returns_automatically" if placed else "waits_for_gpu",
            free=free_of[first],
            competing=sum(1 for _, gpus in own if first in gpus),
            free_by_device=tuple((device, free_of[device]) for device in sorted(demand)),
            elsewhere=sum(1 for claim in before if first in claim.gpus),
        )
    return plans


def _stop(ctx: Context, episode: DrainEpisode, on_node: list[Resident]) -> DrainEpisode:
    stopped = list(episode.stopped)
    already = set(stopped)
    for resident in on_node:
        if resident.key in already:
            continue
        _, namespace, name = resident.key.split("/", 2)
        ctx.command(
            "delete_vmi",
            # This VMI, by uid: a VMI of the same name made since is another VM's, not stopped.
            ObjectRef(kind="VirtualMachineInstance", namespace=namespace, name=name, uid=resident.vmi_uid or None),
            requested_by=episode.requested_by,
        )
        stopped.append(resident.key)
    return replace(episode, stopped=tuple(stopped))


def _complete(ctx: Context, episode: DrainEpisode) -> DrainEpisode:
    observed: dict[str, list[str]] = {fate: [] for fate in OBSERVED_FATES}
    for key in sorted(episode.announced):
        observed[episode.observed[key]].append(key)
    predicted: dict[str, list[str]] = {}
    for key, fate in sorted(episode.announced.items()):
        predicted.setdefault(fate, []).append(key)
    stopped = set(episode.stopped)
    if episode.scope == "evictions":
        what = f"The GPU VM(s) KubeVirt was asked to evict from node {episode.node} are gone ({episode.reason})"
    else:
        what = f"Node {episode.node} has no GPU VM left ({episode.reason})"
    ctx.notify(
        "drain_completed",
        subject=node_subject(episode.node),
        episode=episode.episode,
        recipients=_requesters(ctx, episode),
        project=None,
        severity="info",
        message=(
            f"{what}: {len(episode.announced)} GPU VM(s) were announced, {len(stopped)} stopped at the deadline; "
            f"now {len(observed['came_back'])} running again on another node, "
            f"{len(observed['waits_for_gpu'])} waiting for a GPU, {len(observed['off'])} off."
        ),
        details={
            "node": episode.node,
            "drain_source": episode.source,
            "scope": episode.scope,
            "gpu_vms": len(episode.announced),
            "stopped_at_deadline": sorted(stopped),
            "stopped_before_deadline": sorted(set(episode.announced) - stopped),
            "deleted_and_made_again": list(episode.replaced),
            "observed": observed,
            "announced_outcomes": predicted,
        },
    )
    return replace(episode, completed=True)
