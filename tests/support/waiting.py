"""Waiting in tests: poll a probe until it answers, and stop a child process for good.

Tests never sleep to synchronise; they poll what they can observe, with a deadline that
turns a hang into a failure that says what was awaited.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
DEADLINE = 60.0


def eventually(probe: Callable[[], T | None], what: str, timeout: float = DEADLINE, interval: float = 0.05) -> T:
    """Poll ``probe`` until it returns something truthy, or fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)  # polling interval


def stop(process: subprocess.Popen[bytes] | subprocess.Popen[str] | None, grace: float = 30.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; a process already gone is left alone."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def audit_of_intent(reader: Any, topic: str, intent_id: str, process: subprocess.Popen[bytes], log_path: Path,
                    timeout: float = 180.0) -> list[dict[str, Any]]:
    """The audit records of ``intent_id`` on partition 0 of ``topic``, read from the start with
    ``reader`` (a consumer of streams/common/kafka_clients.py, closed here) once there is one;
    the process deciding it must stay up meanwhile (its log's tail is the failure's message)."""
    from confluent_kafka import OFFSET_BEGINNING, TopicPartition

    from streams.common.reading import poll_records

    try:
        reader.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        deadline = time.monotonic() + timeout
        audits: list[dict[str, Any]] = []
        while not audits:
            assert process.poll() is None, log_path.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, f"no audit record: {log_path.read_text(errors='replace')[-4000:]}"
            audits += [v for v in (json.loads(r.value or b"{}") for r in poll_records(reader, 0.5))
                       if (v.get("input") or {}).get("ref") == intent_id]
        return audits
    finally:
        reader.close()
