"""Configuration models: validated once at load time, frozen, unknown keys rejected.

``nemesis.yaml`` describes the process (backend, directories, addresses);
``integrations/<name>.yaml`` describes one integration.
Units are in the names (``timeout_s``, ``max_wait_ms``, ``window_s``);
durations written as text (``90s``, ``5m``, ``1h``) are accepted where a
field says so.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    Field,
    IPvAnyNetwork,
    SecretStr,
    field_validator,
    model_validator,
)

from nemesis.backends import BackendModel, DlqModel, SourceModel, StateModel, default_backends
from nemesis.backends.base import SOURCE_TOPIC_PATTERN as SOURCE_TOPIC_PATTERN
from nemesis.backends.base import TOPIC_PATTERN as TOPIC_PATTERN
from nemesis.backends.embedded import EmbeddedBackendConfig as EmbeddedBackendConfig
from nemesis.backends.sqlite import SqliteDlqConfig as SqliteDlqConfig
from nemesis.backends.sqlite import SqliteStateConfig as SqliteStateConfig
from nemesis.backends.topic import START_FROM_HELP as START_FROM_HELP
from nemesis.backends.topic import TopicSourceConfig as TopicSourceConfig
from nemesis.backends.topic import parse_start_from as parse_start_from
from nemesis.backends.topic import start_from_at as start_from_at
from nemesis.backends.ydb import YdbBackendConfig as YdbBackendConfig
from nemesis.backends.ydb import YdbConnectionConfig as YdbConnectionConfig
from nemesis.backends.ydb import YdbCredentialsConfig as YdbCredentialsConfig
from nemesis.backends.ydb import YdbDlqConfig as YdbDlqConfig
from nemesis.config_base import CROSS_FIELD_ERROR as CROSS_FIELD_ERROR
from nemesis.config_base import CrossRule as CrossRule
from nemesis.config_base import DurationS as DurationS
from nemesis.config_base import Model as Model
from nemesis.config_base import defaults, get_path
from nemesis.config_base import parse_duration as parse_duration
from nemesis.transports import default_transports

NAME_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$"


# The transports targets may use (``nemesis.transports``): the URL schemes, the
# ``target.transport`` choices and which schemes take TLS settings come from it.
TRANSPORTS: Final = default_transports()


def _check_target_url(url: str) -> str:
    problem = TRANSPORTS.url_problem(url)
    if problem is not None:
        raise ValueError(problem)
    if "${" in url:
        return url  # an unset variable while validating without secrets: checked where it is set
    try:
        port = urlsplit(url).port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError("the port must be a number from 1 to 65535")
    return url


# --- integration --------------------------------------------------------------

# The ``source:`` block: one model per registered source kind, chosen by ``kind``
# (``nemesis.backends``; without ``kind``, a topic of the process's backend); to the
# type checker, what every kind has.
if TYPE_CHECKING:
    SourceConfig = SourceModel
else:
    SourceConfig = default_backends().source_config()


ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


class SigningConfig(Model):
    """Signed deliveries (``nemesis.delivery.signing``): where the secrets are, never what.

    ``secrets_env`` names one environment variable, or two during a rotation
    (the new secret and the previous one): every request then carries one
    signature per secret. ``nemesis run`` reads them when the integration
    starts and refuses to start it when one is unset or empty.

    ``scheme``: the headers that carry the signature. ``standard-webhooks``
    (the default) signs every ``ce-*`` attribute, the content type and the
    body's digest; ``legacy`` sends only the ``nemesis-signature`` header of
    earlier releases, ``both`` sends both while handlers move (legacy is
    supported until ``nemesis.delivery.signing.LEGACY_END``).
    """

    scheme: Literal["standard-webhooks", "legacy", "both"] = "standard-webhooks"
    secrets_env: Annotated[
        list[Annotated[str, Field(pattern=ENV_NAME_PATTERN, max_length=128)]],
        Field(min_length=1, max_length=2),
    ]

    @field_validator("secrets_env", mode="before")
    @classmethod
    def _names_not_values(cls, names: Any) -> Any:
        if isinstance(names, str):
            # A ValueError, not a TypeError: pydantic reports only the former as a problem.
            message = "a list of 1 or 2 environment variable names, e.g. [HOOK_SECRET]"
            raise ValueError(message)  # noqa: TRY004
        return names

    @field_validator("secrets_env")
    @classmethod
    def _distinct(cls, names: list[str]) -> list[str]:
        if len(set(names)) != len(names):
            raise ValueError("the same variable twice: name the new and the previous secret")
        return names


_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
DNS_NAME_PATTERN = rf"(?=.{{1,253}}$){_DNS_LABEL}(?:\.{_DNS_LABEL})*"
_DNS_NAME = re.compile(DNS_NAME_PATTERN)


def _check_server_name(name: str) -> str:
    if not _DNS_NAME.fullmatch(name):
        raise ValueError(
            "must be a DNS name, such as loyalty.internal: the one the certificate holds"
        )
    return name


PemPath = Annotated[str, Field(min_length=1)]


def _cert_and_key_together(tls: Any) -> Iterator[tuple[tuple[Hashable, ...], str]]:
    cert_file, key_file = get_path(tls, "cert_file"), get_path(tls, "key_file")
    if cert_file is not None and key_file is None:
        yield ("cert_file",), "a client certificate needs its private key: set key_file too"
    if key_file is not None and cert_file is None:
        yield ("key_file",), "a private key needs its client certificate: set cert_file too"


class TlsConfig(Model):
    """How an ``https://`` or ``grpcs://`` target's TLS is set up (``nemesis.delivery.tls``).

    Without it, the handler's certificate is verified against the system's CA
    store (``SSL_CERT_FILE`` names another for the whole process). There is
    deliberately no way to skip verification. The files are read when the
    transport is made (at start and on reload): one that is missing or does
    not load stops that integration with an error naming the field and path.
    A file changed on disk (a renewed certificate) restarts the integration
    on the new files at the next reload (``nemesis.runtime.reload``).
    """

    # A PEM bundle the handler's certificate must chain to; replaces the system's CAs.
    ca_file: PemPath | None = None
    # A client certificate (PEM, with its chain) and its unencrypted key: mutual TLS.
    cert_file: PemPath | None = None
    key_file: PemPath | None = None
    # The name checked against the handler's certificate and sent as SNI, instead of
    # the URL's host (for a URL that holds an IP address).
    server_name: Annotated[str, AfterValidator(_check_server_name)] | None = None

    cross_rules = (_cert_and_key_together,)


def _tls_needs_a_tls_url(target: Any) -> Iterator[tuple[tuple[Hashable, ...], str]]:
    url = get_path(target, "url")
    if get_path(target, "tls") is None or not isinstance(url, str):
        return
    problem = TRANSPORTS.tls_problem(url.split("://", 1)[0])
    if problem is not None:
        yield ("tls",), problem


def _not_the_trace_context(headers: dict[str, str]) -> dict[str, str]:
    for name in headers:
        if name.lower() in ("traceparent", "tracestate"):
            raise ValueError(
                f"{name!r}: set by Nemesis for every event (its trace context, docs/tracing.md)"
            )
    return headers


# target.transport: one of the registered clients (to the type checker, a name).
if TYPE_CHECKING:
    TransportClient = str
else:
    TransportClient = Literal[TRANSPORTS.clients()]


class TargetConfig(Model):
    url: Annotated[str, AfterValidator(_check_target_url)]
    timeout_s: Annotated[float, Field(gt=0, le=600)] = 5.0
    format: Literal["json", "protobuf", "bytes"] = "json"
    # Extra request headers; values may use ${VAR} interpolation for secrets.
    headers: Annotated[dict[str, str], AfterValidator(_not_the_trace_context)] = Field(
        default_factory=dict
    )
    # None: requests are not signed.
    signing: SigningConfig | None = None
    # The client of a kind that offers several (``TransportKind.clients``): for http(s)://
    # targets Nemesis' own HTTP/1.1 transport (h1), or aiohttp's. gRPC targets ignore it.
    transport: TransportClient = TRANSPORTS.clients()[0]
    # None: the system's CAs, no client certificate, the URL's host as the name.
    tls: TlsConfig | None = None

    cross_rules = (_tls_needs_a_tls_url,)

    @property
    def scheme(self) -> str:
        return self.url.split("://", 1)[0]


class BatchConfig(Model):
    size: Annotated[int, Field(ge=1, le=10_000)] = 1
    max_wait_ms: Annotated[int, Field(ge=0, le=60_000)] = 0


def _int_at(data: Any, *path: str, default: int) -> int | None:
    value = get_path(data, *path, default=default)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _number_at(data: Any, *path: str, default: float) -> float | None:
    value = get_path(data, *path, default=default)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _buffer_holds_a_batch(delivery: Any) -> Iterator[tuple[tuple[Hashable, ...], str]]:
    buffer, size = (
        _int_at(delivery, "buffer", default=1000),
        _int_at(delivery, "batch", "size", default=1),
    )
    if buffer is not None and size is not None and buffer < size:
        yield (), f"buffer ({buffer}) must hold at least one batch ({size})"


class DeliveryConfig(Model):
    workers: Annotated[int, Field(ge=1, le=4096)] = 32
    buffer: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    batch: BatchConfig = defaults(BatchConfig)
    ordering: Literal["none", "key", "partition"] = "none"

    cross_rules = (_buffer_holds_a_batch,)


def _seconds(value: float) -> str:
    return f"{value:g}s"


class RetryConfig(Model):
    tiers: Annotated[list[DurationS], Field(max_length=16)] = Field(
        default_factory=lambda: [60.0, 300.0, 900.0]
    )
    # Ordered integrations retry in place; when the tiers run out: dead-letter and
    # continue, or halt the key/partition and alert.
    on_exhausted: Literal["dead_letter", "halt"] = "dead_letter"
    # Where an unordered integration's failed message waits out its tier: given back to a
    # source that can release it (a queue: its visibility timeout, no extra queues), or
    # on the tier topics of the process's backend. None: by release where the source can.
    via: Literal["release", "topics"] | None = None

    @field_validator("tiers")
    @classmethod
    def _positive_and_growing(cls, tiers: list[float]) -> list[float]:
        if any(t <= 0 for t in tiers):
            raise ValueError("every retry tier needs a delay above zero")
        for index in range(1, len(tiers)):
            if tiers[index] < tiers[index - 1]:
                # A failing handler needs more time at each step, not less; and a message
                # moves from tier to tier, so a shorter tier after a longer one only shortens
                # the total wait for no gain: write the delays from the shortest up.
                raise ValueError(
                    f"tier {index + 1} ({_seconds(tiers[index])}) is shorter than tier {index}"
                    f" ({_seconds(tiers[index - 1])}): each tier must wait at least as long as"
                    " the one before it, since retries back off as failures go on"
                )
        return tiers


def _hysteresis(breaker: Any) -> Iterator[tuple[tuple[Hashable, ...], str]]:
    open_above = _number_at(breaker, "open_above", default=0.5)
    close_below = _number_at(breaker, "close_below", default=0.2)
    if open_above is not None and close_below is not None and close_below >= open_above:
        yield (), "close_below must be lower than open_above"


class BreakerConfig(Model):
    open_above: Annotated[float, Field(gt=0, le=1)] = 0.5
    close_below: Annotated[float, Field(ge=0, lt=1)] = 0.2
    window_s: Annotated[float, Field(gt=0)] = 30.0
    min_requests: Annotated[int, Field(ge=1)] = 20
    cooldown_s: Annotated[float, Field(gt=0)] = 10.0

    cross_rules = (_hysteresis,)


class RateLimitsConfig(Model):
    """Messages per second per flow; ``null`` means unlimited."""

    main: Annotated[float, Field(gt=0)] | None = None
    retry: Annotated[float, Field(gt=0)] | None = None
    replay: Annotated[float, Field(gt=0)] | None = 20.0


class FlagsConfig(Model):
    disabled_types: list[str] = Field(default_factory=list)


def _halt_needs_ordering(integration: Any) -> Iterator[tuple[tuple[Hashable, ...], str]]:
    on_exhausted = get_path(integration, "retry", "on_exhausted", default="dead_letter")
    ordering = get_path(integration, "delivery", "ordering", default="none")
    if on_exhausted == "halt" and ordering == "none":
        yield (
            ("retry", "on_exhausted"),
            "halt needs delivery.ordering key or partition: only an ordered integration retries"
            " in place and can hold a key back; with ordering none a message that runs out of"
            " retries goes to the DLQ. Set delivery.ordering, or on_exhausted: dead_letter",
        )


def _source_model(integration: Any) -> type[SourceModel] | None:
    """The model of an integration's source kind, from raw input or a validated model."""
    source = get_path(integration, "source", default=None)
    if isinstance(source, SourceModel):
        return type(source)
    sources = default_backends().sources
    kind = get_path(source, "kind", default=None) if isinstance(source, dict) else None
    if kind is None:
        kind = next(iter(sources), None)
    found = sources.get(kind) if isinstance(kind, str) else None
    return None if found is None else found.config


