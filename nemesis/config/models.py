"""Configuration models: validated once at load time, frozen, unknown keys rejected.

``nemesis.yaml`` describes the process (backend, directories, addresses);
``integrations/<name>.yaml`` describes one integration (DESIGN.md section 5).
Units are in the names (``timeout_s``, ``max_wait_ms``, ``window_s``);
durations written as text (``90s``, ``5m``, ``1h``) are accepted where a
field says so.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    IPvAnyNetwork,
    SecretStr,
    Tag,
    field_validator,
    model_validator,
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def parse_duration(value: Any) -> float:
    """``90`` -> 90.0 s; ``"1.5s"``, ``"5m"``, ``"2h"``, ``"7d"``, ``"250ms"`` -> seconds."""
    if isinstance(value, bool):
        # pydantic turns only ValueError into a validation error; a TypeError would escape.
        raise ValueError("expected a duration such as 30s, 5m or 1h")  # noqa: TRY004
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNIT_S[match.group(2)]
    else:
        raise ValueError(f"expected a duration such as 30s, 5m or 1h, got {value!r}")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


DurationS = Annotated[float, BeforeValidator(parse_duration)]

NAME_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"
TOPIC_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,199}$"


def _check_target_url(url: str) -> str:
    if not re.match(r"^(https?|grpcs?)://[^/\s]+", url):
        raise ValueError("must start with http://, https://, grpc:// or grpcs:// and name a host")
    return url


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


# --- integration --------------------------------------------------------------


class SourceConfig(Model):
    topic: Annotated[str, Field(pattern=TOPIC_PATTERN)]
    consumer: Annotated[str, Field(pattern=TOPIC_PATTERN)]
    # The metadata key that names a message's type (ce-type, flags.disabled_types).
    type_key: str = "type"


class TargetConfig(Model):
    url: Annotated[str, AfterValidator(_check_target_url)]
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    format: Literal["json", "protobuf", "bytes"] = "json"
    # Extra request headers; values may use ${VAR} interpolation for secrets.
    headers: dict[str, str] = Field(default_factory=dict)

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0]


class BatchConfig(Model):
    size: Annotated[int, Field(ge=1, le=10_000)] = 1
    max_wait_ms: Annotated[int, Field(ge=0, le=60_000)] = 0


class DeliveryConfig(Model):
    workers: Annotated[int, Field(ge=1, le=4096)] = 32
    buffer: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    batch: BatchConfig = BatchConfig()
    ordering: Literal["none", "key", "partition"] = "none"

    @model_validator(mode="after")
    def _buffer_holds_a_batch(self) -> DeliveryConfig:
        if self.buffer < self.batch.size:
            raise ValueError(
                f"buffer ({self.buffer}) must hold at least one batch ({self.batch.size})"
            )
        return self


class RetryConfig(Model):
    tiers: Annotated[list[DurationS], Field(max_length=16)] = Field(
        default_factory=lambda: [60.0, 300.0, 900.0]
    )
    # Ordered integrations retry in place; when the tiers run out: dead-letter and
    # continue, or halt the key/partition and alert.
    on_exhausted: Literal["dead_letter", "halt"] = "dead_letter"

    @field_validator("tiers")
    @classmethod
    def _positive(cls, tiers: list[float]) -> list[float]:
        if any(t <= 0 for t in tiers):
            raise ValueError("every retry tier needs a delay above zero")
        return tiers


class BreakerConfig(Model):
    open_above: Annotated[float, Field(gt=0, le=1)] = 0.5
    close_below: Annotated[float, Field(ge=0, lt=1)] = 0.2
    window_s: Annotated[float, Field(gt=0)] = 30.0
    min_requests: Annotated[int, Field(ge=1)] = 20
    cooldown_s: Annotated[float, Field(gt=0)] = 10.0

    @model_validator(mode="after")
    def _hysteresis(self) -> BreakerConfig:
        if self.close_below >= self.open_above:
            raise ValueError("close_below must be lower than open_above")
        return self


class RateLimitsConfig(Model):
    """Messages per second per flow; ``null`` means unlimited."""

    main: Annotated[float, Field(gt=0)] | None = None
    retry: Annotated[float, Field(gt=0)] | None = None
    replay: Annotated[float, Field(gt=0)] | None = 20.0


class FlagsConfig(Model):
    disabled_types: list[str] = Field(default_factory=list)


class IntegrationConfig(Model):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    owners: Annotated[list[str], Field(min_length=1)]
    source: SourceConfig
    # A name from pipelines/, or an inline list of stages (compiled by nemesis.pipeline).
    pipeline: str | list[dict[str, Any]] | None = None
    target: TargetConfig
    delivery: DeliveryConfig = DeliveryConfig()
    retry: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    rate_limits: RateLimitsConfig = RateLimitsConfig()
    flags: FlagsConfig = FlagsConfig()
    paused: bool = False


# --- process ------------------------------------------------------------------


class EmbeddedBackendConfig(Model):
    kind: Literal["embedded"] = "embedded"
    # Relative paths are taken from data_dir.
    path: str = "nemesis.db"
    lease_s: Annotated[float, Field(gt=0)] = 10.0
    retention: DurationS = 7 * 86400.0
    default_partitions: Annotated[int, Field(ge=1, le=1024)] = 4


class SqliteDlqConfig(Model):
    kind: Literal["sqlite"] = "sqlite"
    # Relative paths are taken from data_dir.
    path: str = "dlq.db"
    # Rows older than this (by dead-letter time) are deleted; months, so teams can look back.
    retention: DurationS = 180 * 86400.0


# --- YDB (nemesis.broker.ydb, nemesis.dlq.ydb) ------------------------------------


class YdbCredentialsConfig(Model):
    """How Nemesis signs in to YDB; secrets come from ``${VAR}`` references, never the file.

    ``anonymous``: none (a local YDB). ``token``: an access token (IAM, OAuth).
    ``static``: a YDB user and password. ``service_account``: an authorized
    key JSON file (needs the ``ydb[yc]`` extra). ``metadata``: the cloud VM's
    metadata service. ``env``: the SDK's own ``YDB_*`` environment variables.
    """

    mode: Literal["anonymous", "token", "static", "service_account", "metadata", "env"] = (
        "anonymous"
    )
    token: str | None = None
    user: str | None = None
    password: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _what_the_mode_needs(self) -> YdbCredentialsConfig:
        needed = {"token": ("token",), "static": ("user",), "service_account": ("key_file",)}
        missing = [name for name in needed.get(self.mode, ()) if not getattr(self, name)]
        if missing:
            raise ValueError(f"credentials mode {self.mode!r} needs {' and '.join(missing)}")
        return self


class YdbConnectionConfig(Model):
    """Where a YDB database is and how to reach it."""

    endpoint: Annotated[str, Field(pattern=r"^grpcs?://[^/\s]+$")]  # grpcs:// for TLS
    database: Annotated[str, Field(pattern=r"^/\S+$")]  # /local, /ru-central1/b1g.../etn...
    credentials: YdbCredentialsConfig = YdbCredentialsConfig()
    # PEM file with the CA certificates for grpcs:// (None: the SDK's bundled roots).
    root_certificates: str | None = None
    connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 10.0
    # Every call to YDB is bounded by this: the SDK itself retries forever.
    request_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0


class YdbBackendConfig(YdbConnectionConfig):
    """YDB topics: the production broker (``nemesis.broker.ydb``)."""

    kind: Literal["ydb"] = "ydb"
    # Topics live under <database>/<directory>; "" is the database root.
    directory: Annotated[str, Field(pattern=r"^[A-Za-z0-9._/-]*$")] = ""
    retention: DurationS = 7 * 86400.0
    default_partitions: Annotated[int, Field(ge=1, le=1024)] = 4
    reader_buffer_bytes: Annotated[int, Field(ge=64 * 1024)] = 16 * 1024 * 1024
    # Messages of a paused partition held in memory before the whole reader
    # stops taking messages (YDB cannot pause one partition: see the README).
    pause_stash_messages: Annotated[int, Field(ge=1, le=1_000_000)] = 1000


class YdbDlqConfig(Model):
    """The DLQ in YDB tables, with a TTL on the dead-letter time (``nemesis.dlq.ydb``)."""

    kind: Literal["ydb"] = "ydb"
    # The directory of the DLQ tables, relative to the database.
    path: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*$")] = "nemesis/dlq"
    retention: DurationS = 180 * 86400.0
    # None: the backend's connection (the backend must then be ydb).
    connection: YdbConnectionConfig | None = None


# The kafka backend's model lives with its code; imported here, below Model and DurationS.
from nemesis.broker.kafka.config import KafkaBackendConfig  # noqa: E402


def _backend_kind(value: Any) -> str:
    # Anything but "ydb" or "kafka" validates as embedded, so a wrong kind is reported at
    # backend.kind together with the other fields' problems.
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return kind if kind in ("ydb", "kafka") else "embedded"


def _dlq_kind(value: Any) -> str:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return "ydb" if kind == "ydb" else "sqlite"


BackendConfig = Annotated[
    Annotated[EmbeddedBackendConfig, Tag("embedded")]
    | Annotated[YdbBackendConfig, Tag("ydb")]
    | Annotated[KafkaBackendConfig, Tag("kafka")],
    Discriminator(_backend_kind),
]
DlqConfig = Annotated[
    Annotated[SqliteDlqConfig, Tag("sqlite")] | Annotated[YdbDlqConfig, Tag("ydb")],
    Discriminator(_dlq_kind),
]


class ListenConfig(Model):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)]
    enabled: bool = True


# --- admin API, reload, metrics (nemesis.admin, nemesis.runtime.reload) ----------

MIN_ADMIN_TOKEN_CHARS = 16


class AdminConfig(ListenConfig):
    """The admin API: health, readiness, ``/metrics``, live status, and live changes.

    Changes (``PATCH``, pause, reload) need ``Authorization: Bearer <token>``;
    without a token the API is read-only. Set it from the environment:
    ``token: ${NEMESIS_ADMIN_TOKEN:-}``.
    """

    port: Annotated[int, Field(ge=0, le=65535)] = 8081
    token: SecretStr | None = None

    @field_validator("token")
    @classmethod
    def _strong_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():  # the variable is unset or empty
            return None
        if len(value.get_secret_value()) < MIN_ADMIN_TOKEN_CHARS:
            raise ValueError(
                f"needs at least {MIN_ADMIN_TOKEN_CHARS} characters; make one with"
                " `python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        return value


class ReloadConfig(Model):
    """Picking up changed integration and pipeline files while running (SIGHUP works regardless)."""

    watch: bool = True  # watch integrations_dir and pipelines_dir for changes
    # Changes arriving within this window are taken as one reload (an editor's save, a git pull).
    debounce_ms: Annotated[int, Field(ge=0, le=60_000)] = 500
    # Polls instead of inotify: for file systems that do not report changes (some network mounts).
    force_polling: bool = False


class MetricsConfig(Model):
    """How often the broker is asked for end offsets (commit lag); never per scrape."""

    lag_refresh_s: Annotated[float, Field(gt=0, le=3600)] = 5.0


# --- viewer access -------------------------------------------------------------

USER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}$"
# The formats dlq_viewer.passwords writes (``python -m dlq_viewer.hash_password``);
# checked here only for shape, so a plaintext password is refused at load time.
_SCRYPT_HASH = re.compile(
    r"^scrypt\$(\d{1,8})\$(\d{1,3})\$(\d{1,3})\$[A-Za-z0-9_-]{16,}\$[A-Za-z0-9_-]{32,}$"
)
_TOKEN_HASH = re.compile(r"^sha256\$[0-9a-f]{64}$")
_HEADER_NAME = r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$"
MIN_SESSION_SECRET_CHARS = 32


def _check_password_hash(value: str) -> str:
    match = _SCRYPT_HASH.match(value)
    if match is None:
        raise ValueError(
            "must be a scrypt hash made with `python -m dlq_viewer.hash_password`"
            " (never a plaintext password)"
        )
    n, r, p = (int(part) for part in match.groups())
    if n < 2**14 or n > 2**20 or n & (n - 1) or not 1 <= r <= 32 or not 1 <= p <= 16:
        raise ValueError("scrypt parameters out of range (n: a power of two, 2^14 to 2^20)")
    return value


def _check_token_hash(value: str) -> str:
    if not _TOKEN_HASH.match(value):
        raise ValueError(
            "must be sha256$<64 hex digits>, as `python -m dlq_viewer.hash_password --token` prints"
        )
    return value


class UserConfig(Model):
    """A person who signs in to the DLQ viewer with a password."""

    name: Annotated[str, Field(pattern=USER_NAME_PATTERN)]
    password_hash: Annotated[str, AfterValidator(_check_password_hash)]
    # Matched against integrations' ``owners``: the user sees and acts on those integrations.
    teams: list[str] = Field(default_factory=list)
    admin: bool = False  # sees and acts on every integration


class TokenConfig(Model):
    """An API token for the viewer's JSON API (``Authorization: Bearer ...``); only its hash."""

    name: Annotated[str, Field(pattern=USER_NAME_PATTERN)]  # who the audit log names
    token_hash: Annotated[str, AfterValidator(_check_token_hash)]
    teams: list[str] = Field(default_factory=list)
    admin: bool = False


