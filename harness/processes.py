"""Supervising local helper processes: the Kafka broker, etcd and kube-apiserver.

Children are started with ``posix_spawn`` rather than ``Popen``: a detached one outlives any
``Popen`` object, whose finaliser would warn that it is still running. Their pids are kept
in ``_children`` so they are polled and reaped with ``waitpid``; any other pid (one recorded
by an earlier command) is checked through ``/proc``, so that neither a zombie nor a recycled
pid passes for a running process of ours.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import re
import signal
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

__all__ = [
    "POLL_INTERVAL",
    "TAIL_LINES",
    "ArgvCheck",
    "NotReady",
    "Supervisor",
    "exit_code",
    "free_ports",
    "log_tail",
    "poll_until",
    "running",
    "spawn",
    "stop",
    "tail_text",
    "wait_ready",
]

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.1
TAIL_LINES = 40
# How long a SIGKILLed process may take to disappear before we call it stuck.
_KILL_GRACE = 10.0
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_MORE_FRAMES = re.compile(r"\s*\.\.\. \d+ more")

# Pids this interpreter spawned and has not reaped yet.
_children: set[int] = set()

# Tells from a pid's command line whether it is the process we started, not a recycled pid.
ArgvCheck = Callable[[list[str]], bool]


class NotReady(RuntimeError):
    """A started process did not come up; ``pid`` is set when a watched child ended."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid


class Supervisor(abc.ABC):
    """Owns helper processes: ``with`` starts them and stops them again, also on errors."""

    @abc.abstractmethod
    def start(self) -> object: ...

    @abc.abstractmethod
    def stop(self) -> None: ...

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def free_ports(count: int) -> list[int]:
    """Distinct free loopback ports (all held open at once so they cannot coincide)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def spawn(argv: Sequence[str], output: Path, *, detach: bool) -> int:
    """Start ``argv`` with stdout+stderr appended to ``output``; return its pid.

    ``detach`` puts it in its own session so it outlives us. SIGPIPE and SIGXFSZ go back to
    their defaults, as ``Popen`` does (Python ignores SIGPIPE, and children inherit that).
    """
    file_actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, str(output), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    pid = os.posix_spawn(
        argv[0],
        list(argv),
        dict(os.environ),
        file_actions=file_actions,
        setsid=detach,
        setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
    )
    _children.add(pid)
    log.debug("started %s as pid %d", Path(argv[0]).name, pid)
    return pid


def exit_code(pid: int) -> int | None:
    """The exit code of our own child once it has ended (reaping it), else None."""
    done, status = os.waitpid(pid, os.WNOHANG)
    if done != pid:
        return None
    _children.discard(pid)
    return os.waitstatus_to_exitcode(status)


def running(pid: int, argv: ArgvCheck | None = None) -> bool:
    """Whether ``pid`` still runs.

    Our child is polled (and reaped once it ended); any other pid must exist, not be a zombie
    (``<defunct>``) and, given ``argv``, have a command line it accepts.
    """
    if pid in _children:
        try:
            return exit_code(pid) is None
        except ChildProcessError:  # reaped by someone else: judge it like any other pid
            _children.discard(pid)
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or another user's: not ours
        return False
    proc = Path(f"/proc/{pid}")
    if not proc.is_dir():
        return True  # no procfs: trust the pid
    try:
        stat = (proc / "stat").read_text()
        cmdline = (proc / "cmdline").read_bytes()
    except OSError:
        return False  # ended meanwhile
    if stat.rpartition(")")[2].split()[0] == "Z":
        return False
    args = cmdline.removesuffix(b"\0").split(b"\0")
    return argv is None or argv([arg.decode(errors="replace") for arg in args])


def poll_until(
    condition: Callable[[], bool], timeout: float, interval: float = POLL_INTERVAL
) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def wait_ready(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    *,
    watch: Mapping[int, str],
    interval: float = POLL_INTERVAL,
) -> None:
    """Poll ``check`` until it holds, else raise ``NotReady``.

    A watched child (pid -> name) that ends fails it at once, with its exit code, rather
    than after the whole timeout.
    """

    def ready() -> bool:
        if check():
            return True
        for pid, name in watch.items():
            code = exit_code(pid)
            if code is not None:
                raise NotReady(f"{name} exited with code {code}", pid)
        return False

    if not poll_until(ready, timeout, interval):
        raise NotReady(f"{what} not ready after {timeout:.0f}s")


def stop(
    pid: int,
    name: str,
    timeout: float,
    *,
    argv: ArgvCheck | None = None,
    level: int = logging.DEBUG,
) -> None:
    """SIGTERM (our helpers shut down cleanly on it), then SIGKILL if it overstays.

    Waiting through ``running`` reaps our own child, so no zombie is left behind. ``argv``
    keeps a recycled pid from being signalled; ``level`` is that of the "stopping" line.
    """
    if not running(pid, argv):
        return
    log.log(level, "stopping %s (pid %d)", name, pid)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if poll_until(lambda: not running(pid, argv), timeout, interval=0.05):
        return
    log.warning("%s (pid %d) ignored SIGTERM for %.0fs: killing it", name, pid, timeout)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if not poll_until(lambda: not running(pid, argv), _KILL_GRACE, interval=0.05):
        raise RuntimeError(f"{name} (pid {pid}) survived SIGKILL")


def tail_text(text: str, lines: int = TAIL_LINES) -> str:
    """The last lines, without Java stack frames or colour codes, so the causes fit."""
    kept = [
        line
        for line in _ANSI_ESCAPE.sub("", text).splitlines()
        if not line.lstrip().startswith("at ") and not _MORE_FRAMES.fullmatch(line)
    ]
    return "\n".join(kept[-lines:])


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """``tail_text`` of a log file, or a placeholder if there is none."""
    try:
        return tail_text(path.read_text(errors="replace"), lines)
    except OSError:
        return "(no log)"
