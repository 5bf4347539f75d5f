"""``vmstream notify`` on a real broker, delivering to a real SMTP server and a real HTTP receiver.

The SMTP server is aiosmtpd on 127.0.0.1, its inbox counted here; the webhooks, the chat
room and the project directory are an ``http.server`` on a thread, which logs every request
and answers as each test scripts it. What notify did is read back from its topics by this
test's own consumer (the ledger ``deliveries``, ``dlq``) and from the consumer group's
committed offsets — never from notify itself.
"""

from __future__ import annotations

import email
import email.message
import email.policy
import io
import json
import os
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from aiosmtpd.controller import Controller

from handlers.contracts.messages import Notification, ObjectRef
from handlers.contracts.tracing import derived_trace, span_id
from harness.processes import free_ports
from streams.common.cloudevents import kafka_headers, trace_of
from streams.common.settings import Settings, read_yaml
from streams.common.topics import DELIVERIES as LEDGER
from streams.serve.notify import Notifier, ensure_ledger
from tests.support.kafka_broker import committed, end_offsets
from tests.support.kafka_io import Record, TopicReader, publish
from tests.support.waiting import eventually, stop

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
DEADLINE = 60.0
T = TypeVar("T")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CE_HEADERS = ("ce_specversion", "ce_id", "ce_type", "ce_source", "ce_time", "content-type", "traceparent")



# ------------------------------------------------------------------------ the receivers


