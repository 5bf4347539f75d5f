"""``vmstream health``, the image's HEALTHCHECK: the process found, its address read as it reads
it, its ``/health`` asked; 0 healthy, 1 unhealthy, whatever the process is.

No container engine: the check runs against real probe servers (streams/common/probes.py) in
processes whose command line is a vmstream's, found through /proc — in a PID namespace of
their own where ``unshare`` is allowed, as in a container.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from streams.cli import health
from streams.cli.health import Process, address, check, health_url, processes, vmstream_arguments
from streams.cli.main import build_parser
from streams.common.probes import ProbeServer

ROOT = Path(__file__).resolve().parent.parent
VMSTREAM = str(Path(sys.executable).parent / "vmstream")

# A stand-in for a served process: argv as `vmstream <command> --probe-host H --probe-port P`,
# the real probe server at that address, until killed.
FAKE_VMSTREAM = textwrap.dedent(
    """\
    import argparse, sys, time
    from streams.common.probes import ProbeServer
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("--probe-host", default="127.0.0.1")
    parser.add_argument("--probe-port", type=int)
    args = parser.parse_args()
    ProbeServer(ready=lambda: True, host=args.probe_host, port=args.probe_port, process="worker").start()
    print("listening", flush=True)
    time.sleep(120)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(autouse=True)
def _no_probe_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("VMSTREAM_"):
            monkeypatch.delenv(name)


@pytest.fixture
def probes() -> Iterator[ProbeServer]:
    with ProbeServer(ready=lambda: True, host="127.0.0.1", port=0, process="worker") as server:
        yield server


# -- finding the process ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("cmdline", "arguments"),
    [
        (["/opt/vmstream/bin/python", "/opt/vmstream/bin/vmstream", "worker", "--config", "c.yaml"],
         ("worker", "--config", "c.yaml")),
        (["vmstream", "-v", "apply"], ("-v", "apply")),
        (["/sbin/docker-init", "--", "vmstream", "watch"], ("watch",)),  # compose's `init: true`
        (["python", "-m", "streams.cli.main", "api"], ("api",)),
        (["python", "-m", "streams.kube.applying", "apply", "--probe-port", "1"], ("apply", "--probe-port", "1")),
        (["dumb-init", "/opt/vmstream/bin/vmstream", "notify"], ("notify",)),
        (["/usr/local/bin/python3.11", "/opt/vmstream/bin/vmstream"], ()),
        (["/opt/vmstream/bin/python", "-c", "print()"], None),
        (["/usr/bin/sleep", "60"], None),
        # Naming vmstream is not being it.
        (["ls", "/opt/vmstream"], None),
        (["python", "tests/run.py", "/tmp/bin/vmstream", "apply"], None),
        (["sh", "-c", "vmstream worker"], None),
    ],
)
def test_a_vmstream_command_line_is_recognised(cmdline: list[str], arguments: tuple[str, ...] | None) -> None:
    assert vmstream_arguments(cmdline) == arguments


def test_processes_are_read_from_proc_but_the_check_itself(tmp_path: Path) -> None:
    def write(pid: int, *argv: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))

    write(1, "/sbin/docker-init", "--", "vmstream", "worker", "--config", "/etc/vmstream/config.yaml")
    write(7, "/opt/vmstream/bin/python", "/opt/vmstream/bin/vmstream", "worker", "--config",
          "/etc/vmstream/config.yaml")
    write(12, "/opt/vmstream/bin/python", "/opt/vmstream/bin/vmstream", "health")  # another check
    write(13, "sleep", "1")
    (tmp_path / "20").mkdir()  # a kernel thread: an empty command line
    (tmp_path / "20" / "cmdline").write_bytes(b"")
    (tmp_path / "21").mkdir()  # gone since listed
    (tmp_path / "self").mkdir()
    found = list(processes(tmp_path))
    assert [(p.pid, p.command) for p in found] == [(1, "worker"), (7, "worker")]
    assert [p.pid for p in processes(tmp_path, pid=7)] == [7]
    assert list(processes(tmp_path, pid=12)) == []


# -- where it listens, as it reads it ----------------------------------------------------


