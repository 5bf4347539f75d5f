"""A real single-node Apache Kafka broker (KRaft) on loopback, without Docker.

Tests, CI and the demo need a real broker and this machine has no container engine, so
the broker runs from Kafka's own jars: Maven resolves ``org.apache.kafka:kafka_2.13`` and
its runtime dependencies once into ``cache_dir()/kafka/<version>/lib``; every start then
writes ``server.properties`` and a quiet log4j2 config into a data directory, formats the
storage with ``kafka.tools.StorageTool`` (unless it holds a cluster to keep), runs
``kafka.Kafka`` with Java and polls until a metadata request answers.

Two ways to use it: ``LocalKafka`` as a context manager owns a broker for one process (the
test fixture; a fresh cluster each start), while ``up`` / ``down`` / ``status`` keep one
broker running in the background across commands, recorded in a state file (``main`` is
the CLI for those). That one keeps its topics and records across ``down`` / ``up`` (and on
the same ports when they are free) unless ``up --reset`` starts it empty.

A ``LocalKafka`` may require its clients to authenticate: ``sasl=Sasl(...)`` with SCRAM and
the StandardAuthorizer, ``tls=Tls.create(dir)`` with a client certificate (mutual TLS),
``oauth=OAuthBearer(...)`` with an OAuth 2 token (harness/localoauth.py), ``tls`` and ``oauth``
together over SASL_SSL; ``admin_options()`` are kafka-python's options of a client that may
do anything there.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any

from harness import processes
from harness.locations import cache_dir
from harness.processes import free_ports

# kafka-python 3.0 reads its protocol schemas with importlib.resources.read_text/open_text,
# deprecated on Python 3.11-3.12 (and no longer in 3.13): silence exactly that, once, here.
with warnings.catch_warnings():
    warnings.filterwarnings(
        "ignore", message=r"(read_text|open_text) is deprecated", category=DeprecationWarning
    )
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError
    from kafka.net.sasl.oauth import AbstractTokenProvider as KafkaPythonTokenProvider

__all__ = [
    "KAFKA_VERSION",
    "SINGLE_NODE_SETTINGS",
    "BrokerRunning",
    "BrokerState",
    "ClientCertificate",
    "KafkaStartError",
    "LocalKafka",
    "OAuthBearer",
    "Sasl",
    "Tls",
    "down",
    "free_ports",
    "main",
    "probe",
    "resolve_jars",
    "status",
    "up",
]

log = logging.getLogger(__name__)

KAFKA_VERSION = "4.4.0"
SCALA_VERSION = "2.13"
# Kafka's published POMs lack the SLF4J binding that its release tarball adds: without
# log4j-slf4j-impl (the SLF4J 1.x binding; Kafka still uses slf4j-api 1.7) the broker logs
# nothing. Pinned to the log4j that kafka-server itself brings, so versions do not mix.
LOG4J_VERSION = "2.25.5"
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"

HEAP_FLAGS = ("-Xms256m", "-Xmx512m")
# Kafka's own defaults from kafka-run-class.sh.
GC_FLAGS = (
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
)
# StorageTool runs for a second: skip the optimising JIT and G1's set-up (saves ~1 s).
TOOL_FLAGS = ("-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC")
BROKER_MAIN = "kafka.Kafka"
STORAGE_TOOL_MAIN = "kafka.tools.StorageTool"
START_TIMEOUT = 120.0
STOP_TIMEOUT = 30.0
_MARKER = ".complete.json"
_STATE_FILE = "state.json"
_PORTS_FILE = "ports.json"  # in a kept data dir: the ports its cluster last ran on


class KafkaStartError(RuntimeError):
    """The broker could not be obtained or did not come up; the message holds the log tail."""


@dataclass(frozen=True)
class BrokerState:
    """What ``up`` records so later commands can find (and stop) the background broker."""

    pid: int
    port: int
    controller_port: int
    data_dir: str
    version: str

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"


# -- jars ------------------------------------------------------------------------------


def kafka_home(version: str = KAFKA_VERSION) -> Path:
    """Per-version cache folder: ``lib/`` with the jars, the generated pom, a lock."""
    return cache_dir() / "kafka" / version


def _pom(version: str) -> str:
    dependencies = [
        ("org.apache.kafka", f"kafka_{SCALA_VERSION}", version),
        ("org.apache.logging.log4j", "log4j-slf4j-impl", LOG4J_VERSION),
        ("org.apache.logging.log4j", "log4j-api", LOG4J_VERSION),
        ("org.apache.logging.log4j", "log4j-core", LOG4J_VERSION),
    ]
    entries = "\n".join(
        f"    <dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId>"
        f"<version>{ver}</version></dependency>"
        for group, artifact, ver in dependencies
    )
    return f"""<?xml version="1.0" encoding="UTF-8"?>