@dataclass
class Inbox:
    """aiosmtpd's handler: every accepted mail, and scripted temporary refusals."""

    mails: list[tuple[list[str], bytes]] = field(default_factory=list)
    refuse_first: dict[str, int] = field(default_factory=dict)  # address → 451s before accepting
    lock: threading.Lock = field(default_factory=threading.Lock)

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802 (aiosmtpd's name)
        with self.lock:
            for address in envelope.rcpt_tos:
                if self.refuse_first.get(address, 0) > 0:
                    self.refuse_first[address] -= 1
                    return "451 4.3.0 try again later"
            self.mails.append((list(envelope.rcpt_tos), bytes(envelope.content)))
        return "250 OK"

    def to(self, address: str) -> list[bytes]:
        with self.lock:
            return [content for rcpts, content in self.mails if address in rcpts]


@pytest.fixture
def inbox() -> Iterator[tuple[Inbox, int]]:
    handler = Inbox()
    [port] = free_ports(1)
    controller = Controller(handler, hostname="127.0.0.1", port=port)
    controller.start()
    try:
        yield handler, port
    finally:
        controller.stop()


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered
    at: float = field(default_factory=time.monotonic)  # when it was answered


class Receiver:
    """Webhooks, chat and the project directory on one ``http.server``.

    ``script[path]`` is the statuses answered in turn (then 200); ``hold`` makes the next
    POST wait until :meth:`release` and then answer the status given there. ``log`` holds
    every request with the answer it got; ``accepted`` the POSTs answered 2xx.
    """

    def __init__(self) -> None:
        self.script: dict[str, list[int]] = {}
        self.directory: dict[str, Any] = {}
        self.log: list[Request] = []
        self.lock = threading.Lock()
        self.holding = threading.Event()  # a POST is being held
        self._hold = False
        self._released = threading.Event()
        self._release_status = 200
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                with receiver.lock:
                    statuses = receiver.script.get(self.path, [])
                    status = statuses.pop(0) if statuses else 200
                    held, receiver._hold = receiver._hold, False
                if held:
                    receiver.holding.set()
                    receiver._released.wait(DEADLINE)
                    status = receiver._release_status
                with receiver.lock:
                    receiver.log.append(Request("POST", self.path, dict(self.headers), body, status))
                self._answer(status, b'{"error": "bad token"}' if status == 400 else b"ok")

            def do_GET(self) -> None:  # noqa: N802
                project = self.path.rsplit("/", 1)[-1]
                found = receiver.directory.get(project)
                with receiver.lock:
                    receiver.log.append(Request("GET", self.path, dict(self.headers), b"", 200 if found else 404))
                self._answer(200 if found is not None else 404, json.dumps(found).encode())

            def _answer(self, status: int, body: bytes) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the sender is gone (killed): it never saw this answer
                    pass

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def hold_next(self) -> None:
        self._hold = True

    def release(self, status: int) -> None:
        self._release_status = status
        self._released.set()

    def posts(self, path: str) -> list[Request]:
        with self.lock:
            return [r for r in self.log if r.method == "POST" and r.path == path]

    def accepted(self, path: str) -> list[Request]:
        return [r for r in self.posts(path) if 200 <= r.status < 300]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    served = Receiver()
    served.thread.start()
    try:
        yield served
    finally:
        served.release(503)
        served.server.shutdown()
        served.server.server_close()


# --------------------------------------------------------------------------- the broker


@dataclass
class Setup:
    settings: Settings
    config: dict[str, Any]
    workdir: Path

    def topic(self, logical: str) -> str:
        return self.settings.kafka.topic(logical)

    def publish(self, notification: Notification, *, key: str = "vm/spx-proj-a/batch-1",
                traceparent: str | None = None, source: str | None = None) -> dict[str, bytes]:
        """A notification on the topic, with a ``traceparent`` if given; with ``source``, with
        the CloudEvents headers its writer gives it (the worker's: ``/vmstream/worker/…``)."""
        headers = {"traceparent": traceparent.encode()} if traceparent else {}
        if source is not None:
            trace = trace_of(list(headers.items()), notification.notification_id)
            headers = kafka_headers(notification, source=source, trace=trace, time=datetime.now(UTC))
        publish(self.settings.kafka, [Record(self.topic("notifications"), key.encode(),
                                             notification.model_dump_json(exclude_none=True).encode(),
                                             list(headers.items()))], timeout=DEADLINE)
        return headers

    def read(self, logical: str, *, with_headers: bool = False) -> list[dict[str, Any]]:
        """Every record of a topic up to its current end, as (key, value); its headers under
        ``_headers`` when asked."""
        topic = self.topic(logical)
        reader = TopicReader(self.settings.kafka, [topic])
        try:
            return [{"key": r.key.decode() if r.key else None, **json.loads(r.value or b""),
                     **({"_headers": {n: v.decode() for n, v in r.headers}} if with_headers else {})}
                    for r in reader.read_to_end(stall=DEADLINE)]
        finally:
            reader.close()

    def all_committed(self) -> bool:
        """notify's group has committed every notification published so far."""
        ends = end_offsets(self.settings.kafka, self.topic("notifications"))
        done = committed(self.settings.kafka, self.settings.notify.group_id)
        return all(end == 0 or done.get(tp, -1) >= end for tp, end in ends.items())

    def config_file(self) -> Path:
        path = self.workdir / "config.yaml"
        path.write_text(yaml.safe_dump(self.config))
        return path


def make_setup(kafka_bootstrap: str, workdir: Path, *, smtp_port: int, receiver: Receiver,
               **notify: Any) -> Setup:
    name = uuid.uuid4().hex[:8]
    config = read_yaml(ROOT / "examples" / "config.yaml")
    config["kafka"] = {"bootstrap_servers": kafka_bootstrap, "topic_prefix": f"t{name}.", "partitions": 2}
    config["notify"] = {
        "smtp": {"host": "127.0.0.1", "port": smtp_port, "security": "none", "sender": "vmstream@az1.example"},
        "endpoints": {"hooks": {"url": f"{receiver.url}/hooks", "headers": {"Authorization": "Bearer hook-token"}},
                      "room": {"url": f"{receiver.url}/chat/room", "format": "slack"}},
        "routes": [{"severity": ["warning", "critical"], "to": ["webhook:hooks"]}],
        "backoff_seconds": 0.05, "backoff_max_seconds": 0.2, "attempts": 4,
        "group_id": f"notify-{name}",
        **notify,
    }
    settings = Settings(**config)
    ensure_ledger(settings)
    return Setup(settings, config, workdir)


@pytest.fixture
def notifier_for() -> Iterator[Callable[[Setup], Notifier]]:
    """Starts ``vmstream notify``'s loop in this process (a thread), ready once it read its ledger."""
    running: list[tuple[threading.Event, threading.Thread]] = []
    failures: list[BaseException] = []

    def start(setup: Setup) -> Notifier:
        notifier = Notifier(setup.settings)
        stop = threading.Event()

        def run() -> None:
            try:
                notifier.run(stop)
            except BaseException as error:  # handed to the test at the end
                failures.append(error)

        thread = threading.Thread(target=run, name="notify", daemon=True)
        thread.start()
        running.append((stop, thread))
        eventually(lambda: notifier.ready.is_set() or failures, "notify to read its ledger")
        assert not failures, failures
        return notifier

    yield start
    for stop, thread in running:
        stop.set()
        thread.join(DEADLINE)
        assert not thread.is_alive(), "notify did not stop"
    assert not failures, failures


def drain_notice(*recipients: str, nid: str | None = None, severity: str = "warning") -> Notification:
    return Notification(
        notification_id=nid or f"ntf-{uuid.uuid4().hex[:12]}", type="drain_will_stop_gpu_vm",
        recipients=list(recipients), project="proj-a",
        subject=ObjectRef(kind="VirtualMachine", namespace="spx-proj-a", name="batch-1"), severity=severity,
        message="Node gpu-node-1 is being drained (firmware upgrade): GPU VM spx-proj-a/batch-1 will be stopped "
                "at 2026-11-30 06:45:58 UTC, and it will stay off until it is started again (run strategy Manual).",
        details={"outcome": "needs_manual_start", "node": "gpu-node-1"},
        deadline=datetime(2026, 11, 30, 6, 45, 58, tzinfo=UTC), at=datetime.now(UTC),
    )


# -------------------------------------------------------------------------------- tests


def test_a_drain_notice_reaches_the_inbox_and_the_webhook_once(
    kafka_bootstrap: str, tmp_path: Path, inbox: tuple[Inbox, int], receiver: Receiver,
    notifier_for: Callable[[Setup], Notifier],
) -> None:
    mails, smtp_port = inbox
    setup = make_setup(kafka_bootstrap, tmp_path, smtp_port=smtp_port, receiver=receiver,
                       directory={"proj-a": ["webhook:room"]})
    notifier_for(setup)
    notice = drain_notice("alice@example.com", "project:proj-a")
    worker = f"/vmstream/worker/{setup.settings.worker.app_id}"
    sent = setup.publish(notice, traceparent=f"00-{TRACE_ID}-00f067aa0ba902b7-01", source=worker)
    setup.publish(notice)  # the worker sent it again (a redelivered decision): same id, no second delivery
    eventually(setup.all_committed, "notify to commit both copies")

    [raw] = mails.to("alice@example.com")
    mail = email.message_from_bytes(raw, policy=email.policy.default)
    assert mail["Subject"] == "[vmstream warning] VirtualMachine spx-proj-a/batch-1: will be stopped for a node drain"
    assert (mail["From"], mail["To"]) == ("vmstream@az1.example", "alice@example.com")
    assert mail["X-Vmstream-Notification-Id"] == notice.notification_id
    assert isinstance(mail, email.message.EmailMessage)
    assert mail.get_content().startswith(notice.message)
    assert len(mails.mails) == 1
    [hook] = receiver.accepted("/hooks")
    assert len(receiver.posts("/hooks")) == 1
    assert hook.headers["Content-Type"].startswith("application/cloudevents+json")
    assert hook.headers["Authorization"] == "Bearer hook-token"
    event = json.loads(hook.body)
    # One identity, whatever carries it: the webhook's event is the Kafka record's.
    assert (event["specversion"], event["id"], event["source"], event["type"], event["time"]) == tuple(
        sent[name].decode() for name in ("ce_specversion", "ce_id", "ce_source", "ce_type", "ce_time"))
    assert (event["id"], event["source"], event["type"]) == (
        notice.notification_id, worker, "io.vmstream.notification.drain_will_stop_gpu_vm")
    assert Notification.model_validate(event["data"]) == notice
    # The notification's trace goes on: as an HTTP header and the CloudEvent's extension attribute.
    traceparent = {name.lower(): value for name, value in hook.headers.items()}["traceparent"]  # any case
    assert traceparent == f"00-{TRACE_ID}-{span_id(f'{notice.notification_id}|webhook|hooks')}-01"
    assert event["traceparent"] == traceparent
    [chat] = receiver.accepted("/chat/room")
    assert len(receiver.posts("/chat/room")) == 1
    assert json.loads(chat.body)["text"].startswith(":warning: Node gpu-node-1 is being drained")
    assert {name.lower(): value for name, value in chat.headers.items()}["traceparent"].split("-")[1] == TRACE_ID

    ledger = setup.read(LEDGER, with_headers=True)
    assert sorted((r["key"], r["outcome"]) for r in ledger) == sorted(
        (f"{notice.notification_id}|{channel}", "delivered")
        for channel in ("email|alice@example.com", "webhook|hooks", "webhook|room"))
    for entry in ledger:  # each ledger record: CloudEvents headers, in the notification's trace
        headers = entry["_headers"]
        assert set(CE_HEADERS) <= set(headers)
        assert (headers["ce_id"], headers["ce_type"]) == (entry["key"], "io.vmstream.delivery")
        assert headers["ce_source"] == "/vmstream/notify/" + setup.settings.worker.app_id
        assert headers["traceparent"] == f"00-{TRACE_ID}-{span_id(entry['key'])}-01"
    assert {e["_headers"]["traceparent"] for e in ledger if e["key"].endswith("|webhook|hooks")} == {traceparent}
    assert setup.read("dlq") == []


def test_delivered_once_across_a_kill_of_notify_mid_delivery(
    kafka_bootstrap: str, tmp_path: Path, inbox: tuple[Inbox, int], receiver: Receiver,
) -> None:
    """kill -9 while the webhook is being called (the mail already sent), started again: the
    mail is not sent twice, and the webhook gets the notification once."""
    mails, smtp_port = inbox
    setup = make_setup(kafka_bootstrap, tmp_path, smtp_port=smtp_port, receiver=receiver)
    config = setup.config_file()
    [probe_port] = free_ports(1)

    def spawn(name: str) -> subprocess.Popen[bytes]:
        log_path = tmp_path / f"{name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "streams.serve.notify", "notify", "--config", str(config),
                 "--probe-port", str(probe_port)],
                env={**os.environ, "PYTHONUNBUFFERED": "1", "VMSTREAM_WORKER__GROUP_INSTANCE_ID": "notify-0"},
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            )

        def ready() -> bool:
            text = log_path.read_text(errors="replace")
            assert process.poll() is None, f"{name} exited {process.returncode}:\n{text[-3000:]}"
            return "notify ready" in text

        eventually(ready, f"{name} to start", timeout=120)
        return process

    processes = [spawn("notify-1")]
    try:
        receiver.hold_next()
        notice = drain_notice("alice@example.com")
        setup.publish(notice)
        eventually(receiver.holding.is_set, "notify to call the webhook")
        assert len(mails.to("alice@example.com")) == 1  # the mail went first
        processes[0].kill()  # SIGKILL, while the webhook's answer is outstanding
        processes[0].wait(DEADLINE)
        receiver.release(503)  # the held call was never answered to notify: not accepted
        eventually(lambda: receiver.posts("/hooks"), "the held call to end")
        assert receiver.accepted("/hooks") == []

        processes.append(spawn("notify-2"))
        eventually(lambda: receiver.accepted("/hooks"), "the webhook to get the notification")
        eventually(setup.all_committed, "the restarted notify to commit the notification")
        assert len(mails.to("alice@example.com")) == 1, "the mail was sent once, and only once"
        assert len(mails.mails) == 1
        [hook] = receiver.accepted("/hooks")
        assert json.loads(hook.body)["id"] == notice.notification_id
        assert [r["outcome"] for r in setup.read(LEDGER)] == ["delivered", "delivered"]

        # The restarted process is probed, and counts what it did itself.
        with urllib.request.urlopen(f"http://127.0.0.1:{probe_port}/ready", timeout=10) as ready:
            assert json.loads(ready.read()) == {"ready": True}
        with urllib.request.urlopen(f"http://127.0.0.1:{probe_port}/metrics", timeout=10) as page:
            text = page.read().decode()
        assert 'vmstream_notify_deliveries_total{channel="email",outcome="skipped"} 1.0' in text
        assert 'vmstream_notify_deliveries_total{channel="webhook",outcome="delivered"} 1.0' in text
    finally:
        for process in processes:
            stop(process)