def _release_fits_the_source(integration: Any) -> Iterator[tuple[tuple[Hashable, ...], str]]:
    model = _source_model(integration)
    if model is None:
        return  # an unknown kind: reported at source.kind
    via = get_path(integration, "retry", "via", default=None)
    most_s = model.max_release_delay_s
    if most_s is None:
        if via == "release":
            yield (
                ("retry", "via"),
                "release needs a source that can give a message back to come again later"
                " (kind: sqs); a topic's retries go to its tier topics: via: topics",
            )
        return
    if via == "topics":
        return
    tiers = get_path(integration, "retry", "tiers", default=None)
    if not isinstance(tiers, list):
        return
    for index, tier in enumerate(tiers):
        try:
            delay_s = parse_duration(tier)
        except ValueError:
            continue  # reported at the tier
        if delay_s > most_s:
            yield (
                ("retry", "tiers", index),
                f"tier {index + 1} ({_seconds(delay_s)}) is longer than {most_s / 3600:g} hours,"
                f" the most a source of kind {model.model_fields['kind'].default} can hold a"
                " message back (retries by release: the queue's visibility timeout); shorten"
                " it, or keep the tiers on the backend's topics with retry.via: topics",
            )


def _forwarded_not_set_by_target(integration: Any) -> Iterator[tuple[tuple[Hashable, ...], str]]:
    forwarded = get_path(
        integration,
        "source",
        "forward_headers",
        default=SourceModel.model_fields["forward_headers"].default,
    )
    own = get_path(integration, "target", "headers", default=None)
    if not isinstance(forwarded, list | tuple) or not isinstance(own, dict):
        return
    both = sorted({str(n).lower() for n in own} & {str(n) for n in forwarded})
    if both:
        yield (
            ("source", "forward_headers"),
            f"{', '.join(both)}: set by target.headers too; a request carries one or the other",
        )