<!-- Generated by harness/localkafka.py: the jars a local Kafka broker needs. -->
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>vmstream.local</groupId>
  <artifactId>kafka-broker-jars</artifactId>
  <version>{version}</version>
  <packaging>pom</packaging>
  <dependencies>
{entries}
  </dependencies>
</project>
"""


def _complete_lib(lib: Path) -> bool:
    marker = lib / _MARKER
    try:
        jars = json.loads(marker.read_text())["jars"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(jars) and all((lib / name).is_file() for name in jars)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialise work on one folder across processes (parallel test runs, a CLI call)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def resolve_jars(version: str = KAFKA_VERSION) -> Path:
    """Return the folder of broker jars, resolving them with Maven the first time.

    The Maven local repository lives under ``cache_dir()`` too, so one cache folder holds
    everything and a fresh one proves the download path.
    """
    home = kafka_home(version)
    lib = home / "lib"
    if _complete_lib(lib):
        log.info("Kafka %s: using cached jars in %s", version, lib)
        return lib
    with _locked(home / ".lock"):
        if _complete_lib(lib):  # another process finished while we waited
            return lib
        mvn = shutil.which("mvn")
        if mvn is None:
            raise KafkaStartError("Maven (mvn) is needed once to fetch Kafka's jars: not on PATH")
        log.info("Kafka %s: resolving jars with Maven into %s (once, then cached)", version, lib)
        started = time.monotonic()
        pom = home / "pom.xml"
        pom.write_text(_pom(version))
        partial = home / "lib.partial"
        shutil.rmtree(partial, ignore_errors=True)
        command = [
            mvn,
            "-q",
            "-B",
            "-Dstyle.color=never",
            f"-Dmaven.repo.local={cache_dir() / 'maven' / 'repository'}",
            "-f",
            str(pom),
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={partial}",
        ]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        jars = sorted(p.name for p in partial.glob("*.jar")) if partial.is_dir() else []
        if result.returncode != 0 or not jars:
            output = processes.tail_text(result.stdout + result.stderr)
            raise KafkaStartError(
                f"Maven could not resolve Kafka {version} (exit {result.returncode}):\n{output}"
            )
        (partial / _MARKER).write_text(json.dumps({"version": version, "jars": jars}, indent=1))
        shutil.rmtree(lib, ignore_errors=True)
        partial.rename(lib)
        log.info(
            "Kafka %s: %d jars resolved in %.1fs", version, len(jars), time.monotonic() - started
        )
        return lib


# -- processes -------------------------------------------------------------------------


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home, "bin", "java") if java_home else None
    if candidate is not None and candidate.is_file():
        return str(candidate)
    found = shutil.which("java")
    if found is None:
        raise KafkaStartError("Java 17+ is needed to run Kafka: no java on PATH or in JAVA_HOME")
    return found


def _broker_argv(data_dir: Path) -> processes.ArgvCheck:
    """Guard against a recycled pid: the process must be ``kafka.Kafka`` on this data dir."""
    properties = str(data_dir / "server.properties")
    return lambda argv: BROKER_MAIN in argv and properties in argv


def _terminate(pid: int, data_dir: Path, timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM (Kafka shuts down cleanly on it), then SIGKILL if it overstays."""
    processes.stop(pid, "Kafka broker", timeout, argv=_broker_argv(data_dir), level=logging.INFO)


# -- readiness -------------------------------------------------------------------------