def test_a_5xx_and_an_smtp_4xx_are_tried_again_then_delivered(
    kafka_bootstrap: str, tmp_path: Path, inbox: tuple[Inbox, int], receiver: Receiver,
    notifier_for: Callable[[Setup], Notifier],
) -> None:
    mails, smtp_port = inbox
    setup = make_setup(kafka_bootstrap, tmp_path, smtp_port=smtp_port, receiver=receiver)
    receiver.script["/hooks"] = [503, 502]
    mails.refuse_first["alice@example.com"] = 2
    notifier_for(setup)
    notice = drain_notice("alice@example.com")
    setup.publish(notice)
    eventually(setup.all_committed, "notify to commit the notification")

    assert [r.status for r in receiver.posts("/hooks")] == [503, 502, 200]
    assert len(mails.to("alice@example.com")) == 1
    ledger = {r["channel"]: r for r in setup.read(LEDGER)}
    assert (ledger["email"]["outcome"], ledger["email"]["attempts"]) == ("delivered", 3)
    assert (ledger["webhook"]["outcome"], ledger["webhook"]["attempts"]) == ("delivered", 3)
    assert setup.read("dlq") == []


def test_a_permanent_4xx_is_dead_lettered_with_the_reason_and_not_tried_again(
    kafka_bootstrap: str, tmp_path: Path, inbox: tuple[Inbox, int], receiver: Receiver,
    notifier_for: Callable[[Setup], Notifier],
) -> None:
    mails, smtp_port = inbox
    setup = make_setup(kafka_bootstrap, tmp_path, smtp_port=smtp_port, receiver=receiver)
    receiver.script["/hooks"] = [400]
    notifier_for(setup)
    notice = drain_notice("alice@example.com", "nobody")
    setup.publish(notice)
    eventually(setup.all_committed, "notify to commit the notification")

    assert [r.status for r in receiver.posts("/hooks")] == [400]
    assert len(mails.to("alice@example.com")) == 1  # the mail is not held back by the webhook
    letters = {letter["recipient"]: letter for letter in setup.read("dlq", with_headers=True)}
    assert sorted(letters) == ["hooks", "nobody"]
    derived = derived_trace(notice.notification_id).trace_id  # published without a traceparent
    for recipient, letter in letters.items():  # CloudEvents headers, one id per dead letter
        headers = letter["_headers"]
        assert set(CE_HEADERS) <= set(headers) and headers["ce_type"] == "io.vmstream.dead-letter"
        assert headers["ce_id"].endswith(f"|{recipient}") and headers["ce_id"].startswith("dlq:")
        assert headers["traceparent"].split("-")[1] == derived
    hook = letters["hooks"]
    assert hook["error"] == (f"webhook hooks: HTTP 400 from {receiver.url}: "
                             '{"error": "bad token"} (permanent failure)')
    assert (hook["channel"], hook["attempts"]) == ("webhook", 1)
    assert hook["key"] == "vm/spx-proj-a/batch-1"
    assert Notification.model_validate_json(hook["original"]) == notice
    assert hook["source"]["topic"] == setup.topic("notifications")
    assert letters["nobody"]["error"].startswith("no address for recipient 'nobody'")
    outcomes = sorted((r["channel"], r["recipient"], r["outcome"]) for r in setup.read(LEDGER))
    assert outcomes == [("email", "alice@example.com", "delivered"), ("none", "nobody", "dead_lettered"),
                        ("webhook", "hooks", "dead_lettered")]