class IntegrationConfig(Model):
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    owners: Annotated[list[str], Field(min_length=1)]
    source: SourceConfig
    # A name from pipelines/, or an inline list of stages (compiled by nemesis.pipeline).
    pipeline: str | list[dict[str, Any]] | None = None
    target: TargetConfig
    delivery: DeliveryConfig = defaults(DeliveryConfig)
    retry: RetryConfig = defaults(RetryConfig)
    breaker: BreakerConfig = defaults(BreakerConfig)
    rate_limits: RateLimitsConfig = defaults(RateLimitsConfig)
    flags: FlagsConfig = defaults(FlagsConfig)
    paused: bool = False
    # How many members of the fleet run it; "all" for a heavy one, whose partitions
    # the broker then spreads over every member.
    replicas: Annotated[int, Field(ge=1, le=1000)] | Literal["all"] = 1

    cross_rules = (_halt_needs_ordering, _forwarded_not_set_by_target, _release_fits_the_source)

    @property
    def retries_by_release(self) -> bool:
        """Whether a failed message waits out its tier given back to its source (``retry.via``).

        Unordered integrations only: an ordered one retries in place, holding its key.
        """
        if self.delivery.ordering != "none":
            return False
        via = self.retry.via
        if via is None:
            return self.source.max_release_delay_s is not None
        return via == "release"