@pytest.mark.parametrize("command", sorted(health.PROBE_PORTS))
@pytest.mark.parametrize(
    ("arguments", "environment"),
    [
        ([], {}),
        (["--probe-port", "7001"], {}),
        (["--probe-host=0.0.0.0", "--probe-port=7002", "--config", "c.yaml"], {}),
        ([], {"VMSTREAM_PROBE_HOST": "10.1.2.3", "VMSTREAM_PROBE_PORT": "7003"}),
        (["--probe-port", "7004"], {"VMSTREAM_PROBE_PORT": "7003"}),
    ],
    ids=["defaults", "port", "equals-form", "environment", "argument-wins"],
)
def test_the_probe_address_is_what_the_commands_own_parser_reads(
    monkeypatch: pytest.MonkeyPatch, command: str, arguments: list[str], environment: dict[str, str]
) -> None:
    """PROBE_PORTS and the options kept in step with each command's add_probe_arguments."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    real = build_parser().parse_args([command, *arguments])  # defaults read from the environment
    assert address(Process(1, ("-v", command, *arguments))) == (real.probe_host, real.probe_port)


@pytest.mark.parametrize(
    ("command", "section", "host", "port", "default_port"),
    [("worker", "worker", "web_host", "web_port", 6066), ("api", "api", "host", "port", 6069)],
)
def test_the_worker_and_the_api_listen_where_their_configuration_says(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    command: str, section: str, host: str, port: str, default_port: int,
) -> None:
    monkeypatch.setenv("VMSTREAM_AZ", "az1")  # the one setting without a default
    assert address(Process(1, (command,))) == ("127.0.0.1", default_port)
    config = tmp_path / "config.yaml"
    config.write_text(f"az: az1\n{section}:\n  {host}: 0.0.0.0\n  {port}: 7010\n")
    assert address(Process(1, (command, "--config", str(config)))) == ("0.0.0.0", 7010)
    # The environment wins over the file, as it does for the process (VMSTREAM_<SECTION>__<KEY>).
    monkeypatch.setenv(f"VMSTREAM_{section.upper()}__{port.upper()}", "7011")
    assert address(Process(1, (command, f"--config={config}"))) == ("0.0.0.0", 7011)


def test_a_one_shot_command_has_no_address() -> None:
    with pytest.raises(ValueError, match="serves no /health"):
        address(Process(1, ("topics", "create")))


@pytest.mark.parametrize(
    ("host", "url"),
    [
        ("0.0.0.0", "http://127.0.0.1:6066/health"),
        ("", "http://127.0.0.1:6066/health"),
        ("::", "http://[::1]:6066/health"),
        ("10.244.1.7", "http://10.244.1.7:6066/health"),  # the Pod's IP, as deploy/ binds it
        ("fd00::7", "http://[fd00::7]:6066/health"),
        ("localhost", "http://localhost:6066/health"),
    ],
)
def test_an_address_on_every_interface_is_asked_on_loopback(host: str, url: str) -> None:
    assert health_url(host, 6066) == url


# -- the verdict -------------------------------------------------------------------------


def test_a_live_probe_server_is_healthy_and_a_closed_port_is_not(probes: ProbeServer) -> None:
    live = Process(7, ("apply", "--probe-port", str(probes.port)))
    code, lines = check([live], timeout=4)
    assert code == 0, lines
    assert lines == [f"healthy: vmstream apply http://127.0.0.1:{probes.port}/health"]
    closed = Process(8, ("watch", "--probe-port", str(_free_port())))
    code, lines = check([live, closed], timeout=4)
    assert code == 1
    assert lines[0].startswith("healthy: vmstream apply")
    assert lines[1].startswith("unhealthy: vmstream watch http://127.0.0.1:") and "Refused" in lines[1], lines


def test_an_init_and_its_child_are_asked_once(probes: ProbeServer) -> None:
    argv = ("notify", "--probe-port", str(probes.port))
    code, lines = check([Process(1, argv), Process(7, argv)], timeout=4)
    assert (code, len(lines)) == (0, 1), lines


def test_a_page_other_than_200_is_unhealthy(probes: ProbeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(health, "health_url", lambda host, port: f"http://127.0.0.1:{port}/nowhere")
    code, lines = check([Process(7, ("apply", "--probe-port", str(probes.port)))], timeout=4)
    assert code == 1 and lines[0].endswith(": HTTP 404"), lines


def test_a_one_shot_command_is_healthy_and_no_process_is_not() -> None:
    assert check([Process(1, ("topics", "create"))], timeout=1) == (
        0, ["healthy: nothing to check (vmstream topics serves no /health)"])
    assert check([], timeout=1) == (1, ["unhealthy: no vmstream process found"])


def test_a_port_of_zero_or_a_broken_configuration_is_unhealthy(tmp_path: Path) -> None:
    code, lines = check([Process(1, ("watch", "--probe-port", "0"))], timeout=1)
    assert code == 1 and "port 0" in lines[0]
    code, lines = check([Process(1, ("worker", "--config", str(tmp_path / "missing.yaml")))], timeout=1)
    assert code == 1 and lines[0].startswith("unhealthy: vmstream worker (pid 1): "), lines


def test_no_proxy_is_asked(probes: ProbeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An HTTP proxy in the container's environment would answer for loopback otherwise."""
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{_free_port()}")
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{_free_port()}")
    assert check([Process(7, ("apply", "--probe-port", str(probes.port)))], timeout=4)[0] == 0


