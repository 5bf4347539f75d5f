"""docker-compose.yml and the Dockerfile stay in step with the code they package.

No container engine is needed: the files are parsed, not run (each service's command runs here
on what its mounts give it, to the point where it would reach the broker). The compose broker must
behave like ``harness.localkafka``'s (same Kafka version, same single-node settings); the
worker must reach it and run read-only as a non-root user; the image must run ``vmstream``
on Python 3.11 or later.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.localkafka import KAFKA_VERSION, SINGLE_NODE_SETTINGS
from streams.cli import health
from streams.cli.health import SERVED
from streams.cli.main import build_parser
from streams.common import errors
from streams.common.settings import Settings, WorkerSettings, load_settings
from tests.test_cli_errors import Ran, assert_one_line, clean_env, vmstream

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
VMSTREAM_SERVICES = ("topics", "worker", "notify", "api", "watch", "apply")
LONG_RUNNING_SERVICES = ("worker", "notify", "api", "watch", "apply")
OPT_IN_SERVICES = ("watch", "apply")
HEALTH_TIMEOUT = build_parser().parse_args(["health"]).timeout  # seconds the check waits


# -- helpers -----------------------------------------------------------------------------


def _env_value(value: Any) -> str:
    """An environment value as the container sees it (YAML may have typed it)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def _environment(service: dict[str, Any]) -> dict[str, str]:
    """A service's environment, from either compose form (mapping or ``KEY=value`` list)."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        pairs = (item.partition("=") for item in raw)
        return {key: value for key, _, value in pairs}
    return {key: _env_value(value) for key, value in raw.items()}


def _kafka_env_name(prop: str) -> str:
    """The apache/kafka image's env name for a server property: ``a.b_c`` → ``KAFKA_A_B__C``."""
    return "KAFKA_" + prop.replace("_", "__").replace(".", "_").upper()


def _instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for line in dockerfile.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            keyword, _, arguments = full.partition(" ")
            result.append((keyword.upper(), arguments.strip()))
    return result


def _last(instructions: list[tuple[str, str]], keyword: str) -> str:
    values = [arguments for kw, arguments in instructions if kw == keyword]
    assert values, f"the Dockerfile has no {keyword}"
    return values[-1]


def _final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    starts = [i for i, (kw, _) in enumerate(instructions) if kw == "FROM"]
    assert starts, "the Dockerfile has no FROM"
    return instructions[starts[-1]:]


