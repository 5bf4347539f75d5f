"""The long-running processes log the same JSON lines: the worker (through Faust), the watch
bridge and the applier each write one JSON object per line on stderr, with the same keys
(``at``, ``level``, ``logger``, ``message``), so one ``jq`` reads all three."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from harness.running import CONFIG, Deployment, VmstreamProcess, WorkerProcess
from tests.support.kube_apiserver import Kube

pytestmark = [pytest.mark.kafka]

CORE = {"at", "level", "logger", "message"}


def wait_ready(process: VmstreamProcess, port: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        process.check_running()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)  # polling interval of a readiness probe, not synchronisation
    raise AssertionError(f"{process.name} not ready after {timeout}s:\n{process.tail()}")


def json_lines(log: Path) -> list[dict[str, Any]]:
    lines = [line for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert lines, f"{log.name}: nothing logged"
    parsed = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            raise AssertionError(f"{log.name}: not a JSON line: {line!r}") from None
        assert isinstance(entry, dict), line
        parsed.append(entry)
    return parsed


def shared_keys(entries: list[dict[str, Any]]) -> set[str]:
    keys = set(entries[0])
    for entry in entries[1:]:
        keys &= set(entry)
    return keys


def test_worker_watch_and_apply_log_json_lines_with_the_same_keys(
        kafka_bootstrap: str, kube: Kube, tmp_path: Path) -> None:
    deployment = Deployment(kafka_bootstrap, tmp_path)
    deployment.create_topics()
    kubeconfig = str(kube.kubeconfig)
    processes: list[VmstreamProcess] = []
    try:
        worker = WorkerProcess(deployment, "worker").start()
        processes.append(worker)
        for name in ("watch", "apply"):
            process = VmstreamProcess(deployment, name, [name, "--config", str(CONFIG), "--kubeconfig", kubeconfig])
            process.command += ["--probe-port", str(process.web_port)]  # its own free port
            processes.append(process.start())
            wait_ready(process, process.web_port)
    finally:
        for process in processes:
            process.stop()
    logs = {process.name: json_lines(process.log) for process in processes}
    for name, entries in logs.items():
        assert CORE <= shared_keys(entries), (name, shared_keys(entries))
        assert any(entry["logger"].startswith("streams.") for entry in entries), name
        assert min((set(entry) for entry in entries), key=len) == CORE, name  # a line without extra= fields: the same four keys
    # each says it stopped on SIGTERM, in the same form
    assert any("stopping" in entry["message"] for entry in logs["watch"])
    assert any("stopping" in entry["message"] for entry in logs["apply"])