def test_transient_failures_to_the_last_attempt_are_dead_lettered(
    kafka_bootstrap: str, tmp_path: Path, inbox: tuple[Inbox, int], receiver: Receiver,
    notifier_for: Callable[[Setup], Notifier],
) -> None:
    mails, smtp_port = inbox
    setup = make_setup(kafka_bootstrap, tmp_path, smtp_port=smtp_port, receiver=receiver, attempts=3)
    receiver.script["/hooks"] = [503] * 5
    notifier_for(setup)
    setup.publish(drain_notice("alice@example.com"))
    eventually(setup.all_committed, "notify to commit the notification")
    assert [r.status for r in receiver.posts("/hooks")] == [503, 503, 503]
    [letter] = setup.read("dlq")
    assert letter["error"] == f"webhook hooks: HTTP 503 from {receiver.url}: ok (still failing after 3 attempts)"


def test_a_project_is_expanded_to_its_members_from_the_map_and_the_directory(
    kafka_bootstrap: str, tmp_path: Path, inbox: tuple[Inbox, int], receiver: Receiver,
    notifier_for: Callable[[Setup], Notifier],
) -> None:
    mails, smtp_port = inbox
    receiver.directory["proj-b"] = {"members": ["dave@example.com", "alice@example.com"]}
    setup = make_setup(kafka_bootstrap, tmp_path, smtp_port=smtp_port, receiver=receiver, routes=[],
                       directory={"proj-a": ["alice@example.com", "carol@example.com"]},
                       directory_url=f"{receiver.url}/directory/{{project}}")
    notifier_for(setup)
    first = drain_notice("project:proj-a", "project:proj-b", severity="info")
    second = drain_notice("project:proj-b", severity="info")
    setup.publish(first)
    setup.publish(second)
    eventually(setup.all_committed, "notify to commit both notifications")

    assert sorted(address for rcpts, _ in mails.mails for address in rcpts) == [
        "alice@example.com", "alice@example.com", "carol@example.com", "dave@example.com", "dave@example.com"]
    assert sorted(r["recipient"] for r in setup.read(LEDGER)
                  if r["notification_id"] == first.notification_id) == [
        "alice@example.com", "carol@example.com", "dave@example.com"]
    # The directory was asked once: the second notification's lookup came from the cache.
    assert [r.path for r in receiver.log if r.method == "GET"] == ["/directory/proj-b"]
    assert receiver.posts("/hooks") == []  # info: no route to the webhook here


