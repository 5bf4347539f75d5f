"""Throughput and memory of ``vmstream simulate`` on a production-sized AZ.

Why this exists: the worker runs the same pure engine as ``simulate``, one input at a time,
so the engine's cost per input bounds what one partition can keep up with. The targets are
what a 10,000-VM AZ needs with room to spare — replaying a day of watch events in minutes,
and a relist of the whole AZ in seconds: **≥ 10,000 inputs/s** and **< 1 GiB** peak RSS.

What it does:

1. generates, from a seed, a cluster (1,000 nodes of which 200 carry 4–8 GPU cards of the
   two example classes; 10,000 VMs of 40 projects, ~15 % with a GPU, mixed run strategies)
   and a stream of input lines as the watch bridge and the upstream services would send
   them: the initial relist (ADDED), then mostly MODIFIED events (node heartbeats, VM and
   VMI status updates), VMIs deleted and recreated, ``set_gpu`` / ``restart_vm`` /
   ``create_vm`` intents (some refused, some redelivered), a few drains of several kinds
   (intent, cordon, NodeMaintenance, kubectl drain) whose deadlines pass, and a few
   malformed messages. The generator keeps its own model of the cluster so that what
   follows an intent (the patched VM, the VMI coming back elsewhere, a GPU VM waiting for a
   card) is what KubeVirt would show; it never runs the engine.
2. writes it as JSON Lines (not timed) and measures the real simulate path twice:
   in process (``Simulation.feed`` into a counting sink) and end to end (the ``vmstream
   simulate`` CLI as a subprocess, stdout to ``/dev/null``), with wall time and peak RSS.

Run it from the repository root::

    .venv/bin/python benchmarks/simulate_throughput.py            # full size
    .venv/bin/python benchmarks/simulate_throughput.py --profile  # plus a cProfile of the engine
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)
from az_stream import EVENTS_PER_DRAIN, generate, write_config  # noqa: E402  (this directory's: the AZ's input stream)

from handlers.engine import Engine  # noqa: E402
from streams.cli import simulating  # noqa: E402
from streams.cli.simulating import Simulation  # noqa: E402
from streams.common.settings import load_settings  # noqa: E402

TARGET_INPUTS_PER_SECOND = 10_000.0
TARGET_PEAK_RSS_MIB = 1024.0


# ----------------------------------------------------------------------- measurement


@dataclass
class Measurement:
    run: str
    inputs: int
    outputs: int | None
    seconds: float  # wall clock: what the targets are about
    cpu_seconds: float  # user + system: steadier than wall clock on a busy machine
    peak_rss_mib: float | None

    @property
    def rate(self) -> float:
        return self.inputs / self.seconds if self.seconds > 0 else float("inf")

    @property
    def fast_enough(self) -> bool:
        return self.rate >= TARGET_INPUTS_PER_SECOND

    @property
    def small_enough(self) -> bool | None:
        return None if self.peak_rss_mib is None else self.peak_rss_mib < TARGET_PEAK_RSS_MIB


class CountingSink:
    """Stands in for stdout: keeps counts, not text, so the sink costs next to nothing."""

    PREFIX = '{"topic":"'

    def __init__(self) -> None:
        self.lines = 0
        self.bytes = 0
        self.by_topic: Counter[str] = Counter()

    def write(self, line: str) -> None:
        self.lines += 1
        self.bytes += len(line) + 1
        if line.startswith(self.PREFIX):
            self.by_topic[line[len(self.PREFIX):line.find('"', len(self.PREFIX))]] += 1


def _reset_peak_rss() -> bool:
    """Linux can reset a process's peak RSS, so the in-process figure excludes generation."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _own_peak_rss_mib() -> float:
    try:
        for row in Path("/proc/self/status").read_text().splitlines():
            if row.startswith("VmHWM:"):
                return int(row.split()[1]) / 1024
    except OSError:
        pass
    return _maxrss_mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _maxrss_mib(maxrss: int) -> float:
    return maxrss / (1024 * 1024) if sys.platform == "darwin" else maxrss / 1024  # bytes vs KiB