def probe(bootstrap_servers: str, *, timeout: float = 2.0, sasl: tuple[str, str] | None = None,
          options: Mapping[str, Any] | None = None) -> bool:
    """Whether a broker at ``bootstrap_servers`` answers a metadata request with itself
    (``sasl``: the user and password to ask as, over SCRAM-SHA-512; ``options``: other
    kafka-python security options, a client certificate or a token provider)."""
    host, _, port = bootstrap_servers.split(",")[0].rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError:
        return False
    timeout_ms = int(timeout * 1000)
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap_servers,
            client_id="vmstream-localkafka-probe",
            bootstrap_timeout_ms=timeout_ms,
            request_timeout_ms=timeout_ms,
            **(sasl_options(*sasl) if sasl else {}),
            **(options or {}),
        )
    except (KafkaError, OSError):
        return False
    try:
        brokers = admin.describe_cluster().get("brokers") or []
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()
    return any(not broker.get("is_fenced", False) for broker in brokers)


# -- configuration ---------------------------------------------------------------------


def _free(port: int) -> bool:
    """Whether nothing listens on loopback ``port`` (it can be bound now)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cluster_id() -> str:
    """A Kafka ``Uuid`` string (as ``StorageTool random-uuid`` makes), without a JVM start."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):  # Kafka avoids these: they read as CLI options
            return text


# Everything but the listeners and the data dir, shared with the fixture's container so
# both brokers behave alike. One node: every internal topic has a single replica; the
# transaction.state lines are what make transactional (exactly-once) producers work.
SINGLE_NODE_SETTINGS: Mapping[str, str] = MappingProxyType(
    {
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "6",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "6",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        # Faust creates its own internal topics, but clients may still rely on this.
        "auto.create.topics.enable": "true",
        "num.partitions": "6",
    }
)


SASL_MECHANISM = "SCRAM-SHA-512"
AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"


@dataclass(frozen=True)
class Sasl:
    """Clients must authenticate (SCRAM-SHA-512) and be allowed (KRaft's StandardAuthorizer).

    ``users`` (name → password) are created with the storage; ``admin`` is the super user
    the broker itself and its administrators use, everyone else may do only what ACLs allow.
    The controller listener authenticates the broker with PLAIN (KRaft keeps no SCRAM
    credentials for it), as the same admin.
    """

    admin_password: str
    users: Mapping[str, str]
    admin: str = "admin"

    def format_args(self) -> list[str]:
        args: list[str] = []
        for name, password in {self.admin: self.admin_password, **self.users}.items():
            args += ["--add-scram", f"{SASL_MECHANISM}=[name={name},password={password}]"]
        return args

    def properties(self) -> dict[str, str]:
        admin = f'username="{self.admin}" password="{self.admin_password}"'
        return {
            "sasl.enabled.mechanisms": SASL_MECHANISM,
            "sasl.mechanism.inter.broker.protocol": SASL_MECHANISM,
            "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config":
                f"org.apache.kafka.common.security.scram.ScramLoginModule required {admin};",
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config":
                f'org.apache.kafka.common.security.plain.PlainLoginModule required {admin} '
                f'user_{self.admin}="{self.admin_password}";',
            "authorizer.class.name": AUTHORIZER,
            "super.users": f"User:{self.admin}",
            "allow.everyone.if.no.acl.found": "false",
        }


def sasl_options(user: str, password: str) -> dict[str, str]:
    """kafka-python's options for a SCRAM user of a :class:`Sasl` broker."""
    return {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": SASL_MECHANISM,
            "sasl_plain_username": user, "sasl_plain_password": password}


@dataclass(frozen=True)
class ClientCertificate:
    """What a Strimzi ``type: tls`` KafkaUser's Secret holds, as files: the user's certificate
    and key, and the CA that signed the brokers' certificates."""

    cafile: Path
    certfile: Path
    keyfile: Path

    def options(self) -> dict[str, Any]:
        """kafka-python's options for this client over SSL."""
        return {"security_protocol": "SSL", "ssl_cafile": str(self.cafile), "ssl_certfile": str(self.certfile),
                "ssl_keyfile": str(self.keyfile)}


