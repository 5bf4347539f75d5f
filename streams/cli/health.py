"""``vmstream health``: the image's HEALTHCHECK, for whichever process the container runs.

One image runs every job of the ``vmstream`` command, so its HEALTHCHECK is one command for
all of them. It finds the ``vmstream`` process in the container (``/proc/<pid>/cmdline``),
works out where that process serves ``/health`` the way the process itself does — from its
arguments, the configuration file they name and the environment — and asks:

=========  ===========================================================================
worker     ``worker.web_host``:``worker.web_port`` (6066; ``VMSTREAM_WORKER__WEB_*``)
api        ``api.host``:``api.port`` (6069; ``VMSTREAM_API__*``)
apply      ``--probe-host``:``--probe-port`` (6067; ``VMSTREAM_PROBE_HOST``/``_PORT``)
watch      the same, 6068
notify     the same, 6070
=========  ===========================================================================

An address that listens on every interface (``0.0.0.0``, ``::``) is asked on loopback; any
other (the Pod's IP) as it is. No proxy is used. A one-shot command (``topics``, ``tail``, …)
serves no ``/health``: nothing to check, healthy.

Exit 0: healthy (or nothing to check); 1: unhealthy — never 2, which Docker reserves.
It reads the environment of the check, which Docker gives from the container's, as the
process got it. It imports nothing heavy: ``python -m streams.cli.health`` is the same
check without the rest of the ``vmstream`` command (the HEALTHCHECK runs it every 30 s).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

EXIT_HEALTHY = 0
EXIT_UNHEALTHY = 1
# The processes that serve /health, and the probe port of those that take --probe-port
# (streams/kube/applying/process.py, streams/kube/watching.py, streams/serve/notify.py: their
# add_probe_arguments; tests/test_health.py keeps the two in step).
PROBE_PORTS = {"apply": 6067, "watch": 6068, "notify": 6070}
SERVED = ("worker", "api", *PROBE_PORTS)
# What may stand before the program in its command line: an init, and the interpreter.
INITS = {"docker-init", "tini", "dumb-init", "catatonit"}
PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}  # every interface → loopback


@dataclass(frozen=True)
class Process:
    """A ``vmstream`` process: its pid and the arguments after ``vmstream``."""

    pid: int
    argv: tuple[str, ...]

    @property
    def command(self) -> str | None:
        """The subcommand (``worker``, ``topics``, …): the first argument not an option."""
        return next((arg for arg in self.argv if not arg.startswith("-")), None)


def vmstream_arguments(cmdline: Sequence[str]) -> tuple[str, ...] | None:
    """The arguments after ``vmstream`` in a command line, or None if it is no vmstream's.

    The program itself, not any argument that names it: ``vmstream ARGS`` as an init starts
    it (``docker-init -- vmstream ARGS``), ``…/python …/vmstream ARGS`` as the kernel runs the
    console script, or ``python -m streams.… ARGS``."""
    rest = list(cmdline)
    if rest and os.path.basename(rest[0]) in INITS:
        rest = rest[2:] if rest[1:2] == ["--"] else rest[1:]
    if rest and PYTHON.fullmatch(os.path.basename(rest[0])):
        if rest[1:2] == ["-m"] and len(rest) > 2 and rest[2].startswith("streams."):
            return tuple(rest[3:])
        rest = rest[1:]
    if rest and os.path.basename(rest[0]) == "vmstream":
        return tuple(rest[1:])
    return None


def _cmdline(path: Path) -> list[str] | None:
    try:
        raw = (path / "cmdline").read_bytes()
    except OSError:  # gone since listed, or not ours to read
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]] if raw else None


def processes(proc: Path = Path("/proc"), *, pid: int | None = None) -> Iterator[Process]:
    """Every ``vmstream`` process but this check's own (``pid``: that one alone), by pid."""
    paths = [proc / str(pid)] if pid is not None else sorted(
        (p for p in proc.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    for path in paths:
        if pid is None and int(path.name) == os.getpid():
            continue
        cmdline = _cmdline(path)
        argv = vmstream_arguments(cmdline) if cmdline else None
        if argv is not None:
            process = Process(int(path.name), argv)
            if process.command != "health":
                yield process


def _served_options(command: str) -> argparse.ArgumentParser:
    """The options of ``command`` that say where it listens, as its own parser reads them."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--config")
    if command in PROBE_PORTS:  # streams.common.probes.add_probe_arguments
        parser.add_argument("--probe-host", default=os.environ.get("VMSTREAM_PROBE_HOST", "127.0.0.1"))
        parser.add_argument("--probe-port", type=int,
                            default=int(os.environ.get("VMSTREAM_PROBE_PORT", str(PROBE_PORTS[command]))))
    return parser


def address(process: Process) -> tuple[str, int]:
    """Where ``process`` listens for ``/health``: (host, port) as it binds them."""
    command = process.command
    if command is None or command not in SERVED:
        raise ValueError(f"vmstream {command} serves no /health")
    rest = list(process.argv[process.argv.index(command) + 1:])
    args, _ = _served_options(command).parse_known_args(rest)
    if command in PROBE_PORTS:
        return str(args.probe_host), int(args.probe_port)
    from streams.common.settings import load_settings  # only here: pydantic, the configuration

    settings = load_settings(args.config)
    if command == "worker":
        return settings.worker.web_host, settings.worker.web_port
    return settings.api.host, settings.api.port


def health_url(host: str, port: int) -> str:
    """The URL of ``/health`` at an address: one that listens everywhere asked on loopback."""
    host = WILDCARDS.get(host, host)
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:  # a name
        pass
    return f"http://{host}:{port}/health"


def ask(url: str, timeout: float) -> str | None:
    """None if ``url`` answers 200 within ``timeout`` seconds, else what went wrong."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
    try:
        with opener.open(url, timeout=timeout) as response:
            status = int(response.status)
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}"
    except (OSError, ValueError) as error:  # refused, timed out, no such host
        reason = getattr(error, "reason", None) or error
        return f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
    return None if status == 200 else f"HTTP {status}"


def check(found: Sequence[Process], timeout: float) -> tuple[int, list[str]]:
    """(exit code, one line per thing checked) for the vmstream processes found."""
    if not found:
        return EXIT_UNHEALTHY, ["unhealthy: no vmstream process found"]
    served = [process for process in found if process.command in SERVED]
    if not served:
        commands = ", ".join(sorted({process.command or "(no command)" for process in found}))
        return EXIT_HEALTHY, [f"healthy: nothing to check (vmstream {commands} serves no /health)"]
    lines: list[str] = []
    healthy = True
    urls: dict[str, str] = {}  # url → command: an init and its child name the same process
    for process in served:
        try:
            host, port = address(process)
        except Exception as error:  # a configuration the process could not have started with
            healthy = False
            lines.append(f"unhealthy: vmstream {process.command} (pid {process.pid}): {error}")
            continue
        if port == 0:
            healthy = False
            lines.append(f"unhealthy: vmstream {process.command} (pid {process.pid}) listens on "
                         "port 0 (any free): give it a fixed port to be checked")
            continue
        urls.setdefault(health_url(host, port), str(process.command))
    for url, command in urls.items():
        problem = ask(url, timeout)
        healthy = healthy and problem is None
        lines.append(f"healthy: vmstream {command} {url}" if problem is None
                     else f"unhealthy: vmstream {command} {url}: {problem}")
    return (EXIT_HEALTHY if healthy else EXIT_UNHEALTHY), lines


def run(args: argparse.Namespace) -> int:
    code, lines = check(list(processes(pid=args.pid)), args.timeout)
    for line in lines:
        print(line, flush=True)
    return code


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pid", type=int, default=None,
                        help="check this process only (default: every vmstream process in the container)")
    parser.add_argument("--timeout", type=float, default=4.0,
                        help="seconds to wait for /health (default: 4, under the HEALTHCHECK's 5)")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    health = commands.add_parser(
        "health", help="check the vmstream process of this container (the image's HEALTHCHECK)",
        description="Find the vmstream process running beside this command (worker, api, apply, watch or "
        "notify), work out where it serves /health from its arguments, configuration and environment, and "
        "ask. Exit 0 healthy (or a one-shot command with nothing to check), 1 unhealthy.",
        epilog="exit codes: 0 healthy, or nothing to check; 1 unhealthy (2, which Docker reserves, only "
        "for bad arguments to this command)")
    add_arguments(health)
    health.set_defaults(handler=run)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m streams.cli.health``: the check alone, without the other subcommands."""
    parser = argparse.ArgumentParser(prog="python -m streams.cli.health",
                                     description="vmstream health, alone: the image's HEALTHCHECK.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
