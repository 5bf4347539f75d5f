"""harness.processes with small Python children: reaping, zombies, recycled pids, escalation."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import processes


@pytest.fixture
def spawned() -> Iterator[list[int]]:
    """Pids to stop after the test, so none outlives it."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        processes.stop(pid, "test child", 5.0)


def _python(code: str, log: Path, pids: list[int]) -> int:
    pid = processes.spawn([sys.executable, "-c", code], log, detach=False)
    pids.append(pid)
    return pid


def _printed(log: Path, lines: int) -> list[str]:
    assert processes.poll_until(lambda: len(log.read_text().splitlines()) >= lines, 10.0)
    return log.read_text().splitlines()


def test_free_ports_are_distinct() -> None:
    ports = processes.free_ports(5)
    assert len(set(ports)) == 5


def test_an_ended_child_is_reaped_and_reports_its_exit_code(
    tmp_path: Path, spawned: list[int]
) -> None:
    log = tmp_path / "out.log"
    pid = _python("import sys; print('hello'); sys.exit(3)", log, spawned)
    with pytest.raises(processes.NotReady, match="child exited with code 3") as failed:
        processes.wait_ready("child", lambda: False, 10.0, watch={pid: "child"})
    assert failed.value.pid == pid
    assert pid not in processes._children
    assert not processes.running(pid)
    assert processes.log_tail(log) == "hello"


def test_wait_ready_times_out() -> None:
    with pytest.raises(processes.NotReady, match="thing not ready after 0s"):
        processes.wait_ready("thing", lambda: False, 0.2, watch={}, interval=0.05)


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path, spawned: list[int]) -> None:
    log = tmp_path / "out.log"
    code = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    pid = _python(code, log, spawned)
    _printed(log, 1)
    processes.stop(pid, "stubborn", 0.3)
    assert pid not in processes._children
    assert not processes.running(pid)


def test_other_processes_need_a_matching_command_line_and_no_zombie(
    tmp_path: Path, spawned: list[int]
) -> None:
    log = tmp_path / "out.log"
    # Forks two grandchildren (not ours): one that ends unreaped (a zombie), one that sleeps.
    code = (
        "import os, time\n"
        "dead = os.fork()\n"
        "if dead == 0: os._exit(0)\n"
        "alive = os.fork()\n"
        "if alive == 0: time.sleep(60); os._exit(0)\n"
        "print(dead, flush=True); print(alive, flush=True)\n"
        "time.sleep(60)\n"
    )
    _python(code, log, spawned)
    dead, alive = (int(line) for line in _printed(log, 2))
    try:
        assert processes.poll_until(lambda: not processes.running(dead), 5.0), "zombie counted"
        assert processes.running(alive)
        assert processes.running(alive, lambda argv: argv[:2] == [sys.executable, "-c"])
        assert not processes.running(alive, lambda argv: "kafka.Kafka" in argv)
    finally:
        processes.stop(alive, "grandchild", 5.0)


def test_tail_text_drops_stack_frames_and_colours() -> None:
    text = "\x1b[31mboom\x1b[0m\n\tat a.B(C.java:1)\n\t... 3 more\ncause\nlast\n"
    assert processes.tail_text(text, 2) == "cause\nlast"
    assert processes.tail_text(text) == "boom\ncause\nlast"
    assert processes.log_tail(Path("/nonexistent/log")) == "(no log)"
