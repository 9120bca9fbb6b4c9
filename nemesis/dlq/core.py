"""What every DLQ store does the same way, whatever its database: ``StoreCore``.

A store is ``StoreCore`` plus its queries. The core implements the whole
``DeadLetterStore`` port: it checks arguments (``InvalidQuery``, a 4xx to
the API layers), clamps times to what a store keeps, decodes and issues
cursors, folds a failure into its row's history (``fold_failures``), maps
rows to ``DeadLetterRow``, ``Group``, ``Stats`` and ``ActionRecord``, and
runs bulk work in rounds. A store subclasses it and implements the
``_``-prefixed primitives below, each one query (or one transaction) in its
dialect, handing rows back as mappings by column name. Each store
(``nemesis.dlq.sqlite``, ``nemesis.dlq.ydb``, ``nemesis.dlq.postgres``) is a
subclass holding its DDL and those queries; the conditions a filter puts in
them are built once, by ``nemesis.dlq.sql``, in the store's spelling.

A payload is stored up to ``MAX_STORED_PAYLOAD_BYTES`` (16 MiB): past it the
stored payload is its first 16 MiB and ``payload_size`` keeps the real size,
so ``DeadLetterRow.payload_truncated`` says so wherever the row is read
(a requeue leaves such a row dead). The
limit is YDB's (a datashard refuses a cell over 16 MiB with BAD_REQUEST,
which no retry cures), kept by every store, so that a letter reads the same
whichever store holds it.

Text is stored without NUL characters (``no_nul``: each becomes U+FFFD), as
PostgreSQL's text columns require, so every store keeps the same values;
ids, signatures and the payload (bytes) are untouched.

The columns are the same in every store: times in whole microseconds since
1970 (``*_us``, clamped to the store's ``Times``: a signed 64-bit column
keeps times before 1970, an unsigned one starts there), ``history`` and
``metadata`` as JSON text, the payload as bytes.

What a string map cannot hold of a record travels in the ``metadata``
JSON under ``RECORD_ENTRY`` (``nemesis-record``; ``nemesis-*`` names are
Nemesis' own, never a producer's): its headers (``headers``, a list of
``[name, base64 or null]``), a key that is not UTF-8 (``key_base64``; the
``msg_key`` column holds it with replacement characters, for display) and
``tombstone``. A row without them has no such entry, so the stores need no
column of their own for it and the rows written before it read the same. Lists are ordered by
(``dead_lettered_us``, a per-store tie-breaker: ``tiebreak_column``)
descending and paged by keyset.

Writes are idempotent, so a store may retry one whose commit was
undetermined: a failure already in a row (as its latest failure or in its
history, by time, reason, HTTP status and attempts) is not added again, and
an audit entry equal to a recent one (``same_action``) is not appended again.
"""

from __future__ import annotations

import abc
import base64
import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from nemesis.broker.port import Headers, is_text_key, key_bytes, key_text
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.dlq.cursor import decode_cursor, encode_cursor
from nemesis.dlq.port import (
    DEFAULT_RETENTION_S,
    MAX_ERROR_CHARS,
    MAX_GROUPS,
    MAX_HISTORY,
    MAX_SELECT_IDS,
    PREVIEW_BYTES,
    Action,
    ActionPage,
    ActionRecord,
    DeadLetter,
    DeadLetterFilter,
    DeadLetterRow,
    Group,
    IntegrationStats,
    Page,
    PageRequest,
    PastFailure,
    PutResult,
    Reason,
    Stats,
    Status,
    TimeBucket,
    shown_key,
)
from nemesis.dlq.signature import normalise_error, pattern_signature
from nemesis.errors import DlqError, InvalidQuery
from nemesis.topology import META_LAST_SPAN

T = TypeVar("T")
Row = Mapping[str, Any]
Key = tuple[int, int]  # (dead_lettered_us, tie-breaker): a row's place in a list

