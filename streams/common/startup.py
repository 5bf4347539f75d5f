"""What every command checks before it starts, each problem raised as one :class:`UserError`.

- the configuration file: missing, not YAML, an unknown key, a value of the wrong type
  (:func:`load_config`, :func:`load_kafka_config`);
- the files it names, read now: keys, tokens, the JWKS, CA files, and a key to seal with
  where the process seals (:func:`check_secrets`); the Kafka credentials' files, a client
  certificate and its key loaded as a pair, by both loaders;
- ``--bootstrap-servers``, which wins over ``kafka.bootstrap_servers`` and its variable;
- the broker: one metadata round trip bounded by :data:`KAFKA_PROBE_SECONDS`, so a broker
  that is not there is reported in seconds, not after the clients' own 30 s, and before
  it an OAUTHBEARER token, so that a token endpoint's refusal is said as such
  (:func:`reach_kafka`);
- the ports a process listens on (:func:`check_port`, :func:`cannot_listen`).
"""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml
from pydantic import ValidationError

from handlers.contracts.config import lower_case_class_ids
from streams.common.errors import EXIT_OK, ConfigError, KafkaUnreachable, PortInUse
from streams.common.probes import ProbeServer

log = logging.getLogger(__name__)
from streams.common.settings import KafkaSettings, Settings, load_kafka_settings, load_settings, read_yaml

KAFKA_PROBE_SECONDS = 5.0
CONFIG_HINT = "fix the file given with --config (or the VMSTREAM_* variable); docs/contracts.md lists every key"


def add_kafka_arguments(parser: argparse.ArgumentParser) -> None:
    """``--bootstrap-servers``, on every command that talks to Kafka."""
    parser.add_argument("--bootstrap-servers", metavar="HOST:PORT[,HOST:PORT]",
                        help="the Kafka brokers (default: kafka.bootstrap_servers of --config, "
                        "else $VMSTREAM_KAFKA__BOOTSTRAP_SERVERS, else 127.0.0.1:9092)")


def _problem(error: ValidationError) -> str:
    """The first problem of a validation error in a line: ``kafka.partitions: …``."""
    order = {"extra_forbidden": 0, "missing": 2}  # a misspelt key first, the required one it missed last
    problems = sorted(error.errors(), key=lambda problem: order.get(problem["type"], 1))
    first = problems[0]
    where = ".".join(str(part) for part in first["loc"])
    if first["type"] == "extra_forbidden":
        text = f"unknown key {where!r}"
    elif first["type"] == "missing":
        text = f"missing key {where!r}"
    elif first["type"] == "value_error" and isinstance(first.get("input"), dict):
        # A section's own check across its keys (kafka's credentials): its text says it all,
        # and the section's values (secrets among them) are not repeated.
        text = f"{where}: {first['msg'].removeprefix('Value error, ')}"
    else:
        given = repr(first.get("input"))
        given = given if len(given) <= 60 else given[:57] + "..."
        text = f"{where}: {first['msg']} (got {given})" if where else first["msg"]
    if len(problems) > 1:
        text += f" (and {len(problems) - 1} more)"
    return text


def _config_error(path: str | Path | None, error: Exception) -> ConfigError:
    where = f"configuration {path}" if path else "configuration (VMSTREAM_* variables)"
    if isinstance(error, FileNotFoundError):
        return ConfigError(f"configuration file {path} does not exist", "give an existing file with --config")
    if isinstance(error, OSError):
        return ConfigError(f"configuration file {path} cannot be read: {error.strerror or error}",
                           "give a readable file with --config")
    if isinstance(error, ValidationError):
        return ConfigError(f"{where}: {_problem(error)}", CONFIG_HINT)
    cause = error.__cause__
    if isinstance(cause, yaml.MarkedYAMLError) and cause.problem_mark is not None:
        mark = cause.problem_mark
        return ConfigError(f"{where} is not valid YAML: {cause.problem} at line {mark.line + 1}, "
                           f"column {mark.column + 1}", "fix the YAML syntax there")
    if isinstance(cause, yaml.YAMLError):
        return ConfigError(f"{where} is not valid YAML: {cause}", "fix the YAML syntax")
    return ConfigError(f"{where}: {error}", CONFIG_HINT)


def _with_servers(kafka: KafkaSettings, args: argparse.Namespace) -> KafkaSettings:
    servers: str | None = getattr(args, "bootstrap_servers", None)
    return kafka.model_copy(update={"bootstrap_servers": servers}) if servers else kafka