def _seconds(duration: str) -> float:
    """A Docker or compose duration (``5s``, ``1m30s``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    scale = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    return sum(float(n) * scale[u] for n, u in parts)


def _healthcheck(stage: list[tuple[str, str]]) -> tuple[dict[str, str], str]:
    """The HEALTHCHECK of a stage: its ``--option=value`` pairs and its ``CMD`` (exec form)."""
    arguments = _last(stage, "HEALTHCHECK")
    flags, _, command = arguments.partition("CMD ")
    options = dict(flag[2:].split("=", 1) for flag in flags.split())
    return options, command.strip()


def _python_version(image: str) -> tuple[int, int]:
    match = re.fullmatch(r"(?:docker\.io/)?(?:library/)?python:(\d+)\.(\d+)[^\s]*", image)
    assert match, f"not a python:X.Y image: {image!r}"
    return int(match[1]), int(match[2])


# -- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = compose["services"]
    assert isinstance(found, dict)
    return found


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return _instructions(DOCKERFILE.read_text())


# -- the broker --------------------------------------------------------------------------


def test_kafka_image_is_the_local_launchers_version(services: dict[str, dict[str, Any]]) -> None:
    image = services["kafka"]["image"]
    assert image == f"apache/kafka:{KAFKA_VERSION}"


def test_broker_has_every_single_node_setting(services: dict[str, dict[str, Any]]) -> None:
    env = _environment(services["kafka"])
    expected = {_kafka_env_name(prop): value for prop, value in SINGLE_NODE_SETTINGS.items()}
    assert {name: env.get(name) for name in expected} == expected


def test_broker_keeps_internal_topics_at_one_replica(services: dict[str, dict[str, Any]]) -> None:
    """Spelled out: without these a one-node cluster has no offsets and no transactions."""
    env = _environment(services["kafka"])
    for prop in (
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
    ):
        assert SINGLE_NODE_SETTINGS[prop] == "1"
        assert env[_kafka_env_name(prop)] == "1", prop


def test_broker_is_one_kraft_node_reachable_as_kafka_9092(
    services: dict[str, dict[str, Any]],
) -> None:
    kafka = services["kafka"]
    env = _environment(kafka)
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    assert env["KAFKA_NODE_ID"] == "1"
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] == "CONTROLLER"
    assert env["CLUSTER_ID"]
    advertised = env["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert "PLAINTEXT://kafka:9092" in advertised
    protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert protocols["PLAINTEXT"] == "PLAINTEXT"
    assert "healthcheck" in kafka


# -- the vmstream services ---------------------------------------------------------------


def test_worker_reaches_the_compose_broker(services: dict[str, dict[str, Any]]) -> None:
    kafka_env = _environment(services["kafka"])
    for name in VMSTREAM_SERVICES:
        env = _environment(services[name])
        bootstrap = env["VMSTREAM_KAFKA__BOOTSTRAP_SERVERS"]
        assert bootstrap == "kafka:9092", name
        assert f"PLAINTEXT://{bootstrap}" in kafka_env["KAFKA_ADVERTISED_LISTENERS"].split(",")


def test_worker_serves_its_pages_outside_the_container(
    services: dict[str, dict[str, Any]],
) -> None:
    worker = services["worker"]
    env = _environment(worker)
    assert env["VMSTREAM_WORKER__WEB_HOST"] == "0.0.0.0"
    port = int(env.get("VMSTREAM_WORKER__WEB_PORT", WorkerSettings().web_port))
    assert any(str(mapping).endswith(f":{port}") for mapping in worker["ports"])


def test_every_long_running_service_is_checked_by_the_images_check(
    services: dict[str, dict[str, Any]], dockerfile: list[tuple[str, str]]
) -> None:
    """The one check for every process (streams/cli/health.py), as the image runs it; the
    one-shot `topics` has nothing to check."""
    image_check = ["CMD", *json.loads(_healthcheck(_final_stage(dockerfile))[1])]
    for name in LONG_RUNNING_SERVICES:
        check = services[name]["healthcheck"]
        assert not check.get("disable"), name
        assert check["test"] == image_check, name
        assert _seconds(check["timeout"]) > HEALTH_TIMEOUT, name
    assert services["topics"]["healthcheck"] == {"disable": True}
    assert {name for name, service in services.items() if service.get("command", [""])[0] in SERVED} == set(
        LONG_RUNNING_SERVICES)


def test_vmstream_services_run_read_only_as_non_root(services: dict[str, dict[str, Any]]) -> None:
    for name in VMSTREAM_SERVICES:
        service = services[name]
        assert service["read_only"] is True, name
        uid, _, gid = str(service["user"]).partition(":")
        assert uid.isdigit() and int(uid) != 0, name
        assert not gid or (gid.isdigit() and int(gid) != 0), name
        assert "/tmp" in service["tmpfs"], name


def test_worker_data_dir_is_a_volume(services: dict[str, dict[str, Any]]) -> None:
    targets = {
        volume["target"] if isinstance(volume, dict) else volume.split(":")[1]: volume
        for volume in services["worker"]["volumes"]
    }
    assert "/var/lib/vmstream" in targets
    config = targets["/etc/vmstream/config.yaml"]
    assert isinstance(config, dict)
    assert config["read_only"] is True
    assert (ROOT / config["source"]).resolve() == (ROOT / "examples" / "config.yaml").resolve()


def test_start_order(services: dict[str, dict[str, Any]]) -> None:
    assert services["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert services["topics"]["command"][:2] == ["topics", "create"]
    assert services["worker"]["depends_on"]["topics"]["condition"] == "service_completed_successfully"


def test_kubernetes_services_are_opt_in(services: dict[str, dict[str, Any]]) -> None:
    for name in OPT_IN_SERVICES:
        service = services[name]
        assert service["profiles"] == ["kubernetes"], name
        assert service["command"][0] == name
        assert _environment(service)["KUBECONFIG"]
    for name in ("kafka", "topics", "worker", "notify", "api"):
        assert "profiles" not in services[name], name


# -- what the services' files give them ---------------------------------------------------


def _container(service: dict[str, Any], root: Path) -> tuple[list[str], dict[str, str]]:
    """A service's command and environment on this machine: its bind mounts of the checkout
    laid out under ``root`` where the container sees them, its container paths moved there."""
    targets = []
    for volume in service.get("volumes", []):
        if isinstance(volume, dict) and volume["type"] == "bind":
            targets.append(volume["target"])
            if volume["source"].startswith("./"):  # the kubeconfig (from the host's environment) is left out
                where = root / volume["target"].lstrip("/")
                where.parent.mkdir(parents=True, exist_ok=True)
                where.symlink_to(ROOT / volume["source"])

    def moved(value: str) -> str:
        inside = any(value == target or value.startswith(f"{target}/") for target in targets)
        return str(root / value.lstrip("/")) if inside else value

    return [moved(arg) for arg in service["command"]], {k: moved(v) for k, v in _environment(service).items()}


def test_every_service_gets_past_its_configuration_and_keys(
        services: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """Each service's command, run on what its mounts give it, stops only for want of the
    broker or the cluster (or a port of this machine), never for its configuration or keys."""
    def run(name: str) -> tuple[str, Ran]:
        argv, env = _container(services[name], tmp_path / name)
        env = clean_env(**{**{k: v for k, v in env.items() if k.startswith("VMSTREAM_") or k == "KUBECONFIG"},
                           "VMSTREAM_KAFKA__BOOTSTRAP_SERVERS": "127.0.0.1:1"})  # no broker: start-up stops there
        return name, vmstream(*argv, env=env, cwd=tmp_path)

    with ThreadPoolExecutor(3) as pool:
        ran = dict(pool.map(run, VMSTREAM_SERVICES))
    for name in VMSTREAM_SERVICES:
        kube = name in OPT_IN_SERVICES  # its kubeconfig is the host's, not mounted here
        assert ran[name].code in ((errors.EXIT_KUBERNETES,) if kube else (errors.EXIT_KAFKA, errors.EXIT_PORT)), (
            name, ran[name].stderr)
        assert_one_line(ran[name], name, ran[name].code)


def test_the_worker_and_the_applier_seal_with_one_key_and_the_api_has_a_token(
        services: dict[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def settings(name: str) -> Settings:
        argv, env = _container(services[name], tmp_path / name)
        for variable in [variable for variable in os.environ if variable.startswith("VMSTREAM_")]:
            monkeypatch.delenv(variable)
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        return load_settings(argv[argv.index("--config") + 1])

    worker, applier = settings("worker").signing.keyring(), settings("apply").signing.keyring()
    assert worker.active is not None and worker.active == applier.active
    assert worker.keys[worker.active] == applier.keys[applier.active]
    assert any(caller.operator for caller in settings("api").api.tokens().values())


def test_the_check_asks_each_service_where_it_listens(
        services: dict[str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The image's check, given a service's command line and environment, asks the port the
    service serves /health on — the one compose publishes, where it publishes one — on
    loopback inside the container."""
    ports = {"worker": 6066, "apply": 6067, "watch": 6068, "api": 6069, "notify": 6070}
    for name in LONG_RUNNING_SERVICES:
        argv, env = _container(services[name], tmp_path / name)
        for variable in [variable for variable in os.environ if variable.startswith("VMSTREAM_")]:
            monkeypatch.delenv(variable)
        for variable, value in env.items():
            monkeypatch.setenv(variable, value)
        # As the kernel shows the process the image starts: the console script, then the command.
        process = health.Process(1, tuple(argv))
        assert health.vmstream_arguments(["/opt/vmstream/bin/python", "/opt/vmstream/bin/vmstream", *argv]) == tuple(argv)
        assert health.health_url(*health.address(process)) == f"http://127.0.0.1:{ports[name]}/health", name
        for published in services[name].get("ports", []):
            assert str(published).endswith(f":{ports[name]}"), (name, published)


