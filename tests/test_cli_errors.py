"""One face for the CLI: every subcommand answers what a person can fix — a bad
configuration file, an unreachable broker, a missing or unusable kubeconfig, a port in use —
with one line on stderr (``vmstream <command>: <what is wrong> — <what to do>``) and the
exit code of streams/common/errors.py, never a traceback; and within seconds, not after the
Kafka clients' 30 s."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import yaml

from harness.processes import free_ports
from streams.common import errors
from streams.cli.main import build_parser
from streams.common.startup import check_secrets, load_config, load_kafka_config
from streams.kube import kubeconfig
from tests.support.kube_apiserver import Kube

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = (ROOT / "examples" / "config.yaml").read_text(encoding="utf-8")
INTENT = ["intent", "set-gpu", "--by", "alice@example.com", "--project", "proj-a", "--namespace", "spx-proj-a",
          "--name", "web-1", "--gpu-class", "nvidia-a100"]
# Every subcommand, as a person would start it (without --config).
COMMANDS: dict[str, list[str]] = {
    "worker": ["worker"], "topics": ["topics", "create"], "api": ["api"], "intent": INTENT,
    "tail": ["tail", "audit"], "replay": ["replay"], "apply": ["apply"], "watch": ["watch"],
    "notify": ["notify"], "simulate": ["simulate", "--input", os.devnull],
}
KAFKA_COMMANDS = [name for name in COMMANDS if name != "simulate"]
# Every kind of bad file: (name, content or None for a file that is not there, what the line says).
BAD_FILES = [
    ("unknown-key", EXAMPLE + "bogus_section: 1\n", "unknown key 'bogus_section'"),
    ("wrong-type", EXAMPLE + "kafka:\n  partitions: many\n", "kafka.partitions"),
    ("not-yaml", EXAMPLE + "kafka: [\n  a: b\n", "not valid YAML"),
    ("missing", None, "does not exist"),
]


@dataclass
class Ran:
    code: int
    stderr: str
    seconds: float

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any VMSTREAM_*/KUBECONFIG of the shell that runs the tests."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VMSTREAM_") and k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    return {**env, **extra}


def vmstream(*argv: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> Ran:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "streams.cli.main", *argv], capture_output=True, text=True,
                          env=env or clean_env(), cwd=cwd or ROOT, timeout=120, check=False)
    return Ran(done.returncode, done.stderr, time.monotonic() - started)


def assert_one_line(ran: Ran, command: str, code: int, *says: str) -> None:
    assert "Traceback" not in ran.stderr, ran.stderr
    assert ran.code == code, ran.stderr
    mine = [line for line in ran.lines if line.startswith(f"vmstream {command}: ") and " — " in line]
    assert len(mine) == 1, ran.stderr  # what is wrong — what to do
    assert len(ran.lines) <= 2, ran.stderr  # intent may first warn that it goes unsigned
    for text in says:
        assert text in mine[0], mine[0]


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on."""
    return free_ports(1)[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A loopback port another process (this test) listens on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        yield held.getsockname()[1]


# ------------------------------------------------------------------- bad configuration


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_bad_configuration_file_is_one_line_and_exit_2(command: str, tmp_path: Path) -> None:
    def run(bad: tuple[str, str | None, str]) -> tuple[str, Ran]:
        name, content, _ = bad
        path = tmp_path / f"{name}.yaml"
        if content is not None:
            path.write_text(content, encoding="utf-8")
        kafka = ["--bootstrap-servers", "127.0.0.1:1"] if command in KAFKA_COMMANDS else []
        return name, vmstream(*COMMANDS[command], "--config", str(path), *kafka)

    with ThreadPoolExecutor(len(BAD_FILES)) as pool:
        ran = dict(pool.map(run, BAD_FILES))
    for name, _, says in BAD_FILES:
        assert_one_line(ran[name], command, errors.EXIT_USAGE, says)


def test_two_class_ids_differing_only_in_case_are_refused_by_every_command(tmp_path: Path) -> None:
    # Class ids are case-insensitive: kept, one of the two classes would silently be lost.
    config = tmp_path / "config.yaml"
    config.write_text(EXAMPLE.replace("  nvidia-a100:\n", "  NVIDIA-A100:\n    device_name: nvidia.com/GA100_A100_PCIE_80GB\n"
                                      "  nvidia-a100:\n"), encoding="utf-8")
    assert "NVIDIA-A100:" in config.read_text(encoding="utf-8")

    def run(command: str) -> tuple[str, Ran]:
        kafka = ["--bootstrap-servers", "127.0.0.1:1"] if command in KAFKA_COMMANDS else []
        return command, vmstream(*COMMANDS[command], "--config", str(config), *kafka)

    with ThreadPoolExecutor(4) as pool:
        ran = dict(pool.map(run, COMMANDS))
    for command in COMMANDS:
        assert_one_line(ran[command], command, errors.EXIT_USAGE, "gpu_classes", "'NVIDIA-A100'", "'nvidia-a100'",
                        "differ only in case")


def test_schemas_into_a_place_that_is_not_a_directory_is_one_line_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("", encoding="utf-8")
    ran = vmstream("schemas", "--output", str(tmp_path / "file" / "schemas"))
    assert_one_line(ran, "schemas", errors.EXIT_USAGE, "cannot write into")


def test_the_first_problem_named_is_a_misspelt_key_not_the_required_one_it_hid(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(EXAMPLE.replace("az: az1", "zone: az1"), encoding="utf-8")
    with pytest.raises(errors.ConfigError) as caught:
        load_config(argparse.Namespace(config=str(path)))
    assert "unknown key 'zone'" in caught.value.message and "(and 1 more)" in caught.value.message


def test_an_intent_for_a_gpu_class_outside_the_catalog_is_refused_before_kafka(
        tmp_path: Path, closed_port: int) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(EXAMPLE, encoding="utf-8")
    argv = [*INTENT[:-1], "nvidia-h100", "--config", str(config), "--bootstrap-servers", f"127.0.0.1:{closed_port}"]
    ran = vmstream(*argv)
    assert_one_line(ran, "intent", errors.EXIT_USAGE, "'nvidia-h100' is not in the catalog", "nvidia-a100")
    upper = vmstream(*INTENT[:-1], "NVIDIA-A100", "--config", str(config),
                     "--bootstrap-servers", f"127.0.0.1:{closed_port}")
    assert_one_line(upper, "intent", errors.EXIT_KAFKA)  # in the catalog (case-insensitive): on to Kafka


# ------------------------------------------------------------------- unreachable broker


@pytest.mark.parametrize("command", [c for c in KAFKA_COMMANDS if c not in ("watch", "apply")])
def test_an_unreachable_broker_is_one_line_and_exit_4_within_seconds(command: str, closed_port: int) -> None:
    ran = vmstream(*COMMANDS[command], "--config", str(ROOT / "examples" / "config.yaml"),
                   "--bootstrap-servers", f"127.0.0.1:{closed_port}")
    assert_one_line(ran, command, errors.EXIT_KAFKA, f"no Kafka broker answers at 127.0.0.1:{closed_port}")
    assert ran.seconds < 30, f"{ran.seconds:.1f}s: the Kafka clients' own 30 s, not the probe's bound"


@pytest.mark.parametrize("command", ["watch", "apply"])
def test_an_unreachable_broker_is_one_line_and_exit_4_for_the_kubernetes_processes(
        command: str, kube: Kube, closed_port: int) -> None:
    ran = vmstream(*COMMANDS[command], "--config", str(ROOT / "examples" / "config.yaml"), "--kubeconfig",
                   str(kube.kubeconfig), "--bootstrap-servers", f"127.0.0.1:{closed_port}", "--probe-port", "0")
    assert_one_line(ran, command, errors.EXIT_KAFKA, f"no Kafka broker answers at 127.0.0.1:{closed_port}")
    assert ran.seconds < 30, f"{ran.seconds:.1f}s"


# ------------------------------------------------------------------- kubeconfig


@pytest.mark.parametrize("command", ["watch", "apply"])
def test_a_missing_or_unusable_kubeconfig_is_one_line_and_exit_6(
        command: str, tmp_path: Path, closed_port: int) -> None:
    garbage = tmp_path / "garbage"
    garbage.write_text("just: [a, list]\n", encoding="utf-8")
    nowhere = tmp_path / "nowhere"
    nowhere.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: 'https://127.0.0.1:{closed_port}', "
        "insecure-skip-tls-verify: true}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n",
        encoding="utf-8")
    base = [*COMMANDS[command], "--config", str(ROOT / "examples" / "config.yaml"), "--probe-port", "0",
            "--bootstrap-servers", f"127.0.0.1:{closed_port}"]
    cases = {
        "flag, missing": (["--kubeconfig", str(tmp_path / "absent")], clean_env(), "does not exist"),
        "flag, not a kubeconfig": (["--kubeconfig", str(garbage)], clean_env(), "is not usable"),
        "KUBECONFIG, missing": ([], clean_env(KUBECONFIG=str(tmp_path / "absent")), "($KUBECONFIG) does not exist"),
        "none at all": ([], clean_env(HOME=str(tmp_path)), "(the default kubeconfig) does not exist"),
        "API server not there": (["--kubeconfig", str(nowhere)], clean_env(), "does not answer"),
    }

    def run(case: str) -> tuple[str, Ran]:
        extra, env, _ = cases[case]
        return case, vmstream(*base, *extra, env=env)

    with ThreadPoolExecutor(len(cases)) as pool:
        ran = dict(pool.map(run, cases))
    for case, (_, _, says) in cases.items():
        assert_one_line(ran[case], command, errors.EXIT_KUBERNETES, says)


def test_the_kubeconfig_precedence_is_flag_then_kubeconfig_then_in_cluster_then_home(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KUBECONFIG", f"/env/first{os.pathsep}/env/second")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert kubeconfig._source("/flag") == ("flag", "/flag")
    assert kubeconfig._source(None) == ("KUBECONFIG", "/env/first")
    monkeypatch.delenv("KUBECONFIG")
    assert kubeconfig._source(None) == ("in-cluster", None)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    assert kubeconfig._source(None) == ("default", str(tmp_path / ".kube" / "config"))


def test_both_kubernetes_processes_load_their_kubeconfig_through_the_one_loader() -> None:
    for module in ("applying/process", "watching"):
        text = (ROOT / "streams" / "kube" / f"{module}.py").read_text(encoding="utf-8")
        assert "streams.kube.kubeconfig import" in text, module
        assert "load_kube_config" not in text and "load_incluster_config" not in text, module


# ------------------------------------------------------------------- ports


def test_a_port_in_use_is_one_line_and_exit_7(taken_port: int, closed_port: int) -> None:
    example = str(ROOT / "examples" / "config.yaml")
    kafka = ["--bootstrap-servers", f"127.0.0.1:{closed_port}"]  # checked before Kafka: never reached
    cases = {
        "worker": (["worker", "--config", example, *kafka], clean_env(VMSTREAM_WORKER__WEB_PORT=str(taken_port)),
                   "worker.web_port"),
        "api": (["api", "--config", example, *kafka], clean_env(VMSTREAM_API__PORT=str(taken_port)), "api.port"),
        "notify": (["notify", "--config", example, "--probe-port", str(taken_port), *kafka], clean_env(),
                   "--probe-port"),
    }

    def run(case: str) -> tuple[str, Ran]:
        argv, env, _ = cases[case]
        return case, vmstream(*argv, env=env)

    with ThreadPoolExecutor(len(cases)) as pool:
        ran = dict(pool.map(run, cases))
    for case, (_, _, says) in cases.items():
        assert_one_line(ran[case], case, errors.EXIT_PORT, f"127.0.0.1:{taken_port} is in use", says)


# ------------------------------------------------------------------- the face itself


def test_version_prints_the_package_version() -> None:
    done = subprocess.run([sys.executable, "-m", "streams.cli.main", "--version"], capture_output=True,
                          text=True, check=False, timeout=60)
    assert done.returncode == 0
    assert done.stdout.strip() == f"vmstream {version('vmstream')}"


def test_every_subcommand_has_a_description_and_the_exit_codes_in_its_help() -> None:
    parser = build_parser()
    assert parser.epilog == errors.EXIT_CODES_HELP
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(COMMANDS) | {"schemas"} <= set(commands.choices)
    for name, subparser in commands.choices.items():
        assert subparser.description, name
        assert subparser.epilog and "exit codes" in subparser.epilog, name


def test_every_kafka_subcommand_takes_bootstrap_servers_and_it_wins(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    parser = build_parser()
    for name in KAFKA_COMMANDS:
        args = parser.parse_args([*COMMANDS[name], "--bootstrap-servers", "flag:9092"])
        assert args.bootstrap_servers == "flag:9092", name
    config = tmp_path / "config.yaml"
    config.write_text(EXAMPLE + "kafka:\n  bootstrap_servers: file:9092\n", encoding="utf-8")
    monkeypatch.setenv("VMSTREAM_KAFKA__BOOTSTRAP_SERVERS", "env:9092")
    given = argparse.Namespace(config=str(config), bootstrap_servers="flag:9092")
    assert load_config(given).kafka.bootstrap_servers == "flag:9092"
    assert load_kafka_config(given).bootstrap_servers == "flag:9092"
    assert load_config(argparse.Namespace(config=str(config))).kafka.bootstrap_servers == "env:9092"


def test_the_line_is_one_line_whatever_the_cause_held() -> None:
    error = errors.KafkaUnreachable("first\nsecond   third", "do this")
    assert error.line("tail") == "vmstream tail: first second third — do this"
    assert error.exit_code == errors.EXIT_KAFKA


def test_a_token_or_key_file_that_cannot_be_read_is_one_line_and_exit_2(tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "config.yaml")
    empty = tmp_path / "empty"
    empty.write_text("", encoding="utf-8")
    kafka = ["--bootstrap-servers", "127.0.0.1:1"]  # checked before Kafka: never reached
    cases = {
        "worker": (["worker", "--config", example, *kafka],
                   clean_env(VMSTREAM_WORKER__WEB_TOKEN_FILE=str(tmp_path / "absent")), "worker.web_token"),
        "api": (["api", "--config", example, *kafka], clean_env(VMSTREAM_API__OPERATOR_TOKEN_FILE=str(empty)),
                "api tokens"),
    }

    def run(case: str) -> tuple[str, Ran]:
        argv, env, _ = cases[case]
        return case, vmstream(*argv, env=env)

    with ThreadPoolExecutor(len(cases)) as pool:
        ran = dict(pool.map(run, cases))
    for case, (_, _, says) in cases.items():
        assert_one_line(ran[case], case, errors.EXIT_USAGE, says)


# ------------------------------------------------------------------- keys


# What a JWKS file may be wrong with: (name, content or None for a file that is not there,
# what the line says besides auth.jwks_file).
BAD_JWKS = [
    ("missing", None, "No such file or directory"),
    ("empty", "", "empty, not a JWKS"),
    ("not-json", '{"keys": [\n', "not JSON"),
    ("not-a-jwks", '{"kid": "k1", "kty": "OKP"}', "not a JWKS"),
    ("no-usable-key", '{"keys": [{"kid": "k1", "kty": "oct", "k": "c2VjcmV0"}]}', "no usable key"),
]
VERIFYING = ["worker", "simulate", "replay"]  # the commands that verify intents' credentials


def test_a_missing_empty_or_broken_jwks_is_one_line_and_exit_2_before_any_connection(tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "config.yaml")
    cases: dict[tuple[str, str], tuple[dict[str, str], list[str]]] = {}
    for command in VERIFYING:
        cases[command, "jwt without a key set"] = (clean_env(VMSTREAM_AUTH__MODE="jwt"),
                                                   ["neither auth.jwks_file nor auth.jwks_url"])
        for name, content, says in BAD_JWKS:
            path = tmp_path / f"{name}.json"
            if content is not None:
                path.write_text(content, encoding="utf-8")
            cases[command, name] = (clean_env(VMSTREAM_AUTH__MODE="jwt", VMSTREAM_AUTH__JWKS_FILE=str(path)),
                                    ["auth.jwks_file", str(path), says])

    def run(case: tuple[str, str]) -> tuple[tuple[str, str], Ran]:
        command = case[0]
        kafka = ["--bootstrap-servers", "127.0.0.1:1"] if command in KAFKA_COMMANDS else []  # never reached
        return case, vmstream(*COMMANDS[command], "--config", example, *kafka, env=cases[case][0])

    with ThreadPoolExecutor(4) as pool:
        ran = dict(pool.map(run, cases))
    for case, (_, said) in cases.items():
        assert_one_line(ran[case], case[0], errors.EXIT_USAGE, *said)


def test_an_empty_key_set_is_a_key_set(tmp_path: Path) -> None:
    """``{"keys": []}`` is what deploy/ ships until the signers' keys are published: not a mistake."""
    jwks = tmp_path / "jwks.json"
    jwks.write_text('{"keys": []}', encoding="utf-8")
    ran = vmstream("simulate", "--config", str(ROOT / "examples" / "config.yaml"), "--input", os.devnull,
                   env=clean_env(VMSTREAM_AUTH__MODE="jwt", VMSTREAM_AUTH__JWKS_FILE=str(jwks)))
    assert ran.code == errors.EXIT_OK and not ran.lines, ran.stderr


def without_signing(path: Path, **signing: object) -> Path:
    """The example configuration at ``path`` with ``signing`` replaced (left out: no key at all)."""
    config = yaml.safe_load(EXAMPLE)
    config.pop("signing", None)
    if signing:
        config["signing"] = signing
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


def test_a_worker_or_applier_without_a_key_to_seal_with_does_not_start(tmp_path: Path) -> None:
    # Unsealed, every command the worker publishes would be refused by the applier, silently.
    none = without_signing(tmp_path / "none.yaml")
    two = without_signing(tmp_path / "two.yaml", keys={"k1": "a" * 32, "k2": "b" * 32})
    empty = tmp_path / "empty-secret"  # a mounted Secret without any key
    empty.mkdir()
    unmounted = without_signing(tmp_path / "unmounted.yaml", keys_file=str(empty))
    env = clean_env(HOME=str(tmp_path))  # no kubeconfig either: the keys are checked first
    cases = {
        ("worker", "none"): (none, ["no key to seal commands with", "signing.keys_file", "signing.keys"]),
        ("apply", "none"): (none, ["no key to seal results with", "signing.keys_file", "signing.keys"]),
        ("worker", "two keys"): (two, ["signing.key_id is not set", "k1, k2"]),
        ("worker", "empty Secret"): (unmounted, [f"signing.keys_file {empty} holds none"]),
    }

    def run(case: tuple[str, str]) -> tuple[tuple[str, str], Ran]:
        config, _ = cases[case]
        return case, vmstream(*COMMANDS[case[0]], "--config", str(config), "--bootstrap-servers", "127.0.0.1:1",
                              env=env)

    with ThreadPoolExecutor(4) as pool:
        ran = dict(pool.map(run, cases))
    for case, (_, said) in cases.items():
        assert_one_line(ran[case], case[0], errors.EXIT_USAGE, *said)


def test_the_example_configuration_gets_every_process_past_its_keys_from_any_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's commands as written: with examples/config.yaml, a process fails only for
    want of a broker or a cluster, wherever it is started from (the key is beside the file)."""
    example = ROOT / "examples" / "config.yaml"
    for name in [name for name in os.environ if name.startswith("VMSTREAM_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    settings = load_config(argparse.Namespace(config=str(example)))
    check_secrets(settings, seals="commands", page_token=True, credentials=True)
    check_secrets(settings, seals="results")
    ran = vmstream("apply", "--config", str(example), env=clean_env(HOME=str(tmp_path)), cwd=tmp_path)
    assert_one_line(ran, "apply", errors.EXIT_KUBERNETES, "kubeconfig")


def test_a_keys_or_tokens_file_that_is_not_yaml_is_one_line_and_exit_2(tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "config.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("k1: [\n  a: b\n", encoding="utf-8")
    kafka = ["--bootstrap-servers", "127.0.0.1:1"]  # checked before Kafka: never reached
    cases = {
        "worker": (clean_env(VMSTREAM_SIGNING__KEYS_FILE=str(broken)), "not YAML"),
        "apply": (clean_env(VMSTREAM_SIGNING__KEYS_FILE=str(broken), HOME=str(tmp_path)), "not YAML"),
        "api": (clean_env(VMSTREAM_API__PROJECT_TOKENS_FILE=str(broken)), "api.project_tokens_file"),
    }

    def run(case: str) -> tuple[str, Ran]:
        return case, vmstream(*COMMANDS[case], "--config", example, *kafka, env=cases[case][0])

    with ThreadPoolExecutor(len(cases)) as pool:
        ran = dict(pool.map(run, cases))
    for case, (_, says) in cases.items():
        assert_one_line(ran[case], case, errors.EXIT_USAGE, str(broken), says, "line 3, column 1")


def test_a_file_that_cannot_be_read_is_said_of_the_setting_that_names_it(tmp_path: Path) -> None:
    settings = load_config(argparse.Namespace(config=str(ROOT / "examples" / "config.yaml")))
    absent = str(tmp_path / "absent")
    updates: list[tuple[dict[str, Any], str]] = [
        ({"signing": settings.signing.model_copy(update={"keys_file": absent})}, "signing.keys_file"),
        ({"worker": settings.worker.model_copy(update={"web_token_file": absent})}, "worker.web_token_file")]
    for update, says in updates:
        with pytest.raises(errors.ConfigError) as caught:
            check_secrets(settings.model_copy(update=update), seals="commands", page_token=True)
        assert caught.value.message == f"{says}: {absent}: No such file or directory"


def test_a_ca_file_that_cannot_be_read_is_one_line_and_exit_2_not_a_server_that_does_not_answer(
        tmp_path: Path) -> None:
    example = str(ROOT / "examples" / "config.yaml")
    absent = str(tmp_path / "ca.crt")
    tls = {"VMSTREAM_KAFKA__SECURITY_PROTOCOL": "SSL", "VMSTREAM_KAFKA__SSL_CAFILE": absent}
    cases = {
        "worker": (clean_env(**tls), "kafka.ssl_cafile"),
        "tail": (clean_env(**tls), "kafka.ssl_cafile"),
        "notify": (clean_env(VMSTREAM_NOTIFY__SMTP__HOST="127.0.0.1", VMSTREAM_NOTIFY__SMTP__SSL_CAFILE=absent),
                   "notify.smtp.ssl_cafile"),
    }

    def run(case: str) -> tuple[str, Ran]:
        return case, vmstream(*COMMANDS[case], "--config", example, "--bootstrap-servers", "127.0.0.1:1",
                              env=cases[case][0])

    with ThreadPoolExecutor(len(cases)) as pool:
        ran = dict(pool.map(run, cases))
    for case, (_, says) in cases.items():
        assert_one_line(ran[case], case, errors.EXIT_USAGE, f"{says}: {absent}: No such file or directory")
