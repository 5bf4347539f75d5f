"""Does a restarted worker decide every intent that waited for it? (It must; before
``streams/worker/faustfixes.py`` it sometimes did not — see ``benchmarks/README.md``.)

A worker decides a small AZ and stops; N ``set_gpu`` intents on three observed VMs are
published while no worker runs; a second worker (same app id, its predecessor's committed
offsets) starts. Prints how many of the N intents have an audit record within the window.

    .venv/bin/python benchmarks/restart_backlog.py [--intents 5000] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import kit  # noqa: E402  (this directory's: puts the repository on sys.path)

from harness.publishing import publish  # noqa: E402
from harness.running import Outputs, WorkerProcess  # noqa: E402
from harness.scenarios import cluster  # noqa: E402

VMS = ("train-1", "batch-1", "web-1")


def one_run(bootstrap: str, count: int, window: float) -> int:
    """How many of ``count`` waiting intents a restarted worker decided within ``window``."""
    deployment = kit.new_deployment(bootstrap, Path(tempfile.mkdtemp(prefix="vmstream-backlog-")))
    outputs = Outputs(deployment)
    first = WorkerProcess(deployment, "w1").start()
    lines = list(cluster().jsonl())
    try:
        deployment.publish_lines(lines)
        outputs.wait_for(lambda o: len(o.seen["audit"]) >= len(lines), timeout=120, what="the AZ decided")
    finally:
        first.stop()
    now = int(time.time() * 1000)
    records = []
    for i in range(count):
        name = VMS[i % len(VMS)]
        value = {"intent_id": f"backlog-{i}", "type": "set_gpu", "requested_by": "alice@example.com",
                 "project": "proj-a",
                 "spec": {"namespace": "spx-proj-a", "name": name, "gpu_class": None if i % 2 else "nvidia-a100"}}
        records.append((deployment.kafka.topic("intents"), f"vm/spx-proj-a/{name}", json.dumps(value).encode(), now))
    publish(deployment.kafka, records)
    second = WorkerProcess(deployment, "w2").start()

    def decided(o: Outputs) -> int:
        return len({a["input"]["ref"] for a in o.seen["audit"] if a["input"]["ref"].startswith("backlog-")})

    try:
        outputs.wait_for(lambda o: decided(o) >= count, timeout=window, what="every waiting intent")
    except AssertionError:
        pass
    finally:
        second.stop()
        outputs.close()
    return decided(outputs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intents", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--window", type=float, default=90.0, help="seconds a run waits for the audits")
    kit.add_json_option(parser)
    kit.add_small_option(parser, intents=500, runs=1)
    args = kit.parse(parser)
    kit.print_load("at the start")
    with ExitStack() as stack:
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        results = [one_run(bootstrap, args.intents, args.window) for _ in range(args.runs)]
    for number, got in enumerate(results, start=1):
        print(f"run {number}: {got} of {args.intents} waiting intents decided"
              + ("" if got == args.intents else f"  ({args.intents - got} MISSING)"))
    kit.print_load("at the end")
    kit.write_json(args.json, {"intents": args.intents, "decided": results})
    return 0 if all(got == args.intents for got in results) else 1


if __name__ == "__main__":
    sys.exit(main())