# -- the image ---------------------------------------------------------------------------


def test_image_is_python_3_11_or_later(dockerfile: list[tuple[str, str]]) -> None:
    bases = [arguments.split()[0] for kw, arguments in dockerfile if kw == "FROM"]
    assert bases, "no FROM"
    for base in bases:
        if base.startswith(("python:", "docker.io/", "library/")):
            assert _python_version(base) >= (3, 11), base
    assert _python_version(bases[-1]) >= (3, 11)  # the image people run


# python:X.Y-slim by the digest of its index: the build argument (required: no default), or
# the digest itself once one is committed.
PINNED_BASE = re.compile(r"python:3\.\d+-slim@(?:\$\{PYTHON_DIGEST:\?\}|sha256:[0-9a-f]{64})")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def test_the_base_image_is_pinned_by_digest(
    dockerfile: list[tuple[str, str]], compose: dict[str, Any]
) -> None:
    """Every stage starts from the same digest of python:3.11-slim; no digest is invented:
    PYTHON_DIGEST has no default or a well-formed one, and a build without it stops."""
    first = next(i for i, (kw, _) in enumerate(dockerfile) if kw == "FROM")
    meta = dict(arguments.partition("=")[::2] for kw, arguments in dockerfile[:first] if kw == "ARG")
    assert "PYTHON_DIGEST" in meta
    assert meta["PYTHON_DIGEST"] == "" or DIGEST.fullmatch(meta["PYTHON_DIGEST"]), meta["PYTHON_DIGEST"]
    bases = {arguments.split()[0] for kw, arguments in dockerfile if kw == "FROM"}
    assert len(bases) == 1, bases
    (base,) = bases
    assert PINNED_BASE.fullmatch(base), base
    # How to get the digest, where it is asked for.
    assert "docker buildx imagetools inspect python:3.11-slim" in DOCKERFILE.read_text()
    # Compose builds the same image: it passes the digest on.
    build = compose["x-vmstream"]["build"]
    assert build["args"]["PYTHON_DIGEST"] == "${VMSTREAM_PYTHON_DIGEST:-}"


