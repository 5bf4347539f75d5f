"""Is the engine flat? Its cost per input over AZs of 1k, 10k and 100k VMs with 0, 100 and
1,000 drains in flight, the mix of ``simulate_throughput.py`` with 1 % drains, and the
engine time of the drains that tell the most owners at once.

Why this exists: the worker and ``vmstream simulate`` decide one input at a time; if what
one input costs grew with the drains in flight, the nodes, the VMs or the pending restarts,
the busiest hour of an AZ (a rack drained for a firmware upgrade) would be the slowest.
Targets (issue 14): inputs/s within 20 % across the grid; ≥ 20,000 inputs/s on one core on
the 1 % drain mix; peak RSS < 1 GiB with 100k VMs; a 500-VM drain and a NodeMaintenance on
50 nodes each decided well within 1 s.

What it does, each part in a child process of its own (so that a part's peak RSS is its
own, and so that ``--baseline`` runs the very same script in another tree):

1. **grid** — per VM count, an AZ from ``simulate_throughput.Generator`` (nodes: a tenth of
   the VMs, at least 1,100 so that 1,000 of them can be drained) relisted through the
   engine; then, in turn, 0, 100 and 1,000 drains in flight (``drain_node`` intents with a
   day's notice, each node cordoned after it — GPU nodes with GPU VMs first), each followed
   by the same number of inputs of background traffic (the MIX of simulate_throughput.py:
   heartbeats, VM and VMI updates, restarts, intents, follow-ups), which alone are timed;
2. **mix** — simulate_throughput.py's stream of 10,000 VMs / 1,000 nodes with a drain every
   100 lines (as far as GPU nodes are free for one), through ``Simulation.feed``; with
   ``--by-kind`` its lines are then decided again on a fresh engine, one at a time, and what
   an input of each kind costs is printed (an intent's type, a watch event's kind and type);
3. **scale** — a node with 500 GPU VMs drained by one intent, then NodeMaintenances on 50
   nodes of 8 GPU VMs one after the other: the engine time (decision, its state applied,
   the node learning of its residents) and the owners told by that decision.

The machine is shared: every row prints the load average, and rates are given per second
of wall clock and per second of this process's CPU (user + system), which swings much less.
Inputs are JSON lines made before timing starts; the timed loop is ``Simulation.feed_line``
into a counting sink, as in simulate_throughput.py.

Run it from the repository root::

    .venv/bin/python benchmarks/engine_grid.py --quick        # 1k and 10k VMs, fewer inputs (≈ 1 min)
    .venv/bin/python benchmarks/engine_grid.py                # the whole grid, 100k VMs included
    # the previous commit side by side, in a snapshot of it:
    mkdir -p /tmp/before && git archive HEAD~1 | tar -x -C /tmp/before
    .venv/bin/python benchmarks/engine_grid.py --quick --baseline /tmp/before
    # each part three times, the trees taking turns; a cell's rate is the median of its rounds
    .venv/bin/python benchmarks/engine_grid.py --quick --repeat 3
    # what each kind of input costs in the mix, beside another commit
    .venv/bin/python benchmarks/engine_grid.py --parts mix --by-kind --baseline /tmp/before

``--baseline DIR`` copies this script and simulate_throughput.py into ``DIR/benchmarks/``
(overwriting them there) and runs each part in DIR right after the same part here.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import az_stream as az  # noqa: E402  (benchmarks/ is this script's directory)
import kit  # noqa: E402  (this directory's: puts the repository on sys.path)
import simulate_throughput as st  # noqa: E402

from handlers.engine import Engine  # noqa: E402
from handlers.state import MemoryState  # noqa: E402
from handlers.tables import DRAINS  # noqa: E402
from harness.scenarios import Script  # noqa: E402
from samples.cluster import RTX, node, node_maintenance, vm, vmi  # noqa: E402
from streams.cli.simulating import Simulation  # noqa: E402
from streams.common.settings import load_settings  # noqa: E402

HERE = Path(__file__).resolve()
TARGET_SPREAD = 0.20
TARGET_MIX_RATE = 20_000.0
TARGET_RSS_MIB = 1024.0
DRAIN_NOTICE = 86_400  # a day: no deadline passes while a cell is timed


def peak_rss_mib() -> float:
    for row in Path("/proc/self/status").read_text().splitlines():
        if row.startswith("VmHWM:"):
            return int(row.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def simulation(config: Path) -> Simulation:
    settings = load_settings(config)
    return Simulation(Engine(settings.rules()), settings.kafka)


class Lines:
    """Stands in for the generator's output file: keeps the lines of one phase."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def write(self, text: str) -> None:
        if text != "\n":
            self.lines.append(text)

    def take(self) -> list[str]:
        taken, self.lines = self.lines, []
        return taken