class Tls:
    """The client listener speaks TLS with a certificate of a throwaway CA (harness/pki.py's
    ``CertificateAuthority``), the keystore and truststore as PEM files (Kafka's
    ``ssl.keystore.type=PEM``). Alone, it is mutual TLS: the listener is ``SSL`` with
    ``ssl.client.auth=required``, so only a client with a certificate of that CA connects, as
    the principal ``User:CN=<name>`` (Strimzi's ``type: tls`` listener authentication). With
    :class:`OAuthBearer` it is ``SASL_SSL``: TLS for privacy, the token for the principal.

    ``Tls.create(directory)`` writes the CA (``ca.crt``) and the broker's key and certificate
    (both server and client use: the broker connects to its own listener for inter-broker
    requests); ``client(name)`` signs a client certificate as the User Operator would.
    """

    def __init__(self, directory: Path, authority: Any) -> None:
        self.directory = directory
        self.authority = authority
        self.cafile = directory / "ca.crt"
        self.keystore = directory / "broker.pem"

    @classmethod
    def create(cls, directory: Path) -> Tls:
        from harness.pki import CertificateAuthority

        directory.mkdir(parents=True, exist_ok=True)
        tls = cls(directory, CertificateAuthority.create(directory / "ca"))
        (directory / "ca.crt").write_bytes((directory / "ca" / "ca.crt").read_bytes())
        tls._write_broker_keystore()
        return tls

    def _write_broker_keystore(self) -> None:
        """The broker's private key (PKCS#8) and certificate chain in one PEM file."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.now(UTC)
        ca_cert, ca_key = self.authority.cert, self.authority.key
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kafka-broker")]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                        x509.DNSName("localhost")]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        pem += cert.public_bytes(serialization.Encoding.PEM) + ca_cert.public_bytes(serialization.Encoding.PEM)
        self.keystore.write_bytes(pem)
        self.keystore.chmod(0o600)

    def client(self, name: str) -> ClientCertificate:
        """A client certificate for principal ``CN=name``, in ``<directory>/users/<name>/``
        as ``user.crt``, ``user.key`` and ``ca.crt`` (a Strimzi KafkaUser's Secret)."""
        folder = self.directory / "users" / name
        certfile, keyfile = self.authority.issue(folder, "user", name)
        cafile = folder / "ca.crt"
        cafile.write_bytes(self.cafile.read_bytes())
        return ClientCertificate(cafile=cafile, certfile=certfile, keyfile=keyfile)

    def properties(self, listener: str, *, client_auth: bool) -> dict[str, str]:
        prefix = f"listener.name.{listener.lower()}."
        return {
            f"{prefix}ssl.keystore.type": "PEM",
            f"{prefix}ssl.keystore.location": str(self.keystore),
            f"{prefix}ssl.truststore.type": "PEM",
            f"{prefix}ssl.truststore.location": str(self.cafile),
            f"{prefix}ssl.client.auth": "required" if client_auth else "none",
        }


OAUTH_LOGIN_MODULE = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginModule"
OAUTH_VALIDATOR = "org.apache.kafka.common.security.oauthbearer.OAuthBearerValidatorCallbackHandler"
OAUTH_LOGIN = "org.apache.kafka.common.security.oauthbearer.OAuthBearerLoginCallbackHandler"
# Kafka 4 reads OAuth URLs only from this list (CVE-2025-27817): a JVM system property.
OAUTH_ALLOWED_URLS = "org.apache.kafka.sasl.oauthbearer.allowed.urls"


@dataclass(frozen=True)
class OAuthBearer:
    """Clients must authenticate with SASL OAUTHBEARER: a JWT that Kafka's own
    ``OAuthBearerValidatorCallbackHandler`` verifies against the keys at ``jwks_url``, with
    ``issuer`` and ``audience``; its subject is the principal (Strimzi's ``type: oauth``
    listener authentication does the same with its own validator). The broker gets its own
    token from ``token_url`` with the client credentials grant as ``client_id``
    (``OAuthBearerLoginCallbackHandler``). harness/localoauth.py's ``TokenEndpoint`` serves both.
    """

    token_url: str
    jwks_url: str
    issuer: str
    audience: str
    client_id: str
    client_secret: str

    def properties(self, listener: str) -> dict[str, str]:
        prefix = f"listener.name.{listener.lower()}.oauthbearer."
        return {
            "sasl.enabled.mechanisms": "OAUTHBEARER",
            "sasl.mechanism.inter.broker.protocol": "OAUTHBEARER",
            f"{prefix}sasl.jaas.config": f'{OAUTH_LOGIN_MODULE} required clientId="{self.client_id}" '
                                         f'clientSecret="{self.client_secret}";',
            f"{prefix}sasl.server.callback.handler.class": OAUTH_VALIDATOR,
            f"{prefix}sasl.login.callback.handler.class": OAUTH_LOGIN,
            "sasl.oauthbearer.token.endpoint.url": self.token_url,
            "sasl.oauthbearer.jwks.endpoint.url": self.jwks_url,
            "sasl.oauthbearer.expected.issuer": self.issuer,
            "sasl.oauthbearer.expected.audience": self.audience,
        }

    def jvm_flags(self) -> list[str]:
        return [f"-D{OAUTH_ALLOWED_URLS}={self.token_url},{self.jwks_url}"]

    def token(self, timeout: float = 10.0) -> str:
        """A token for ``client_id``, by the client credentials grant (the readiness probe's)."""
        form = urllib.parse.urlencode({"grant_type": "client_credentials", "client_id": self.client_id,
                                       "client_secret": self.client_secret}).encode()
        with urllib.request.urlopen(urllib.request.Request(self.token_url, data=form), timeout=timeout) as answer:
            token: str = json.loads(answer.read())["access_token"]
        return token


class _Token(KafkaPythonTokenProvider):  # type: ignore[misc]
    """kafka-python's token provider for one token fetched by :meth:`OAuthBearer.token`."""

    def __init__(self, oauth: OAuthBearer) -> None:
        super().__init__()
        self.oauth = oauth

    def token(self) -> str:
        return self.oauth.token()


def oauth_options(oauth: OAuthBearer, *, tls: Tls | None = None) -> dict[str, Any]:
    """kafka-python's options for the broker's own OAuth client (the probe's, an admin's)."""
    options: dict[str, Any] = {"security_protocol": "SASL_SSL" if tls else "SASL_PLAINTEXT",
                               "sasl_mechanism": "OAUTHBEARER", "sasl_oauth_token_provider": _Token(oauth)}
    if tls is not None:
        options["ssl_cafile"] = str(tls.cafile)
    return options


def _server_properties(*, port: int, controller_port: int, log_dirs: Path, sasl: Sasl | None = None,
                       tls: Tls | None = None, oauth: OAuthBearer | None = None) -> str:
    if tls is not None or oauth is not None:
        # The client listener is the only one a client reaches; the controller's listener
        # (KRaft's own requests, never a produce or fetch) stays PLAINTEXT on loopback.
        listener = ("SASL_SSL" if tls else "SASL_PLAINTEXT") if oauth else "SSL"
        secured = {
            "listeners": f"{listener}://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"{listener}://127.0.0.1:{port}",
            "inter.broker.listener.name": listener,
            "listener.security.protocol.map": f"CONTROLLER:PLAINTEXT,{listener}:{listener}",
            **(tls.properties(listener, client_auth=oauth is None) if tls else {}),
            **(oauth.properties(listener) if oauth else {}),
        }
    if sasl is not None:
        secured = {
            "listeners": f"SASL_PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
            "advertised.listeners": f"SASL_PLAINTEXT://127.0.0.1:{port}",
            "inter.broker.listener.name": "SASL_PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
            **sasl.properties(),
        }
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(log_dirs),
        **SINGLE_NODE_SETTINGS,
    }
    if sasl is not None or tls is not None or oauth is not None:
        settings.update(secured)
    lines = ["# Generated by harness/localkafka.py: one KRaft node on loopback."]
    lines += [f"{key}={value}" for key, value in settings.items()]
    return "\n".join(lines) + "\n"