# --- process ------------------------------------------------------------------


# The backend and the DLQ store: one model per built-in kind, chosen by ``kind``
# (``nemesis.backends``); to the type checker, what every kind has.
if TYPE_CHECKING:
    BackendConfig = BackendModel
    DlqConfig = DlqModel
    StateConfig = StateModel
else:
    BackendConfig = default_backends().backend_config()
    DlqConfig = default_backends().dlq_config()
    StateConfig = default_backends().state_config()


class ListenConfig(Model):
    """An address to listen on; the default port is the DLQ viewer's (the admin API has its own).

    Every field has a default, so ``viewer: {enabled: false}`` needs no port.
    """

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    enabled: bool = True


class ViewerConfig(ListenConfig):
    """The DLQ viewer's address, and the reverse proxies whose forwarded addresses it believes."""

    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    # Connections from these networks may name the client in X-Forwarded-For or
    # Forwarded (sign-in throttling counts per client address). Empty: the TCP peer
    # is the client, and forwarded headers are ignored.
    trusted_proxies: list[IPvAnyNetwork] = Field(default_factory=list)


# --- admin API, reload, metrics (nemesis.admin, nemesis.runtime.reload) ----------

MIN_ADMIN_TOKEN_CHARS = 16


class AdminConfig(ListenConfig):
    """The admin API: health, readiness, ``/metrics``, live status, and live changes.

    ``token`` is the platform's token: it sees and changes every integration.
    Teams use the tokens and SSO identities of ``auth:``, each for its own
    integrations (``nemesis.admin.access``). ``metrics_token`` is the one
    credential Prometheus needs for ``/metrics``. Set them from the
    environment: ``token: ${NEMESIS_ADMIN_TOKEN:-}``.
    """

    port: Annotated[int, Field(ge=0, le=65535)] = 8081
    token: SecretStr | None = None
    metrics_token: SecretStr | None = None

    @field_validator("token", "metrics_token")
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
    """Picking up changed integration, pipeline and TLS files while running (SIGHUP works too)."""

    # Watch integrations_dir, pipelines_dir and the folders of target.tls files for changes.
    watch: bool = True
    # Changes arriving within this window are taken as one reload (an editor's save, a git pull).
    debounce_ms: Annotated[int, Field(ge=0, le=60_000)] = 500
    # Polls instead of inotify: for file systems that do not report changes (some network mounts).
    force_polling: bool = False