def test_mail_goes_over_starttls_with_auth_to_a_relay_that_demands_both(tmp_path: Path) -> None:
    """notify's SMTP sender against aiosmtpd requiring STARTTLS and AUTH (a certificate of a
    throwaway CA, given as ``ssl_cafile``); a wrong password is a permanent failure (535)."""
    from aiosmtpd.smtp import AuthResult, LoginPassword
    from pydantic import SecretStr

    from harness.pki import CertificateAuthority
    from streams.common.settings import SmtpSettings
    from streams.serve.notify import Failed, SmtpSender

    authority = CertificateAuthority.create(tmp_path / "ca")
    cert, key = authority.issue(tmp_path / "ca", "smtp", "127.0.0.1", server_hosts=["127.0.0.1"])
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    logins: list[tuple[bytes, bool]] = []

    def authenticate(server: Any, session: Any, envelope: Any, mechanism: str, data: Any) -> AuthResult:
        good = isinstance(data, LoginPassword) and (data.login, data.password) == (b"vmstream", b"s3cret")
        logins.append((data.login if isinstance(data, LoginPassword) else b"", bool(session.ssl)))
        return AuthResult(success=good, handled=False)  # handled=False: aiosmtpd answers 535 itself

    mails = Inbox()
    [port] = free_ports(1)
    controller = Controller(mails, hostname="127.0.0.1", port=port, tls_context=served, require_starttls=True,
                            authenticator=authenticate, auth_required=True)
    controller.start()
    try:
        relay = SmtpSettings(host="127.0.0.1", port=port, security="starttls",
                             ssl_cafile=str(tmp_path / "ca" / "ca.crt"), username="vmstream",
                             password=SecretStr("s3cret"), sender="vmstream@az1.example")
        sender = SmtpSender(relay)
        notice = drain_notice("alice@example.com")
        sender.send("alice@example.com", notice)
        sender.idle()
        [raw] = mails.to("alice@example.com")
        assert email.message_from_bytes(raw, policy=email.policy.default)["X-Vmstream-Notification-Id"] == (
            notice.notification_id)
        assert logins == [(b"vmstream", True)]  # the password went over TLS

        wrong = SmtpSender(relay.model_copy(update={"password": SecretStr("wrong")}))
        with pytest.raises(Failed) as failed:
            wrong.send("alice@example.com", notice)
        assert failed.value.verdict == "permanent", failed.value.reason
        assert failed.value.reason.startswith("SMTP 535")
        assert len(mails.mails) == 1
    finally:
        controller.stop()