def test_a_tag_or_a_malformed_digest_is_not_a_pin() -> None:
    for base in ("python:3.11-slim", "python:3.11-slim@${PYTHON_DIGEST}", "python:3.11-slim@sha256:abc",
                 "python:3.11-slim@sha256:" + "A" * 64, "python:3.11@sha256:" + "a" * 64):
        assert not PINNED_BASE.fullmatch(base), base
    assert PINNED_BASE.fullmatch("python:3.11-slim@sha256:" + "0" * 64)


def test_image_runs_vmstream_as_non_root(dockerfile: list[tuple[str, str]]) -> None:
    final = _final_stage(dockerfile)
    assert json.loads(_last(final, "ENTRYPOINT")) == ["vmstream"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "vmstream" in scripts
    uid = _last(final, "USER").partition(":")[0]
    assert uid.isdigit() and int(uid) != 0
    command = json.loads(_last(final, "CMD"))
    assert command[0] == "worker"
    assert command[command.index("--config") + 1] == "/etc/vmstream/config.yaml"


def test_image_exposes_the_web_port_and_checks_health(dockerfile: list[tuple[str, str]]) -> None:
    final = _final_stage(dockerfile)
    assert str(WorkerSettings().web_port) in _last(final, "EXPOSE").split()
    options, command = _healthcheck(final)
    # `vmstream health` run as a module: the same check, without the other subcommands.
    assert json.loads(command) == ["python", "-m", "streams.cli.health"]
    assert build_parser().parse_args(["health"]).handler is health.run
    # Docker's timeout above the check's own, so the check says why before Docker kills it.
    assert _seconds(options["timeout"]) > HEALTH_TIMEOUT
    assert {"interval", "start-period", "retries"} <= options.keys()
    volumes = " ".join(arguments for kw, arguments in final if kw == "VOLUME")
    assert "/var/lib/vmstream" in volumes
    assert _last(final, "WORKDIR") == "/var/lib/vmstream"
