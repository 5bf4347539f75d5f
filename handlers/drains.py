"""Node drains: tell every GPU VM's owner before the drain stops it, then stop it.

GPU VMs cannot live-migrate, so draining their node stops them. A drain *episode* starts
at the earliest signal — a ``drain_node`` intent, a NodeMaintenance, a cordon, a VMI with
``EvictionRequested`` — and then, level-based, on every later observation of the node:

1. the node is cordoned (a command, unless it already is);
2. each GPU VM on the node is announced once to its owner, with the deadline and its fate:
   it *returns automatically* (run strategy Always and a free card of its class on
   another schedulable node), it *waits for a GPU* (Always, but no card is free), or it
   *needs a manual start* (any other strategy — RerunOnFailure does not rerun after an
   eviction, which ends the VMI ``Succeeded``);
3. at the deadline the GPU VMIs still there are deleted — what an eviction would do; the
   run strategy then decides whether the VM comes back;
4. once no GPU VMI is left, whoever asked gets ``drain_completed`` with the tally.

The episode ends (and is forgotten) on ``undrain_node``, when its NodeMaintenance is
deleted, or when the node is seen schedulable again after having been cordoned.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from collections.abc import Iterable
from datetime import datetime, timedelta

from handlers import ids
from handlers.capacity import capacity
from handlers.cluster import NodeRecord, Resident
from handlers.decisions import Context, node_subject, vm_subject
from handlers.messages import ObjectRef
from handlers.state import DrainEpisode, DrainOutcome, DrainSource

FATES: dict[DrainOutcome, str] = {
    "returns_automatically": "it will start again by itself on another node with a free {gpu}",
    "waits_for_gpu": "it will start again by itself once a {gpu} frees up elsewhere (none is free now)",
    "needs_manual_start": "it will stay off until it is started again (run strategy {strategy})",
}


def start_drain(
    ctx: Context,
    *,
    node: str,
    source: DrainSource,
    reason: str,
    requested_by: str | None,
    notice_seconds: int | None = None,
) -> DrainEpisode:
    """Open an episode for ``node`` (or join the one already open) and reconcile it."""
    existing: DrainEpisode | None = ctx.state.get("drains", node)
    if existing is not None:
        reconcile_drain(ctx, node)
        return existing
    notice = ctx.config.drain.notice_seconds if notice_seconds is None else notice_seconds
    episode = DrainEpisode(
        node=node,
        episode=ids.episode_id(node, ctx.cause),
        source=source,
        cause=ctx.cause,
        reason=reason,
        requested_by=requested_by,
        started_at=ctx.now,
        deadline=ctx.now + timedelta(seconds=notice),
    )
    ctx.state.put("drains", node, episode)
    observed: NodeRecord | None = ctx.state.get("nodes", node)
    if observed is None or not observed.unschedulable:
        ctx.command("cordon_node", node_subject(node), requested_by=requested_by)
    reconcile_drain(ctx, node)
    return episode


def end_drain(ctx: Context, node: str) -> DrainEpisode | None:
    episode: DrainEpisode | None = ctx.state.get("drains", node)
    if episode is not None:
        ctx.state.put("drains", node, None)
    return episode


def residents_of(ctx: Context, node: str) -> list[Resident]:
    """The GPU VMIs on ``node``, in key order."""
    residents: dict[str, Resident] = ctx.state.get("residents", node) or {}
    return [residents[key] for key in sorted(residents)]


def reconcile_drain(ctx: Context, node: str) -> None:
    """Bring the node's episode up to date with what is observed now."""
    episode: DrainEpisode | None = ctx.state.get("drains", node)
    if episode is None:
        return
    observed: NodeRecord | None = ctx.state.get("nodes", node)
    if observed is not None and observed.unschedulable and not episode.cordon_observed:
        episode = replace(episode, cordon_observed=True)
    on_node = residents_of(ctx, node)
    newcomers = [r for r in on_node if r.key not in episode.announced]
    if newcomers and not episode.completed:
        episode = _announce(ctx, episode, newcomers)
    if episode.deadline_passed:
        episode = _stop(ctx, episode, on_node)
    if not on_node and not episode.completed:
        episode = _complete(ctx, episode)
    ctx.state.put("drains", node, episode)


def fire_deadline(ctx: Context, node: str) -> None:
    """The notice is over: stop the GPU VMs still on the node."""
    episode: DrainEpisode | None = ctx.state.get("drains", node)
    if episode is not None:
        ctx.state.put("drains", node, replace(episode, deadline_passed=True))
    reconcile_drain(ctx, node)


def due_deadlines(episodes: Iterable[DrainEpisode], now: datetime) -> list[str]:
    """Nodes whose notice is over and whose GPU VMs have not been stopped yet."""
    return sorted(e.node for e in episodes if not e.deadline_passed and not e.completed and e.deadline <= now)


