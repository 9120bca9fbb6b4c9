"""The dead-letter store port: what the runner writes, what the UI and the CLI read.

One row per source message per integration (``dead_letter_id``): a message
dead-lettered again (a redelivery after a crash, or a requeue that failed
again) updates its row instead of adding one. The row keeps its first
failure time, requeue count and the message's metadata; its last error,
attempts, dead-letter time and the span of the attempt that gave up
(``nemesis-last-span``) follow the latest failure, the earlier ones move to
``history``, and a ``requeued`` row is ``dead`` again. A
``discarded`` row stays discarded: only a duplicate of a failure someone
already chose to drop can reach it.

Lists are ordered newest first by (dead-letter time, a per-store tie-breaker)
and paged by keyset: a page's ``next_cursor`` is an opaque string that
resumes after its last row, so deep pages cost what the first one costs and
rows added meanwhile never shift a page. Every filter takes the set of
integrations the caller may see (``None``: all, for admins; an empty set:
nothing). Stores: ``nemesis.dlq.sqlite`` (embedded) and ``nemesis.dlq.ydb``,
both ``nemesis.dlq.core`` plus their queries.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from nemesis.broker.port import Headers, is_text_key, key_bytes
from nemesis.dlq.signature import dead_letter_id, failure_signature
from nemesis.errors import InvalidQuery

MAX_TEXT_CHARS = 200  # a text filter longer than this is refused, not truncated
MAX_FILTER_INTEGRATIONS = 1000
MAX_PAGE_ROWS = 500
MAX_SELECT_IDS = 100_000  # one bulk action's worth; larger actions run in rounds
MAX_GROUPS = 1000
MAX_ERROR_CHARS = 4000  # a longer error text is stored cut, marked with an ellipsis
MAX_HISTORY = 10  # earlier failures kept per row
PREVIEW_BYTES = 1024  # payload bytes per row in a list; ``get`` returns all of it
DEFAULT_RETENTION_S = 180 * 86400.0


class Reason(enum.StrEnum):
    """Why a message left the stream for the DLQ."""

    HTTP_4XX = "http_4xx"  # the handler rejected the message itself (400, 409, 410, 413, 415, 422)
    VERDICT_DEAD = "verdict_dead"  # the handler answered `nemesis-verdict: dead`
    RETRIES_EXHAUSTED = "retries_exhausted"  # the last retry tier failed too
    DECODE_ERROR = "decode_error"  # the payload could not be decoded (JSON, Protobuf)
    PIPELINE_ERROR = "pipeline_error"  # a pipeline stage raised on this message
    GRPC_STATUS = "grpc_status"  # the gRPC mirror of http_4xx (INVALID_ARGUMENT, ...)


class Status(enum.StrEnum):
    """Where a dead letter stands."""

    DEAD = "dead"  # waiting for someone
    REQUEUED = "requeued"  # sent to its integration's replay path
    DISCARDED = "discarded"  # dropped on purpose


class Action(enum.StrEnum):
    """What a person did to dead letters, an integration's offsets or its live settings.

    The audit log: the viewer's actions, ``nemesis offsets``, and every change
    made through the admin API (``nemesis.admin.audit``).
    """

    REQUEUE = "requeue"
    DISCARD = "discard"
    SEEK = "seek"  # nemesis offsets seek: committed offsets moved
    SKIP = "skip"  # nemesis offsets skip: messages passed over unread
    PAUSE = "pause"  # admin API: reading stopped
    RESUME = "resume"  # admin API: reading again
    TUNE = "tune"  # admin API: live values laid over the YAML (PATCH)
    RESET = "reset"  # admin API: live values cleared, back to the YAML
    RELOAD = "reload"  # admin API: the integrations directory read again


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One failure as the runner reports it; ``put`` turns it into a row or updates one.

    ``source_*`` are the coordinates of the message's first appearance (the
    source topic, not a retry tier); ``event_id`` is its CloudEvents id,
    which a requeue must carry in ``nemesis-event-id`` so that a new failure
    finds the same row. ``dead_lettered_at`` None means now (the store's
    clock); ``first_failure_at`` None means ``dead_lettered_at``.

    ``key``, ``headers`` and ``tombstone`` are the record's as the broker
    port holds them (``nemesis.broker.port.Message``): a binary key, the
    headers with their duplicates and null values, and a null value are
    kept, and a requeue writes them back as they were.
    """

    integration: str
    event_id: str
    payload: bytes
    reason: Reason
    error: str
    source_topic: str
    source_partition: int
    source_offset: int
    attempts: int = 1
    http_status: int | None = None
    key: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)
    stage: str | None = None  # the pipeline stage that failed, if one did
    first_failure_at: float | None = None
    dead_lettered_at: float | None = None
    headers: Headers = ()
    tombstone: bool = False  # the record had no value (``payload`` is empty)

    @property
    def id(self) -> str:
        return dead_letter_id(self.integration, self.event_id)

    @property
    def signature(self) -> str:
        return failure_signature(self.integration, self.reason, self.http_status, self.error)


