"""The configuration file (docs/contracts.md) plus the shell's own options, from YAML and env.

Precedence, highest first: environment variables (``VMSTREAM_<KEY>``, nested with
``__``: ``VMSTREAM_DRAIN__NOTICE_SECONDS=60``), then the YAML file, then defaults. The
rules see only :class:`~handlers.contracts.config.Config`; Kafka and worker options stay here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from handlers.contracts.config import Config
from handlers.contracts.delivery import Endpoint, Route
from handlers.contracts.topics import Topic
from streams.common.signing import Keyring, keyring_from, yaml_problem


class KafkaOAuthSettings(BaseModel):
    """SASL OAUTHBEARER's token (``kafka.sasl_mechanism: OAUTHBEARER``): an OAuth 2 access
    token from a token endpoint by the client credentials grant, as a Strimzi ``type: oauth``
    listener expects (docs/security.md), or read from ``token_file``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token_endpoint_uri: str | None = Field(
        default=None, description="The OAuth 2 token endpoint asked for a token with the client credentials "
        "grant (Strimzi: tokenEndpointUri), e.g. https://sso.example.com/realms/kafka/protocol/openid-connect/token.")
    client_id: str | None = Field(default=None, description="The OAuth 2 client this process authenticates as "
                                  "(Strimzi: clientId); the broker's principal is the token's subject.")
    client_secret: SecretStr | None = Field(default=None, description="The client's secret, sent with HTTP Basic "
                                            "authentication (VMSTREAM_KAFKA__OAUTH__CLIENT_SECRET).")
    scope: str | None = Field(default=None, description="The scope asked for, if the token endpoint wants one.")
    audience: str | None = Field(default=None, description="The audience asked for, if the token endpoint wants one.")
    token_file: str | None = Field(
        default=None, description="Instead of a token endpoint: a file holding the access token, read again "
        "whenever a token is needed after a minute or past its expiry (a projected or mounted token, tests).")
    ssl_cafile: str | None = Field(default=None, description="The CA certificates (PEM) the token endpoint's TLS "
                                   "certificate is verified with; default: the system's.")
    timeout_seconds: float = Field(default=10.0, gt=0, description="How long one token request may take.")

    @property
    def configured(self) -> bool:
        """Whether any way to a token is set."""
        return bool(self.token_file or self.token_endpoint_uri or self.client_id or self.client_secret)


class KafkaSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    bootstrap_servers: str = "127.0.0.1:9092"
    topic_prefix: str = "vmstream."
    partitions: int = Field(default=6, ge=1)
    replication_factor: int = Field(default=1, ge=1)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="SSL: TLS, with a client certificate if ssl_certfile is set (mutual TLS, "
        "a Strimzi type: tls KafkaUser); SASL_SSL, SASL_PLAINTEXT: sasl_mechanism over TLS or not.")
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = Field(
        default=None, description="PLAIN and SCRAM-*: sasl_username and sasl_password; OAUTHBEARER: a token as "
        "the oauth section says.")
    sasl_username: str | None = Field(default=None, description="PLAIN and SCRAM-*: the principal's name (a "
                                      "Strimzi type: scram-sha-512 KafkaUser's name).")
    sasl_password: SecretStr | None = Field(default=None, description="PLAIN and SCRAM-*: its password (the "
                                            "KafkaUser's Secret, key password; VMSTREAM_KAFKA__SASL_PASSWORD).")
    ssl_cafile: str | None = Field(default=None, description="The CA certificates (PEM) the brokers' certificates "
                                   "are verified with (a Strimzi cluster CA's ca.crt); default: the system's.")
    ssl_certfile: str | None = Field(
        default=None, description="The client certificate (PEM) presented to the brokers: mutual TLS, with "
        "security_protocol SSL (or SASL_SSL). A Strimzi type: tls KafkaUser's Secret holds it as user.crt.")
    ssl_keyfile: str | None = Field(default=None, description="The client certificate's private key (PEM; "
                                    "user.key of a Strimzi KafkaUser's Secret); needed with ssl_certfile.")
    ssl_key_password: SecretStr | None = Field(default=None, description="The password of ssl_keyfile, "
                                               "if it is encrypted.")
    oauth: KafkaOAuthSettings = KafkaOAuthSettings()
    # False where the topics are managed elsewhere (Strimzi KafkaTopics, deploy/components/strimzi):
    # processes then only check that they exist, and need no permission to create them.
    create_topics: bool = True

    @property
    def tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def sasl(self) -> bool:
        """Whether the clients authenticate with SASL (the ``sasl_*`` and ``oauth`` settings
        are read only then)."""
        return self.security_protocol.startswith("SASL_")

    @model_validator(mode="after")
    def _credentials_fit(self) -> KafkaSettings:
        """The credentials fit the protocol: a mistake here is said at start, not as a
        broker that closes the connection."""
        if (self.ssl_certfile or self.ssl_keyfile) and not self.tls:
            raise ValueError(f"a client certificate (ssl_certfile, ssl_keyfile) needs security_protocol SSL or "
                             f"SASL_SSL, not {self.security_protocol}")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            given, other = ("ssl_certfile", "ssl_keyfile") if self.ssl_certfile else ("ssl_keyfile", "ssl_certfile")
            raise ValueError(f"{given} is set but {other} is not: a client certificate needs both")
        oauth = self.oauth
        if not self.sasl:
            return self
        if self.sasl_mechanism == "OAUTHBEARER":
            if oauth.token_file and oauth.token_endpoint_uri:
                raise ValueError("oauth.token_file and oauth.token_endpoint_uri are both set: give one")
            missing = [] if oauth.token_file else [
                f"oauth.{name}" for name in ("token_endpoint_uri", "client_id", "client_secret") if not getattr(oauth, name)]
            if missing:
                raise ValueError(f"sasl_mechanism OAUTHBEARER needs oauth.token_file, or oauth.token_endpoint_uri, "
                                 f"oauth.client_id and oauth.client_secret: {', '.join(missing)} not set")
        elif oauth.configured:
            raise ValueError(f"oauth is set but sasl_mechanism is {self.sasl_mechanism}, not OAUTHBEARER")
        return self

    def topic(self, topic: Topic | str) -> str:
        """The full name of a topic of handlers/contracts/topics.py, or of a logical name
        (``AUDIT`` → ``vmstream.audit``)."""
        return f"{self.topic_prefix}{topic.name if isinstance(topic, Topic) else topic}"


class WorkerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    app_id: str = "vmstream"
    store: str = "memory://"  # or rocksdb:// (through rocksdict)
    web_port: int = 6066
    # Where the pages listen (Faust's web_bind): loopback unless told; deploy/ sets the Pod's IP.
    web_host: str = "127.0.0.1"
    # Every page but /health and /ready needs "Authorization: Bearer <token>": the token
    # from web_token (VMSTREAM_WORKER__WEB_TOKEN) or the file web_token_file. Without
    # either, those pages answer 401 to everyone.
    web_token: SecretStr | None = None
    web_token_file: str | None = None
    tick_seconds: float = Field(default=1.0, gt=0)
    batch_size: int = Field(default=500, ge=1)  # inputs decided per group commit, at most
    batch_seconds: float = Field(default=0.005, gt=0)  # how long a batch waits to fill
    # The consumer's long poll; Faust's own 1.5 s stalls busy partitions (streams/worker/faustfixes.py).
    # A fetch returns once it holds fetch_min_bytes or fetch_max_wait_ms has passed: under load,
    # one fetch per 10 ms instead of one per record; when idle, one per fetch_idle_wait_ms,
    # returning at the first record (docs/worker.md, "Latency").
    fetch_max_wait_ms: int = Field(default=10, ge=1, le=1500)
    fetch_min_bytes: int = Field(default=16384, ge=1)
    fetch_idle_wait_ms: int = Field(default=500, ge=1, le=1500)
    # Survivors frozen this often, everything collected that often: streams/common/heap.py.
    gc_freeze_seconds: float = Field(default=1.0, gt=0)
    gc_full_seconds: float = Field(default=600.0, gt=0)
    exactly_once: bool = False  # Faust's transactions break on rebalance: see streams/worker/app.py
    # A message the broker refuses is sent again this many times in all, after a backoff that
    # starts here and doubles; then the worker exits (status 75) before acknowledging its input.
    publish_attempts: int = Field(default=5, ge=1)
    publish_backoff_seconds: float = Field(default=0.2, gt=0)
    # Consumer group membership of this process (the worker's group, or the applier's):
    # docs/worker.md, "Recovery". With a group_instance_id (static membership, KIP-345) a
    # process restarted after a crash takes its partitions back as soon as it joins, instead
    # of waiting out its dead predecessor's session: one id per replica, stable across
    # restarts (deploy/ uses the pod name), never shared by two live processes (the broker
    # fences the older one). Without one, a dead member's partitions wait for its session to
    # time out. The session also bounds how long a replica that is gone for good (a pod
    # replaced under a new name) keeps its partitions: 10 s (Faust's default was 60 s).
    # At most 243 characters: the route stage joins its group as "<id>-route", and Kafka takes 249.
    group_instance_id: str | None = Field(default=None, min_length=1, max_length=243)
    session_timeout_seconds: float = Field(default=10.0, ge=6, le=300)  # the broker's minimum is 6 s
    heartbeat_interval_seconds: float = Field(default=1.0, gt=0)  # well under a third of the session

    def faust_consumer_settings(self) -> dict[str, Any]:
        """The membership settings as Faust's App takes them."""
        return {
            "consumer_group_instance_id": self.group_instance_id,
            "broker_session_timeout": self.session_timeout_seconds,
            "broker_heartbeat_interval": self.heartbeat_interval_seconds,
        }

    def librdkafka_membership(self) -> dict[str, Any]:
        """The membership settings as librdkafka takes them (the GroupReader of the applier and notify)."""
        return {
            **({"group.instance.id": self.group_instance_id} if self.group_instance_id else {}),
            "session.timeout.ms": int(self.session_timeout_seconds * 1000),
            "heartbeat.interval.ms": int(self.heartbeat_interval_seconds * 1000),
        }

    def page_token(self) -> str | None:
        """The bearer token the private pages want, if one is configured."""
        if self.web_token is not None and self.web_token.get_secret_value():
            return self.web_token.get_secret_value()
        if self.web_token_file:
            token = Path(self.web_token_file).read_text(encoding="utf-8").strip()
            if not token:
                raise ValueError(f"worker.web_token_file: {self.web_token_file} is empty")
            return token
        return None


class ApplySettings(BaseModel):
    """``vmstream apply``: commands of different keys are applied at once, those of one key
    (one VM, one node) one after the other in offset order."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    concurrency: int = Field(default=8, ge=1, le=256)  # API calls in flight, at most (one per key)
    max_in_flight: int = Field(default=200, ge=1)  # commands read and not yet released, at most
    # What settled is published at most this often while commands keep coming (sooner once
    # max_in_flight are unreleased, and when partitions go): each release is two produce
    # requests, and a request that comes alone costs the broker several times one of a stream
    # (benchmarks/README.md, broker_cost.py). It delays results, never an API call;
    # 0: a release at every turn.
    release_seconds: float = Field(default=0.05, ge=0, le=60)
    # How long the broker may hold the commands' fetch for more of them (GroupReader's
    # ``fetch_wait_ms``): a command arriving alone waits up to this long; commands arriving
    # one by one come several to a fetch instead of a fetch request each, which takes much of
    # the broker's CPU per command off (benchmarks/README.md, apply_rate.py, lever 11).
    # 0: every fetch is answered at the first command.
    fetch_wait_ms: int = Field(default=20, ge=0, le=500)
    cache: bool = True  # the policy's reads from a watched copy (streams/kube/informing.py); false: live


@dataclass(frozen=True, slots=True)
class Caller:
    """Who an API token is: the operator, or one project's member."""

    operator: bool
    project: str | None  # a project token's project


