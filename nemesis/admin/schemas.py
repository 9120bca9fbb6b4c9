"""The admin API's request and response bodies (they are its OpenAPI schema)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

# The bounds repeat DeliveryConfig's and BatchConfig's (tests/test_admin_api.py
# checks that they agree): the schema tells a client what fits before it asks.
Workers = Annotated[int, Field(ge=1, le=4096)]
Buffer = Annotated[int, Field(ge=1, le=1_000_000)]
BatchSize = Annotated[int, Field(ge=1, le=10_000)]
MaxWaitMs = Annotated[int, Field(ge=0, le=60_000)]
Rate = Annotated[float, Field(gt=0, le=1e9)]
TypeName = Annotated[str, Field(min_length=1, max_length=200)]


class _Request(BaseModel):
    # Strict: a field the schema calls boolean takes true/false, not 0 or "yes"; an
    # integer takes 4, not "4" or 4.0 (a number still takes an integer: 5 is 5.0).
    model_config = ConfigDict(extra="forbid", strict=True)


class BatchPatch(_Request):
    """``delivery.batch``: read by each worker when it starts its next batch."""

    size: BatchSize | None = None
    max_wait_ms: MaxWaitMs | None = None


class DeliveryPatch(_Request):
    """``delivery``: workers resize at once, the buffer bound moves at once."""

    workers: Workers | None = None
    buffer: Buffer | None = None
    batch: BatchPatch | None = None


class RateLimitsPatch(_Request):
    """``rate_limits`` in messages per second; an explicit ``null`` lifts a limit."""

    main: Rate | None = None
    retry: Rate | None = None
    replay: Rate | None = None


class FlagsPatch(_Request):
    """``flags``: message types (``ce-type``) acknowledged without delivery."""

    disabled_types: Annotated[list[TypeName], Field(max_length=1000)] | None = None


class IntegrationPatch(_Request):
    """Live values to lay over an integration's YAML; omitted fields stay as they are."""

    delivery: DeliveryPatch | None = None
    rate_limits: RateLimitsPatch | None = None
    flags: FlagsPatch | None = None
    paused: bool | None = None

    def changes(self) -> dict[str, Any]:
        """The patch as dotted live fields (``delivery.workers``) and their new values."""
        changes: dict[str, Any] = {}
        if self.delivery is not None:
            delivery = self.delivery
            for name in ("workers", "buffer"):
                if getattr(delivery, name) is not None:
                    changes[f"delivery.{name}"] = getattr(delivery, name)
            if delivery.batch is not None:
                for name in ("size", "max_wait_ms"):
                    if getattr(delivery.batch, name) is not None:
                        changes[f"delivery.batch.{name}"] = getattr(delivery.batch, name)
        if self.rate_limits is not None:
            # Only the flows the client named: an explicit null is "unlimited".
            for name in sorted(self.rate_limits.model_fields_set):
                changes[f"rate_limits.{name}"] = getattr(self.rate_limits, name)
        if self.flags is not None and self.flags.disabled_types is not None:
            changes["flags.disabled_types"] = list(self.flags.disabled_types)
        if self.paused is not None:
            changes["paused"] = self.paused
        return changes


class Problem(BaseModel):
    """A configuration problem: file, line and field."""

    file: str
    line: int | None
    field: str | None
    message: str


class Setting(BaseModel):
    """A live field: its running value, where it came from and what the YAML says."""

    field: str
    value: Any
    source: Literal["default", "yaml", "override"]
    yaml: Any
    drift: bool


class StalledPartition(BaseModel):
    """A partition the flow holds and cannot deliver from until an operator acts."""

    topic: str
    partition: int
    reason: str


class FlowStatus(BaseModel):
    """One flow's runner: main, retry-<n> or replay."""

    flow: str
    topic: str
    state: str
    workers: int
    workers_busy: int
    workers_retiring: int
    buffered: int
    in_flight: int
    delayed: int
    halted: int  # keys held behind a message past its retries (on_exhausted: halt)
    dlq_waiting: int = 0  # dead messages waiting for the dead-letter store, which cannot write
    unfinished: int
    uncommitted: int
    paused_partitions: int
    assigned_partitions: int
    messages_read: int
    seconds_since_last_read: float
    seconds_since_last_commit: float | None
    stalled_partitions: list[StalledPartition] = []


class PartitionLagStatus(BaseModel):
    """The commit lag of one flow on one partition."""

    flow: str
    topic: str
    partition: int
    end_offset: int
    committed_offset: int
    messages: int
    seconds: float | None
    exact: bool


class LagStatus(BaseModel):
    """Commit lag: total messages behind, the oldest one's age, and per partition."""

    messages: int
    seconds: float | None
    partitions: list[PartitionLagStatus]


class BreakerStatus(BaseModel):
    """The circuit breaker of the integration's target."""

    state: Literal["closed", "open", "half_open"]
    time_in_state_s: float
    cooldown_remaining_s: float
    error_rate: float | None
    window_requests: int
    window_failures: int


class RateLimitStatus(BaseModel):
    """One flow's rate limiter."""

    flow: Literal["main", "retry", "replay"]
    limit: float | None
    waiting: int
    waits: int
    waited_s: float


class Rates(BaseModel):
    """Throughput and delivery time, measured over the last minute of the main flow."""

    window_s: float
    delivered_per_s: float
    produced_per_s: float | None
    latency_ms: float
    batch_size: int