@dataclass(frozen=True, slots=True)
class PastFailure:
    """An earlier failure of a row, kept when the message failed again."""

    dead_lettered_at: float
    reason: Reason
    http_status: int | None
    attempts: int
    error: str


@dataclass(frozen=True, slots=True)
class DeadLetterRow:
    """A row of the DLQ.

    In a list (``query``) ``payload`` holds at most the first ``preview_bytes``
    of the message; ``payload_size`` is always the full size and ``get``
    returns the whole payload as stored: a payload over 16 MiB is stored cut
    (``nemesis.dlq.core.MAX_STORED_PAYLOAD_BYTES``), and its row from ``get``
    says ``payload_truncated``.
    """

    id: str
    integration: str
    event_id: str
    status: Status
    reason: Reason
    http_status: int | None
    error: str
    signature: str
    attempts: int
    first_failure_at: float
    dead_lettered_at: float
    requeue_count: int
    last_action: Action | None
    last_action_by: str | None
    last_action_at: float | None
    source_topic: str
    source_partition: int
    source_offset: int
    key: str | None
    stage: str | None
    metadata: Mapping[str, str]
    payload: bytes
    payload_size: int
    history: tuple[PastFailure, ...] = ()
    headers: Headers = ()  # as in ``DeadLetter``
    tombstone: bool = False

    @property
    def payload_truncated(self) -> bool:
        return len(self.payload) < self.payload_size


def shown_key(key: str | None) -> str | None:
    """A key as a person reads it (the stores' ``msg_key`` column): a binary one (see
    ``nemesis.broker.port.key_text``) with replacement characters, a NUL as U+FFFD."""
    if key is None:
        return None
    text = key if is_text_key(key) else key_bytes(key).decode("utf-8", "replace")
    return text.replace("\x00", "\ufffd")


