"""docs/howto.md's worked examples (tests/support/extension_example.py) through the shell's own
paths: the project intent through ``vmstream simulate``, the sink through notify's sender to
a local receiver."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from handlers.contracts import topics
from handlers.contracts.delivery import PAYLOADS, Endpoint, targets
from handlers.contracts.messages import Notification, ObjectRef
from handlers.decide.engine import Engine
from samples.cluster import RTX, kubevirt_cr, node, vm
from streams.cli.simulating import Simulation
from streams.common.settings import KafkaSettings, NotifySettings, load_settings
from streams.serve.notify import Senders
from tests.support.extension_example import GOTIFY, RULES_WITH_EXAMPLE

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EVENTS, INTENTS = KafkaSettings().topic(topics.K8S_EVENTS), KafkaSettings().topic(topics.INTENTS)


def event_line(number: int, obj: dict[str, Any]) -> str:
    metadata = obj["metadata"]
    key = "/".join(part for part in (obj["kind"], metadata.get("namespace"), metadata["name"]) if part)
    return json.dumps({"topic": EVENTS, "key": key, "value": {
        "event_id": f"ev-{number}", "type": "ADDED", "kind": obj["kind"], "object": obj,
        "observed_at": "2026-11-30T10:00:00Z"}})


def test_simulate_decides_the_project_intent_registered_with_its_engine() -> None:
    engine = Engine(load_settings(EXAMPLES / "config.yaml").rules(), rules=RULES_WITH_EXAMPLE)
    objects = [kubevirt_cr(), node("gpu-node-1", gpus={RTX: 2}),
               vm("spx-proj-a", "train-1", project="proj-a", gpu=RTX),
               vm("spx-proj-b", "train-1", project="proj-b", gpu=RTX)]
    intent = json.dumps({"topic": INTENTS, "key": "project/proj-a", "value": {
        "intent_id": "detach-1", "type": "detach_project_gpus", "requested_by": "ops@example.com",
        "project": "proj-a", "spec": {"reason": "the project's GPU quota ended"}}})
    lines = [json.loads(line) for line in Simulation(engine).feed(
        [*(event_line(n, obj) for n, obj in enumerate(objects, start=1)), intent])]
    [audit] = [line["value"] for line in lines if line["topic"].endswith(".audit")
               and line["value"]["input"]["ref"] == "detach-1"]
    assert audit["outcome"] == "accepted"
    [command] = [line for line in lines if line["topic"].endswith(".commands")]
    assert command["key"] == "vm/spx-proj-a/train-1" and command["value"]["cause"] == "detach-1"
    assert not [line for line in lines if line["topic"].endswith(".dlq")]


# ------------------------------------------------------------------ a notification sink


class Receiver:
    """An HTTP server on localhost that keeps what is POSTed to it, answering 200."""

    def __init__(self) -> None:
        self.received: list[tuple[str, dict[str, str], dict[str, Any]]] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                receiver.received.append((self.path, dict(self.headers), json.loads(body)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/message"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    served = Receiver()
    thread = threading.Thread(target=served.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        served.server.shutdown()
        served.server.server_close()
        thread.join()


def test_a_registered_sink_is_sent_what_its_entry_makes(receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PAYLOADS, "gotify", GOTIFY)  # the step: its entry in PAYLOADS
    settings = NotifySettings.model_validate({"endpoints": {"phones": {
        "url": receiver.url, "format": "gotify", "headers": {"X-Gotify-Key": "app-token"}}}})
    notification = Notification(
        notification_id="n-1", type="drain_will_stop_gpu_vm", recipients=["webhook:phones"], project="proj-a",
        subject=ObjectRef(kind="VirtualMachine", namespace="spx-proj-a", name="train-1"), severity="critical",
        message="Your VM spx-proj-a/train-1 will be stopped for a node drain.")
    [target] = targets(notification, directory={}, endpoints=settings.endpoints).targets
    Senders(settings).send(target, notification, {}, source="/vmstream/worker")
    [(path, headers, body)] = receiver.received  # send returns once the receiver answered
    assert path == "/message" and headers["Content-Type"] == "application/json"
    assert headers["X-Gotify-Key"] == "app-token"
    assert body == {"title": "[vmstream critical] VirtualMachine spx-proj-a/train-1: will be stopped for a node drain",
                    "message": notification.message, "priority": 8}


def test_an_endpoint_of_a_format_nobody_registered_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown format 'gotify'"):
        Endpoint.model_validate({"url": "http://127.0.0.1/message", "format": "gotify"})