class ApiSettings(BaseModel):
    """``vmstream api``, the read API for consoles (docs/api.md).

    Tokens: ``operator_token`` (or the file ``operator_token_file``) sees everything;
    ``project_tokens`` (token → project; or the YAML map ``project_tokens_file``) sees the
    GPU classes and that project only. Without any token every ``/v1`` page answers 401.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"  # loopback unless told; deploy/ sets the Pod's IP
    port: int = Field(default=6069, ge=0, le=65535)
    operator_token: SecretStr | None = None
    operator_token_file: str | None = None
    project_tokens: dict[str, str] = Field(default_factory=dict)  # VMSTREAM_API__PROJECT_TOKENS as JSON
    project_tokens_file: str | None = None
    # How often the GPU classes' figures are compared with vmstream.gpu-classes (and the
    # classes that changed published).
    publish_seconds: float = Field(default=1.0, gt=0)

    def tokens(self) -> dict[str, Caller]:
        """Every accepted token → its caller."""
        projects = dict(self.project_tokens)
        if self.project_tokens_file:
            try:
                loaded = yaml.safe_load(Path(self.project_tokens_file).read_text(encoding="utf-8")) or {}
            except yaml.YAMLError as exc:
                raise ValueError(f"api.project_tokens_file: {self.project_tokens_file} is not YAML "
                                 f"({yaml_problem(exc)})") from exc
            if not isinstance(loaded, dict):
                raise ValueError(f"api.project_tokens_file: {self.project_tokens_file} is not a map of token → project")
            projects.update({str(token): str(project) for token, project in loaded.items()})
        tokens: dict[str, Caller] = {token: Caller(operator=False, project=project)
                                  for token, project in projects.items() if token}
        operator = self.operator_token.get_secret_value() if self.operator_token else None
        if not operator and self.operator_token_file:
            operator = Path(self.operator_token_file).read_text(encoding="utf-8").strip()
            if not operator:
                raise ValueError(f"api.operator_token_file: {self.operator_token_file} is empty")
        if operator:
            tokens[operator] = Caller(operator=True, project=None)
        return tokens


class SigningSettings(BaseModel):
    """The keys that seal commands (worker) and command results (applier): docs/security.md.

    ``keys_file`` is a directory of one file per key, named by its id (a mounted Secret), or
    a YAML mapping of key id → secret; ``keys`` adds keys inline (``VMSTREAM_SIGNING__KEYS``
    as JSON). Messages are sealed with ``key_id`` (default: the only key) and verified with
    any key held, so a new key is rolled out to every verifier before it seals.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    key_id: str | None = None
    keys: dict[str, SecretStr] = Field(default_factory=dict)
    keys_file: str | None = None

    def keyring(self) -> Keyring:
        return keyring_from(keys={kid: secret.get_secret_value() for kid, secret in self.keys.items()},
                            keys_file=self.keys_file, key_id=self.key_id)


class SmtpSettings(BaseModel):
    """The mail relay ``vmstream notify`` sends through (docs/notify.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str | None = None  # None: no e-mail; addresses then go to dead letters
    port: int = Field(default=587, ge=1, le=65535)
    # starttls: upgrade a plain connection (587); ssl: TLS from the first byte (465).
    security: Literal["starttls", "ssl", "none"] = "starttls"
    ssl_cafile: str | None = None
    username: str | None = None
    password: SecretStr | None = None  # VMSTREAM_NOTIFY__SMTP__PASSWORD
    sender: str = "vmstream@localhost"
    timeout_seconds: float = Field(default=30.0, gt=0)


class RateLimit(BaseModel):
    """A token bucket per recipient: ``burst`` at once, then ``per_second``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    per_second: float = Field(default=1.0, gt=0)
    burst: int = Field(default=20, ge=1)


