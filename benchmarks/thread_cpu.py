"""CPU of each thread of a running process between two lines of a benchmark's output.

Why this exists: "the applier's CPU per command" (apply_rate.py) is one number for a process
of a dozen threads — the API calls' pool, the poll loop, the Kafka clients' I/O threads, the
watched copy. This splits it, from ``/proc/<pid>/task/<tid>/stat`` (user + system), between
the first line of ``--log`` that contains ``--start`` and the first that contains ``--end``.
Python does not name its threads for the OS, so the names come from ``py-spy dump``
(``pip install py-spy`` into the venv; without it threads are shown by id). Pool threads
(``apply_0`` … ``apply_7``) are summed as ``apply_N``.

    .venv/bin/python benchmarks/apply_rate.py > /tmp/apply.txt &
    .venv/bin/python benchmarks/thread_cpu.py --match "apply --config" --exclude-env VMSTREAM_APPLY__CACHE \\
        --log /tmp/apply.txt --start "round 1" --end "paced:" --per 600
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def find(match: str, exclude_env: str | None, timeout: float) -> int:
    """The pid of the first process whose command line holds ``match`` (and whose
    environment lacks ``exclude_env``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if match in command and not (exclude_env and any(v.startswith(exclude_env.encode() + b"=") for v in environ)):
                return int(entry.name)
        time.sleep(0.2)  # polling /proc for the process to appear
    raise TimeoutError(f"no process matching {match!r} in {timeout:.0f}s")


def wait_for_line(log: Path, text: str) -> None:
    while not (log.exists() and text in log.read_text(errors="replace")):
        time.sleep(0.1)  # polling the benchmark's output


def thread_times(pid: int) -> dict[str, float]:
    """Thread id → CPU seconds so far."""
    times: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        times[task.name] = (int(fields[11]) + int(fields[12])) / TICKS
    return times


def thread_names(pid: int) -> dict[str, str]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        return {}
    dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, check=False).stdout
    return {tid: name for tid, name in re.findall(r'Thread (\d+) \(\w+\): "([^"]*)"', dump)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", required=True, help="text of the process's command line")
    parser.add_argument("--exclude-env", help="skip processes whose environment sets this variable")
    parser.add_argument("--log", type=Path, required=True, help="the benchmark's output")
    parser.add_argument("--start", required=True, help="start counting at the first line holding this")
    parser.add_argument("--end", required=True, help="stop at the first line holding this")
    parser.add_argument("--per", type=int, help="also show ms per unit of work (e.g. commands applied)")
    args = parser.parse_args()
    pid = find(args.match, args.exclude_env, timeout=600)
    wait_for_line(args.log, args.start)
    before, names = thread_times(pid), thread_names(pid)
    wait_for_line(args.log, args.end)
    after = thread_times(pid)
    names.update(thread_names(pid))  # pool threads started meanwhile
    spent: Counter[str] = Counter()
    for tid, seconds in after.items():
        name = re.sub(r"_\d+$", "_N", names.get(tid, f"thread {tid}"))
        spent[name] += seconds - before.get(tid, 0.0)
    total = sum(spent.values())
    print(f"pid {pid}: {total:.2f} s of CPU between {args.start!r} and {args.end!r}")
    for name, seconds in spent.most_common():
        per = f"   {1000 * seconds / args.per:5.2f} ms per unit" if args.per else ""
        print(f"  {seconds:7.2f} s  {100 * seconds / total if total else 0:5.1f} %  {name}{per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