# -- the command itself, on real processes -----------------------------------------------


@pytest.fixture
def fake_vmstream(tmp_path: Path) -> Path:
    script = tmp_path / "bin" / "vmstream"
    script.parent.mkdir()
    script.write_text(FAKE_VMSTREAM)
    return script


def _start(argv: list[str]) -> subprocess.Popen[str]:
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "listening"
    return process


def _stop(process: subprocess.Popen[str]) -> None:
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    if process.stdout is not None:
        process.stdout.close()


@pytest.mark.parametrize("entry", [[VMSTREAM, "health"], [sys.executable, "-m", "streams.cli.health"]],
                         ids=["vmstream-health", "python-m"])
def test_the_check_asks_the_process_it_is_given(fake_vmstream: Path, entry: list[str]) -> None:
    port = _free_port()
    served = _start([sys.executable, str(fake_vmstream), "watch", "--probe-port", str(port)])
    try:
        done = subprocess.run([*entry, "--pid", str(served.pid)], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (0, f"healthy: vmstream watch http://127.0.0.1:{port}/health\n"), done
    finally:
        _stop(served)
    done = subprocess.run([*entry, "--pid", str(served.pid)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done  # gone: no vmstream process


def _unshare() -> str:
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1)")
    tried = subprocess.run([unshare, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=30)
    if tried.returncode != 0:
        pytest.skip(f"no PID namespace here: {tried.stderr.decode(errors='replace').strip()}")
    return unshare


# PID 1 of the namespace: starts the served process, waits until it listens, runs the check
# beside it as Docker runs a HEALTHCHECK, stops the process, runs the check again.
NAMESPACE_INIT = textwrap.dedent(
    """\
    import subprocess, sys
    fake, port = sys.argv[1], sys.argv[2]
    served = subprocess.Popen([sys.executable, fake, "apply", "--probe-host", "0.0.0.0", "--probe-port", port],
                              stdout=subprocess.PIPE, text=True)
    assert served.stdout.readline().strip() == "listening"
    check = [sys.executable, "-m", "streams.cli.health"]
    done = subprocess.run(check, capture_output=True, text=True)
    print(done.stdout, end="")
    print(f"exit={done.returncode}")
    served.kill()
    served.wait()
    done = subprocess.run(check, capture_output=True, text=True)
    print(done.stdout, end="")
    print(f"exit={done.returncode}")
    """
)


def test_in_a_pid_namespace_of_its_own_the_check_finds_the_process_alone(fake_vmstream: Path) -> None:
    """As in a container: the HEALTHCHECK's command, run beside the process, finds it in /proc
    without being told which it is, and asks it on loopback (it listens on 0.0.0.0)."""
    unshare = _unshare()
    port = _free_port()
    done = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", NAMESPACE_INIT,
         str(fake_vmstream), str(port)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert done.stdout.splitlines() == [
        f"healthy: vmstream apply http://127.0.0.1:{port}/health",
        "exit=0",
        "unhealthy: no vmstream process found",
        "exit=1",
    ], (done.stdout, done.stderr)


def test_the_check_is_a_subcommand_with_its_own_exit_codes() -> None:
    parser = build_parser()
    args = parser.parse_args(["health", "--timeout", "2"])
    assert args.handler is health.run and args.timeout == 2.0 and args.pid is None
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "1 unhealthy" in (commands.choices["health"].epilog or "")