SCHEMA_VERSION = 1
# The most of a payload a store keeps (see the module docstring): YDB's
# NLimits::MaxWriteValueSize, the datashard's limit on one cell.
MAX_STORED_PAYLOAD_BYTES = 16 * 1024 * 1024
RECORD_ENTRY = "nemesis-record"  # in the metadata JSON: headers, a binary key, a tombstone
# Candidates a text search examines per page: a page answers in tens of
# milliseconds even when nothing matches among a million rows.
TEXT_SCAN_ROWS = 20_000
ID_CHUNK = 500  # ids per statement
SELECT_ROUND = 5000  # ids per query of ``select_ids``
MARK_BATCH = 1000  # ids per status-change transaction, so puts interleave with a bulk action
DELETE_BATCH = 1000  # rows per retention transaction: locks are held for milliseconds
MAX_HISTORY_ERROR_CHARS = 500
MAX_SAMPLE_ERROR_CHARS = 1000
MAX_DESCRIPTION_CHARS = 2000
MAX_ACTOR_CHARS = 200
MAX_BUCKETS = 1000
MAX_BUCKET_S = 366 * 86400.0
RECENT_ACTIONS = 16  # audit entries a retried write compares itself with
US = 1_000_000
# Year 2262 in microseconds: every time a store keeps fits a signed 64-bit column.
MAX_TIME_US = 2**63 // 1000
LETTERS_CURSOR = "dlq"
ACTIONS_CURSOR = "dlq-audit"

# Every column of a dead letter, in the order the sqlite store keeps them
# (the payload last); a store's table may add its own (a tie-breaker).
LETTER_COLUMNS = (
    "id",
    "integration",
    "status",
    "reason",
    "http_status",
    "signature",
    "dead_lettered_us",
    "first_failure_us",
    "attempts",
    "requeue_count",
    "last_action",
    "last_action_by",
    "last_action_us",
    "event_id",
    "source_topic",
    "source_partition",
    "source_offset",
    "msg_key",
    "stage",
    "payload_size",
    "error",
    "history",
    "metadata",
    "payload",
)
# What a new failure of an existing row changes; ``put`` reads them first.
FAILURE_COLUMNS = (
    "id",
    "status",
    "reason",
    "http_status",
    "signature",
    "dead_lettered_us",
    "attempts",
    "stage",
    "error",
    "history",
    # The message's, but for the span of the attempt that gave up: the latest failure's.
    "metadata",
)
# What a status change writes.
ACTION_COLUMNS = (
    "id",
    "status",
    "requeue_count",
    "last_action",
    "last_action_by",
    "last_action_us",
)
SIGNATURE_COLUMNS = ("signature", "integration", "reason", "http_status", "pattern", "sample_error")
AUDIT_COLUMNS = ("seq", "at_us", "who", "action", "integrations", "count", "description")


# --- values ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Times:
    """The times a store's columns hold: from ``earliest_us`` to the year 2262."""

    earliest_us: int

    def to_us(self, seconds: float) -> int:
        """A time in whole microseconds, clamped to what the store keeps.

        A filter's bound outside the range matches what the range's end
        would: ``since=-1e20`` everything, ``until=1e20`` everything.
        """
        if not math.isfinite(seconds):
            raise InvalidQuery("a time must be a finite number of seconds")
        bound = MAX_TIME_US / US + 1.0
        return self.clamp(round(min(max(seconds, -bound), bound) * US))

    def clamp(self, us: int) -> int:
        return min(max(us, self.earliest_us), MAX_TIME_US)


SIGNED = Times(-MAX_TIME_US)  # a signed column: times before 1970 too
UNSIGNED = Times(0)  # an unsigned column: from 1970
to_us = SIGNED.to_us


def to_s(us: int) -> float:
    return us / US


def cut(text: str, limit: int) -> str:
    """``text``, or its first ``limit - 1`` characters and an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def no_nul(text: str) -> str:
    """``text`` with each NUL as U+FFFD: a PostgreSQL text column cannot hold a NUL."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def _no_nul_or_none(text: str | None) -> str | None:
    return None if text is None else no_nul(text)


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def ascii_lower(text: str) -> str:
    """Lowercase ASCII letters only, as every store's text search compares."""
    return text.translate(_ASCII_LOWER)


def check_schema_version(found: object, where: str) -> None:
    """Refuses a store written by a newer Nemesis."""
    if found is not None and int(str(found)) > SCHEMA_VERSION:
        raise DlqError(
            f"{where}: DLQ schema version {found} is newer than this Nemesis ({SCHEMA_VERSION})"
        )


# --- rows -----------------------------------------------------------------------------


