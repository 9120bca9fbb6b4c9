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
    Field,
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


class ListenConfig(Model):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)]
    enabled: bool = True


class NemesisConfig(Model):
    backend: EmbeddedBackendConfig = EmbeddedBackendConfig()
    dlq: SqliteDlqConfig = SqliteDlqConfig()
    data_dir: str = "data"
    integrations_dir: str = "integrations"
    pipelines_dir: str = "pipelines"
    admin: ListenConfig = ListenConfig(port=8081)
    viewer: ListenConfig = ListenConfig(port=8080)
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 10.0
    log_format: Literal["text", "json"] = "text"
