"""Faults while intents flow, at benchmark size: what is lost, what changed its content.

A broker of its own (``LocalKafka``, kept data) and one worker. The AZ of
``tests/support/chaos.py`` is decided, then its set_gpu intents (with GPU VMIs arriving and
drains whose deadlines fire) are published at a steady rate (slow enough that the faults all
strike while they flow) while faults strike at random moments, in a shuffled order:

- ``kill``: the worker is killed with SIGKILL and started again;
- ``row``: the worker is replaced by one that dies (``os._exit``) right after the n-th
  table row of an intent's decision has reached the broker, n random in 1..50
  (``tests/support/crashpoints/sitecustomize.py``): a decision's rows half written;
- ``broker``: the broker is stopped and started again on its data, down for 2–5 s.

A worker that exits is started again (as Kubernetes would). At the end, a reader of its own
(kafka-python) counts the intents without an audit record (lost) and the command,
notification and audit ids seen with two different contents. Also printed: how long after
each SIGKILL the first intent published after the kill was audited (recovery).

    .venv/bin/python benchmarks/faults.py            # 3,000 intents, 8 kills, 4 row crashes, 2 broker restarts
    .venv/bin/python benchmarks/faults.py --small    # 300 intents, 2 kills, 1 row crash, 1 broker restart
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import kit  # noqa: E402  (this directory's; first: quiets kafka-python's import)

from harness.localkafka import LocalKafka, free_ports  # noqa: E402  (a broker of its own, restarted on purpose)
from harness.running import WorkerProcess  # noqa: E402
from tests.support.chaos import Ledger, Publisher, Workload, with_faults, worker_env  # noqa: E402


def run(*, vms: int, kills: int, row_crashes: int, outages: int, rate: float, seed: int) -> dict[str, object]:
    chance = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="vmstream-faults-") as tmp:
        kafka = LocalKafka(data_dir=Path(tmp) / "broker", keep_data=True, port=free_ports(1)[0])
        kafka.start()
        deployment = kit.new_deployment(kafka.bootstrap_servers, Path(tmp))
        ledger, publisher = Ledger(deployment), Publisher(deployment)
        workload = Workload(vms=vms, drains=2)
        started = 0
        worker = WorkerProcess(deployment, "w0", env=worker_env()).start()
        restarts = 0
        exits: dict[str, int] = {}  # exit status → how many of the workers that ended by themselves

        def supervise() -> None:
            nonlocal worker, restarts, started
            assert worker.process is not None
            if worker.process.poll() is not None:
                exits[str(worker.process.returncode)] = exits.get(str(worker.process.returncode), 0) + 1
                restarts += 1
                started += 1
                worker = WorkerProcess(deployment, f"w{started}", env=worker_env()).start()

        try:
            setup = workload.setup()
            publisher.publish(setup)
            ledger.wait_until(lambda l: l.event_audits >= len(setup), timeout=300, what="the AZ decided")
            stream = workload.stream()
            intent_at = [(n, value["intent_id"]) for n, (topic, _, value) in enumerate(stream, len(setup))
                         if topic == "intents"]
            began = time.monotonic()
            publisher.start(stream, per_second=rate)
            faults = ["kill"] * kills + ["row"] * row_crashes + ["broker"] * outages
            chance.shuffle(faults)
            recoveries: list[float] = []
            for fault in faults:
                moment = time.monotonic() + chance.uniform(1.0, 3.0)  # a random moment to strike
                ledger.wait_until(lambda l: time.monotonic() >= moment, timeout=60, what="the next fault",
                                  while_waiting=supervise)
                if fault == "kill":
                    later = {ident for n, ident in intent_at if n >= publisher.sent}
                    killed = time.monotonic()
                    worker.stop(signal.SIGKILL)
                    started += 1
                    worker = WorkerProcess(deployment, f"w{started}", env=worker_env()).start()
                    if later and publisher.running:
                        ledger.wait_until(lambda l: any(i in l.audited for i in later), timeout=300,
                                          what="an intent published after the kill audited", while_waiting=supervise)
                        recoveries.append(time.monotonic() - killed)
                elif fault == "row":
                    worker.stop(signal.SIGKILL)
                    started += 1
                    after = str(chance.randint(1, 50))
                    worker = WorkerProcess(deployment, f"w{started}",
                                           env=with_faults(VMSTREAM_TEST_CRASH_AFTER_ROWS=after)).start()
                else:
                    kafka.stop()
                    time.sleep(chance.uniform(2.0, 5.0))  # the outage itself
                    kafka.start()
            publisher.join(timeout=600)
            ledger.wait_until(lambda l: not l.missing(workload.intent_ids), timeout=600,
                              what="every intent audited", while_waiting=supervise)
            took = time.monotonic() - began
            ledger.poll()
            for ident, contents in list(ledger.two_contents().items())[:3]:  # what to look at, if any
                print(f"two contents of {ident}:", *contents, sep="\n  ", file=sys.stderr)
            return {
                "seed": seed,
                "intents": len(workload.intent_ids),
                "kills": kills,
                "row_crashes": row_crashes,
                "broker_restarts": outages,
                "worker_exits_restarted": restarts,
                "worker_exit_statuses": exits,  # 86: a row crash fired (tests/support/crashpoints/sitecustomize.py)
                "lost": len(ledger.missing(workload.intent_ids)),
                "ids_with_two_contents": len(ledger.two_contents()),
                "records_read": ledger.records,
                "distinct_ids": len(ledger.contents),
                "seconds": round(took, 1),
                "recovery_after_kill_s": {
                    "runs": len(recoveries),
                    "median": round(statistics.median(recoveries), 1) if recoveries else None,
                    "max": round(max(recoveries), 1) if recoveries else None,
                },
                "broker_port_kept": kafka.bootstrap_servers == deployment.bootstrap,
            }
        finally:
            worker.stop()
            publisher.close()
            ledger.close()
            kafka.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="300 intents, 2 kills, 1 row crash, 1 broker restart")
    parser.add_argument("--seed", type=int, default=None)
    kit.add_json_option(parser)
    args = parser.parse_args()
    kit.print_load("at the start")
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    if args.small:
        figures = run(vms=100, kills=2, row_crashes=1, outages=1, rate=10, seed=seed)
    else:
        figures = run(vms=1000, kills=8, row_crashes=4, outages=2, rate=20, seed=seed)
    print(json.dumps(figures, indent=2))
    kit.print_load("at the end")
    kit.write_json(args.json, figures)


if __name__ == "__main__":
    main()
