"""Spans exported by the real processes over OTLP/HTTP (streams/common/spans.py): a worker
and ``vmstream notify``, started with ``OTEL_EXPORTER_OTLP_ENDPOINT``, send their spans to a
receiver written here (127.0.0.1, protobuf decoded with opentelemetry-proto), and one traced
intent arrives as one trace: route → decide → the command's and the notification's sends →
notify → the webhook's delivery, whose span the webhook's ``traceparent`` names. The applier's
apply span is checked in process (tests/test_spans.py)."""

from __future__ import annotations

import gzip
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from handlers.contracts.tracing import parse_traceparent
from harness.running import CONFIG, Deployment, VmstreamProcess, WorkerProcess
from tests.kafka.test_cloudevents import CLUSTER, TRACE_ID, Records, send, set_gpu

pytestmark = pytest.mark.kafka

PUBLISHER_SPAN = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP trace receiver and a webhook, on one loopback port."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.hooks: list[dict[str, str]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path == "/v1/traces":
                    receiver.take(body)
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.end_headers()
                    return
                with receiver.lock:
                    receiver.hooks.append({k.lower(): v for k, v in self.headers.items()})
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource in request.resource_spans:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            for scope in resource.scope_spans:
                for span in scope.spans:
                    with self.lock:
                        self.spans.append({
                            "service": service, "name": span.name, "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(), "parent": span.parent_span_id.hex() or None,
                            "attributes": {a.key: a.value.string_value or a.value.int_value
                                           for a in span.attributes},
                        })

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = Receiver()
    yield running
    running.close()


def eventually(condition: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.2)
    return found


def test_one_intent_is_one_trace_across_the_worker_and_notify(
    kafka_bootstrap: str, tmp_path: Path, receiver: Receiver
) -> None:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    deployment.create_topics()
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"}
    worker = WorkerProcess(deployment, "w1", env=otel)
    notify = VmstreamProcess(deployment, "n1", ["notify", "--config", str(CONFIG)])
    notify.env = {**otel, "VMSTREAM_PROBE_PORT": str(notify.web_port),
                  "VMSTREAM_NOTIFY__ENDPOINTS": json.dumps({"hooks": {"url": f"{receiver.url}/hooks"}}),
                  "VMSTREAM_NOTIFY__ROUTES": json.dumps([{"types": ["gpu_change_pending_restart"],
                                                           "to": ["webhook:hooks"]}])}
    records = Records(deployment)
    try:
        worker.start()
        notify.start()
        deployment.publish_lines(CLUSTER)
        events = [json.loads(line)["value"]["event_id"] for line in CLUSTER]
        records.wait_for("the cluster's events decided", lambda: all(records.audits(e) for e in events))
        send(deployment, "vm/spx-proj-b/dev-1", json.dumps(set_gpu("it-otlp", "dev-1", "nvidia-rtx-pro-6000-bse")).encode(),
             [("traceparent", f"00-{TRACE_ID}-{PUBLISHER_SPAN}-01".encode())])
        [hook] = eventually(lambda: [h for h in receiver.hooks if TRACE_ID in h.get("traceparent", "")],
                            "webhook call in the intent's trace")

        def every_step() -> list[dict[str, Any]] | None:
            with receiver.lock:
                found = [s for s in receiver.spans if s["trace_id"] == TRACE_ID]
            wanted = ("route", "decide intent", "send", "notify gpu_change_pending_restart", "deliver webhook")
            return found if all(any(s["name"].startswith(w) for s in found) for w in wanted) else None

        spans = eventually(every_step, "spans of every step", timeout=30)
    finally:
        records.close()
        assert notify.stop() == 0, notify.tail()
        assert worker.stop() == 0, worker.tail()

    by_name = {s["name"]: s for s in spans}
    route, decide = by_name["route"], by_name["decide intent"]
    assert route["service"] == decide["service"] == "vmstream-worker"
    assert route["parent"] == PUBLISHER_SPAN and decide["parent"] == route["span_id"]
    sends = {s["attributes"]["messaging.message.id"]: s for s in spans if s["name"].startswith("send")}
    assert {s["parent"] for s in sends.values()} == {decide["span_id"]}
    assert any("commands" in s["name"] for s in sends.values())
    notified = by_name["notify gpu_change_pending_restart"]
    assert notified["service"] == "vmstream-notify"
    assert notified["parent"] in {s["span_id"] for s in sends.values()}
    assert sends[notified["attributes"]["vmstream.notification"]]["span_id"] == notified["parent"]
    delivered = by_name["deliver webhook"]
    assert delivered["parent"] == notified["span_id"]
    told = parse_traceparent(hook["traceparent"])  # what the webhook is told
    assert told is not None and told.span_id == delivered["span_id"]
