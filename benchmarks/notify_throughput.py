"""How fast ``vmstream notify`` delivers: throughput over a backlog, latency at a steady rate.

What it does: on a local Kafka broker (or ``KAFKA_BOOTSTRAP_SERVERS``), in an isolated topic
set, it starts an SMTP server (aiosmtpd) and a webhook receiver (``http.server``) on
127.0.0.1 and ``vmstream notify`` as its own process. Each notification goes to one owner
by e-mail (``--owners`` distinct addresses) and, by a route, to the webhook as a CloudEvent:
two deliveries, each recorded in the ledger.

1. backlog: ``--backlog`` notifications published before notify starts; deliveries per
   second from the first to the last one received.
2. steady: ``--count`` notifications at ``--rate`` per second; latency from each
   notification's ``at`` to its arrival at the webhook receiver (p50, p90, p99, max).
3. anchor: the backlog's deliveries again from a plain client (``smtplib`` and ``urllib``,
   one at a time, one SMTP connection), to the same server and receiver: deliveries/s.

Rate limits are lifted (this measures delivery, not the limits). Run from the repository root::

    .venv/bin/python benchmarks/notify_throughput.py                   # 300 backlog, 200 at 20/s
    .venv/bin/python benchmarks/notify_throughput.py --backlog 2000 --count 1000 --rate 50
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import smtplib
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kit  # noqa: E402  (this directory's; first: it puts the repository on sys.path)
from kit import REPO  # noqa: E402

from harness.localkafka import free_ports  # noqa: E402

import yaml  # noqa: E402  # isort: skip
from aiosmtpd.controller import Controller  # noqa: E402

from handlers.contracts.messages import Notification, ObjectRef  # noqa: E402
from streams.common.durable import DurableProducer, Record  # noqa: E402
from streams.common.settings import Settings, read_yaml  # noqa: E402
from streams.serve.notify import ensure_ledger  # noqa: E402


class Sink:
    """Arrival times by notification id, for mails and webhook calls."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.mails: dict[str, float] = {}
        self.hooks: dict[str, float] = {}

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
        now = time.time()
        for line in bytes(envelope.content).splitlines():
            if line.startswith(b"X-Vmstream-Notification-Id: "):
                with self.lock:
                    self.mails.setdefault(line.split(b": ", 1)[1].decode(), now)
        return "250 OK"

    def server(self) -> ThreadingHTTPServer:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                now = time.time()
                with sink.lock:
                    sink.hooks.setdefault(json.loads(body)["id"], now)
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        return server


def notification(index: int, owners: int) -> Notification:
    return Notification(
        notification_id=f"ntf-{uuid.uuid4().hex}", type="drain_will_stop_gpu_vm",
        recipients=[f"owner-{index % owners}@example.com"], project="proj-a",
        subject=ObjectRef(kind="VirtualMachine", namespace="spx-proj-a", name=f"vm-{index}"), severity="warning",
        message=f"Node gpu-node-1 is being drained (firmware upgrade): GPU VM spx-proj-a/vm-{index} will be stopped.",
        deadline=datetime.now(UTC), at=datetime.now(UTC),
    )


def plain_client(sink: Sink, smtp_port: int, hook_url: str, count: int, owners: int) -> float:
    """The anchor: ``count`` notifications delivered by mail and webhook from a plain client;
    deliveries per second, from the first received to the last."""
    ids = [f"anchor-{index}" for index in range(count)]
    with smtplib.SMTP("127.0.0.1", smtp_port) as smtp:
        for index, nid in enumerate(ids):
            smtp.sendmail("vmstream@example.com", [f"owner-{index % owners}@example.com"],
                          f"X-Vmstream-Notification-Id: {nid}\r\nSubject: GPU VM {index} will be stopped\r\n\r\n"
                          f"Node gpu-node-1 is being drained.\r\n")
            request = urllib.request.Request(hook_url, data=json.dumps({"id": nid}).encode(),
                                             headers={"Content-Type": "application/json"})
            urllib.request.urlopen(request, timeout=10).close()
    wait_for(lambda: all(nid in sink.mails and nid in sink.hooks for nid in ids), "the anchor's deliveries", 60)
    with sink.lock:
        arrivals = sorted([*(sink.mails[nid] for nid in ids), *(sink.hooks[nid] for nid in ids)])
    return len(arrivals) / max(arrivals[-1] - arrivals[0], 1e-9)


