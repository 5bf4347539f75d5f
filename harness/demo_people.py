"""What the people around the demo see: mail, and a console's view.

The demo runs ``vmstream notify`` delivering to a local SMTP sink it starts itself
(:class:`MailSink`, aiosmtpd on 127.0.0.1), which prints each mail as it arrives, and
``vmstream api``, whose pages it prints where a console would show them (:class:`Console`).
"""

from __future__ import annotations

import email
import email.policy
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any, TextIO

from aiosmtpd.controller import Controller

from handlers.contracts.topics import NOTIFICATIONS
from harness.processes import free_ports
from harness.running import CONFIG, Deployment, Outputs, VmstreamProcess

SENDER = "vmstream@az1.example"
# project id → its members, as an organisation's directory would say (docs/notify.md).
DIRECTORY = {"proj-a": ["alice@example.com"], "proj-b": ["bob@example.com"]}


class MailSink:
    """An SMTP server on 127.0.0.1 that accepts every mail and prints it as it arrives."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.delivered: list[tuple[str, str]] = []  # (recipient, subject)
        [self.port] = free_ports(1)
        self.controller = Controller(self, hostname="127.0.0.1", port=self.port)

    def __enter__(self) -> MailSink:
        self.controller.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.controller.stop()

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802 (aiosmtpd's name)
        message = email.message_from_bytes(bytes(envelope.content), policy=email.policy.default)
        subject = str(message["Subject"])
        with self.lock:
            for recipient in envelope.rcpt_tos:
                self.delivered.append((recipient, subject))
                self.out.write(f"  mail    → {recipient}: {subject}\n")
            self.out.flush()
        return "250 OK"

    def count(self) -> int:
        with self.lock:
            return len(self.delivered)


def mails_due(outputs: Outputs) -> int:
    """How many mails the notifications seen so far make: one per notification and address."""
    due = set()
    for notification in outputs.seen[NOTIFICATIONS.name]:
        for principal in notification["recipients"]:
            members = DIRECTORY.get(principal.removeprefix("project:"), []) if principal.startswith("project:") \
                else [principal]
            due |= {(notification["notification_id"], m.lower()) for m in members if "@" in m}
    return len(due)


class NotifyProcess(VmstreamProcess):
    """``vmstream notify`` delivering to the sink; ready once it has read its ledger."""

    def __init__(self, deployment: Deployment, sink: MailSink) -> None:
        super().__init__(deployment, "notify", [])
        self.command = ["notify", "--config", str(CONFIG), "--probe-port", str(self.web_port)]
        self.env = {"VMSTREAM_NOTIFY__SMTP__HOST": "127.0.0.1", "VMSTREAM_NOTIFY__SMTP__PORT": str(sink.port),
                    "VMSTREAM_NOTIFY__SMTP__SECURITY": "none", "VMSTREAM_NOTIFY__SMTP__SENDER": SENDER,
                    "VMSTREAM_NOTIFY__DIRECTORY": json.dumps(DIRECTORY),
                    "VMSTREAM_NOTIFY__GROUP_ID": f"{deployment.app_id}-notify"}

    def wait_ready(self, timeout: float) -> None:
        _wait_ready(self, f"http://127.0.0.1:{self.web_port}/ready", timeout)


class ApiProcess(VmstreamProcess):
    """``vmstream api`` with an operator token; ready once it has read the changelogs."""

    def __init__(self, deployment: Deployment) -> None:
        super().__init__(deployment, "api", ["api", "--config", str(CONFIG)])
        self.token = f"console-{deployment.web_token}"
        self.env = {"VMSTREAM_API__PORT": str(self.web_port), "VMSTREAM_API__OPERATOR_TOKEN": self.token}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.web_port}"

    def wait_ready(self, timeout: float) -> None:
        _wait_ready(self, f"{self.url}/ready", timeout)

    def get(self, path: str) -> Any:
        request = urllib.request.Request(f"{self.url}{path}", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.loads(answer.read())


def start_together(stack: ExitStack, parts: list[VmstreamProcess]) -> None:
    """Start processes side by side (each stopped when ``stack`` closes); return once all are ready."""
    for part in parts:
        stack.callback(part.stop)
    with ThreadPoolExecutor(len(parts)) as pool:
        for started in [pool.submit(part.start) for part in parts]:
            started.result()


def _wait_ready(process: VmstreamProcess, url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.check_running()
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)  # polling interval of a readiness probe, not synchronisation
    raise AssertionError(f"{process.name} not ready after {timeout}s:\n{process.tail()}")


def _gpus(refs: list[dict[str, Any]]) -> str:
    return ", ".join(r["display_name"] for r in refs) or "none"


class Console:
    """Prints what a console shows, from ``vmstream api``'s pages."""

    def __init__(self, api: ApiProcess, outputs: Outputs, out: TextIO) -> None:
        self.api = api
        self.outputs = outputs
        self.out = out

    def show_badge(self, namespace: str, name: str, timeout: float) -> None:
        """A VM's GPU now and after its restart, once its template shows the GPU asked for."""
        path = f"/v1/vms/{namespace}/{name}"
        badge: dict[str, Any] = {}

        def pending(_: Outputs) -> bool:
            badge.update(self.api.get(path))
            return badge["waits_for"] == "restart" and bool(badge["gpus_after_restart"])

        try:
            self.outputs.wait_for(pending, timeout=timeout, what=f"{path} to show the GPU after the restart")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; it answers {badge}") from None
        self.out.write(f"  console GET {path} → GPU now: {_gpus(badge['gpus_now'])}; "
                       f"after restart: {_gpus(badge['gpus_after_restart'])} {badge['badge']}\n")
        self.out.flush()

    def show_classes(self) -> None:
        classes = self.api.get("/v1/gpu-classes")
        self.out.write(f"  console GET /v1/gpu-classes → AZ {classes['az']}:\n")
        for c in classes["classes"]:
            self.out.write(f"            {c['display_name']}: total {c['total']}, in use {c['in_use']}, "
                           f"free {c['free']}{'' if c['permitted'] else ' (not permitted by KubeVirt)'}\n")
        self.out.flush()