def feed(sim: Simulation, lines: Iterable[str], sink: st.CountingSink, first: int = 1) -> None:
    for number, text in enumerate(lines, start=first):
        for output in sim.feed_line(text, number):
            sink.write(output)


SLICES = 10  # a cell's inputs are also timed in this many slices (median_cpu_rate)


def timed(sim: Simulation, lines: list[str], profiler: cProfile.Profile | None = None) -> dict[str, float]:
    """Rates over all of ``lines``, and the median of the per-CPU-second rates of its
    SLICES slices: on this shared machine a burst of other work slows one slice, and
    moves the median much less than the whole (a steady load still moves both)."""
    sink = st.CountingSink()
    gc.collect()
    if profiler is not None:
        profiler.enable()
    size = max(1, -(-len(lines) // SLICES))
    slices: list[float] = []
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(lines), size):
        begun = time.process_time()
        feed(sim, lines[start:start + size], sink, start + 1)
        slices.append(len(lines[start:start + size]) / max(time.process_time() - begun, 1e-9))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if profiler is not None:
        profiler.disable()
    return {"inputs": len(lines), "outputs": sink.lines, "wall": wall, "cpu": cpu,
            "rate": len(lines) / wall, "cpu_rate": len(lines) / cpu, "median_cpu_rate": statistics.median(slices)}


def episodes(state: MemoryState) -> tuple[int, int]:
    """Drain episodes in the table, and those of them whose deadline is still to fire."""
    rows = list(state.values(DRAINS))
    return len(rows), sum(1 for e in rows if not e.deadline_passed and not e.completed)


# ------------------------------------------------------------------------------ grid


def drain_hosts(gen: az.Generator, count: int) -> list[az.NodeState]:
    """Nodes to drain, not drained yet: GPU nodes with GPU VMs first, then any other."""
    free = [n for n in gen.all_nodes if not n.busy and n.schedulable]
    crowded = [n for n in free if any(gen.vmis[k].gpu for k in n.vmis)]
    chosen = {n.name for n in crowded}
    rest = [n for n in free if n.name not in chosen] if len(crowded) < count else []
    return (crowded + rest)[:count]


def open_drains(gen: az.Generator, count: int) -> int:
    """``count`` drain intents with a day's notice, each node cordoned as kubectl would show."""
    hosts = drain_hosts(gen, count)
    gen.limit = 10**12  # background() cut the stream at its end
    for host in hosts:
        host.busy = True
        gen._intent("drain_node", {"node": host.name, "reason": "rack firmware upgrade",
                                   "notice_seconds": DRAIN_NOTICE}, by=az.OPS, project=None)
        gen._cordon(host, True)
        gen.flush()
    return len(hosts)


def background(gen: az.Generator, count: int) -> None:
    gen.limit = gen.written + count
    while gen.written < gen.limit:
        gen.step()


def run_grid_row(vms: int, drains: list[int], inputs: int, config: Path, seed: int,
                 profile: int) -> dict[str, Any]:
    nodes = max(vms // 10, 1_100)
    out = Lines()
    gen = az.Generator(random.Random(seed), vms=vms, nodes=nodes, limit=10**12, out=out)
    tmp = tempfile.TemporaryDirectory(prefix="vmstream-grid-")
    phases: list[tuple[str, Path, int]] = []

    def keep(kind: str, opened: int) -> None:  # on disk: the peak RSS is the engine's and its state's
        path = Path(tmp.name) / f"{len(phases)}.jsonl"
        path.write_text("\n".join(out.take()), encoding="utf-8")
        phases.append((kind, path, opened))

    gen.relist()
    gen.flush()
    keep("relist", 0)
    opened = 0
    for target in drains:
        opened += open_drains(gen, target - opened)
        keep("drains", opened)
        background(gen, inputs)
        keep("timed", opened)
    del gen
    gc.collect()
    reset_peak_rss()
    sim = simulation(config)
    cells = []
    fed = 0
    for kind, path, opened in phases:
        if kind != "timed":  # read as fed: the relist of 100k VMs is some 250 MB of text
            with path.open(encoding="utf-8") as source:
                feed(sim, source, st.CountingSink(), fed + 1)
            fed += st.count_lines(path)
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        profiler = cProfile.Profile(time.process_time) if profile and opened == max(drains) else None
        cell: dict[str, Any] = {"vms": vms, "nodes": nodes, "drains": opened, **timed(sim, lines, profiler)}
        cell["episodes"], cell["to_fire"] = episodes(sim.state)
        cell["load"] = kit.load_average()
        cells.append(cell)
        fed += len(lines)
        if profiler is not None:
            print(f"cProfile of the {vms:,} VMs / {opened:,} drains cell, top {profile} by tottime:", file=sys.stderr)
            pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(profile)
    tmp.cleanup()
    return {"cells": cells, "peak_rss_mib": peak_rss_mib(), "rows": sum(len(t) for t in sim.state.tables.values())}


# ------------------------------------------------------------------------------- mix


def input_kind(text: str) -> str:
    """What a line of the mix carries: ``intent:<type>``, ``event:<kind>:<type>``, ``topic:<name>``
    for a topic vmstream does not read, or ``malformed`` (the mix's hostile lines)."""
    try:
        line = json.loads(text)
        value, topic = line["value"], str(line["topic"]).rsplit(".", 1)[-1]
    except (ValueError, TypeError, KeyError):
        return "malformed"
    if not isinstance(value, dict):
        return "malformed"
    if topic == "intents":
        return f"intent:{value.get('type')}"
    if topic == "k8s-events":
        return f"event:{value.get('kind')}:{value.get('type')}"
    return f"topic:{topic}"


def costs_by_kind(config: Path, lines: list[str]) -> dict[str, dict[str, float]]:
    """Each line of the mix decided alone on a fresh engine, its CPU time summed by its kind:
    what an input of each kind costs, parse and output line included (the clock read around
    each line adds about a microsecond to each)."""
    sim = simulation(config)
    sink = st.CountingSink()
    kinds = [input_kind(text) for text in lines]
    costs: dict[str, dict[str, float]] = {}
    for number, (text, kind) in enumerate(zip(lines, kinds, strict=True), start=1):
        started = time.process_time()
        for output in sim.feed_line(text, number):
            sink.write(output)
        cost = costs.setdefault(kind, {"inputs": 0, "seconds": 0.0})
        cost["inputs"] += 1
        cost["seconds"] += time.process_time() - started
    return costs


def run_mix(events: int, config: Path, seed: int, every: int, profile: int, by_kind: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vmstream-grid-") as tmp:
        path = Path(tmp) / "mix.jsonl"
        mix = az.generate(path, vms=10_000, nodes=1_000, events=events, seed=seed, events_per_drain=every)
        lines = path.read_text(encoding="utf-8").splitlines()
    drains = sum(n for kind, n in mix.items() if any(w in kind for w in ("drain", "cordon", "maintenance", "evict")))
    sim = simulation(config)
    profiler = cProfile.Profile(time.process_time) if profile else None
    result: dict[str, Any] = {**timed(sim, lines, profiler)}
    if profiler is not None:
        print(f"cProfile of the 1 % drain mix, top {profile} by tottime:", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(profile)
    result["episodes"], result["to_fire"] = episodes(sim.state)
    result["drain_lines"] = drains
    if by_kind:
        result["by_kind"] = costs_by_kind(config, lines)
    result["load"] = kit.load_average()
    return result


# ----------------------------------------------------------------------------- scale


def crowded_node(s: Script, name: str, gpus: int, owners: int) -> None:
    s.event("ADDED", node(name, gpus={RTX: gpus}))
    for i in range(gpus):
        vm_name = f"{name}-vm-{i:03d}"
        s.event("ADDED", vm(f"spx-proj-{i % 40:02d}", vm_name, project=f"proj-{i % 40:02d}",
                            owner=f"user-{i % owners:03d}@example.com",
                            run_strategy="Always" if i % 2 else "Manual", gpu=RTX))
        s.event("ADDED", vmi(f"spx-proj-{i % 40:02d}", vm_name, node_name=name, gpu=RTX,
                             cpu_model="host-passthrough"))
        s.wait(0.001)


def decided(sim: Simulation, line: dict[str, Any], number: int) -> tuple[float, int, int]:
    """Engine CPU seconds for one input (with the node learning of it), owners told, audit records."""
    text = json.dumps(line, sort_keys=True)
    started = time.process_time()
    outputs = list(sim.feed_line(text, number))
    seconds = time.process_time() - started
    told = sum(1 for o in outputs if '"type":"drain_will_stop_gpu_vm"' in o)
    audits = sum(1 for o in outputs if o.startswith('{"topic":"vmstream.audit"'))
    return seconds, told, audits


def run_scale(vms: int, config: Path, seed: int) -> dict[str, Any]:
    out = Lines()
    gen = az.Generator(random.Random(seed), vms=vms, nodes=max(vms // 10, 5), limit=10**12, out=out)
    gen.relist()
    gen.flush()
    s = Script(gen.now, prefix="scale")
    s.event("ADDED", node("spare-node", gpus={RTX: 100}))
    crowded_node(s, "big-node", 500, 300)
    racks = [f"rack-node-{i:02d}" for i in range(50)]
    for name in racks:
        crowded_node(s, name, 8, 300)
    setup = out.take() + list(s.jsonl())
    del gen
    sim = simulation(config)
    feed(sim, setup, st.CountingSink())
    number = len(setup)
    s.lines.clear()
    s.wait(5).intent("it-scale-drain", "drain_node", {"node": "big-node", "reason": "firmware upgrade",
                                                      "notice_seconds": 900}, by=az.OPS)
    seconds, told, audits = decided(sim, s.lines[0], number + 1)
    result: dict[str, Any] = {"big_node": {"seconds": seconds, "told": told, "decisions": audits}}
    per_node = []
    for i, name in enumerate(racks):
        s.lines.clear()
        s.wait(0.01).event("ADDED", node_maintenance(f"nm-{name}", name, "rack PSU replacement"))
        per_node.append(decided(sim, s.lines[0], number + 2 + i))
    result["maintenance"] = {
        "nodes": len(racks), "total_seconds": sum(p[0] for p in per_node), "max_seconds": max(p[0] for p in per_node),
        "told": sum(p[1] for p in per_node), "told_min_per_node": min(p[1] for p in per_node),
        "decisions": sum(p[2] for p in per_node),
    }
    result["load"] = kit.load_average()
    return result


# ------------------------------------------------------------------------ the parent


def child(tree: Path, args: list[str]) -> dict[str, Any]:
    """Run one part in ``tree``'s copy of this script; its JSON result."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        script = tree / "benchmarks" / HERE.name
        command = [sys.executable, str(script), *args, "--result", result.name]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        completed = subprocess.run(command, env=env, cwd=tree)
        if completed.returncode != 0:
            raise SystemExit(f"{' '.join(command)} exited with {completed.returncode}")
        parsed: dict[str, Any] = json.loads(Path(result.name).read_text())
        return parsed


def spread(rates: list[float]) -> float:
    return (max(rates) - min(rates)) / max(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1k and 10k VMs, 5,000 inputs a cell, a shorter mix")
    parser.add_argument("--vms", type=int, nargs="+", help="VM counts of the grid (default 1,000 10,000 100,000)")
    parser.add_argument("--drains", type=int, nargs="+", default=[0, 100, 1_000], help="drains in flight per cell")
    parser.add_argument("--inputs", type=int, help="timed inputs per cell (default 20,000; --quick 5,000)")
    parser.add_argument("--mix-events", type=int, help="lines of the 1 %% drain mix (default 100,000; --quick 30,000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--parts", nargs="+", default=["grid", "mix", "scale"], choices=["grid", "mix", "scale"])
    parser.add_argument("--baseline", type=Path, metavar="DIR",
                        help="also run every part in DIR (a snapshot of another commit), side by side")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="cProfile the largest-drain cell of each row and the mix; top N by tottime "
                             "(timed in CPU seconds: on a loaded machine wall-clock profiles blame whatever ran "
                             "when the process was descheduled)")
    parser.add_argument("--by-kind", action="store_true",
                        help="after the mix, decide its lines again one at a time and print what an input of "
                             "each kind costs")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run every part N times, the trees taking turns; each cell reports the median "
                             "of its N rates (a cell's rate moves by up to a quarter from one run to the "
                             "next on this shared machine, more than the cells differ)")
    kit.add_json_option(parser)
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a child: which part
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    inputs = args.inputs or (5_000 if args.quick else 20_000)
    mix_events = args.mix_events or (30_000 if args.quick else 100_000)
    grid_vms = args.vms or ([1_000, 10_000] if args.quick else [1_000, 10_000, 100_000])

    if args.part:  # a child: one part, its result as JSON
        config = Path(args.config)
        kind, _, value = args.part.partition(":")
        if kind == "grid":
            result = run_grid_row(int(value), args.drains, inputs, config, args.seed, args.profile)
        elif kind == "mix":
            result = run_mix(mix_events, config, args.seed, 100, args.profile, by_kind=args.by_kind)
        else:
            result = run_scale(10_000 if not args.quick else 1_000, config, args.seed)
        Path(args.result).write_text(json.dumps(result))
        return 0

    trees = [("now", HERE.parent.parent)]
    if args.baseline:
        base = args.baseline.resolve()
        for name in (HERE.name, "simulate_throughput.py", "az_stream.py", "kit.py"):
            shutil.copy(HERE.parent / name, base / "benchmarks" / name)
        trees.append(("baseline", base))
    print("trees: " + ", ".join(f"{label} = {tree}" for label, tree in trees))
    print(f"start: {kit.load_average()}")
    with tempfile.TemporaryDirectory(prefix="vmstream-grid-") as tmp:
        config = Path(tmp) / "config.yaml"
        az.write_config(config)
        common = ["--seed", str(args.seed), "--inputs", str(inputs), "--mix-events", str(mix_events),
                  "--drains", *map(str, args.drains), "--config", str(config), "--profile", str(args.profile)]
        if args.quick:
            common.append("--quick")
        if args.by_kind:
            common.append("--by-kind")
        results: dict[str, dict[str, list[dict[str, Any]]]] = {label: {} for label, _ in trees}
        parts = [f"grid:{v}" for v in grid_vms] if "grid" in args.parts else []
        parts += [p for p in ("mix", "scale") if p in args.parts]
        for round_ in range(args.repeat):
            for part in parts:
                # the trees take turns going first, so that neither always runs on a warmer machine
                for label, tree in trees if round_ % 2 == 0 else trees[::-1]:
                    print(f"{part} in {label}, round {round_ + 1} of {args.repeat} … ({kit.load_average()})", flush=True)
                    results[label].setdefault(part, []).append(child(tree, ["--part", part, *common]))
        report(results, grid_vms, inputs, mix_events)
    print(f"end: {kit.load_average()}")
    kit.write_json(args.json, {"inputs": inputs, "mix_events": mix_events, "results": results})
    return 0


def report(results: dict[str, dict[str, list[dict[str, Any]]]], grid_vms: list[int], inputs: int,
           mix_events: int) -> None:
    """The tables; with ``--repeat`` each rate is the median of a part's rounds (their CPU
    rates listed beside it), the counts those of its first round (the same in every round)."""
    labels = list(results)
    first = results[labels[0]]
    if any(p.startswith("grid") for p in first):
        rounds = len(first[f"grid:{grid_vms[0]}"])
        print(f"\n== grid: {inputs:,} timed inputs a cell (background traffic after the drains opened)"
              + (f", median of {rounds} rounds" if rounds > 1 else ""))
        print("   inputs/s wall | per CPU-second; episodes = drain rows (of them, deadlines still to fire)")
        header = ["VMs", "nodes", "drains", "episodes (to fire)"]
        for label in labels:
            header += [f"{label} wall/s", f"{label} cpu/s", f"{label} median"]
            if rounds > 1:
                header.append(f"{label} cpu/s by round")
        body = []
        for vms in grid_vms:
            for i, cell in enumerate(first[f"grid:{vms}"][0]["cells"]):
                line = [f"{vms:,}", f"{cell['nodes']:,}", f"{cell['drains']:,}", f"{cell['episodes']:,} ({cell['to_fire']:,})"]
                for label in labels:
                    line += _cell_columns([r["cells"][i] for r in results[label][f"grid:{vms}"]])
                body.append([*line, f"[{cell['load']}]"])
        print(kit.table([*header, "load"], body))
        for label in labels:
            rows = [results[label][f"grid:{vms}"] for vms in grid_vms]
            cells = [[r["cells"][i] for r in row] for row in rows for i in range(len(row[0]["cells"]))]
            rss = {vms: max(r["peak_rss_mib"] for r in row) for vms, row in zip(grid_vms, rows, strict=True)}
            sliced = all("median_cpu_rate" in c for rs in cells for c in rs)
            by_round = ", ".join(f"{spread([rs[r]['cpu_rate'] for rs in cells]):.0%}" for r in range(rounds))
            print(f"{label}: spread across the grid (max−min)/max: wall {spread([_median(rs, 'rate') for rs in cells]):.0%}, "
                  f"CPU {spread([_median(rs, 'cpu_rate') for rs in cells]):.0%}"
                  + (f", CPU median of slices {spread([_median(rs, 'median_cpu_rate') for rs in cells]):.0%}"
                     if sliced else "")
                  + (f"; by round, CPU {by_round}" if rounds > 1 else "")
                  + f" (target ≤ {TARGET_SPREAD:.0%}); "
                  "peak RSS MiB by VMs (engine, state and one timed phase's lines): "
                  + ", ".join(f"{v:,}: {m:,.0f}" for v, m in rss.items()) + f" (target < {TARGET_RSS_MIB:,.0f})")
    if "mix" in first:
        print(f"\n== simulate_throughput.py's mix, 10,000 VMs / 1,000 nodes, {mix_events:,} lines, a drain every 100 "
              "lines as far as GPU nodes are free")
        for label in labels:
            ms = results[label]["mix"]
            m = ms[0]
            by_round = " (rounds: " + ", ".join(f"{r['cpu_rate']:,.0f}" for r in ms) + ")" if len(ms) > 1 else ""
            print(f"{label:>9}: {_median(ms, 'rate'):>8,.0f} inputs/s wall, {_median(ms, 'cpu_rate'):>8,.0f} per "
                  f"CPU-second{by_round} (median of {SLICES} slices {_median_text(ms)}) "
                  f"(target ≥ {TARGET_MIX_RATE:,.0f}); drain lines {m['drain_lines']:,} "
                  f"({m['drain_lines'] / m['inputs']:.1%}), episodes at the end "
                  f"{m['episodes']:,} ({m['to_fire']:,} to fire)  [{ms[-1]['load']}]")
    if "mix" in first and "by_kind" in first["mix"][0]:
        print_costs_by_kind({label: results[label]["mix"][0]["by_kind"] for label in labels})
    if "scale" in first:
        print("\n== drains at scale: engine CPU time of the decision (state applied, the node told of its residents)")
        for label in labels:
            ss = results[label]["scale"]
            s, big, nm = ss[0], ss[0]["big_node"], ss[0]["maintenance"]
            big_ms = statistics.median(r["big_node"]["seconds"] for r in ss) * 1000
            nm_ms = statistics.median(r["maintenance"]["total_seconds"] for r in ss) * 1000
            slowest = max(r["maintenance"]["max_seconds"] for r in ss) * 1000
            print(f"{label:>9}: a node with 500 GPU VMs drained: {big_ms:,.0f} ms, "
                  f"{big['told']} owners' notices in {big['decisions']} decision(s); "
                  f"NodeMaintenance on {nm['nodes']} nodes: {nm_ms:,.0f} ms in all, "
                  f"slowest node {slowest:,.1f} ms, {nm['told']} notices in {nm['decisions']} "
                  f"decisions (≥ {nm['told_min_per_node']} a node)  [{s['load']}]")


def print_costs_by_kind(costs: dict[str, dict[str, dict[str, float]]]) -> None:
    """µs of CPU per input of each kind of the mix (first round), and its share of the whole."""
    labels = list(costs)
    totals = {label: sum(c["seconds"] for c in costs[label].values()) for label in labels}
    first = costs[labels[0]]
    print("\n== the mix by kind of input, each line decided alone (first round): µs of CPU per input, share of all")
    header = ["kind", "inputs"] + [f"{label} {what}" for label in labels for what in ("µs", "share")]
    body = []
    for kind in sorted(first, key=lambda k: first[k]["seconds"], reverse=True):
        row = [kind, f"{int(first[kind]['inputs']):,}"]
        for label in labels:
            cost = costs[label].get(kind, {"inputs": 1, "seconds": float("nan")})
            row += [f"{1e6 * cost['seconds'] / cost['inputs']:,.1f}", f"{cost['seconds'] / totals[label]:.1%}"]
        body.append(row)
    print(kit.table(header, body))
    for label in labels:
        inputs = sum(c["inputs"] for c in costs[label].values())
        print(f"{label:>9}: {inputs:,} inputs, {1e6 * totals[label] / inputs:,.1f} µs each on average")


def _median(rounds: list[dict[str, Any]], field: str) -> float:
    return statistics.median(r[field] for r in rounds)


def _median_text(rounds: list[dict[str, Any]]) -> str:
    """The median slice rate over the rounds; '–' from a copy of this script that did not time slices."""
    return f"{_median(rounds, 'median_cpu_rate'):,.0f}" if all("median_cpu_rate" in r for r in rounds) else "–"


def _cell_columns(rounds: list[dict[str, Any]]) -> list[str]:
    columns = [f"{_median(rounds, 'rate'):,.0f}", f"{_median(rounds, 'cpu_rate'):,.0f}", _median_text(rounds)]
    if len(rounds) > 1:
        columns.append(" ".join(f"{r['cpu_rate']:,.0f}" for r in rounds))
    return columns


if __name__ == "__main__":
    sys.exit(main())