class SizingStatus(BaseModel):
    """Workers as configured beside what the measured load needs (``nemesis size``)."""

    configured_workers: int
    configured_buffer: int
    recommended_workers: int | None
    recommended_buffer: int | None
    headroom: float
    capped: bool


class IntegrationStatus(BaseModel):
    """An integration as it runs now."""

    name: str
    state: str
    paused: bool
    file: str | None
    flows: list[FlowStatus]
    issues: dict[str, str]
    breaker: BreakerStatus
    lag: LagStatus
    rates: Rates | None  # None until a minute of deliveries is measured
    rate_limits: list[RateLimitStatus]
    settings: list[Setting]
    drift: list[Setting]
    sizing: SizingStatus
    problems: list[Problem]


class IntegrationList(BaseModel):
    """Every running integration."""

    integrations: list[IntegrationStatus]


class Health(BaseModel):
    """The process answers."""

    status: Annotated[Literal["ok"], WithJsonSchema({"type": "string", "enum": ["ok"]})]


class Readiness(BaseModel):
    """Whether the proxy is up and running its integrations, and if not, why."""

    status: Literal["ready", "not_ready"]
    reasons: list[str]
    integrations: int


class ReloadResult(BaseModel):
    """What a configuration reload found and did."""

    trigger: str
    at: float
    ok: bool
    added: list[str]
    applied: dict[str, list[str]]
    restarted: dict[str, list[str]]
    removed: list[str]
    kept: list[str]
    problems: list[Problem]


class ConfigStatus(BaseModel):
    """The integrations directory and the last reload."""

    directory: str | None
    watching: bool
    last_reload: ReloadResult | None


class SizingFigure(BaseModel):
    """``N = R x T`` with headroom, and the buffer it implies."""

    rps: float
    latency_ms: float
    batch_size: int
    headroom: float
    in_flight: float
    workers: int
    buffer: int
    capped: bool


class ErrorMessage(BaseModel):
    """Why a request was refused."""

    detail: str


class FleetMemberStatus(BaseModel):
    """One replica of the fleet, from its row in the state store."""

    member_id: str
    host: str
    pid: int
    started_at: float
    heartbeat_age_s: float
    lease_left_s: float  # negative: expired, forgotten at the next look
    draining: bool  # shutting down: takes nothing new, hands its integrations over
    running: int  # integrations it runs now
    this: bool  # the member answering


# An enum of one rather than ``const``: OpenAPI client generators read enums.
AllReplicas = Annotated[Literal["all"], WithJsonSchema({"type": "string", "enum": ["all"]})]


class FleetPlacement(BaseModel):
    """Who should run an integration (``assigned``) and who runs it now (``running``)."""

    name: str
    replicas: int | AllReplicas
    assigned: list[str]
    running: list[str]


class FleetOverride(BaseModel):
    """A live value stored for the whole fleet."""

    integration: str
    field: str
    value: Any
    version: int
    set_by: str
    set_at: float


class FleetStatus(BaseModel):
    """The replicas sharing this configuration's state store, and their integrations."""

    location: str
    generation: int
    member_id: str
    members: list[FleetMemberStatus]
    integrations: list[FleetPlacement]
    overrides: list[FleetOverride]
    last_error: str | None  # the state store's last failure, while it lasts


AuditAction = Literal[
    "requeue", "discard", "seek", "skip", "pause", "resume", "tune", "reset", "reload"
]


class AuditEntry(BaseModel):
    """One entry of the audit log: who did what, when, to which integrations."""

    seq: int
    at: float  # Unix seconds
    who: str
    action: AuditAction
    integrations: list[str]  # for a team: only its own
    # How many messages or fields; null when the entry also covered another team's integrations.
    count: int | None
    description: str


class AuditPage(BaseModel):
    """Audit entries, newest first; ``next_cursor`` asks for the next page (null: the end)."""

    entries: list[AuditEntry]
    next_cursor: str | None


class PartitionOffsets(BaseModel):
    """One partition of a flow: where its consumer stands and how far behind."""

    partition: int
    start: int
    committed: int
    end: int
    lag: int
    next_written_at: float | None  # Unix seconds: when the next message to deliver was written


class FlowOffsetsStatus(BaseModel):
    """A flow's topic and consumer; ``partitions`` null: its topic does not exist yet."""

    flow: str
    topic: str
    consumer: str
    partitions: list[PartitionOffsets] | None


class OffsetsStatus(BaseModel):
    """An integration's committed offsets, flow by flow (``nemesis offsets show``)."""

    integration: str
    flows: list[FlowOffsetsStatus]


class SkipRequest(_Request):
    """Moves a paused integration's committed offsets past the next ``count`` messages."""

    flow: Annotated[str, Field(min_length=1, max_length=64)] = "main"
    count: Annotated[int, Field(ge=1, le=1_000_000)]
    partition: Annotated[int, Field(ge=0, le=1_000_000)] | None = None  # None: every partition


class OffsetMove(BaseModel):
    """One partition's committed offset before and after a move."""

    partition: int
    before: int
    after: int


class SkipResult(BaseModel):
    """What moved; it is in the audit log too."""

    integration: str
    flow: str
    moves: list[OffsetMove]
