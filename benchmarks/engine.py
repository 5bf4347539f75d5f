"""How fast is the engine, and does it stay as fast as the AZ grows and drains pile up?

The worker and ``vmstream simulate`` run the same pure engine one input at a time, so what
it costs per input bounds what one partition can keep up with; if that cost grew with the
drains in flight, the nodes or the VMs, the busiest hour of an AZ (a rack drained for a
firmware upgrade) would be the slowest. Every part feeds JSON lines of a generated AZ
(``az_stream.py``, from a seed) made before timing starts, and reports rates per second of
wall clock and per second of CPU (user + system), which swings much less on a shared
machine. Each part runs in a child process of its own, so that its peak RSS is its own.

1. **simulate** — an AZ of 10,000 VMs on 1,000 nodes and 100,000 input lines, through
   ``Simulation.feed`` in process and through the ``vmstream simulate`` CLI (interpreter
   start and imports included). Anchor, over the same lines: ``json.loads`` of each, nothing
   decided — what any Python reader of the stream pays. Targets: ≥ 10,000 inputs/s, < 1 GiB.
2. **grid** — per VM count (1k, 10k, 100k), an AZ relisted through the engine, then 0, 100
   and 1,000 drains in flight (``drain_node`` intents with a day's notice, each node cordoned
   after it), each followed by the same number of inputs of background traffic, which alone
   are timed. Targets: inputs/s within 20 % across the grid; peak RSS < 1 GiB with 100k VMs.
3. **mix** — simulate's stream with a drain every 100 lines (as far as GPU nodes are free
   for one). Target: ≥ 20,000 inputs/s on one core. ``--by-kind``: its lines decided again
   one at a time, what an input of each kind costs.
4. **scale** — a node with 500 GPU VMs drained by one intent, then NodeMaintenances on 50
   nodes of 8 GPU VMs one after the other: the engine's CPU time per decision and the owners
   it tells.

    .venv/bin/python benchmarks/engine.py --parts simulate --repeat 2
    .venv/bin/python benchmarks/engine.py --parts grid mix scale --repeat 3
    .venv/bin/python benchmarks/engine.py --parts mix --by-kind
    .venv/bin/python benchmarks/engine.py --quick       # 1k and 10k VMs, fewer inputs
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
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

from handlers.core.state import MemoryState  # noqa: E402
from handlers.core.tables import DRAINS  # noqa: E402
from handlers.decide.engine import Engine  # noqa: E402
from harness.scenarios import Script  # noqa: E402
from samples.cluster import RTX, node, node_maintenance, vm, vmi  # noqa: E402
from streams.cli.simulating import Simulation  # noqa: E402
from streams.common.settings import load_settings  # noqa: E402

HERE = Path(__file__).resolve()
TARGET_RATE = 10_000.0  # simulate, inputs/s
TARGET_SPREAD = 0.20
TARGET_MIX_RATE = 20_000.0
TARGET_RSS_MIB = 1024.0
DRAIN_NOTICE = 86_400  # a day: no deadline passes while a cell is timed
SLICES = 10  # a cell's inputs are also timed in this many slices (median_cpu_rate)
PARTS = ("simulate", "grid", "mix", "scale")


def peak_rss_mib() -> float:
    return kit.rss_mib(os.getpid())[1]


def reset_peak_rss() -> None:
    """Linux can reset a process's peak RSS, so the figure leaves out what came before."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def simulation(config: Path) -> Simulation:
    settings = load_settings(config)
    return Simulation(Engine(settings.rules()), settings.kafka)


class Sink:
    """Stands in for stdout: counts lines, so the sink costs next to nothing."""

    def __init__(self) -> None:
        self.lines = 0

    def write(self, line: str) -> None:
        self.lines += 1


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


def feed(sim: Simulation, lines: Iterable[str], sink: Sink, first: int = 1) -> None:
    for number, text in enumerate(lines, start=first):
        for output in sim.feed_line(text, number):
            sink.write(output)


