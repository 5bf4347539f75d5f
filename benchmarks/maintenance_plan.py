"""GPU node maintenance: vmstream's plan against draining the same nodes one by one in name order.

Why this exists: the GPU documentation tells operators that draining a GPU node stops its
VMs, which restart elsewhere only if a card of their class is free there. A plain
NodeMaintenance per node (or Harvester's maintenance mode), one after another in name
order, keeps no card for anyone, places restarted VMs wherever the scheduler likes — on a
node still to be drained too, which stops them again — and tells owners at the drain.
``handlers/rules/maintenance.py`` plans the order instead. This script compares the two on one
generated AZ, in the same model (pure: no broker, no API server; seconds):

- 40 planned GPU nodes of 3 classes, 300 GPU VMs, every run strategy, owners' preferences
  mixed (mostly ``elsewhere``), a few VMs of two cards; 6 nodes outside the plan with some
  free cards of each class (the spare cards). Two scenarios: *roomy* (10 cards a node, a
  card or two free on most; 0–2 spare cards of each class per other node) and *tight* (8
  cards a node, all held; 0–1 spare) — fewer spare cards than some nodes' VMs want;
- a 5-day window, 2 nodes at once, 4 h per node, 3 days' notice.

Printed side by side: VMs stopped with no card to land on, VMs stopped twice, VM-hours
without a GPU of VMs meant to run again — waiting for a card, and back on their own node at
their owner's wish (from the stop to the node's return) —,
owners' notice before their VM's stop (min / median), the plan's duration and what falls
outside the window; whether the AZ meets the planner's guarantee, and the fewest VMs any
order must leave without a card; and the load average. ``--seed`` generates another AZ.
``--write DIR`` also writes each scenario's AZ and plan request as ``vmstream simulate
--maintenance`` reads them (``<scenario>.az.json``, ``<scenario>.plan.json``), to run the
same plan as a what-if.

Run it from the repository root::

    .venv/bin/python benchmarks/maintenance_plan.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tree this file sits in

from handlers.rules.maintenance import (  # noqa: E402
    GPUVM,
    AfterMaintenance,
    MaintenancePlan,
    MaintenanceRequest,
    OtherNode,
    PlannedNode,
    name_order_baseline,
    no_wait_guaranteed,
    plan_maintenance,
    wanted_elsewhere,
)
from streams.cli.planning import az_document, spec_document  # noqa: E402

CLASSES = ("a100", "l40s", "rtx6000")
STRATEGIES = ("Always", "Once", "RerunOnFailure", "Manual", "Halted")
STRATEGY_WEIGHTS = (6, 1, 1, 2, 0)  # a Halted VM runs only if it was started before the change
PREFERENCES: tuple[AfterMaintenance, ...] = ("elsewhere", "same_node", "stay_off")
PREFERENCE_WEIGHTS = (8, 1, 1)
SCENARIOS = {  # name: cards per planned node, spare cards of each class per other node (0 to)
    "roomy": (10, 2),  # planned nodes with a card or two free, a few spare cards
    "tight": (8, 1),  # planned nodes full, fewer spare cards than a node's VMs want
}
PUBLISHED = datetime(2027, 1, 4, 8, 0, tzinfo=UTC)


def generated_az(seed: int, *, cards: int, spare_max: int, nodes: int = 40, vms: int = 300,
                 others: int = 6) -> MaintenanceRequest:
    """A seeded AZ: each planned node of one class with ``cards`` cards, ``vms`` VMs spread
    over them, the other nodes with 0 to ``spare_max`` free cards of each class."""
    rng = random.Random(seed)
    names = [f"gpu-{i:02d}" for i in range(nodes)]
    node_class = {name: CLASSES[i % len(CLASSES)] for i, name in enumerate(names)}
    held = {name: 0 for name in names}
    residents: dict[str, list[GPUVM]] = {name: [] for name in names}
    for i in range(vms):
        size = 2 if rng.random() < 0.1 else 1
        candidates = [name for name in names if held[name] + size <= cards] or names
        node = rng.choice(candidates)
        held[node] += size
        strategy = STRATEGIES[i] if i < len(STRATEGIES) else rng.choices(STRATEGIES, STRATEGY_WEIGHTS)[0]
        preference = rng.choices(PREFERENCES, PREFERENCE_WEIGHTS)[0]
        residents[node].append(GPUVM(
            uid=f"uid-{i:04d}", name=f"vm-{i:04d}", namespace=f"proj-{i % 23:02d}",
            owner=f"owner-{i % 61:02d}@example.com", gpus={node_class[node]: size},
            run_strategy=strategy, after_maintenance=preference,
        ))
    planned = tuple(PlannedNode(name, {node_class[name]: max(cards, held[name])}, tuple(residents[name]))
                    for name in names)
    spare = tuple(OtherNode(f"spare-{i}", {c: rng.randint(0, spare_max) for c in CLASSES}) for i in range(others))
    return MaintenanceRequest(
        nodes=planned, others=spare,
        earliest_start=PUBLISHED + timedelta(days=3), latest_end=PUBLISHED + timedelta(days=8),
        concurrency=2, duration=timedelta(hours=4), notice=timedelta(days=3), published=PUBLISHED,
    )


def hours(delta: timedelta | None) -> str:
    return "-" if delta is None else f"{delta.total_seconds() / 3600:,.1f} h"


def row_of(plan: MaintenancePlan) -> list[str]:
    totals = plan.totals
    own = sum(entry.hours_without_gpu for entry in plan.vms if entry.fate == "back_on_own_node")
    return [
        str(totals.waiting),
        str(totals.stopped_twice),
        str(totals.stopped),
        f"{totals.hours_without_gpu - own:,.1f}",
        f"{own:,.1f}",
        f"{hours(totals.lead_min)} / {hours(totals.lead_median)}",
        hours(totals.duration),
        str(len(totals.outside_window)),
    ]


def table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    """Columns side by side: the first left-aligned, the others right-aligned (as benchmarks/kit.py)."""
    widths = [max(len(row[i]) for row in (header, *body)) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row))

    return "\n".join([line(header), "  ".join("-" * width for width in widths), *(line(row) for row in body)])


def load_average() -> str:
    return "load average " + " ".join(f"{value:.2f}" for value in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--write", type=Path, metavar="DIR",
                        help="write each scenario's AZ and plan request for `vmstream simulate --maintenance`")
    args = parser.parse_args(argv)
    print(load_average(), flush=True)
    for scenario, (cards, spare_max) in SCENARIOS.items():
        request = generated_az(args.seed, cards=cards, spare_max=spare_max)
        compare(scenario, request, args.seed)
        if args.write:
            write(args.write, scenario, request, args.seed)
    print(load_average(), flush=True)


def write(directory: Path, scenario: str, request: MaintenanceRequest, seed: int) -> None:
    """The AZ and the plan request, in the files `vmstream simulate --maintenance` reads; the
    planned nodes labelled with their GPU class, the others as spare."""
    labels = {node.name: {"example.com/gpu-class": next(iter(node.capacity))} for node in request.nodes}
    labels.update({other.name: {"example.com/pool": "spare"} for other in request.others})
    directory.mkdir(parents=True, exist_ok=True)
    for name, document in ((f"{scenario}.az.json", az_document(request, labels)),
                           (f"{scenario}.plan.json", spec_document(request, f"{scenario}-seed-{seed}"))):
        (directory / name).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {directory / name}")
    print(f"published {request.published.isoformat()}: give it with --at")


def compare(scenario: str, request: MaintenanceRequest, seed: int) -> None:
    spare = {c: sum(other.free.get(c, 0) for other in request.others) for c in CLASSES}
    print(f"\n{scenario} AZ (seed {seed}): {len(request.nodes)} planned nodes, "
          f"{sum(len(node.vms) for node in request.nodes)} GPU VMs, spare cards {spare}; "
          f"window {request.earliest_start:%Y-%m-%d %H:%M} to {request.latest_end:%Y-%m-%d %H:%M}, "
          f"{request.concurrency} at once, {hours(request.duration)} per node, notice {request.notice.days} days")
    largest: Counter[str] = Counter()
    for node in request.nodes:
        largest |= wanted_elsewhere(node)
    # Each planned node here has cards of one class: the first node of a class to go finds
    # only the spare cards of that class, whatever the order.
    floor = sum(max(0, min(wanted_elsewhere(node)[c] for node in request.nodes if c in node.capacity) - spare[c])
                for c in CLASSES)
    print(f"largest one node's VMs want elsewhere {dict(sorted(largest.items()))}: guarantee "
          f"{'met' if no_wait_guaranteed(request) else 'not met'}; "
          f"any order leaves at least {floor} VM(s) without a card")
    began = time.process_time()
    planned = plan_maintenance(request)
    planning = time.process_time() - began
    baseline = name_order_baseline(request)
    header = ["", "no card to land on", "stopped twice", "stops", "VM-h waiting", "VM-h own node",
              "notice min / median", "duration", "nodes outside window"]
    print(table(header, [["vmstream plan", *row_of(planned)], ["name order, one by one", *row_of(baseline)]]))
    for name, plan in (("vmstream plan", planned), ("name order", baseline)):
        fates = ", ".join(f"{fate} {count}" for fate, count in plan.totals.fates.items())
        print(f"{name}: {fates}")
    print(f"planning took {planning * 1000:,.0f} ms of CPU")


if __name__ == "__main__":
    main()