def _announce(ctx: Context, episode: DrainEpisode, newcomers: list[Resident]) -> DrainEpisode:
    fates = plan_fates(ctx, episode, newcomers)
    announced = dict(episode.announced)
    for resident in newcomers:
        fate = fates[resident.key]
        gpu = ctx.catalog.for_device((resident.template_gpus or resident.gpu_devices)[0])
        strategy = resident.run_strategy or "none (a VMI without a VM)"
        subject = vm_subject(resident.key)
        ctx.notify(
            "drain_will_stop_gpu_vm",
            subject=subject,
            episode=episode.episode,
            recipients=list(resident.recipients) if resident.has_vm else list(ctx.config.operators),
            project=resident.project,
            severity="warning",
            message=(
                f"Node {episode.node} is being drained ({episode.reason}): GPU VM "
                f"{subject.namespace}/{subject.name} will be stopped at "
                f"{episode.deadline.strftime('%Y-%m-%d %H:%M:%S UTC')}, and "
                + FATES[fate].format(gpu=gpu.display_name, strategy=strategy)
                + "."
            ),
            details={
                "node": episode.node,
                "reason": episode.reason,
                "drain_source": episode.source,
                "outcome": fate,
                "run_strategy": resident.run_strategy,
                "gpu": gpu.describe(),
            },
            deadline=episode.deadline,
        )
        announced[resident.key] = fate
    return replace(episode, announced=announced)


def plan_fates(ctx: Context, episode: DrainEpisode, residents: list[Resident]) -> dict[str, DrainOutcome]:
    """Which of ``residents`` come back by themselves, counting each free card once.

    Cards elsewhere already promised to VMs announced earlier in the episode are not
    promised again; VMs are taken in key order so the plan is deterministic.
    """
    on_node = {r.key: r for r in residents_of(ctx, episode.node)}
    promised: Counter[str] = Counter()
    for key, fate in episode.announced.items():
        earlier = on_node.get(key)
        if fate == "returns_automatically" and earlier and earlier.template_gpus:
            promised[earlier.template_gpus[0]] += 1
    free: dict[str, int] = {}
    fates: dict[str, DrainOutcome] = {}
    for resident in sorted(residents, key=lambda r: r.key):
        if resident.run_strategy != "Always":
            fates[resident.key] = "needs_manual_start"
            continue
        if not resident.template_gpus:  # its GPU was removed: it returns without one
            fates[resident.key] = "returns_automatically"
            continue
        device = resident.template_gpus[0]
        if device not in free:
            free[device] = capacity(ctx.state, device, excluding_node=episode.node).free - promised[device]
        if free[device] > 0:
            free[device] -= 1
            fates[resident.key] = "returns_automatically"
        else:
            fates[resident.key] = "waits_for_gpu"
    return fates


def _stop(ctx: Context, episode: DrainEpisode, on_node: list[Resident]) -> DrainEpisode:
    stopped = list(episode.stopped)
    for resident in on_node:
        if resident.key in stopped:
            continue
        _, namespace, name = resident.key.split("/", 2)
        ctx.command(
            "delete_vmi",
            ObjectRef(kind="VirtualMachineInstance", namespace=namespace, name=name),
            requested_by=episode.requested_by,
        )
        stopped.append(resident.key)
    return replace(episode, stopped=tuple(stopped))


def _complete(ctx: Context, episode: DrainEpisode) -> DrainEpisode:
    by_fate: dict[str, list[str]] = {fate: [] for fate in FATES}
    for key, fate in sorted(episode.announced.items()):
        by_fate[fate].append(key)
    stopped = set(episode.stopped)
    recipients = [episode.requested_by] if episode.requested_by else list(ctx.config.operators)
    ctx.notify(
        "drain_completed",
        subject=node_subject(episode.node),
        episode=episode.episode,
        recipients=recipients,
        project=None,
        severity="info",
        message=(
            f"Node {episode.node} has no GPU VM left ({episode.reason}): "
            f"{len(episode.announced)} GPU VM(s) were announced, {len(stopped)} stopped at the "
            f"deadline, {len(by_fate['returns_automatically'])} expected back by themselves, "
            f"{len(by_fate['waits_for_gpu'])} waiting for a GPU, "
            f"{len(by_fate['needs_manual_start'])} needing a manual start."
        ),
        details={
            "node": episode.node,
            "drain_source": episode.source,
            "gpu_vms": len(episode.announced),
            "stopped_at_deadline": sorted(stopped),
            "stopped_before_deadline": sorted(set(episode.announced) - stopped),
            "outcomes": by_fate,
        },
    )
    return replace(episode, completed=True)