def history(raw: str | None) -> tuple[PastFailure, ...]:
    if not raw:
        return ()
    return tuple(
        PastFailure(to_s(at_us), Reason(reason), http_status, attempts, error)
        for at_us, reason, http_status, attempts, error in orjson.loads(raw)
    )


def _with_last_span(stored: str, letter: DeadLetter) -> str:
    """A row's ``metadata`` column naming the span of ``letter``'s attempt, when it has one.

    A requeue's attempt spans link to the attempt that gave up last
    (``nemesis.runtime.tracing``); the rest of the metadata is the message's.
    """
    last_span = letter.metadata.get(META_LAST_SPAN)
    if last_span is None:
        return stored
    entries = orjson.loads(stored)
    entries[META_LAST_SPAN] = no_nul(last_span)
    return orjson.dumps(entries).decode()


def metadata_json(letter: DeadLetter) -> str:
    """The ``metadata`` column of a letter: its metadata, and its record's rest (see above)."""
    entries: dict[str, object] = dict(letter.metadata)
    entries.pop(RECORD_ENTRY, None)
    record: dict[str, object] = {}
    if letter.headers:
        record["headers"] = [
            [no_nul(name), None if value is None else base64.b64encode(value).decode("ascii")]
            for name, value in letter.headers
        ]
    if letter.key is not None and not is_text_key(letter.key):
        record["key_base64"] = base64.b64encode(key_bytes(letter.key)).decode("ascii")
    if letter.tombstone:
        record["tombstone"] = True
    if record:
        entries[RECORD_ENTRY] = record
    return orjson.dumps(entries).decode()


def _record_of(raw: str, shown_key: str | None) -> tuple[dict[str, str], str | None, Headers, bool]:
    """The metadata, key, headers and tombstone of a row's ``metadata`` column and key."""
    entries = orjson.loads(raw)
    record = entries.pop(RECORD_ENTRY, None)
    if not isinstance(record, dict):
        return entries, shown_key, (), False
    headers: Headers = tuple(
        (str(name), None if value is None else base64.b64decode(value))
        for name, value in record.get("headers", ())
    )
    key = shown_key
    if isinstance(record.get("key_base64"), str):
        key = key_text(base64.b64decode(record["key_base64"]))
    return entries, key, headers, record.get("tombstone") is True


def letter_row(r: Row) -> DeadLetterRow:
    """A row by column name; a list's row holds a payload preview under ``payload``."""
    metadata, key, headers, tombstone = _record_of(r["metadata"], r["msg_key"])
    return DeadLetterRow(
        id=r["id"],
        integration=r["integration"],
        event_id=r["event_id"],
        status=Status(r["status"]),
        reason=Reason(r["reason"]),
        http_status=r["http_status"],
        error=r["error"],
        signature=r["signature"],
        attempts=r["attempts"],
        first_failure_at=to_s(r["first_failure_us"]),
        dead_lettered_at=to_s(r["dead_lettered_us"]),
        requeue_count=r["requeue_count"],
        last_action=None if r["last_action"] is None else Action(r["last_action"]),
        last_action_by=r["last_action_by"],
        last_action_at=None if r["last_action_us"] is None else to_s(r["last_action_us"]),
        source_topic=r["source_topic"],
        source_partition=r["source_partition"],
        source_offset=r["source_offset"],
        key=key,
        stage=r["stage"],
        metadata=metadata,
        # A database may answer NULL for a piece of an empty value (SQLite's substr does).
        payload=bytes(r["payload"] or b""),
        payload_size=r["payload_size"],
        history=history(r["history"]),
        headers=headers,
        tombstone=tombstone,
    )


def group(r: Row) -> Group:
    return Group(
        signature=r["signature"],
        integration=r["integration"],
        reason=Reason(r["reason"]),
        http_status=r["http_status"],
        pattern=r["pattern"],
        sample_error=r["sample_error"],
        count=int(r["n"]),
        first_at=to_s(r["first_us"]),
        last_at=to_s(r["last_us"]),
    )


def action_record(r: Row) -> ActionRecord:
    # The integrations column holds a JSON list of names, or an object of each name's count.
    integrations = orjson.loads(r["integrations"])
    return ActionRecord(
        seq=int(r["seq"]),
        at=to_s(r["at_us"]),
        who=r["who"],
        action=Action(r["action"]),
        integrations=tuple(integrations),
        count=int(r["count"]),
        description=r["description"],
        counts=dict(integrations) if isinstance(integrations, dict) else None,
    )