class TrustedHeaderConfig(Model):
    """Sign-in by a fronting SSO proxy that puts the user (and teams) in request headers.

    The headers are believed only on connections from ``trusted_proxies``;
    from anywhere else they are ignored.
    """

    user_header: Annotated[str, Field(pattern=_HEADER_NAME)] = "X-Forwarded-User"
    # Comma-separated team names; None: teams come from a ``users`` entry of the same name.
    teams_header: Annotated[str, Field(pattern=_HEADER_NAME)] | None = "X-Forwarded-Groups"
    trusted_proxies: Annotated[list[IPvAnyNetwork], Field(min_length=1)]


class AuthConfig(Model):
    """Who may use the DLQ viewer, and how its sessions are signed."""

    # Signs session cookies and CSRF tokens: set it from the environment
    # (``${NEMESIS_SESSION_SECRET}``). Unset: a random secret per process, so
    # sessions end at every restart and replicas do not share them.
    session_secret: str | None = None
    session_ttl_s: Annotated[DurationS, Field(gt=0, le=30 * 86400)] = 8 * 3600.0
    # Secure cookies travel over HTTPS only (browsers make an exception for
    # localhost); turn off only for plain HTTP on another address.
    secure_cookies: bool = True
    users: list[UserConfig] = Field(default_factory=list)
    tokens: list[TokenConfig] = Field(default_factory=list)
    trusted_header: TrustedHeaderConfig | None = None
    admin_teams: list[str] = Field(default_factory=list)  # members of these teams are admins

    @field_validator("session_secret")
    @classmethod
    def _strong_secret(cls, value: str | None) -> str | None:
        if not value:  # ``${NEMESIS_SESSION_SECRET:-}`` with the variable unset
            return None
        if len(value) < MIN_SESSION_SECRET_CHARS:
            raise ValueError(
                f"needs at least {MIN_SESSION_SECRET_CHARS} characters; make one with"
                " `python -c 'import secrets; print(secrets.token_urlsafe(48))'`"
            )
        return value

    @model_validator(mode="after")
    def _unique_names(self) -> AuthConfig:
        for kind, names in (
            ("user", [user.name for user in self.users]),
            ("token", [token.name for token in self.tokens]),
        ):
            duplicates = sorted({name for name in names if names.count(name) > 1})
            if duplicates:
                raise ValueError(f"{kind} names must be unique: {', '.join(duplicates)}")
        return self


class NemesisConfig(Model):
    backend: BackendConfig = EmbeddedBackendConfig()
    dlq: DlqConfig = SqliteDlqConfig()
    data_dir: str = "data"
    integrations_dir: str = "integrations"
    pipelines_dir: str = "pipelines"
    admin: AdminConfig = AdminConfig()
    viewer: ListenConfig = ListenConfig(port=8080)
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 10.0
    log_format: Literal["text", "json"] = "text"
    auth: AuthConfig = AuthConfig()
    reload: ReloadConfig = ReloadConfig()
    metrics: MetricsConfig = MetricsConfig()

    @model_validator(mode="after")
    def _ydb_dlq_has_a_connection(self) -> NemesisConfig:
        if (
            isinstance(self.dlq, YdbDlqConfig)
            and self.dlq.connection is None
            and not isinstance(self.backend, YdbBackendConfig)
        ):
            raise ValueError(
                "dlq.kind ydb needs dlq.connection (endpoint, database) unless the backend is ydb"
            )
        return self