class NotifySettings(BaseModel):
    """``vmstream notify``: notifications delivered to people (docs/notify.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    smtp: SmtpSettings = SmtpSettings()
    endpoints: dict[str, Endpoint] = Field(default_factory=dict)  # webhook:<name> → where and how
    # project id → its members (principals); else looked up at directory_url, with {project}
    # replaced, answering a JSON list of principals (or {"members": [...]}), kept for a while.
    directory: dict[str, list[str]] = Field(default_factory=dict)
    directory_url: str | None = None
    directory_cache_seconds: float = Field(default=300.0, ge=0)
    routes: list[Route] = Field(default_factory=list)
    rate_limit: RateLimit = RateLimit()
    attempts: int = Field(default=6, ge=1)  # per delivery, then a dead letter
    backoff_seconds: float = Field(default=0.5, gt=0)  # the first wait; it doubles
    backoff_max_seconds: float = Field(default=30.0, gt=0)
    http_timeout_seconds: float = Field(default=10.0, gt=0)
    # Read no more, kept so that a file that sets it still loads: a webhook's CloudEvent has the
    # source of the record it delivers (handlers/contracts/events.py).
    source: str | None = Field(default=None, description=(
        "Not used: a webhook's CloudEvent has the type and source of the Kafka record it delivers "
        "(the process that wrote it: docs/notify.md). Accepted so that an older file still loads."))
    group_id: str = "vmstream-notify"


class EnvironmentFirst(BaseSettings):
    """Settings whose file values arrive as init arguments, so the environment must win."""

    model_config = SettingsConfigDict(env_prefix="VMSTREAM_", env_nested_delimiter="__", frozen=True)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return env_settings, init_settings


class Settings(EnvironmentFirst, Config):
    """The whole configuration file: the AZ's policy plus Kafka and worker options."""

    model_config = SettingsConfigDict(
        env_prefix="VMSTREAM_", env_nested_delimiter="__", frozen=True, extra="forbid"
    )

    kafka: KafkaSettings = KafkaSettings()
    worker: WorkerSettings = WorkerSettings()
    api: ApiSettings = ApiSettings()
    apply: ApplySettings = ApplySettings()
    signing: SigningSettings = SigningSettings()
    notify: NotifySettings = NotifySettings()

    def rules(self) -> Config:
        """The policy the handlers obey."""
        return Config.model_validate(self.model_dump(include=set(Config.model_fields)))


class ClientSettings(EnvironmentFirst):
    """The file as a client (``intent``, ``tail``) sees it: only ``kafka`` matters, so a
    person can publish or read without the AZ's policy."""

    model_config = SettingsConfigDict(
        env_prefix="VMSTREAM_", env_nested_delimiter="__", frozen=True, extra="ignore"
    )

    kafka: KafkaSettings = KafkaSettings()


# The settings that name a file. A relative path in the configuration file is relative to
# the file's own directory, so a file and the keys beside it go together wherever it is read
# from (examples/config.yaml, a ConfigMap); in a VMSTREAM_* variable, to the current directory.
FILE_SETTINGS: tuple[tuple[str, ...], ...] = (
    ("kafka", "ssl_cafile"),
    ("kafka", "ssl_certfile"),
    ("kafka", "ssl_keyfile"),
    ("kafka", "oauth", "token_file"),
    ("kafka", "oauth", "ssl_cafile"),
    ("worker", "web_token_file"),
    ("api", "operator_token_file"),
    ("api", "project_tokens_file"),
    ("signing", "keys_file"),
    ("auth", "jwks_file"),
    ("notify", "smtp", "ssl_cafile"),
)


def relative_to(loaded: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``loaded`` with the relative paths of :data:`FILE_SETTINGS` made relative to ``directory``."""
    for *sections, name in FILE_SETTINGS:
        holder: Any = loaded
        for section in sections:
            holder = holder.get(section) if isinstance(holder, dict) else None
        value = holder.get(name) if isinstance(holder, dict) else None
        if isinstance(value, str) and value and not Path(value).is_absolute():
            holder[name] = str(directory / value)
    return loaded


def read_yaml(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not YAML: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: the configuration must be a YAML mapping")
    return relative_to(loaded, Path(path).absolute().parent)


def load_settings(path: str | Path | None) -> Settings:
    return Settings(**read_yaml(path))


def load_kafka_settings(path: str | Path | None) -> KafkaSettings:
    """``kafka`` from the configuration file and ``VMSTREAM_KAFKA__*``, as the worker reads it."""
    return ClientSettings(**{k: v for k, v in read_yaml(path).items() if k == "kafka"}).kafka