def same_action(entry: Row, recent: Sequence[Row]) -> int | None:
    """The seq of an audit entry among ``recent`` equal to ``entry`` (a retried write), or None."""
    fields = AUDIT_COLUMNS[1:]
    for row in recent:
        if all(row[name] == entry[name] for name in fields):
            return int(row["seq"])
    return None


# --- writing failures -------------------------------------------------------------------


@dataclass
class Folded:
    """What ``put`` writes: whole new rows, changed failure columns, signatures to add."""

    inserts: list[dict[str, Any]] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    signatures: list[dict[str, Any]] = field(default_factory=list)
    inserted: int = 0
    updated: int = 0

    @property
    def result(self) -> PutResult:
        return PutResult(self.inserted, self.updated)


def signature_of(letter: DeadLetter) -> str:
    pattern = normalise_error(letter.error)
    return pattern_signature(letter.integration, letter.reason, letter.http_status, pattern)


def _failure_key(
    at_us: int, reason: str, http_status: int | None, attempts: int
) -> tuple[Any, ...]:
    return (at_us, reason, http_status, attempts)


def _known_failures(row: Row) -> set[tuple[Any, ...]]:
    known = {
        _failure_key(row["dead_lettered_us"], row["reason"], row["http_status"], row["attempts"])
    }
    for at_us, reason, http_status, attempts, _ in orjson.loads(row["history"] or "[]"):
        known.add(_failure_key(at_us, reason, http_status, attempts))
    return known


def stored_payload(payload: bytes) -> bytes:
    """What a store keeps of a payload: all of it, or its first ``MAX_STORED_PAYLOAD_BYTES``."""
    if len(payload) <= MAX_STORED_PAYLOAD_BYTES:
        return payload
    return payload[:MAX_STORED_PAYLOAD_BYTES]


def fold_failures(
    letters: Sequence[DeadLetter],
    existing: Mapping[str, Row],
    known_signatures: Collection[str],
    now_us: int,
    times: Times = SIGNED,
) -> Folded:
    """Applies failures in batch order to the rows they concern (see ``nemesis.dlq.port``).

    ``existing``: the ``FAILURE_COLUMNS`` of the rows the batch concerns, by
    id. A message twice in the batch is folded here, in memory, so a store
    reads once and writes once. A failure its row holds already (the same
    time, reason, HTTP status and attempts) is a write being retried, and
    changes nothing.
    """
    folded = Folded()
    rows: dict[str, dict[str, Any]] = {}  # this batch's version of each row
    new: set[str] = set()
    signatures: dict[str, dict[str, Any]] = {}
    for letter in letters:
        letter_id = letter.id
        at_us = now_us if letter.dead_lettered_at is None else times.to_us(letter.dead_lettered_at)
        pattern = normalise_error(letter.error)
        signature = pattern_signature(
            letter.integration, letter.reason, letter.http_status, pattern
        )
        if signature not in known_signatures:
            signatures.setdefault(
                signature,
                {
                    "signature": signature,
                    "integration": letter.integration,
                    "reason": letter.reason.value,
                    "http_status": letter.http_status,
                    "pattern": no_nul(pattern),
                    "sample_error": no_nul(cut(letter.error, MAX_SAMPLE_ERROR_CHARS)),
                },
            )
        error = no_nul(cut(letter.error, MAX_ERROR_CHARS))
        previous = rows.get(letter_id) or existing.get(letter_id)
        if previous is None:
            first = letter.first_failure_at
            first_us = at_us if first is None else times.to_us(first)
            rows[letter_id] = {
                "id": letter_id,
                "integration": letter.integration,
                "status": Status.DEAD.value,
                "reason": letter.reason.value,
                "http_status": letter.http_status,
                "signature": signature,
                "dead_lettered_us": at_us,
                "first_failure_us": first_us,
                "attempts": letter.attempts,
                "requeue_count": 0,
                "last_action": None,
                "last_action_by": None,
                "last_action_us": None,
                "event_id": no_nul(letter.event_id),
                "source_topic": no_nul(letter.source_topic),
                "source_partition": letter.source_partition,
                "source_offset": letter.source_offset,
                "msg_key": shown_key(letter.key),
                "stage": _no_nul_or_none(letter.stage),
                "payload_size": len(letter.payload),
                "error": error,
                "history": None,
                "metadata": metadata_json(letter),
                "payload": stored_payload(letter.payload),
            }
            new.add(letter_id)
            folded.inserted += 1
            continue
        folded.updated += 1
        key = _failure_key(at_us, letter.reason.value, letter.http_status, letter.attempts)
        if key in _known_failures(previous):
            continue  # this failure is in the row already: a retried write
        past = [*orjson.loads(previous["history"] or "[]")]
        past.append(
            [
                previous["dead_lettered_us"],
                previous["reason"],
                previous["http_status"],
                previous["attempts"],
                cut(previous["error"], MAX_HISTORY_ERROR_CHARS),
            ]
        )
        # A requeued message that failed again waits for someone again; a
        # discarded one can only be a duplicate of a failure already dropped.
        status = previous["status"]
        if status == Status.REQUEUED.value:
            status = Status.DEAD.value
        rows[letter_id] = {
            **previous,
            "id": letter_id,
            "status": status,
            "reason": letter.reason.value,
            "http_status": letter.http_status,
            "signature": signature,
            "dead_lettered_us": at_us,
            "attempts": letter.attempts,
            "stage": _no_nul_or_none(letter.stage),
            "error": error,
            "history": orjson.dumps(past[-MAX_HISTORY:]).decode(),
            "metadata": _with_last_span(previous["metadata"], letter),
        }
    for letter_id, row in rows.items():
        if letter_id in new:
            folded.inserts.append(row)
        elif row is not existing.get(letter_id):
            folded.updates.append({name: row[name] for name in FAILURE_COLUMNS})
    folded.signatures = list(signatures.values())
    return folded