def _check_kafka_files(kafka: KafkaSettings) -> None:
    """The files the Kafka clients read, read now: the CA files, the client certificate and its
    key (which must load as a pair), the token file. A :class:`ConfigError` names the setting,
    where the clients would otherwise say only that no broker answers."""
    _check_readable("kafka.ssl_cafile", kafka.ssl_cafile if kafka.tls else None)
    _check_readable("kafka.ssl_certfile", kafka.ssl_certfile)
    _check_readable("kafka.ssl_keyfile", kafka.ssl_keyfile)
    if kafka.sasl and kafka.sasl_mechanism == "OAUTHBEARER":
        _check_readable("kafka.oauth.token_file", kafka.oauth.token_file)
        _check_readable("kafka.oauth.ssl_cafile", kafka.oauth.ssl_cafile if kafka.oauth.token_endpoint_uri else None)
    if kafka.ssl_certfile and kafka.ssl_keyfile:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(
                kafka.ssl_certfile, kafka.ssl_keyfile,
                kafka.ssl_key_password.get_secret_value() if kafka.ssl_key_password else None)
        except (ssl.SSLError, OSError) as error:
            raise ConfigError(f"kafka.ssl_certfile: {kafka.ssl_certfile} and kafka.ssl_keyfile {kafka.ssl_keyfile} "
                              f"are not a certificate and its key ({getattr(error, 'reason', None) or error})",
                              "give the PEM files of one client certificate (user.crt and user.key of a "
                              "Strimzi KafkaUser's Secret), and kafka.ssl_key_password if the key is encrypted") from error


def _check_readable(setting: str, path: str | None) -> None:
    """A :class:`ConfigError` if the file ``setting`` names cannot be read (a CA file: the
    clients would otherwise say only that the server does not answer)."""
    if path is None:
        return
    try:
        with open(path, "rb"):
            pass
    except OSError as error:
        raise ConfigError(f"{setting}: {path}: {error.strerror or error}",
                          "fix the file or value the configuration names") from error


def load_config(args: argparse.Namespace) -> Settings:
    """The whole configuration (``--config`` and ``VMSTREAM_*``), ``--bootstrap-servers`` applied."""
    path = getattr(args, "config", None)
    try:
        settings = load_settings(path)
    except (OSError, ValueError) as error:  # a ValidationError is a ValueError
        raise _config_error(path, error) from error
    _check_kafka_files(settings.kafka)
    kafka = _with_servers(settings.kafka, args)
    return settings if kafka is settings.kafka else settings.model_copy(update={"kafka": kafka})


def load_kafka_config(args: argparse.Namespace) -> KafkaSettings:
    """Only ``kafka`` of the configuration, as clients read it, ``--bootstrap-servers`` applied."""
    path = getattr(args, "config", None)
    try:
        kafka = load_kafka_settings(path)
        loaded = read_yaml(path)
    except (OSError, ValueError) as error:
        raise _config_error(path, error) from error
    unknown = sorted(set(loaded) - set(Settings.model_fields))
    if unknown:  # the other sections are not read here, but a misspelt one is still a mistake
        raise ConfigError(f"configuration {path}: unknown key {unknown[0]!r}", CONFIG_HINT)
    try:  # nor is a catalog that would lose a class (intent checks its --gpu-class against it)
        lower_case_class_ids(loaded.get("gpu_classes"))
    except ValueError as error:
        raise ConfigError(f"configuration {path}: gpu_classes: {error}", CONFIG_HINT) from error
    _check_kafka_files(kafka)
    return _with_servers(kafka, args)


def check_secrets(settings: Settings, *, signing: bool = False, seals: str | None = None,
                  page_token: bool = False, api_tokens: bool = False, credentials: bool = False,
                  smtp: bool = False) -> None:
    """Read the files the configuration names for keys and tokens now, so that one missing,
    empty or broken is a :class:`ConfigError` at start, before any connection, not a
    traceback from deep inside a process. ``seals``: what the process seals (``"commands"``,
    ``"results"``), which it cannot do without a key: unsealed, its messages would all be
    refused. ``credentials``: the key set intents' credentials are verified with (``auth``;
    a JWKS URL is not fetched here). ``smtp``: the CA file of the mail relay, if used."""
    from streams.common.credentials import check_key_set

    # (what a problem is said of, the setting naming the file an OSError is about, the check)
    checks: list[tuple[str, str, Callable[[], object]]] = []
    if signing or seals:
        checks.append(("signing", "signing.keys_file", settings.signing.keyring))
    if seals:
        checks.append(("signing", "signing.keys_file", lambda: _key_to_seal(settings, seals)))
    if page_token:
        checks.append(("worker.web_token", "worker.web_token_file", settings.worker.page_token))
    if api_tokens:
        checks.append(("api tokens", "api tokens", settings.api.tokens))
    if credentials:  # its text names the setting
        checks.append(("", "auth.jwks_file", lambda: check_key_set(settings.auth)))
    if smtp:
        smtp_settings = settings.notify.smtp
        used = smtp_settings.host is not None and smtp_settings.security != "none"
        checks.append(("", "notify.smtp.ssl_cafile",
                       lambda: _check_readable("notify.smtp.ssl_cafile", smtp_settings.ssl_cafile if used else None)))
    for section, file_setting, read in checks:
        try:
            read()
        except OSError as error:
            raise ConfigError(f"{file_setting}: {error.filename}: {error.strerror or error}",
                              "fix the file or value the configuration names") from error
        except ValueError as error:  # a KeyringError is a ValueError
            raise ConfigError(f"{section}: {error}" if section else str(error),
                              "fix the file or value the configuration names") from error