class TracingConfig(Model):
    """OpenTelemetry spans of delivery attempts (docs/tracing.md): the ``tracing`` extra.

    Off, Nemesis still continues or starts each event's W3C trace context; on,
    it records a span per delivery attempt, a child of the producer's span,
    exported over OTLP/HTTP.
    """

    enabled: bool = False
    # The share of traces Nemesis starts that are recorded; a producer's trace follows
    # the producer's sampled flag.
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    # The OTLP/HTTP traces URL; unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    # OTEL_EXPORTER_OTLP_ENDPOINT as the SDK reads them, else http://localhost:4318/v1/traces.
    otlp_endpoint: Annotated[str, Field(pattern=r"^https?://")] | None = None
    service_name: Annotated[str, Field(min_length=1, max_length=128)] = "nemesis"


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


# --- platform limits (nemesis.config.limits) -------------------------------------

PositiveInt = Annotated[int, Field(ge=1)]
PositiveRate = Annotated[float, Field(gt=0)]


class RateCapsConfig(Model):
    """The highest ``rate_limits`` (messages per second) per flow; unset: no cap."""

    main: PositiveRate | None = None
    retry: PositiveRate | None = None
    replay: PositiveRate | None = None


class IntegrationCapsConfig(Model):
    """What one integration may set at most: the ``delivery`` sizes and its rate limits.

    A capped rate must be set: an integration without one (unlimited) is over it.
    """

    workers: PositiveInt | None = None  # delivery.workers
    buffer: PositiveInt | None = None  # delivery.buffer
    batch_size: PositiveInt | None = None  # delivery.batch.size
    rate_limits: RateCapsConfig = defaults(RateCapsConfig)


class TeamCapsConfig(Model):
    """What a team's integrations may take together (each counts for every team it lists)."""

    # Workers and buffers are per replica: an integration counts with them times its replicas.
    workers: PositiveInt | None = None  # the sum of delivery.workers x replicas
    buffer: PositiveInt | None = None  # the sum of delivery.buffer x replicas
    rate_limits: RateCapsConfig = defaults(RateCapsConfig)  # the sum of each flow's rate_limits
    # How many replicas ``replicas: all`` counts for (the fleet's size); None: such an
    # integration cannot be counted, and is refused where a workers or buffer cap is set.
    all_replicas: PositiveInt | None = None