# --- stats ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    """A chart's time range: ``buckets`` steps of ``bucket_us`` ending after ``now``.

    Steps before the earliest time a store keeps hold nothing: ``first`` of
    them are skipped, and a store counts from ``first_us``.
    """

    now: float
    hour_ago_us: int
    start_us: int
    end_us: int
    bucket_us: int
    buckets: int
    first: int

    @classmethod
    def of(cls, now: float, bucket_s: float, buckets: int, times: Times = SIGNED) -> Window:
        now_us = times.to_us(now)
        bucket_us = max(1, round(bucket_s * US))
        end_us = (now_us // bucket_us + 1) * bucket_us
        start_us = end_us - buckets * bucket_us
        first = min(buckets, max(0, -((start_us - times.earliest_us) // bucket_us)))
        hour_ago_us = times.clamp(now_us - 3600 * US)
        return cls(now, hour_ago_us, start_us, end_us, bucket_us, buckets, first)

    @property
    def first_us(self) -> int:
        return self.start_us + self.first * self.bucket_us

    @property
    def empty(self) -> bool:
        return self.first >= self.buckets


def build_stats(window: Window, pairs: Sequence[Row], per_bucket: Mapping[int, int]) -> Stats:
    """``Stats`` from counts per (integration, reason) and per bucket (counted from ``first``).

    A pair has ``integration``, ``reason``, ``total``, ``recent`` (in the
    last hour), ``oldest`` and ``newest`` (microseconds).
    """
    pairs = [p for p in pairs if p["total"]]
    integrations: dict[str, list[Row]] = {}
    for pair in pairs:
        integrations.setdefault(pair["integration"], []).append(pair)
    by_integration = [
        IntegrationStats(
            integration=name,
            total=sum(int(p["total"]) for p in rows),
            last_hour=sum(int(p["recent"]) for p in rows),
            by_reason={Reason(p["reason"]): int(p["total"]) for p in rows},
            oldest_at=to_s(min(p["oldest"] for p in rows)),
            newest_at=to_s(max(p["newest"] for p in rows)),
        )
        for name, rows in integrations.items()
    ]
    by_integration.sort(key=lambda s: (-s.last_hour, -s.total, s.integration))
    by_reason: dict[Reason, int] = {}
    for pair in pairs:
        reason = Reason(pair["reason"])
        by_reason[reason] = by_reason.get(reason, 0) + int(pair["total"])
    counts = {int(index) + window.first: int(n) for index, n in per_bucket.items()}
    return Stats(
        now=window.now,
        total=sum(s.total for s in by_integration),
        last_hour=sum(s.last_hour for s in by_integration),
        oldest_at=min((s.oldest_at for s in by_integration), default=None),
        newest_at=max((s.newest_at for s in by_integration), default=None),
        by_integration=by_integration,
        by_reason=by_reason,
        bucket_s=window.bucket_us / US,
        buckets=[
            TimeBucket(to_s(window.start_us + i * window.bucket_us), counts.get(i, 0))
            for i in range(window.buckets)
        ],
    )


# --- cursors ----------------------------------------------------------------------------


def _int_key(cursor: str, kind: str, arity: int) -> tuple[int, ...]:
    # decode_cursor checked arity and types; the filter only narrows the type for mypy.
    return tuple(
        part for part in decode_cursor(cursor, kind, (int,) * arity) if isinstance(part, int)
    )


def letters_key(cursor: str | None, times: Times = SIGNED) -> Key | None:
    if cursor is None:
        return None
    at_us, tie = _int_key(cursor, LETTERS_CURSOR, 2)
    return times.clamp(at_us), tie


def actions_key(cursor: str | None) -> int | None:
    if cursor is None:
        return None
    (seq,) = _int_key(cursor, ACTIONS_CURSOR, 1)
    return seq


# --- the store --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mark:
    """A status change of ``dead`` rows, as one ``_mark`` round writes it."""

    status: Status
    action: Action
    by: str
    at_us: int
    integrations: frozenset[str] | None

    @property
    def requeued(self) -> int:
        """What the change adds to a row's requeue count."""
        return 1 if self.status is Status.REQUEUED else 0