def count_lines(path: Path) -> int:
    with path.open("rb") as source:
        return sum(1 for line in source if line.strip())


def measure_in_process(config: Path, inputs_path: Path, inputs: int,
                       profiler: cProfile.Profile | None) -> tuple[Measurement, CountingSink]:
    """``Simulation.feed`` over the file, as the CLI does it, minus writing the output."""
    settings = load_settings(config)
    simulation = Simulation(Engine(settings.rules()), settings.kafka)
    sink = CountingSink()
    gc.collect()
    reset = _reset_peak_rss()
    with inputs_path.open(encoding="utf-8") as source:
        if profiler is not None:
            profiler.enable()
        started, cpu_started = time.perf_counter(), time.process_time()
        for line in simulation.feed(source):
            sink.write(line)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        if profiler is not None:
            profiler.disable()
    label = "in-process" + (" (profiled)" if profiler else "") + ("" if reset else " (RSS incl. generation)")
    return Measurement(label, inputs, sink.lines, seconds, cpu_seconds, _own_peak_rss_mib()), sink


def cli_command(config: Path, inputs_path: Path) -> list[str]:
    script = Path(sys.executable).with_name("vmstream")
    base = [str(script)] if script.exists() else [sys.executable, "-m", "streams.cli.main"]
    return [*base, "simulate", "--config", str(config), "--input", str(inputs_path)]


def code_root() -> Path:
    """The tree ``handlers``/``streams`` were imported from (a checkout, or a snapshot)."""
    return Path(simulating.__file__).resolve().parents[2]  # streams/cli/simulating.py


