"""Waiting in tests: poll a probe until it answers, and stop a child process for good.

Tests never sleep to synchronise; they poll what they can observe, with a deadline that
turns a hang into a failure that says what was awaited.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

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