def _key_to_seal(settings: Settings, seals: str) -> None:
    """A :class:`ConfigError` naming the setting that is missing, unless there is a key to seal with."""
    signing = settings.signing
    keyring = signing.keyring()
    if keyring.active is not None:
        return
    hint = ("give the worker and the applier the same key: signing.keys_file or VMSTREAM_SIGNING__KEYS "
            "(docs/security.md; examples/config.yaml names an example key)")
    if not keyring:
        where = (f"signing.keys_file {signing.keys_file} holds none" if signing.keys_file
                 else "neither signing.keys_file nor signing.keys is set")
        raise ConfigError(f"signing: no key to seal {seals} with: {where}", hint)
    raise ConfigError(f"signing: no key to seal {seals} with: signing.key_id is not set and there are "
                      f"{len(keyring.keys)} keys ({', '.join(sorted(keyring.keys))})",
                      "set signing.key_id to the one that seals (docs/security.md, rotation)")


def config_problem(path: str | Path | None, error: Exception) -> ConfigError:
    """The :class:`ConfigError` of an error raised while reading ``path`` (for loaders of
    their own sections, such as the watch bridge's ``limits``)."""
    return _config_error(path, error)


@contextmanager
def quiet(logger: str) -> Iterator[None]:
    """A probe's client logs nothing but the one line its failure becomes (``-v``: each try)."""
    quieted = logging.getLogger(logger)
    level = quieted.level
    if not logging.getLogger().isEnabledFor(logging.DEBUG):
        quieted.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        quieted.setLevel(level)


def reach_kafka(kafka: KafkaSettings, timeout: float = KAFKA_PROBE_SECONDS) -> None:
    """Raise :class:`KafkaUnreachable` unless a broker answers a metadata request within
    ``timeout`` seconds."""
    from confluent_kafka import KafkaException

    from streams.common.kafka_clients import admin_client

    if kafka.sasl and kafka.sasl_mechanism == "OAUTHBEARER":
        from streams.common.oauth import TokenError, token_source

        try:  # the token first: a refusal of the token endpoint is said as such
            token_source(kafka.oauth).token()
        except TokenError as error:
            raise KafkaUnreachable(f"no OAUTHBEARER token: {error}",
                                   "check kafka.oauth: the token endpoint, the client id and secret, "
                                   "or the token file") from error
    try:
        with quiet("kafka"):  # librdkafka's lines of each connection refused
            admin_client(kafka, client_id="vmstream-probe").list_topics(timeout=timeout)
    except KafkaException as error:
        hint = ("start one (python -m harness kafka up), or give its address with --bootstrap-servers "
                "or kafka.bootstrap_servers")
        if kafka.security_protocol != "PLAINTEXT":  # a TLS or SASL refusal looks the same to the client
            hint += (f", or check the credentials for {kafka.security_protocol} (kafka.ssl_*, kafka.sasl_*, "
                     "kafka.oauth): a broker that refuses them does not answer either")
        raise KafkaUnreachable(
            f"no Kafka broker answers at {kafka.bootstrap_servers} within {timeout:g}s ({error.args[0].name()})",
            hint,
        ) from error


def cannot_listen(host: str, port: int, option: str, error: OSError) -> PortInUse:
    """The :class:`PortInUse` of an ``OSError`` raised by binding ``host:port``."""
    if error.errno == errno.EADDRINUSE:
        return PortInUse(f"{host}:{port} is in use by another process",
                         f"stop that process, or choose another port with {option}")
    return PortInUse(f"cannot listen on {host}:{port}: {error.strerror or error}",
                     f"choose another address or port with {option}")


def check_port(host: str, port: int, option: str) -> None:
    """Raise :class:`PortInUse` if ``host:port`` cannot be listened on now, before a server
    that binds it later (Faust's web server, the API's) fails deep inside its start-up."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
            probe.bind(address)
    except socket.gaierror as error:
        raise PortInUse(f"cannot listen on {host}:{port}: {error.strerror or error}",
                        f"choose another address with {option}") from error
    except OSError as error:
        raise cannot_listen(host, port, option, error) from error


def run_until_signalled(
    name: str,
    run: Callable[[threading.Event], None],
    probes: Callable[[threading.Event], ProbeServer],
    *,
    host: str,
    port: int,
) -> int:
    """``run(stop)`` until SIGTERM or SIGINT sets ``stop``, serving ``/health``, ``/ready`` and
    ``/metrics`` (``probes(stop)``) if the probe port is free. A process without a web server
    of its own (the watch bridge, the applier) goes on without probes when the port is taken:
    its work matters more than being probed, and a kubelet would notice."""
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("%s: %s received, stopping after the current piece of work", name, signal.Signals(signum).name)
        stop.set()

    server: ProbeServer | None
    try:
        server = probes(stop).start()
    except OSError as error:
        log.error("%s: no /health, /ready, /metrics: %s", name,
                  cannot_listen(host, port, "--probe-port", error).line(None))
        server = None
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        run(stop)
    finally:
        if server is not None:
            server.close()
    return EXIT_OK
