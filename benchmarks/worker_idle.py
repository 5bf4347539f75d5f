"""What does an idle worker cost? CPU of a ready ``vmstream worker`` with nothing to decide.

A worker on a fresh deployment is started, waits until ``/ready``, settles for a few
seconds, and its CPU time (user + system, all threads) is read over ``--seconds``. Run it
with ``VMSTREAM_WORKER__FETCH_IDLE_WAIT_MS`` set to compare fetch pacings.

    .venv/bin/python benchmarks/worker_idle.py [--seconds 10] [--runs 2]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)
from kit import cpu_of  # noqa: E402

from harness.running import WorkerProcess  # noqa: E402


def idle_share(bootstrap: str, seconds: float, settle: float) -> float:
    """Share of one core the idle worker used over ``seconds``."""
    with tempfile.TemporaryDirectory() as tmp:
        deployment = kit.new_deployment(bootstrap, Path(tmp))
        worker = WorkerProcess(deployment, "idle").start()
        try:
            worker.wait_ready(120)
            time.sleep(settle)  # the start-up's own work (first collection, commits) is done
            assert worker.process is not None
            pid = worker.process.pid
            cpu0, t0 = cpu_of(pid), time.monotonic()
            time.sleep(seconds)
            return (cpu_of(pid) - cpu0).total / (time.monotonic() - t0)
        finally:
            worker.stop()
            deployment.delete_topics()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="idle seconds measured")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds waited after /ready")
    parser.add_argument("--runs", type=int, default=2)
    kit.add_small_option(parser, seconds=3.0, settle=1.0, runs=1)
    args = kit.parse(parser, argv)
    pacing = os.environ.get("VMSTREAM_WORKER__FETCH_IDLE_WAIT_MS", "default")
    with ExitStack() as stack:
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        for run in range(1, args.runs + 1):
            share = idle_share(bootstrap, args.seconds, args.settle)
            print(f"run {run}: idle worker used {100 * share:.1f} % of a core over {args.seconds:.0f} s "
                  f"(fetch_idle_wait_ms {pacing}; {kit.load_average()})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