class StoreCore(abc.ABC):
    """The ``DeadLetterStore`` port over a store's primitives (see the module docstring)."""

    tiebreak_column = "seq"  # the column that orders rows of one microsecond
    times = SIGNED  # the times the store's columns hold

    def __init__(
        self, *, clock: Clock = SYSTEM_CLOCK, retention_s: float | None = DEFAULT_RETENTION_S
    ) -> None:
        self._clock = clock
        self.retention_s = retention_s

    # --- the primitives a store implements -----------------------------------------------

    @abc.abstractmethod
    async def _put(self, letters: Sequence[DeadLetter], now_us: int) -> PutResult:
        """In one transaction: read the rows and signatures, ``fold_failures``, write."""

    @abc.abstractmethod
    async def _rows(self, letter_ids: Sequence[str]) -> Sequence[Row]:
        """The rows among (at most ``ID_CHUNK``) ids, whole payloads, any order."""

    @abc.abstractmethod
    async def _list(
        self, where: DeadLetterFilter, after: Key | None, limit: int, preview_bytes: int
    ) -> tuple[Sequence[Row], Key | None]:
        """Up to ``limit`` matching rows after ``after``, newest first, payloads cut.

        A text search examines at most ``TEXT_SCAN_ROWS`` candidates: then the
        second value is the key of the last one examined, else None.
        """

    @abc.abstractmethod
    async def _ids(
        self, where: DeadLetterFilter, after: Key | None, limit: int
    ) -> tuple[Sequence[str], Key | None]:
        """Up to ``limit`` matching ids after ``after``, newest first, and the last one's key."""

    @abc.abstractmethod
    async def _count(self, where: DeadLetterFilter, limit: int | None) -> int:
        """How many rows match, counting at most ``limit``."""

    @abc.abstractmethod
    async def _groups(self, where: DeadLetterFilter, limit: int) -> Sequence[Row]:
        """The ``limit`` largest groups: signature columns, ``n``, ``first_us``, ``last_us``."""

    @abc.abstractmethod
    async def _stats(
        self, where: DeadLetterFilter, window: Window
    ) -> tuple[Sequence[Row], Mapping[int, int]]:
        """Counts per pair (see ``build_stats``) and per bucket from ``window.first_us``."""

    @abc.abstractmethod
    async def _mark(self, letter_ids: Sequence[str], mark: Mark) -> int:
        """In one transaction: applies ``mark`` to the dead rows in scope; how many."""

    @abc.abstractmethod
    async def _append_action(self, entry: Row) -> int:
        """Appends an audit entry (``AUDIT_COLUMNS`` but ``seq``); its seq."""

    @abc.abstractmethod
    async def _actions(
        self, before: int | None, limit: int, integrations: frozenset[str] | None
    ) -> Sequence[Row]:
        """Audit entries with a seq below ``before``, newest first, touching ``integrations``."""

    @abc.abstractmethod
    async def _delete_expired(self, cutoff_us: int, limit: int) -> int:
        """Deletes up to ``limit`` rows dead-lettered before ``cutoff_us``; how many."""

    @abc.abstractmethod
    async def _prune_signatures(self) -> None:
        """Deletes signatures no row has any more."""

    # --- the port ------------------------------------------------------------------------

    async def put(self, letters: Sequence[DeadLetter]) -> PutResult:
        """Writes failures, one row per ``DeadLetter.id`` (see ``nemesis.dlq.port``)."""
        if not letters:
            return PutResult(0, 0)
        return await self._put(tuple(letters), self.times.to_us(self._clock.time()))

    async def get(self, letter_id: str) -> DeadLetterRow | None:
        """One row with its whole payload, or None."""
        rows = await self.get_many([letter_id])
        return rows[0] if rows else None

    async def get_many(self, letter_ids: Collection[str]) -> Sequence[DeadLetterRow]:
        """The rows that exist among ``letter_ids``, whole payloads, newest first."""
        rows: list[DeadLetterRow] = []
        for chunk in chunks(sorted(set(letter_ids)), ID_CHUNK):
            rows.extend(letter_row(r) for r in await self._rows(chunk))
        rows.sort(key=lambda row: (row.dead_lettered_at, row.id), reverse=True)
        return rows

    async def query(
        self,
        where: DeadLetterFilter,
        page: PageRequest | None = None,
        *,
        preview_bytes: int = PREVIEW_BYTES,
    ) -> Page:
        """One page of matching rows, newest first (payloads cut to ``preview_bytes``)."""
        page = page or PageRequest()
        if preview_bytes < 0:
            raise InvalidQuery("preview_bytes cannot be negative")
        after = letters_key(page.cursor, self.times)
        if where.matches_nothing:
            return Page([], None)
        found, next_key = await self._list(
            where, after, page.limit + 1, min(preview_bytes, 2**31 - 1)
        )
        rows = list(found)
        if len(rows) > page.limit:
            rows = rows[: page.limit]
            next_key = (rows[-1]["dead_lettered_us"], rows[-1][self.tiebreak_column])
        cursor = None if next_key is None else encode_cursor(LETTERS_CURSOR, next_key)
        return Page([letter_row(r) for r in rows], cursor)

    async def count(self, where: DeadLetterFilter, *, limit: int | None = None) -> int:
        """How many rows match; with ``limit``, stops counting there."""
        if limit is not None and limit < 0:
            raise InvalidQuery("a count limit cannot be negative")
        if where.matches_nothing or limit == 0:
            return 0
        return await self._count(where, limit)

    async def groups(self, where: DeadLetterFilter, *, limit: int = 100) -> Sequence[Group]:
        """Matching rows grouped by signature, largest group first."""
        if not 1 <= limit <= MAX_GROUPS:
            raise InvalidQuery(f"a group list holds 1 to {MAX_GROUPS} groups")
        if where.matches_nothing:
            return []
        groups = [group(r) for r in await self._groups(where, limit)]
        groups.sort(key=lambda g: (-g.count, g.signature))
        return groups

    async def stats(
        self,
        where: DeadLetterFilter,
        *,
        now: float | None = None,
        bucket_s: float = 3600.0,
        buckets: int = 24,
    ) -> Stats:
        """Counts per integration and reason, oldest and newest, and a time series."""
        if not (math.isfinite(bucket_s) and 0 < bucket_s <= MAX_BUCKET_S):
            raise InvalidQuery(f"a chart's bucket is longer than 0 and at most {MAX_BUCKET_S:g}s")
        if not 1 <= buckets <= MAX_BUCKETS:
            raise InvalidQuery(f"a chart has 1 to {MAX_BUCKETS} buckets")
        now = self._clock.time() if now is None else now
        window = Window.of(now, bucket_s, buckets, self.times)
        if where.matches_nothing:
            return build_stats(window, [], {})
        pairs, per_bucket = await self._stats(where, window)
        return build_stats(window, pairs, per_bucket)

    async def select_ids(self, where: DeadLetterFilter, limit: int) -> Sequence[str]:
        """Ids of up to ``limit`` matching rows, newest first, for a bulk action."""
        if not 1 <= limit <= MAX_SELECT_IDS:
            raise InvalidQuery(f"a bulk action covers 1 to {MAX_SELECT_IDS} rows at a time")
        if where.matches_nothing:
            return []
        ids: list[str] = []
        after: Key | None = None
        # In rounds, each a query of its own: other reads queue between them.
        while len(ids) < limit:
            size = min(SELECT_ROUND, limit - len(ids))
            found, after = await self._ids(where, after, size)
            ids += found
            if len(found) < size or after is None:
                break
        return ids

    async def mark_requeued(
        self,
        letter_ids: Collection[str],
        *,
        by: str,
        at: float | None = None,
        integrations: frozenset[str] | None = None,
    ) -> int:
        """Marks ``dead`` rows requeued (requeue count + 1); returns how many changed."""
        return await self._marked(letter_ids, Status.REQUEUED, Action.REQUEUE, by, at, integrations)

    async def mark_discarded(
        self,
        letter_ids: Collection[str],
        *,
        by: str,
        at: float | None = None,
        integrations: frozenset[str] | None = None,
    ) -> int:
        """Marks ``dead`` rows discarded; returns how many changed."""
        return await self._marked(
            letter_ids, Status.DISCARDED, Action.DISCARD, by, at, integrations
        )

    async def _marked(
        self,
        letter_ids: Collection[str],
        status: Status,
        action: Action,
        by: str,
        at: float | None,
        integrations: frozenset[str] | None,
    ) -> int:
        unique = sorted(set(letter_ids))
        if not unique or (integrations is not None and not integrations):
            return 0
        at_us = self.times.to_us(self._clock.time() if at is None else at)
        mark = Mark(status, action, no_nul(cut(by, MAX_ACTOR_CHARS)), at_us, integrations)
        changed = 0
        for chunk in chunks(unique, MARK_BATCH):
            changed += await self._mark(chunk, mark)
        return changed

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
        at_us = self.times.to_us(self._clock.time() if at is None else at)
        names: object = tuple(sorted({no_nul(name) for name in integrations}))
        if counts is not None:
            # Each name's own count, so a team reading the entry sees its part of it.
            names = {no_nul(name): int(counts.get(name, 0)) for name in sorted(integrations)}
        entry = {
            "at_us": at_us,
            "who": no_nul(cut(who, MAX_ACTOR_CHARS)),
            "action": action.value,
            "integrations": orjson.dumps(names).decode(),
            "count": count,
            "description": no_nul(cut(description, MAX_DESCRIPTION_CHARS)),
        }
        seq = await self._append_action(entry)
        return action_record({**entry, "seq": seq})

    async def actions(
        self, page: PageRequest | None = None, *, integrations: frozenset[str] | None = None
    ) -> ActionPage:
        """The audit log, newest first; with ``integrations``, entries touching any of them."""
        page = page or PageRequest()
        before = actions_key(page.cursor)
        if integrations is not None and not integrations:
            return ActionPage([], None)
        found = await self._actions(before, page.limit + 1, integrations)
        records = sorted((action_record(r) for r in found), key=lambda r: r.seq, reverse=True)
        if len(records) <= page.limit:
            return ActionPage(records, None)
        records = records[: page.limit]
        return ActionPage(records, encode_cursor(ACTIONS_CURSOR, (records[-1].seq,)))

    async def enforce_retention(self, now: float | None = None) -> int:
        """Deletes rows dead-lettered longer ago than the retention, in small batches; how many."""
        if self.retention_s is None:
            return 0
        now = self._clock.time() if now is None else now
        cutoff_us = self.times.to_us(now - self.retention_s)
        deleted = 0
        # One transaction per batch: puts and status changes queue between them.
        while cutoff_us > self.times.earliest_us:
            batch = await self._delete_expired(cutoff_us, DELETE_BATCH)
            deleted += batch
            if batch < DELETE_BATCH:
                break
        if deleted:
            await self._prune_signatures()
        return deleted


def check_retention(retention_s: float | None) -> None:
    """Refuses a retention that is not a positive number of seconds (None: keep forever)."""
    if retention_s is not None and not (math.isfinite(retention_s) and retention_s > 0):
        raise ValueError("retention_s must be a positive number of seconds, or None")