_LOG4J2_XML = """\
<?xml version="1.0" encoding="UTF-8"?>
<!-- Generated by harness/localkafka.py: warnings and errors only, into the data dir. -->
<Configuration status="WARN" shutdownHook="disable">
  <Appenders>
    <File name="server" fileName="${sys:kafka.logs.dir}/server.log" append="true">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </File>
  </Appenders>
  <Loggers>
    <Root level="WARN"><AppenderRef ref="server"/></Root>
    <!-- Keeps the "Kafka Server started" line for orientation. -->
    <Logger name="kafka.server.KafkaRaftServer" level="INFO"/>
  </Loggers>
</Configuration>
"""


# -- the broker ------------------------------------------------------------------------


class LocalKafka(processes.Supervisor):
    """One broker process owned by the caller: ``with LocalKafka() as kafka: ...``.

    Every start is a fresh, empty cluster on new loopback ports (``port`` fixes the client
    port), unless ``keep_data``: then a ``data_dir`` already formatted is started as it is,
    with its topics and records, on the ports it last had when they are free. Without
    ``data_dir`` a temporary folder is used and removed on stop. ``detach=True`` puts the
    broker in its own session so it outlives the caller (``up``).
    """

    def __init__(
        self,
        *,
        data_dir: Path | None = None,
        version: str = KAFKA_VERSION,
        port: int | None = None,
        detach: bool = False,
        start_timeout: float = START_TIMEOUT,
        keep_data: bool = False,
        sasl: Sasl | None = None,
        tls: Tls | None = None,
        oauth: OAuthBearer | None = None,
    ) -> None:
        if sasl is not None and (tls is not None or oauth is not None):
            raise ValueError("Sasl (SCRAM) is a broker of its own: not with tls or oauth")
        self.version = version
        self.sasl = sasl
        self.tls = tls
        self.oauth = oauth
        self._keep_data = keep_data
        self._data_dir = data_dir
        self._owns_data_dir = data_dir is None
        self._fixed_port = port
        self._detach = detach
        self._start_timeout = start_timeout
        self._pid: int | None = None
        self._port: int | None = None
        self._controller_port: int | None = None
        self._admin_certificate: ClientCertificate | None = None

    @property
    def bootstrap_servers(self) -> str:
        if self._port is None:
            raise RuntimeError("LocalKafka is not started")
        return f"127.0.0.1:{self._port}"

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise RuntimeError("LocalKafka is not started")
        return self._data_dir

    @property
    def server_log(self) -> Path:
        return self.data_dir / "logs" / "server.log"

    def admin_options(self) -> dict[str, Any]:
        """kafka-python's security options of a client that may do anything here: the SCRAM
        admin, a client certificate ``CN=admin``, or the broker's own OAuth client."""
        if self.sasl is not None:
            return sasl_options(self.sasl.admin, self.sasl.admin_password)
        if self.oauth is not None:
            return oauth_options(self.oauth, tls=self.tls)
        if self.tls is not None:
            if self._admin_certificate is None:
                self._admin_certificate = self.tls.client("admin")
            return self._admin_certificate.options()
        return {}

    def state(self) -> BrokerState:
        if self._pid is None or self._port is None or self._controller_port is None:
            raise RuntimeError("LocalKafka is not started")
        return BrokerState(
            pid=self._pid,
            port=self._port,
            controller_port=self._controller_port,
            data_dir=str(self.data_dir),
            version=self.version,
        )

    def start(self) -> str:
        """Start the broker and return its bootstrap servers once it answers."""
        if self._pid is not None:
            raise RuntimeError("LocalKafka is already started")
        lib = resolve_jars(self.version)
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="vmstream-kafka-"))
        # A port picked free can be taken before the JVM binds it: retry with new ones.
        attempts = 1 if self._fixed_port is not None else 3
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(lib)
            except KafkaStartError as error:
                if attempt < attempts and "Address already in use" in str(error):
                    log.warning("Kafka port taken meanwhile, retrying on other ports")
                    if self._pid is not None:
                        _terminate(self._pid, self.data_dir)
                        self._pid = None
                    continue
                self.stop()
                raise
            except BaseException:
                self.stop()
                raise
            break
        if not self._detach:
            atexit.register(self.stop)
        return self.bootstrap_servers

    def _kept(self) -> bool:
        """Whether this start continues the cluster already stored in the data dir."""
        return self._keep_data and (self.data_dir / "kraft" / "meta.properties").is_file()

    def _last_ports(self) -> tuple[int, int] | None:
        """The ports the kept cluster last ran on, if both are free now."""
        try:
            recorded = json.loads((self.data_dir / _PORTS_FILE).read_text())
            port, controller = int(recorded["port"]), int(recorded["controller_port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if self._fixed_port is not None and self._fixed_port != port:
            return None
        return (port, controller) if _free(port) and _free(controller) else None

    def _start_once(self, lib: Path) -> None:
        data_dir = self.data_dir
        kept = self._kept()
        last = self._last_ports() if kept else None
        if last is not None:
            self._port, self._controller_port = last
        elif self._fixed_port is not None:
            spare = [p for p in free_ports(2) if p != self._fixed_port]
            self._port, self._controller_port = self._fixed_port, spare[0]
        else:
            self._port, self._controller_port = free_ports(2)
        kraft = data_dir / "kraft"
        logs = data_dir / "logs"
        # Logs tell only this start; the storage is new unless a kept cluster lives there.
        if not kept:
            shutil.rmtree(kraft, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)
        logs.mkdir(parents=True)
        properties = data_dir / "server.properties"
        properties.write_text(
            _server_properties(
                port=self._port, controller_port=self._controller_port, log_dirs=kraft, sasl=self.sasl,
                tls=self.tls, oauth=self.oauth,
            )
        )
        log4j = data_dir / "log4j2.xml"
        log4j.write_text(_LOG4J2_XML)
        common = [
            f"-Dlog4j2.configurationFile={log4j}",
            f"-Dkafka.logs.dir={logs}",
            "-cp",
            str(lib / "*"),
        ]

        if kept:
            log.info("Kafka %s: keeping the cluster stored in %s", self.version, kraft)
            format_run = None
        else:
            log.info("Kafka %s: formatting storage in %s", self.version, kraft)
            format_args = ("format", "-t", _cluster_id(), "-c", str(properties),
                           *(self.sasl.format_args() if self.sasl else ()))
            format_run = subprocess.run(
                [_java(), *TOOL_FLAGS, *common, STORAGE_TOOL_MAIN, *format_args],
                capture_output=True,
                text=True,
                check=False,
            )
        if format_run is not None and format_run.returncode != 0:
            raise KafkaStartError(
                f"Kafka storage format failed (exit {format_run.returncode}):\n"
                f"{processes.tail_text(format_run.stdout + format_run.stderr)}\n"
                f"--- {self.server_log} ---\n{processes.log_tail(self.server_log)}"
            )

        console = logs / "console.log"
        log.info("Kafka %s: starting broker on %s", self.version, self.bootstrap_servers)
        started = time.monotonic()
        pid = self._pid = processes.spawn(
            [_java(), *HEAP_FLAGS, *GC_FLAGS, *(self.oauth.jvm_flags() if self.oauth else ()), *common,
             BROKER_MAIN, str(properties)],
            console,
            detach=self._detach,
        )
        bootstrap_servers = self.bootstrap_servers
        credentials = (self.sasl.admin, self.sasl.admin_password) if self.sasl else None
        options = self.admin_options() if self.tls or self.oauth else None
        try:
            processes.wait_ready(
                "Kafka broker",
                lambda: probe(bootstrap_servers, timeout=1.0, sasl=credentials, options=options),
                self._start_timeout,
                watch={pid: "Kafka broker"},
            )
        except processes.NotReady as failed:
            if failed.pid is not None:  # it ended and has been reaped
                self._pid = None
            raise KafkaStartError(self._failure(str(failed))) from None
        if self._keep_data:
            ports = {"port": self._port, "controller_port": self._controller_port}
            (data_dir / _PORTS_FILE).write_text(json.dumps(ports))
        log.info(
            "Kafka %s: broker ready at %s (pid %d) in %.1fs",
            self.version,
            self.bootstrap_servers,
            self._pid,
            time.monotonic() - started,
        )

    def _failure(self, headline: str) -> str:
        console = self.data_dir / "logs" / "console.log"
        return (
            f"{headline}\n--- {self.server_log} ---\n{processes.log_tail(self.server_log)}\n"
            f"--- {console} ---\n{processes.log_tail(console)}"
        )

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the broker (if running) and remove a temporary data dir. Idempotent."""
        atexit.unregister(self.stop)
        if self._pid is not None:
            _terminate(self._pid, self.data_dir, timeout)
            self._pid = None
        if self._owns_data_dir and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            self._data_dir = None
        self._port = None
        self._controller_port = None


# -- a background broker across commands -----------------------------------------------


def default_state_dir() -> Path:
    return cache_dir() / "kafka" / "run"


def _read_state(state_dir: Path) -> BrokerState | None:
    try:
        raw = json.loads((state_dir / _STATE_FILE).read_text())
        return BrokerState(**raw)
    except (OSError, ValueError, TypeError):
        return None


def status(state_dir: Path | None = None) -> BrokerState | None:
    """The background broker recorded in ``state_dir`` if it still runs, else None."""
    state_dir = state_dir or default_state_dir()
    state = _read_state(state_dir)
    if state is None or not processes.running(state.pid, _broker_argv(Path(state.data_dir))):
        return None
    return state


class BrokerRunning(RuntimeError):
    """``up --reset`` while the broker runs: its data is in use."""


def up(
    state_dir: Path | None = None,
    *,
    port: int | None = None,
    version: str = KAFKA_VERSION,
    reset: bool = False,
) -> BrokerState:
    """Start a background broker (or return the one already running) and record it.

    The broker keeps its topics and records in ``state_dir`` across ``down`` / ``up``;
    ``reset`` starts it empty instead (only while it is down).
    """
    state_dir = state_dir or default_state_dir()
    with _locked(state_dir / ".lock"):
        running = status(state_dir)
        if running is not None:
            if reset:
                raise BrokerRunning(
                    f"Kafka runs at {running.bootstrap_servers} (pid {running.pid}): "
                    "stop it first (python -m harness kafka down) to start it empty"
                )
            if port is not None and port != running.port:
                log.warning("Kafka already running on port %d, not %d", running.port, port)
            log.info("Kafka already running at %s (pid %d)", running.bootstrap_servers, running.pid)
            return running
        broker = LocalKafka(
            data_dir=state_dir / "broker", version=version, port=port, detach=True, keep_data=not reset
        )
        broker.start()
        state = broker.state()
        target = state_dir / _STATE_FILE
        scratch = target.with_suffix(".tmp")
        scratch.write_text(json.dumps(asdict(state), indent=1))
        scratch.replace(target)
        return state


def down(state_dir: Path | None = None, *, timeout: float = STOP_TIMEOUT) -> bool:
    """Stop the background broker; True if one was running."""
    state_dir = state_dir or default_state_dir()
    with _locked(state_dir / ".lock"):
        running = status(state_dir)
        if running is not None:
            _terminate(running.pid, Path(running.data_dir), timeout)
        (state_dir / _STATE_FILE).unlink(missing_ok=True)
        return running is not None


def main(argv: list[str]) -> int:
    """``python -m harness kafka up|down|status``: a broker for the demo that outlives the command."""
    parser = argparse.ArgumentParser(
        prog="python -m harness kafka", description="A local Apache Kafka broker (KRaft, no Docker)."
    )
    parser.add_argument("command", choices=("up", "down", "status"))
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help=f"where the running broker is recorded (default: {default_state_dir()})",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="client port for 'up' (default: the one it last had if free, else any free)",
    )
    parser.add_argument(
        "--reset",
        action="store_true",
        help="'up' with an empty cluster: every topic and record of the last run is removed",
    )
    args = parser.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
        logging.getLogger("kafka").setLevel(logging.WARNING)  # the readiness probe's chatter

    if args.command == "down":
        stopped = down(args.state_dir)
        print("stopped" if stopped else "not running", file=sys.stderr)
        return 0
    if args.command == "up":
        try:
            running: BrokerState | None = up(args.state_dir, port=args.port, reset=args.reset)
        except (KafkaStartError, BrokerRunning) as error:
            print(error, file=sys.stderr)
            return 1
        assert running is not None
        # For the shell: eval "$(python -m harness kafka up)" points tests and vmstream at it.
        print(f"export KAFKA_BOOTSTRAP_SERVERS={running.bootstrap_servers}")
        print(f"export VMSTREAM_KAFKA__BOOTSTRAP_SERVERS={running.bootstrap_servers}")
        return 0
    running = status(args.state_dir)
    if running is None:
        print("not running", file=sys.stderr)
        return 1
    print(running.bootstrap_servers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