class LimitsConfig(Model):
    """The platform's caps, which ``nemesis validate``, ``nemesis run`` and live changes enforce.

    ``integration`` bounds each integration's own settings; ``team`` bounds
    the totals over the integrations a team owns (``owners``). Unset caps
    bound nothing.
    """

    integration: IntegrationCapsConfig = defaults(IntegrationCapsConfig)
    team: TeamCapsConfig = defaults(TeamCapsConfig)


def _stores_reach_every_replica(config: Any) -> Iterator[tuple[tuple[Hashable, ...], str]]:
    """A broker that spans hosts needs ``state:`` and ``dlq:`` that span them too.

    Replicas on several hosts split the work only when they meet in one state
    store: with a file per host, each host's replicas take themselves for the
    whole fleet and run every integration (rate limits multiply at the
    handlers, a live change reaches one host), and each keeps the dead letters
    of its integrations where the viewers of the other hosts never see them.
    ``single_host: true`` says every replica runs on one host (or there is
    one), where a file is enough.
    """
    if get_path(config, "single_host") is True:
        return
    registry = default_backends()
    backend = _kind_at(config, "backend", next(iter(registry.brokers)))
    broker = registry.brokers.get(backend)
    if broker is None or not broker.config.spans_hosts:
        return
    sections: tuple[tuple[str, str, dict[str, Any]], ...] = (
        ("state", "state store", {n: k.config for n, k in registry.states.items()}),
        ("dlq", "DLQ", {n: k.config for n, k in registry.dlqs.items()}),
    )
    for section, what, models in sections:
        kind = _kind_at(config, section, next(iter(models)))
        model = models.get(kind)
        if model is None or not model.per_host:
            continue
        shared = [name for name, other in models.items() if not other.per_host]
        default = "" if _written(config, section) else " (the default)"
        own = f"; {backend}: tables in the backend's database" if backend in shared else ""
        harm = (
            "each host's replicas would take themselves for the whole fleet and run every"
            " integration"
            if section == "state"
            else "each replica would keep its dead letters where the other hosts never see them"
        )
        yield (
            (section,),
            f"the {kind} {what}{default} is a file only one host's replicas reach, but the"
            f" {backend} backend shares its topics with replicas on any host: {harm}. Set"
            f" {section}.kind to {' or '.join(shared)} (see docs/state-store.md{own}), or"
            " single_host: true if every replica of this configuration runs on one host",
        )


def _kind_at(config: Any, section: str, default: str) -> str:
    kind = get_path(config, section, "kind", default=default)
    return kind if isinstance(kind, str) else default


def _written(config: Any, section: str) -> bool:
    if isinstance(config, dict):
        return section in config
    return section in getattr(config, "model_fields_set", ())


class NemesisConfig(Model):
    backend: BackendConfig = defaults(EmbeddedBackendConfig)
    dlq: DlqConfig = defaults(SqliteDlqConfig)
    # Where the replicas of this configuration meet (nemesis.fleet).
    state: StateConfig = defaults(SqliteStateConfig)
    data_dir: str = "data"
    integrations_dir: str = "integrations"
    pipelines_dir: str = "pipelines"
    admin: AdminConfig = defaults(AdminConfig)
    viewer: ViewerConfig = defaults(ViewerConfig)
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 10.0
    log_format: Literal["text", "json"] = "text"
    # The level of other libraries' records (aiokafka, ydb, uvicorn, ...); Nemesis' own
    # follow --log-level.
    library_log_level: Literal["debug", "info", "warning", "error"] = "warning"
    tracing: TracingConfig = defaults(TracingConfig)
    auth: AuthConfig = defaults(AuthConfig)
    reload: ReloadConfig = defaults(ReloadConfig)
    metrics: MetricsConfig = defaults(MetricsConfig)
    # Caps per integration and per team (nemesis.config.limits).
    limits: LimitsConfig = defaults(LimitsConfig)
    # Every replica of this configuration runs on one host (or there is one): the
    # sqlite state and DLQ files then serve a broker that spans hosts too.
    single_host: bool = False

    cross_rules = (_stores_reach_every_replica,)

    @model_validator(mode="after")
    def _dlq_works_with_the_backend(self) -> NemesisConfig:
        self.dlq.check_backend(self.backend)
        self.state.check_backend(self.backend)
        return self
