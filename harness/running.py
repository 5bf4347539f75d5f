"""Running vmstream as separate processes: the demo and the tests drive real workers.

A :class:`Deployment` is one isolated vmstream on a broker: its own topics
(``t<id>.intents``, …), its own Faust app id (so its consumer group and changelogs are its
own). :class:`WorkerProcess` runs ``vmstream worker`` for it, ready when its ``/ready``
page says so; :class:`Outputs` reads what it wrote, polling until a condition holds or a
deadline passes.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self, cast

from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from pydantic import SecretStr

from handlers.contracts.topics import AUDIT, COMMAND_RESULTS, COMMANDS, NOTIFICATIONS, outputs
from handlers.decide.engine import Engine
from handlers.rules.capacity import capacity_report
from harness.locations import REPO_ROOT
from harness.processes import free_ports
from harness.publishing import publish, scenario_records
from streams.common.kafka_clients import ADMIN_SECONDS, admin_client, consumer
from streams.common.reading import poll_records
from streams.cli.simulating import Simulation
from streams.common.settings import KafkaSettings, SigningSettings, load_settings
from streams.common.topics import ensure_topics

CONFIG = REPO_ROOT / "examples" / "config.yaml"
# What the worker and the applier write, by logical name (handlers/contracts/topics.py).
OUTPUTS = tuple(topic.name for topic in outputs("worker", "applier"))


@dataclass
class Deployment:
    """One isolated vmstream deployment on a shared broker: topics, app id, settings."""

    bootstrap: str
    workdir: Path
    ident: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    web_token: str = field(default_factory=lambda: uuid.uuid4().hex)  # its worker's private pages
    # The key its worker seals commands with and its applier checks them by (docs/security.md).
    signing_key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)

    @property
    def signing(self) -> SigningSettings:
        return SigningSettings(key_id=f"k-{self.ident}", keys={f"k-{self.ident}": SecretStr(self.signing_key)})

    @property
    def kafka(self) -> KafkaSettings:
        return KafkaSettings(bootstrap_servers=self.bootstrap, topic_prefix=f"t{self.ident}.")

    @property
    def app_id(self) -> str:
        return f"vmstream-{self.ident}"

    def env(self, web_port: int) -> dict[str, str]:
        return {
            **os.environ,
            "VMSTREAM_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap,
            "VMSTREAM_KAFKA__TOPIC_PREFIX": self.kafka.topic_prefix,
            "VMSTREAM_WORKER__APP_ID": self.app_id,
            "VMSTREAM_WORKER__WEB_PORT": str(web_port),
            "VMSTREAM_WORKER__WEB_TOKEN": self.web_token,
            "VMSTREAM_WORKER__TICK_SECONDS": "0.2",
            "VMSTREAM_SIGNING__KEY_ID": f"k-{self.ident}",
            "VMSTREAM_SIGNING__KEYS": json.dumps({f"k-{self.ident}": self.signing_key}),
        }

    def create_topics(self) -> None:
        ensure_topics(self.kafka)

    def delete_topics(self) -> list[str]:
        """Delete this deployment's topics and its worker's changelogs; returns their names.

        A broker shared by many deployments (a benchmark's runs) keeps all their
        partitions otherwise.
        """
        admin = admin_client(self.kafka)
        names = [name for name in admin.list_topics(timeout=ADMIN_SECONDS).topics
                 if name.startswith(self.kafka.topic_prefix) or name.startswith(f"{self.app_id}-")]
        for deleted in admin.delete_topics(names, request_timeout=ADMIN_SECONDS).values() if names else ():
            deleted.result()
        return names

    def publish_lines(self, lines: Iterable[str]) -> int:
        return publish(self.kafka, scenario_records(lines, shift_to_now=True))

    def publish_raw(self, logical_topic: str, key: str, value: bytes) -> int:
        return publish(self.kafka, [(self.kafka.topic(logical_topic), key, value, int(time.time() * 1000))])


class VmstreamProcess:
    """A ``vmstream <command>`` subprocess of a deployment, its output in a log file."""

    def __init__(self, deployment: Deployment, name: str, command: list[str], *,
                 env: dict[str, str] | None = None) -> None:
        self.deployment = deployment
        self.name = name
        self.command = command
        self.env = env or {}
        self.web_port = free_ports(1)[0]
        self.cwd = deployment.workdir / name
        self.cwd.mkdir(parents=True, exist_ok=True)
        self.log = self.cwd / f"{name}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> Self:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "streams.cli.main", *self.command],
                cwd=self.cwd, env={**self.deployment.env(self.web_port), **self.env},
                stdout=log, stderr=subprocess.STDOUT,
            )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop(signal.SIGKILL)  # a process that never became ready is not left behind
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        """Processes without a readiness page are ready once they run."""
        self.check_running()

    def check_running(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.process.returncode}:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process is None:  # never started
            return 0
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class WorkerProcess(VmstreamProcess):
    """A ``vmstream worker``: ready when its ``/ready`` page says so."""

    def __init__(self, deployment: Deployment, name: str, *, config: Path = CONFIG,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(deployment, name, ["worker", "--config", str(config)], env=env)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_running()
            try:
                if self.page("/ready").get("ready"):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
                pass
            time.sleep(0.2)  # polling interval of a readiness probe, not synchronisation
        raise AssertionError(f"worker {self.name} not ready after {timeout}s:\n{self.tail()}")

    def page(self, path: str) -> Any:
        """A page, with the deployment's bearer token (all but /health and /ready want it)."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.web_port}{path}",
                                         headers={"Authorization": f"Bearer {self.deployment.web_token}"})
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.loads(answer.read())

    def wait_until(self, path: str, condition: Callable[[Any], bool], timeout: float = 30.0) -> Any:
        """Poll one of the worker's pages until ``condition`` holds on its JSON."""
        deadline = time.monotonic() + timeout
        while True:
            body = self.page(path)
            if condition(body):
                return body
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name} {path} never satisfied the condition: {body}")
            time.sleep(0.1)  # polling interval

    def wait_for_capacity(self, figures: dict[str, tuple[int, int]], timeout: float = 30.0) -> None:
        """Poll ``/capacity`` until each class shows its (total, free) cards of ``figures``
        (:func:`capacity_after`). Usage is a global table: an instance sees the other's nodes
        late, and free cards alone are reached by a partial view too (a node before its VMIs)."""
        self.wait_until("/capacity", lambda c: all((c.get(gpu, {}).get("total"), c.get(gpu, {}).get("free")) == pair
                                                   for gpu, pair in figures.items()), timeout)


