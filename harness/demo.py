"""``python -m harness demo``: vmstream on a local Kafka broker, with a realistic scenario.

It starts a broker (Kafka's own jars, no Docker) and, by default, a local kube-apiserver
with the watch bridge and the applier in the loop (:mod:`harness.demo_kubernetes`). With
``--kafka-only`` the worker alone runs and the cluster's state comes as scripted watch
events (:func:`~harness.scenarios.demo_phases`). Every notification, command and result is
printed as it arrives, and so is every mail ``vmstream notify`` delivers to the demo's SMTP
sink; ``vmstream api``'s console view is printed once bob's GPU change waits for its restart
(:mod:`harness.demo_people`). Everything the demo started is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TextIO

from handlers.contracts.topics import AUDIT, COMMAND_RESULTS, COMMANDS, DLQ, NOTIFICATIONS
from harness import demo_kubernetes
from harness.demo_people import ApiProcess, Console, MailSink, NotifyProcess, mails_due, start_together
from harness.localkafka import LocalKafka
from harness.publishing import publish, scenario_records
from harness.running import Deployment, Outputs, WorkerProcess
from harness.scenarios import demo_phases
from samples.cluster import EXAMPLE_CONFIG
from streams.cli.tailing import render
from streams.common.credentials import DevSigner

Expectation = Callable[[Outputs], bool]


def _expectations(notice_seconds: int) -> list[tuple[str, Expectation]]:
    """What must have come out after each phase before the next one is played."""

    def audited(count: int) -> Expectation:
        return lambda o: len(o.seen[AUDIT.name]) >= count

    def told(type_: str, count: int = 1) -> Expectation:
        return lambda o: len(o.notifications(type_)) >= count

    def commanded(type_: str, count: int = 1) -> Expectation:
        return lambda o: len(o.commands(type_)) >= count

    return [
        ("all watch events decided", audited(16)),
        ("the owner told the GPU waits for a restart", told("gpu_change_pending_restart")),
        ("a restart command", commanded("restart_vm")),
        ("the restart observed", audited(21)),
        ("every GPU VM owner on gpu-node-1 told, and the deadline's stops",
         lambda o: told("drain_will_stop_gpu_vm", 2)(o) and commanded("delete_vmi", 2)(o)),
        ("the operator told the drain is complete", told("drain_completed")),
    ]


class Printer:
    """Prints each output as one readable line, the way ``vmstream tail`` does."""

    LABELS = {NOTIFICATIONS.name: "notify ", COMMANDS.name: "command", COMMAND_RESULTS.name: "result ",
              AUDIT.name: "audit  ", DLQ.name: "dead   "}

    def __init__(self, out: TextIO, *, show_audit: bool) -> None:
        self.out = out
        self.show_audit = show_audit

    def __call__(self, topic: str, value: bytes) -> None:
        if topic == "audit" and not self.show_audit:
            return
        self.out.write(f"  {self.LABELS[topic]} {render(topic, value)}\n")
        self.out.flush()


def run(out: TextIO, *, kubernetes: bool, notice_seconds: int, show_audit: bool, timeout: float) -> int:
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="vmstream-demo-")))
        bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
        if not bootstrap:
            out.write("starting a local Kafka broker (jars from Maven Central, cached)...\n")
            bootstrap = stack.enter_context(LocalKafka()).bootstrap_servers
        printer = Printer(out, show_audit=show_audit)
        started = time.monotonic()
        if kubernetes:
            outputs = demo_kubernetes.run(out, stack, workdir, bootstrap, printer,
                                          notice_seconds=notice_seconds, timeout=timeout)
        else:
            outputs = _run_on_kafka(out, stack, workdir, bootstrap, printer,
                                    notice_seconds=notice_seconds, timeout=timeout)
        counts = ", ".join(f"{len(values)} {name}" for name, values in outputs.seen.items())
        out.write(f"\ndone in {time.monotonic() - started:.1f}s: {counts}\n")
    return 0


def _run_on_kafka(out: TextIO, stack: ExitStack, workdir: Path, bootstrap: str, printer: Printer, *,
                  notice_seconds: int, timeout: float) -> Outputs:
    """Kafka only: what Kubernetes would show after each command comes from a script."""
    deployment = Deployment(bootstrap, workdir)
    deployment.create_topics()
    out.write(f"broker {bootstrap}; topics {deployment.kafka.topic('*')}; starting the worker...\n")
    # The worker verifies credentials (auth: jwt); the demo signs as an upstream service does.
    signer = DevSigner(workdir, operators=EXAMPLE_CONFIG["operators"])  # type: ignore[arg-type]
    worker = WorkerProcess(deployment, "worker", env=signer.worker_env()).start()
    stack.callback(worker.stop)
    sink = stack.enter_context(MailSink(out))
    notify = NotifyProcess(deployment, sink)
    api = ApiProcess(deployment)
    start_together(stack, [notify, api])
    outputs = Outputs(deployment, on_arrival=printer)
    stack.callback(outputs.close)
    out.write(f"worker ready: http://127.0.0.1:{worker.web_port}/ready, /metrics, /capacity; "
              f"intents signed with a key made now (kid {signer.key.kid}, docs/auth.md)\n")
    out.write(f"notify delivering to an SMTP sink on 127.0.0.1:{sink.port}; console API {api.url}/v1/…\n")
    console = Console(api, outputs, out)
    phases = demo_phases(notice_seconds)
    for (title, script), (waiting_for, expected) in zip(phases, _expectations(notice_seconds), strict=True):
        out.write(f"\n== {title}\n")
        publish(deployment.kafka, signer.sign_records(scenario_records(script.jsonl(), shift_to_now=True)))
        wait = timeout + (notice_seconds if "deadline" in waiting_for else 0)

        def arrived(o: Outputs, done: Expectation = expected) -> bool:
            return done(o) and sink.count() >= mails_due(o)

        outputs.wait_for(arrived, timeout=wait, what=f"{waiting_for}, and its mail delivered")
        if script.prefix == "demo-patched":  # the template shows the GPU: what bob's console shows
            console.show_badge("spx-proj-b", "dev-1", timeout)
            console.show_classes()
    return outputs


def main(args: argparse.Namespace) -> int:
    return run(sys.stdout, kubernetes=not args.kafka_only, notice_seconds=args.notice_seconds,
               show_audit=args.audit, timeout=args.timeout)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser("demo", help="the worker on a local Kafka broker, with a realistic scenario")
    demo.add_argument("--notice-seconds", type=int, default=10, help="the drain's notice (default 10)")
    demo.add_argument("--kafka-only", action="store_true",
                      help="no API server: the cluster's reactions come from a script (no Go build needed)")
    demo.add_argument("--audit", action="store_true", help="print audit records too")
    demo.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for each phase")
    demo.set_defaults(handler=main)