def _check_time(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise InvalidQuery(f"{name} must be a finite time")


@dataclass(frozen=True, slots=True)
class DeadLetterFilter:
    """Which rows a list, count, group, chart or bulk action covers; unset fields match all.

    Constructing one validates it, so input from a browser fails here with
    ``InvalidQuery`` (a 4xx), never deeper in a store.
    """

    integrations: frozenset[str] | None = None  # None: every integration (admins only)
    reason: Reason | None = None
    status: Status | None = None
    http_status: int | None = None
    signature: str | None = None  # one group (``Group.signature``)
    since: float | None = None  # dead_lettered_at >= since
    until: float | None = None  # dead_lettered_at < until
    text: str | None = None  # inside the payload or the error text; ASCII case-insensitive

    def __post_init__(self) -> None:
        if self.integrations is not None and len(self.integrations) > MAX_FILTER_INTEGRATIONS:
            raise InvalidQuery(f"a filter names at most {MAX_FILTER_INTEGRATIONS} integrations")
        if self.http_status is not None and not 100 <= self.http_status <= 599:
            raise InvalidQuery("an HTTP status is a number from 100 to 599")
        if self.signature is not None and not _is_signature(self.signature):
            raise InvalidQuery("a signature is 16 lowercase hex characters")
        _check_time("since", self.since)
        _check_time("until", self.until)
        if self.since is not None and self.until is not None and self.since > self.until:
            raise InvalidQuery("the time range ends before it starts")
        if self.text is not None and len(self.text) > MAX_TEXT_CHARS:
            raise InvalidQuery(f"the search text is longer than {MAX_TEXT_CHARS} characters")

    @property
    def matches_nothing(self) -> bool:
        """True for a caller who may see no integration at all."""
        return self.integrations is not None and not self.integrations


def _is_signature(value: str) -> bool:
    return len(value) == 16 and all(c in "0123456789abcdef" for c in value)


@dataclass(frozen=True, slots=True)
class PageRequest:
    """How many rows, starting after which cursor (None: the first page)."""

    limit: int = 50
    cursor: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_PAGE_ROWS:
            raise InvalidQuery(f"a page holds 1 to {MAX_PAGE_ROWS} rows")


@dataclass(frozen=True, slots=True)
class Page:
    """Rows of a list, newest first.

    ``next_cursor`` None means the list ends here. A text search stops at
    the store's scan bound: its page may hold fewer rows than asked (even
    none) and still have a ``next_cursor`` to search on from.
    """

    rows: Sequence[DeadLetterRow]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class PutResult:
    """What one ``put`` did."""

    inserted: int  # new rows
    updated: int  # failures of messages that had a row already


@dataclass(frozen=True, slots=True)
class Group:
    """Failures with one signature: one integration, reason, HTTP status and error pattern."""

    signature: str
    integration: str
    reason: Reason
    http_status: int | None
    pattern: str  # the normalised error text
    sample_error: str  # the error text of the first failure seen with this signature
    count: int
    first_at: float  # dead-letter times of the group's oldest and newest rows
    last_at: float


@dataclass(frozen=True, slots=True)
class IntegrationStats:
    """One integration's share of a ``Stats`` overview."""

    integration: str
    total: int
    last_hour: int  # rows dead-lettered within the hour before ``Stats.now``
    by_reason: Mapping[Reason, int]
    oldest_at: float
    newest_at: float


@dataclass(frozen=True, slots=True)
class TimeBucket:
    """Rows dead-lettered in ``[start, start + Stats.bucket_s)``."""

    start: float
    count: int


@dataclass(frozen=True, slots=True)
class Stats:
    """An overview of what a filter matches, for the UI's first page.

    ``by_integration`` lists the integrations that grew most in the last
    hour first, then the largest. ``buckets`` cover the time before ``now``
    in equal steps aligned to ``bucket_s``, oldest first; the last one is
    the current, partial step.
    """

    now: float
    total: int
    last_hour: int
    oldest_at: float | None
    newest_at: float | None
    by_integration: Sequence[IntegrationStats]
    by_reason: Mapping[Reason, int]
    bucket_s: float
    buckets: Sequence[TimeBucket]


@dataclass(frozen=True, slots=True)
class ActionRecord:
    """One entry of the audit log."""

    seq: int
    at: float
    who: str
    action: Action
    integrations: tuple[str, ...]
    count: int
    description: str  # what was selected: ids, a filter or a group, in words
    # How many of ``count`` each integration had; None when the action did not say.
    counts: Mapping[str, int] | None = None


@dataclass(frozen=True, slots=True)
class ActionPage:
    """Entries of the audit log, newest first; ``next_cursor`` None at the end."""

    rows: Sequence[ActionRecord]
    next_cursor: str | None


class DeadLetterStore(Protocol):
    """A DLQ table: idempotent writes, keyset-paged reads, status changes, an audit log."""

    async def put(self, letters: Sequence[DeadLetter]) -> PutResult:
        """Writes failures, one row per ``DeadLetter.id`` (see the module docstring)."""
        ...

    async def get(self, letter_id: str) -> DeadLetterRow | None:
        """One row with its whole payload, or None."""
        ...

    async def get_many(self, letter_ids: Collection[str]) -> Sequence[DeadLetterRow]:
        """The rows that exist among ``letter_ids``, whole payloads, newest first."""
        ...

    async def query(
        self,
        where: DeadLetterFilter,
        page: PageRequest | None = None,
        *,
        preview_bytes: int = PREVIEW_BYTES,
    ) -> Page:
        """One page of matching rows, newest first."""
        ...

    async def count(self, where: DeadLetterFilter, *, limit: int | None = None) -> int:
        """How many rows match; with ``limit``, stops counting there (a UI shows "10,000+")."""
        ...

    async def groups(self, where: DeadLetterFilter, *, limit: int = 100) -> Sequence[Group]:
        """Matching rows grouped by signature, largest group first."""
        ...

    async def stats(
        self,
        where: DeadLetterFilter,
        *,
        now: float | None = None,
        bucket_s: float = 3600.0,
        buckets: int = 24,
    ) -> Stats:
        """Counts per integration and reason, oldest and newest, and a time series."""
        ...

    async def select_ids(self, where: DeadLetterFilter, limit: int) -> Sequence[str]:
        """Ids of up to ``limit`` matching rows, newest first, for a bulk action."""
        ...

    async def mark_requeued(
        self,
        letter_ids: Collection[str],
        *,
        by: str,
        at: float | None = None,
        integrations: frozenset[str] | None = None,
    ) -> int:
        """Marks ``dead`` rows requeued (requeue count + 1); returns how many changed.

        Rows in another status, and with ``integrations`` rows of other
        integrations, are left alone: the caller's scope is enforced in the
        same statement that changes the rows.
        """
        ...

    async def mark_discarded(
        self,
        letter_ids: Collection[str],
        *,
        by: str,
        at: float | None = None,
        integrations: frozenset[str] | None = None,
    ) -> int:
        """Marks ``dead`` rows discarded; returns how many changed (scope as ``mark_requeued``)."""
        ...

    async def record_action(
        self,
        *,
        who: str,
        action: Action,
        integrations: Collection[str],
        count: int,
        description: str,
        at: float | None = None,
        counts: Mapping[str, int] | None = None,
    ) -> ActionRecord:
        """Appends an entry to the audit log; ``counts``: each integration's part of ``count``."""
        ...

    async def actions(
        self, page: PageRequest | None = None, *, integrations: frozenset[str] | None = None
    ) -> ActionPage:
        """The audit log, newest first; with ``integrations``, entries touching any of them."""
        ...

    async def enforce_retention(self, now: float | None = None) -> int:
        """Deletes rows dead-lettered longer ago than the retention, in small batches; how many."""
        ...

    async def close(self) -> None:
        """Releases the store's connections."""
        ...