def cli_environment() -> dict[str, str]:
    """The child imports the very code measured in process, not whatever is installed.

    The editable install's finder comes after ``sys.path``, so PYTHONPATH decides.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code_root()), env.get("PYTHONPATH")) if p)
    return env


def measure_cli(command: list[str], inputs: int) -> Measurement:
    """The command end to end — interpreter start, imports, output rendering and writing.

    ``os.wait4`` gives this one child's resource usage; RUSAGE_CHILDREN would be the
    maximum over every child this process ever had.
    """
    with open(os.devnull, "wb") as devnull:
        started = time.perf_counter()
        child = subprocess.Popen(command, stdout=devnull, env=cli_environment())
        _, status, usage = os.wait4(child.pid, 0)
        seconds = time.perf_counter() - started
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited with {child.returncode}")
    return Measurement("cli (vmstream simulate)", inputs, None, seconds, usage.ru_utime + usage.ru_stime,
                       _maxrss_mib(usage.ru_maxrss))


# ------------------------------------------------------------------------- reporting


def table(rows: list[Measurement], outputs_hint: int | None) -> str:
    header = ("run", "inputs", "outputs", "seconds", "cpu s", "inputs/s", "peak RSS MiB", "≥10k/s", "<1GiB")
    body = []
    for m in rows:
        outputs = f"{m.outputs:,}" if m.outputs is not None else (f"{outputs_hint:,}*" if outputs_hint else "?")
        rss = f"{m.peak_rss_mib:,.0f}" if m.peak_rss_mib is not None else "?"
        body.append((m.run, f"{m.inputs:,}", outputs, f"{m.seconds:.2f}", f"{m.cpu_seconds:.2f}", f"{m.rate:,.0f}", rss,
                     kit.yes(m.fast_enough), kit.yes(m.small_enough)))
    lines = kit.render(header, body)
    lines.append("seconds and inputs/s are wall clock (best run); cpu s is user + system time of that run")
    if any(m.outputs is None for m in rows):
        lines.append("* the CLI writes to /dev/null; its output count is the in-process one "
                     "(simulate is deterministic)")
    return "\n".join(lines)


def _counter_lines(counter: Counter[str], total: int) -> Iterator[str]:
    for name, n in sorted(counter.items(), key=lambda item: (-item[1], item[0])):
        yield f"  {name:<28} {n:>8,}  {100 * n / total:5.1f} %"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=10_000, help="VMs in the AZ (default 10,000)")
    parser.add_argument("--nodes", type=int, default=1_000, help="nodes, 20%% with GPUs (default 1,000)")
    parser.add_argument("--events", type=int, default=100_000, help="input lines in total (default 100,000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the generator (default 1)")
    parser.add_argument("--events-per-drain", type=int, default=EVENTS_PER_DRAIN, metavar="N",
                        help=f"a drain every N input lines, as far as nodes are free for one "
                             f"(default {EVENTS_PER_DRAIN:,}; 100: 1 %% drains)")
    parser.add_argument("--out", type=Path, help="where to write the JSONL input (default: a temp dir, removed)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each measurement N times and keep the fastest (for a busy machine)")
    parser.add_argument("--skip-cli", action="store_true", help="measure in process only")
    parser.add_argument("--profile", type=int, nargs="?", const=25, default=0, metavar="N",
                        help="profile the in-process run with cProfile and print the top N functions")
    parser.add_argument("--profile-out", type=Path, help="also dump the cProfile stats there (pstats format)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    kit.add_json_option(parser)
    kit.add_small_option(parser, vms=1_000, nodes=110, events=5_000)
    return kit.parse(parser, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    kit.print_load("at the start")
    with tempfile.TemporaryDirectory(prefix="vmstream-bench-") as tmp:
        inputs_path = args.out or Path(tmp) / "simulate-input.jsonl"
        inputs_path.parent.mkdir(parents=True, exist_ok=True)
        config = inputs_path.with_name(inputs_path.stem + ".config.yaml")
        write_config(config)

        started = time.perf_counter()
        mix = generate(inputs_path, vms=args.vms, nodes=args.nodes, events=args.events, seed=args.seed,
                       events_per_drain=args.events_per_drain)
        inputs = count_lines(inputs_path)
        size_mib = inputs_path.stat().st_size / 2**20
        print(f"generated {inputs:,} input lines ({size_mib:,.1f} MiB) in "
              f"{time.perf_counter() - started:.1f} s (not timed): {args.vms:,} VMs, {args.nodes:,} nodes, "
              f"seed {args.seed}")
        print(f"  input  {inputs_path}\n  config {config}")
        print("input mix:")
        print("\n".join(_counter_lines(mix, inputs)))

        profiler = cProfile.Profile() if args.profile or args.profile_out else None
        runs = [measure_in_process(config, inputs_path, inputs, profiler) for _ in range(max(1, args.repeat))]
        in_process, sink = min(runs, key=lambda run: run[0].seconds)
        in_process.peak_rss_mib = max(run[0].peak_rss_mib or 0.0 for run in runs) or None
        rows = [in_process]
        command = cli_command(config, inputs_path)
        if not args.skip_cli:
            cli_runs = [measure_cli(command, inputs) for _ in range(max(1, args.repeat))]
            best = min(cli_runs, key=lambda m: m.seconds)
            best.peak_rss_mib = max(m.peak_rss_mib or 0.0 for m in cli_runs) or None
            rows.append(best)

        print("outputs by topic (in process):")
        print("\n".join(_counter_lines(sink.by_topic, max(1, sink.lines))))
        print(f"  {sink.bytes / 2**20:,.1f} MiB of output")
        print(f"code measured: {code_root()}")
        if not args.skip_cli:
            print(f"cli: PYTHONPATH={code_root()} {' '.join(command)} > /dev/null")
        print()
        print(table(rows, sink.lines))

        if profiler is not None:
            if args.profile_out:
                profiler.dump_stats(args.profile_out)
            if args.profile:
                for order in ("tottime", "cumulative"):
                    print(f"\ncProfile of the in-process run, top {args.profile} by {order}:")
                    pstats.Stats(profiler, stream=sys.stdout).sort_stats(order).print_stats(args.profile)
        kit.print_load("at the end")
        kit.write_json(args.json, {"rows": [{"run": m.run, "inputs": m.inputs, "seconds": m.seconds,
                                             "cpu_seconds": m.cpu_seconds, "rate": m.rate, "peak_rss_mib": m.peak_rss_mib}
                                            for m in rows]})
        missed = [m for m in rows if not m.fast_enough or m.small_enough is False]
        return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