def wait_for(condition: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backlog", type=int, default=300)
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--owners", type=int, default=50)
    kit.add_small_option(parser, backlog=30, count=20, rate=10.0, owners=5)
    args = kit.parse(parser)

    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        bootstrap = stack.enter_context(kit.broker()).bootstrap
        sink = Sink()
        [smtp_port, probe_port] = free_ports(2)
        controller = Controller(sink, hostname="127.0.0.1", port=smtp_port)
        controller.start()
        stack.callback(controller.stop)
        http = sink.server()
        threading.Thread(target=http.serve_forever, daemon=True).start()
        stack.callback(http.shutdown)

        config = read_yaml(REPO / "examples" / "config.yaml")
        config["kafka"] = {"bootstrap_servers": bootstrap, "topic_prefix": f"b{uuid.uuid4().hex[:8]}."}
        config["notify"] = {
            "smtp": {"host": "127.0.0.1", "port": smtp_port, "security": "none"},
            "endpoints": {"hooks": {"url": f"http://127.0.0.1:{http.server_address[1]}/hooks"}},
            "routes": [{"to": ["webhook:hooks"]}],
            "rate_limit": {"per_second": 1e6, "burst": 1000000},
            "group_id": f"bench-{uuid.uuid4().hex[:8]}",
        }
        settings = Settings(**config)
        ensure_ledger(settings)
        (workdir / "config.yaml").write_text(yaml.safe_dump(config))
        out = DurableProducer(settings.kafka, client_id="bench-notify", linger_ms=5)
        stack.callback(out.close)
        topic = settings.kafka.topic("notifications")

        def record(index: int, value: Notification) -> Record:
            return Record(topic, f"vm/spx-proj-a/vm-{index}".encode(), value.model_dump_json().encode())

        out.send_all([record(index, notification(index, args.owners)) for index in range(args.backlog)])
        print(f"backlog of {args.backlog} notifications published ({2 * args.backlog} deliveries)")

        log = open(workdir / "notify.log", "wb")  # noqa: SIM115 — closed by the stack
        stack.callback(log.close)
        started = time.time()
        process = subprocess.Popen(
            [sys.executable, "-m", "streams.serve.notify", "notify", "--config", str(workdir / "config.yaml"),
             "--probe-port", str(probe_port)],
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )

        def stop() -> None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

        stack.callback(stop)
        wait_for(lambda: len(sink.hooks) >= args.backlog and len(sink.mails) >= args.backlog,
                 "the backlog's deliveries", timeout=600 + args.backlog)
        with sink.lock:
            arrivals = sorted([*sink.hooks.values(), *sink.mails.values()])
        first, last = arrivals[0], arrivals[-1]
        print(f"process start to first delivery: {first - started:.1f} s")
        backlog_rate = len(arrivals) / max(last - first, 1e-9)
        print(f"backlog: {len(arrivals)} deliveries in {last - first:.2f} s: {backlog_rate:.0f} deliveries/s "
              f"({backlog_rate / 2:.0f} notifications/s)")

        sent: dict[str, float] = {}
        begin = time.monotonic()
        for n in range(args.count):
            value = notification(args.backlog + n, args.owners)
            due = begin + n / args.rate
            while time.monotonic() < due:
                time.sleep(min(0.002, due - time.monotonic()))  # pacing the publisher, not synchronising
            value = value.model_copy(update={"at": datetime.now(UTC)})
            assert value.at is not None
            sent[value.notification_id] = value.at.timestamp()
            out.send_all([record(args.backlog + n, value)])
        wait_for(lambda: all(nid in sink.hooks for nid in sent), "the steady run's webhook calls", timeout=300)
        latencies = sorted((sink.hooks[nid] - at) * 1000 for nid, at in sent.items())
        print(f"steady {args.rate:g}/s, {args.count} notifications: notification time → webhook received: "
              + kit.summary_ms([ms / 1000 for ms in latencies]))
        anchor = plain_client(sink, smtp_port, f"http://127.0.0.1:{http.server_address[1]}/hooks", args.backlog,
                              args.owners)
        print(kit.table(("the backlog's deliveries", "deliveries/s"), [
            ("anchor: a plain client, one at a time", f"{anchor:,.0f}"),
            ("vmstream notify", f"{backlog_rate:,.0f}")]))
        kit.print_load("at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