def simulated(lines: Iterable[str], config: Path = CONFIG) -> Simulation:
    """``lines`` decided as ``simulate`` decides them: one process, state in memory, no
    partitions — what a deployment's workers must agree with."""
    simulation = Simulation(Engine(load_settings(config).rules()))
    for _ in simulation.feed(lines):
        pass
    return simulation


def capacity_after(lines: Iterable[str], config: Path = CONFIG) -> dict[str, tuple[int, int]]:
    """Each GPU class's (total, free) cards once every line is decided (:func:`simulated`):
    what every worker must show before an intent that reads capacity is sent."""
    simulation = simulated(lines, config)
    report = capacity_report(simulation.state, simulation.engine.catalog)
    return {gpu: (cast(int, figures["total"]), cast(int, figures["free"])) for gpu, figures in report.items()}


class Outputs:
    """Everything the deployment wrote on its output topics, read as it arrives."""

    def __init__(self, deployment: Deployment,
                 on_arrival: Callable[[str, bytes], None] | None = None) -> None:
        self.on_arrival = on_arrival
        kafka = deployment.kafka
        self.topics = {kafka.topic(name): name for name in OUTPUTS}
        # Only committed output counts: under exactly-once, what a killed worker had not
        # committed is aborted and decided again by its successor.
        self.consumer = consumer(kafka, client_id="vmstream-outputs")  # read_committed
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING)
                              for topic in self.topics for p in range(kafka.partitions)])
        self.seen: dict[str, list[dict[str, Any]]] = {name: [] for name in OUTPUTS}
        self.keys: dict[str, list[str]] = {name: [] for name in OUTPUTS}
        self.arrivals: list[tuple[datetime, str, dict[str, Any]]] = []  # (read at, topic, value)

    def poll(self) -> list[tuple[str, bytes]]:
        """Read what arrived; returns it as (logical topic, raw value) in arrival order."""
        arrived = []
        for record in poll_records(self.consumer, 0.2):
            name = self.topics[record.topic]
            value = json.loads(record.value or b"null")
            self.seen[name].append(value)
            self.arrivals.append((datetime.now(UTC), name, value))
            self.keys[name].append(record.key.decode() if record.key else "")
            arrived.append((name, record.value or b""))
        if self.on_arrival is not None:
            for name, value in sorted(arrived, key=lambda item: OUTPUTS.index(item[0])):
                self.on_arrival(name, value)
        return arrived

    def wait_for(self, condition: Callable[[Outputs], object], timeout: float = 60.0, what: str = "") -> None:
        """Poll until ``condition`` holds: true, or what it looks for found (a list not empty)."""
        deadline = time.monotonic() + timeout
        while not condition(self):
            if time.monotonic() > deadline:
                counts = {name: len(values) for name, values in self.seen.items()}
                raise AssertionError(f"timed out waiting for {what or condition}; seen {counts}")
            self.poll()

    def audits(self, **match: Any) -> list[dict[str, Any]]:
        return self._matching(AUDIT.name, match)

    def notifications(self, type_: str) -> list[dict[str, Any]]:
        return [n for n in self.seen[NOTIFICATIONS.name] if n["type"] == type_]

    def commands(self, type_: str) -> list[dict[str, Any]]:
        return [c for c in self.seen[COMMANDS.name] if c["type"] == type_]

    def results(self, **match: Any) -> list[dict[str, Any]]:
        return self._matching(COMMAND_RESULTS.name, match)

    def _matching(self, topic: str, match: dict[str, Any]) -> list[dict[str, Any]]:
        """The records seen on ``topic`` whose fields match (``input__topic=…``: a nested field)."""
        return [r for r in self.seen[topic] if all(_field(r, k) == v for k, v in match.items())]

    def close(self) -> None:
        self.consumer.close()


def _field(record: dict[str, Any], dotted: str) -> Any:
    value: Any = record
    for part in dotted.split("__"):
        value = value.get(part) if isinstance(value, dict) else None
    return value