def timed(sim: Simulation, lines: list[str]) -> dict[str, float]:
    """Rates over all of ``lines``, and the median of the per-CPU-second rates of its
    SLICES slices: a burst of other work slows one slice, and moves the median much less
    than the whole (a steady load still moves both)."""
    sink = Sink()
    gc.collect()
    size = max(1, -(-len(lines) // SLICES))
    slices: list[float] = []
    wall, cpu = time.perf_counter(), time.process_time()
    for start in range(0, len(lines), size):
        begun = time.process_time()
        feed(sim, lines[start:start + size], sink, start + 1)
        slices.append(len(lines[start:start + size]) / max(time.process_time() - begun, 1e-9))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"inputs": len(lines), "outputs": sink.lines, "wall": wall, "cpu": cpu,
            "rate": len(lines) / wall, "cpu_rate": len(lines) / cpu, "median_cpu_rate": statistics.median(slices)}


def episodes(state: MemoryState) -> tuple[int, int]:
    """Drain episodes in the table, and those of them whose deadline is still to fire."""
    rows = list(state.values(DRAINS))
    return len(rows), sum(1 for e in rows if not e.deadline_passed and not e.completed)


# -------------------------------------------------------------------------- simulate


def run_simulate(config: Path, events: int, seed: int, quick: bool) -> dict[str, Any]:
    vms, nodes = (1_000, 110) if quick else (10_000, 1_000)
    with tempfile.TemporaryDirectory(prefix="vmstream-engine-") as tmp:
        path = Path(tmp) / "az.jsonl"
        az.generate(path, vms=vms, nodes=nodes, events=events, seed=seed)
        gc.collect()
        with path.open(encoding="utf-8") as source:
            wall, cpu = time.perf_counter(), time.process_time()
            inputs = 0
            for text in source:
                inputs += 1
                with contextlib.suppress(ValueError):  # the stream's malformed lines
                    json.loads(text)
            anchor = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
        sim, sink = simulation(config), Sink()
        gc.collect()
        reset_peak_rss()
        with path.open(encoding="utf-8") as source:  # read as fed, as the CLI reads it
            wall, cpu = time.perf_counter(), time.process_time()
            for line in sim.feed(source):
                sink.write(line)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        result = {"vms": vms, "nodes": nodes, "inputs": inputs, "outputs": sink.lines, "wall": wall, "cpu": cpu,
                  "rate": inputs / wall, "cpu_rate": inputs / cpu, "anchor": anchor, "peak_rss_mib": peak_rss_mib()}
        script = Path(sys.executable).with_name("vmstream")
        command = [*([str(script)] if script.exists() else [sys.executable, "-m", "streams.cli.main"]),
                   "simulate", "--config", str(config), "--input", str(path)]
        with open(os.devnull, "wb") as devnull:  # os.wait4: this one child's resource usage
            started = time.perf_counter()
            child = subprocess.Popen(command, stdout=devnull, env={**os.environ, "PYTHONPATH": str(kit.REPO)})
            _, status, usage = os.wait4(child.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(command)} exited with {os.waitstatus_to_exitcode(status)}")
        result["cli"] = {"wall": time.perf_counter() - started, "cpu": usage.ru_utime + usage.ru_stime,
                         "peak_rss_mib": usage.ru_maxrss / 1024}
    result["load"] = kit.load_average()
    return result


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


def run_grid_row(vms: int, drains: list[int], inputs: int, config: Path, seed: int) -> dict[str, Any]:
    nodes = max(vms // 10, 1_100)  # so that 1,000 of them can be drained
    out = Lines()
    gen = az.Generator(random.Random(seed), vms=vms, nodes=nodes, limit=10**12, out=out)
    tmp = tempfile.TemporaryDirectory(prefix="vmstream-engine-")
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
                feed(sim, source, Sink(), fed + 1)
            fed += sum(1 for _ in path.open(encoding="utf-8"))
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        cell: dict[str, Any] = {"vms": vms, "nodes": nodes, "drains": opened, **timed(sim, lines)}
        cell["episodes"], cell["to_fire"] = episodes(sim.state)
        cell["load"] = kit.load_average()
        cells.append(cell)
        fed += len(lines)
    tmp.cleanup()
    return {"cells": cells, "peak_rss_mib": peak_rss_mib()}


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
    """Each line decided alone on a fresh engine, its CPU time summed by its kind (the clock
    read around each line adds about a microsecond to each)."""
    sim = simulation(config)
    sink = Sink()
    costs: dict[str, dict[str, float]] = {}
    for number, text in enumerate(lines, start=1):
        started = time.process_time()
        for output in sim.feed_line(text, number):
            sink.write(output)
        cost = costs.setdefault(input_kind(text), {"inputs": 0, "seconds": 0.0})
        cost["inputs"] += 1
        cost["seconds"] += time.process_time() - started
    return costs


def run_mix(events: int, config: Path, seed: int, by_kind: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="vmstream-engine-") as tmp:
        path = Path(tmp) / "mix.jsonl"
        mix = az.generate(path, vms=10_000, nodes=1_000, events=events, seed=seed, events_per_drain=100)
        lines = path.read_text(encoding="utf-8").splitlines()
    sim = simulation(config)
    result: dict[str, Any] = timed(sim, lines)
    result["episodes"], result["to_fire"] = episodes(sim.state)
    result["drain_lines"] = sum(n for kind, n in mix.items()
                                if any(w in kind for w in ("drain", "cordon", "maintenance", "evict")))
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


def decided(sim: Simulation, line: dict[str, Any], number: int) -> tuple[float, int]:
    """Engine CPU seconds for one input (with the node learning of it), and the owners told."""
    text = json.dumps(line, sort_keys=True)
    started = time.process_time()
    outputs = list(sim.feed_line(text, number))
    return time.process_time() - started, sum(1 for o in outputs if '"type":"drain_will_stop_gpu_vm"' in o)


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
    feed(sim, setup, Sink())
    number = len(setup)
    s.lines.clear()
    s.wait(5).intent("it-scale-drain", "drain_node", {"node": "big-node", "reason": "firmware upgrade",
                                                      "notice_seconds": 900}, by=az.OPS)
    seconds, told = decided(sim, s.lines[0], number + 1)
    per_node = []
    for i, name in enumerate(racks):
        s.lines.clear()
        s.wait(0.01).event("ADDED", node_maintenance(f"nm-{name}", name, "rack PSU replacement"))
        per_node.append(decided(sim, s.lines[0], number + 2 + i))
    return {"big_node": {"seconds": seconds, "told": told},
            "maintenance": {"nodes": len(racks), "total_seconds": sum(p[0] for p in per_node),
                            "max_seconds": max(p[0] for p in per_node), "told": sum(p[1] for p in per_node)},
            "load": kit.load_average()}


# --------------------------------------------------------------------------- report


def median(rounds: list[dict[str, Any]], field: str) -> float:
    return float(statistics.median(r[field] for r in rounds))


def spread(rates: list[float]) -> float:
    return (max(rates) - min(rates)) / max(rates)


def report(results: dict[str, list[Any]], grid_vms: list[int], args: argparse.Namespace) -> bool:
    """The tables; with ``--repeat`` each rate is the median of a part's rounds."""
    ok = True
    if "simulate" in results:
        runs = results["simulate"]
        s, anchor = runs[0], min(runs, key=lambda r: r["anchor"]["cpu"])["anchor"]
        best, cli = min(runs, key=lambda r: r["wall"]), min((r["cli"] for r in runs), key=lambda c: c["wall"])
        rss = max(r["peak_rss_mib"] for r in runs), max(r["cli"]["peak_rss_mib"] for r in runs)
        n = s["inputs"]
        print(f"\n== simulate: {s['vms']:,} VMs on {s['nodes']:,} nodes, {n:,} inputs, best of {len(runs)}  [{s['load']}]")
        print(kit.table(("run", "seconds", "cpu s", "inputs/s", "per CPU-second", "peak RSS MiB"), [
            ("anchor: json.loads of each line", f"{anchor['wall']:.2f}", f"{anchor['cpu']:.2f}",
             f"{n / anchor['wall']:,.0f}", f"{n / anchor['cpu']:,.0f}", ""),
            ("in process (Simulation.feed)", f"{best['wall']:.2f}", f"{best['cpu']:.2f}", f"{best['rate']:,.0f}",
             f"{best['cpu_rate']:,.0f}", f"{rss[0]:,.0f}"),
            ("cli (vmstream simulate)", f"{cli['wall']:.2f}", f"{cli['cpu']:.2f}", f"{n / cli['wall']:,.0f}",
             f"{n / cli['cpu']:,.0f}", f"{rss[1]:,.0f}")]))
        met = best["cpu_rate"] >= TARGET_RATE and max(rss) < TARGET_RSS_MIB
        ok &= met
        print(f"targets ≥ {TARGET_RATE:,.0f} inputs per CPU-second, < {TARGET_RSS_MIB:,.0f} MiB: {kit.yes(met)}")
    if any(part.startswith("grid") for part in results):
        rounds = len(results[f"grid:{grid_vms[0]}"])
        print(f"\n== grid: {args.inputs:,} timed inputs a cell, after the drains opened"
              + (f", median of {rounds} rounds" if rounds > 1 else ""))
        body, cells, peak = [], [], {}
        for vms in grid_vms:
            row = results[f"grid:{vms}"]
            peak[vms] = max(r["peak_rss_mib"] for r in row)
            for i, cell in enumerate(row[0]["cells"]):
                rs = [r["cells"][i] for r in row]
                cells.append(rs)
                body.append((f"{vms:,}", f"{cell['nodes']:,}", f"{cell['drains']:,}",
                             f"{cell['episodes']:,} ({cell['to_fire']:,})", f"{median(rs, 'rate'):,.0f}",
                             f"{median(rs, 'cpu_rate'):,.0f}", f"{median(rs, 'median_cpu_rate'):,.0f}",
                             f"[{cell['load']}]"))
        print(kit.table(("VMs", "nodes", "drains", "episodes (to fire)", "wall/s", "per CPU-s", "median slice",
                         "load"), body))
        flat = spread([median(rs, "cpu_rate") for rs in cells])
        met = flat <= TARGET_SPREAD and max(peak.values()) < TARGET_RSS_MIB
        ok &= met
        print(f"spread across the grid (max−min)/max: CPU {flat:.0%}, median slice "
              f"{spread([median(rs, 'median_cpu_rate') for rs in cells]):.0%} (target ≤ {TARGET_SPREAD:.0%}); "
              "peak RSS MiB by VMs: " + ", ".join(f"{v:,}: {m:,.0f}" for v, m in peak.items())
              + f" (target < {TARGET_RSS_MIB:,.0f}): {kit.yes(met)}")
    if "mix" in results:
        ms = results["mix"]
        m = ms[0]
        met = median(ms, "cpu_rate") >= TARGET_MIX_RATE
        ok &= met
        print(f"\n== mix: 10,000 VMs / 1,000 nodes, {m['inputs']:,} lines, {m['drain_lines']:,} of them drains "
              f"({m['drain_lines'] / m['inputs']:.1%})  [{ms[-1]['load']}]")
        print(f"{median(ms, 'rate'):,.0f} inputs/s wall, {median(ms, 'cpu_rate'):,.0f} per CPU-second (median slice "
              f"{median(ms, 'median_cpu_rate'):,.0f}; target ≥ {TARGET_MIX_RATE:,.0f}: {kit.yes(met)}); "
              f"episodes at the end {m['episodes']:,} ({m['to_fire']:,} to fire)")
        if "by_kind" in m:
            costs = m["by_kind"]
            total = sum(c["seconds"] for c in costs.values())
            print(kit.table(("kind", "inputs", "µs each", "share of CPU"), [
                (kind, f"{int(c['inputs']):,}", f"{1e6 * c['seconds'] / c['inputs']:,.1f}", f"{c['seconds'] / total:.1%}")
                for kind, c in sorted(costs.items(), key=lambda item: item[1]["seconds"], reverse=True)]))
    if "scale" in results:
        ss = results["scale"]
        big, nm = ss[0]["big_node"], ss[0]["maintenance"]
        print("\n== the largest drains: engine CPU time of the decision (state applied, the node told of its residents)")
        print(f"a node with 500 GPU VMs drained: {1000 * statistics.median(r['big_node']['seconds'] for r in ss):,.0f} ms, "
              f"{big['told']} owners told; NodeMaintenance on {nm['nodes']} nodes: "
              f"{1000 * statistics.median(r['maintenance']['total_seconds'] for r in ss):,.0f} ms in all, slowest node "
              f"{1000 * max(r['maintenance']['max_seconds'] for r in ss):,.1f} ms, {nm['told']} told  [{ss[0]['load']}]")
    return ok


# ------------------------------------------------------------------------ the parent


def child(args: list[str]) -> Any:
    """One part in a child process of this script; its JSON result."""
    with tempfile.NamedTemporaryFile(suffix=".json") as result:
        command = [sys.executable, str(HERE), *args, "--result", result.name]
        if subprocess.run(command).returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed")
        return json.loads(Path(result.name).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    parser.add_argument("--quick", action="store_true", help="smaller AZs and fewer inputs: a smoke run")
    parser.add_argument("--vms", type=int, nargs="+", help="VM counts of the grid (default 1,000 10,000 100,000)")
    parser.add_argument("--drains", type=int, nargs="+", default=[0, 100, 1_000], help="drains in flight per cell")
    parser.add_argument("--inputs", type=int, help="timed inputs per grid cell (default 20,000; --quick 5,000)")
    parser.add_argument("--events", type=int, help="lines of simulate's and the mix's streams "
                                                   "(default 100,000; --quick 20,000)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--by-kind", action="store_true", help="after the mix, what an input of each kind costs")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="every part N times; a rate is the median of its N rounds (simulate: the best)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    kit.add_json_option(parser)
    parser.add_argument("--part", help=argparse.SUPPRESS)  # a child: which part
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.inputs = args.inputs or (5_000 if args.quick else 20_000)
    args.events = args.events or (20_000 if args.quick else 100_000)
    grid_vms = args.vms or ([1_000, 10_000] if args.quick else [1_000, 10_000, 100_000])

    if args.part:  # a child: one part, its result as JSON
        config = Path(args.config)
        kind, _, value = args.part.partition(":")
        if kind == "simulate":
            result = run_simulate(config, args.events, args.seed, args.quick)
        elif kind == "grid":
            result = run_grid_row(int(value), args.drains, args.inputs, config, args.seed)
        elif kind == "mix":
            result = run_mix(args.events, config, args.seed, args.by_kind)
        else:
            result = run_scale(1_000 if args.quick else 10_000, config, args.seed)
        Path(args.result).write_text(json.dumps(result))
        return 0

    kit.print_load("at the start")
    with tempfile.TemporaryDirectory(prefix="vmstream-engine-") as tmp:
        config = Path(tmp) / "config.yaml"
        az.write_config(config)
        common = ["--seed", str(args.seed), "--inputs", str(args.inputs), "--events", str(args.events),
                  "--drains", *map(str, args.drains), "--config", str(config),
                  *(["--quick"] if args.quick else []), *(["--by-kind"] if args.by_kind else [])]
        parts = [p for p in args.parts if p != "grid"]
        if "grid" in args.parts:
            parts[args.parts.index("grid"):args.parts.index("grid")] = [f"grid:{v}" for v in grid_vms]
        results: dict[str, list[Any]] = {}
        for round_ in range(args.repeat):
            for part in parts:
                print(f"{part}, round {round_ + 1} of {args.repeat} … ({kit.load_average()})", flush=True)
                results.setdefault(part, []).append(child(["--part", part, *common]))
        ok = report(results, grid_vms, args)
    kit.print_load("at the end")
    kit.write_json(args.json, {"inputs": args.inputs, "events": args.events, "results": results, "targets_met": ok})
    return 1 if args.check and not ok else 0


if __name__ == "__main__":
    sys.exit(main())