def test_a_recipient_is_sent_no_more_than_its_rate(
    kafka_bootstrap: str, tmp_path: Path, inbox: tuple[Inbox, int], receiver: Receiver,
    notifier_for: Callable[[Setup], Notifier],
) -> None:
    """A token bucket per recipient: one at once (burst 1), then 4 a second — so the webhook's
    four calls are at least a quarter of a second apart, by the receiver's clock."""
    mails, smtp_port = inbox
    setup = make_setup(kafka_bootstrap, tmp_path, smtp_port=smtp_port, receiver=receiver,
                       rate_limit={"per_second": 4, "burst": 1})
    notifier_for(setup)
    for _ in range(4):
        setup.publish(drain_notice("alice@example.com"))
    eventually(setup.all_committed, "notify to commit the notifications")
    calls = [r.at for r in receiver.accepted("/hooks")]
    assert len(calls) == 4 and len(mails.to("alice@example.com")) == 4
    gaps = [later - earlier for earlier, later in zip(calls, calls[1:])]
    assert min(gaps) >= 0.2, gaps  # 0.25 s by the bucket, less the receiver's own jitter


def test_the_engines_own_drain_notices_reach_each_recipient_once(
    kafka_bootstrap: str, tmp_path: Path, inbox: tuple[Inbox, int], receiver: Receiver,
    notifier_for: Callable[[Setup], Notifier],
) -> None:
    """The notifications the decision engine makes of examples/drain.jsonl (what the worker
    publishes), each published twice: alice is told of both her VMs, ops of the drain's end,
    once each; the two warnings also reach the webhook, once each."""
    from handlers.decide.engine import Engine
    from streams.cli.simulating import run as simulate

    setup = make_setup(kafka_bootstrap, tmp_path, smtp_port=inbox[1], receiver=receiver)
    decided = io.StringIO()
    with open(ROOT / "examples" / "drain.jsonl", encoding="utf-8") as source:
        simulate(Engine(setup.settings.rules()), source, decided)  # the file's topics: vmstream.*
    outputs = [json.loads(line) for line in decided.getvalue().splitlines()]
    notices = [(o["key"], Notification.model_validate(o["value"])) for o in outputs
               if o["topic"] == "vmstream.notifications"]
    assert sorted(n.type for _, n in notices) == ["drain_completed", "drain_will_stop_gpu_vm",
                                                  "drain_will_stop_gpu_vm"]
    notifier_for(setup)
    for key, notice in [*notices, *notices]:
        setup.publish(notice, key=key)
    eventually(setup.all_committed, "notify to commit the notifications")

    mails = inbox[0]
    subjects = sorted(email.message_from_bytes(raw, policy=email.policy.default)["Subject"]
                      for raw in mails.to("alice@example.com"))
    assert subjects == ["[vmstream warning] VirtualMachine spx-proj-a/batch-1: will be stopped for a node drain",
                        "[vmstream warning] VirtualMachine spx-proj-a/train-1: will be stopped for a node drain"]
    [raw] = mails.to("ops@example.com")
    assert email.message_from_bytes(raw, policy=email.policy.default)["Subject"] == (
        "[vmstream info] Node gpu-node-1: drain completed")
    assert len(mails.mails) == 3
    hooked = sorted(json.loads(r.body)["id"] for r in receiver.accepted("/hooks"))
    assert hooked == sorted(n.notification_id for _, n in notices if n.severity == "warning")
    assert len(receiver.posts("/hooks")) == 2
