"""The ``sqlite`` DLQ store: one SQLite file (WAL), every statement on a worker thread.

Two connections, each owned by its own thread (``nemesis.sqlite_thread``, shared with
the embedded broker): writes (``put``, status changes, retention) queue on
one, reads (the UI's lists, counts, charts) on the other, so a slow chart
never delays the runner's ``put`` and WAL lets both run at once.

Speed at millions of rows comes from the indexes, not from the planner's
guesses: every list is ``(equality columns..., dead_lettered_us)`` on one
index, named with ``INDEXED BY`` so the plan cannot flip as the table grows.
The rowid (``seq``) is the implicit last column of each index, so
``ORDER BY dead_lettered_us DESC, seq DESC`` walks an index backwards with
no sort, and ``seq`` is the keyset's tie-breaker. An index column the filter
leaves open (the status, or several integrations) becomes one branch per
value, each branch limited to a page, merged by ``UNION ALL``; a list reads
only (time, seq) pairs from covering indexes and then fetches its page's
rows by seq. A text search has to read rows, so it examines at most
``TEXT_SCAN_ROWS`` candidates per page and hands back a cursor to continue.
"""

from __future__ import annotations

import itertools
import math
import os
import sqlite3
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import orjson

from nemesis.sqlite_thread import SqliteThread, read_transaction, write_transaction
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
)
from nemesis.dlq.signature import escape_like, normalise_error, pattern_signature
from nemesis.errors import BrokerError, BrokerTimeout, DlqError, DlqTimeout, InvalidQuery

T = TypeVar("T")

SCHEMA_VERSION = 1
# Candidates a text search examines per page: a page answers in tens of
# milliseconds even when nothing matches among a million rows.
TEXT_SCAN_ROWS = 20_000
# Branches of one list query; a filter that would need more falls back to an
# index that needs fewer (in the end the time index, filtering as it goes).
MAX_BRANCHES = 64
DELETE_BATCH = 1000  # rows per retention transaction: the write lock is held for milliseconds
SELECT_ROUND = 5000  # ids per read job of ``select_ids``
MARK_BATCH = 1000  # ids per status-change transaction, so puts interleave with a bulk action
ID_CHUNK = 500  # bound parameters per IN list, well under SQLite's limit
MAX_HISTORY_ERROR_CHARS = 500
MAX_SAMPLE_ERROR_CHARS = 1000
MAX_DESCRIPTION_CHARS = 2000
MAX_ACTOR_CHARS = 200
_US = 1_000_000

# The small columns come first and the payload last: SQLite reads a row's
# columns in order and keeps a large payload in overflow pages that a filter
# on the small ones never touches.
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS dlq_meta (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS dlq_letters (
        seq INTEGER PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        integration TEXT NOT NULL,
        status TEXT NOT NULL,
        reason TEXT NOT NULL,
        http_status INTEGER,
        signature TEXT NOT NULL,
        dead_lettered_us INTEGER NOT NULL,
        first_failure_us INTEGER NOT NULL,
        attempts INTEGER NOT NULL,
        requeue_count INTEGER NOT NULL DEFAULT 0,
        last_action TEXT,
        last_action_by TEXT,
        last_action_us INTEGER,
        event_id TEXT NOT NULL,
        source_topic TEXT NOT NULL,
        source_partition INTEGER NOT NULL,
        source_offset INTEGER NOT NULL,
        msg_key TEXT,
        stage TEXT,
        payload_size INTEGER NOT NULL,
        error TEXT NOT NULL,
        history TEXT,
        metadata TEXT NOT NULL,
        payload BLOB NOT NULL
    )""",
    # One row per signature ever seen: what a group shows, kept apart so that a
    # million rows do not each carry their normalised error text.
    """CREATE TABLE IF NOT EXISTS dlq_signatures (
        signature TEXT PRIMARY KEY,
        integration TEXT NOT NULL,
        reason TEXT NOT NULL,
        http_status INTEGER,
        pattern TEXT NOT NULL,
        sample_error TEXT NOT NULL
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS dlq_signatures_by_integration ON dlq_signatures (integration)",
    # AUTOINCREMENT: an audit entry's number is never reused.
    """CREATE TABLE IF NOT EXISTS dlq_actions (
        seq INTEGER PRIMARY KEY AUTOINCREMENT,
        at_us INTEGER NOT NULL,
        who TEXT NOT NULL,
        action TEXT NOT NULL,
        integrations TEXT NOT NULL,
        count INTEGER NOT NULL,
        description TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS dlq_action_integrations (
        integration TEXT NOT NULL,
        action_seq INTEGER NOT NULL,
        PRIMARY KEY (integration, action_seq)
    ) WITHOUT ROWID""",
)


@dataclass(frozen=True, slots=True)
class _Index:
    """An index on ``(*columns, dead_lettered_us)`` (+ the implicit seq) of dlq_letters."""

    name: str
    columns: tuple[str, ...]

    @property
    def ddl(self) -> str:
        columns = ", ".join((*self.columns, "dead_lettered_us"))
        return f"CREATE INDEX IF NOT EXISTS {self.name} ON dlq_letters ({columns})"


# In order of preference: the first whose columns the filter pins (the status
# may stay open: it has three values) serves the query.
_BY_SIGNATURE = _Index("dlq_letters_by_signature", ("signature", "status"))
_BY_INTEGRATION_REASON = _Index(
    "dlq_letters_by_integration_reason", ("integration", "reason", "status")
)
_BY_INTEGRATION = _Index("dlq_letters_by_integration", ("integration", "status"))
_BY_REASON = _Index("dlq_letters_by_reason", ("reason", "status"))
_BY_STATUS = _Index("dlq_letters_by_status", ("status",))
_BY_TIME = _Index("dlq_letters_by_time", ())
_INDEXES = (_BY_SIGNATURE, _BY_INTEGRATION_REASON, _BY_INTEGRATION, _BY_REASON, _BY_STATUS)
_OPEN_COLUMNS = {"status": tuple(s.value for s in Status)}

_ROW_COLUMNS = (
    "seq, id, integration, event_id, status, reason, http_status, error, signature, attempts,"
    " first_failure_us, dead_lettered_us, requeue_count, last_action, last_action_by,"
    " last_action_us, source_topic, source_partition, source_offset, msg_key, stage, metadata,"
    " payload_size, history"
)


def _to_us(seconds: float) -> int:
    return round(seconds * _US)


def _to_s(us: int) -> float:
    return us / _US


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _marks(count: int) -> str:
    return ",".join("?" * count)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- filters to SQL -----------------------------------------------------------


@dataclass
class _Where:
    """Conditions joined by AND, with their parameters in order."""

    parts: list[str] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)

    def add(self, sql: str, *params: Any) -> _Where:
        self.parts.append(sql)
        self.params.extend(params)
        return self

    def __add__(self, other: _Where) -> _Where:
        return _Where([*self.parts, *other.parts], [*self.params, *other.params])

    @property
    def sql(self) -> str:
        return " AND ".join(self.parts) or "1"


def _pinned(where: DeadLetterFilter) -> dict[str, tuple[str, ...]]:
    """The indexed columns the filter pins to values."""
    pinned: dict[str, tuple[str, ...]] = {}
    if where.signature is not None:
        pinned["signature"] = (where.signature,)
    if where.integrations is not None:
        pinned["integration"] = tuple(sorted(where.integrations))
    if where.reason is not None:
        pinned["reason"] = (where.reason.value,)
    if where.status is not None:
        pinned["status"] = (where.status.value,)
    return pinned


def _choose_index(
    pinned: Mapping[str, tuple[str, ...]], max_branches: float
) -> tuple[_Index, list[tuple[str, ...]]]:
    """The index that serves the filter, and the values of each of its columns."""
    for index in _INDEXES:
        if not any(column in pinned for column in index.columns):
            continue
        values = [
            pinned[column] if column in pinned else _OPEN_COLUMNS.get(column)
            for column in index.columns
        ]
        present = [v for v in values if v is not None]
        if len(present) == len(values) and math.prod(map(len, present)) <= max_branches:
            return index, present
    return _BY_TIME, []


def _in(column: str, values: Collection[Any]) -> _Where:
    if len(values) == 1:
        return _Where().add(f"{column} = ?", *values)
    return _Where().add(f"{column} IN ({_marks(len(values))})", *values)


def _unindexed(
    where: DeadLetterFilter, pinned: Mapping[str, tuple[str, ...]], index: _Index
) -> _Where:
    """Conditions of the filter that the index's columns do not settle (text aside)."""
    conditions = _Where()
    for column, values in pinned.items():
        if column not in index.columns:
            conditions += _in(column, values)
    if where.http_status is not None:
        conditions.add("http_status = ?", where.http_status)
    return conditions + _time_range(where)


def _time_range(where: DeadLetterFilter) -> _Where:
    conditions = _Where()
    if where.since is not None:
        conditions.add("dead_lettered_us >= ?", _to_us(where.since))
    if where.until is not None:
        conditions.add("dead_lettered_us < ?", _to_us(where.until))
    return conditions


def _text(where: DeadLetterFilter, payload: str = "payload", error: str = "error") -> _Where:
    if not where.text:
        return _Where()
    pattern = f"%{escape_like(where.text)}%"
    # CAST: this SQLite is built with LIKE_DOESNT_MATCH_BLOBS, and the payload is a BLOB.
    return _Where().add(
        f"({error} LIKE ? ESCAPE '\\' OR CAST({payload} AS TEXT) LIKE ? ESCAPE '\\')",
        pattern,
        pattern,
    )


def _after(key: tuple[int, int] | None) -> _Where:
    """Rows strictly after ``key`` in (time desc, seq desc) order."""
    if key is None:
        return _Where()
    at, seq = key
    # The first condition bounds the index range; the second settles ties in time.
    return _Where().add("dead_lettered_us <= ? AND (dead_lettered_us < ? OR seq < ?)", at, at, seq)


def _not_after(key: tuple[int, int]) -> _Where:
    """Rows up to and including ``key`` in (time desc, seq desc) order."""
    at, seq = key
    return _Where().add("dead_lettered_us >= ? AND (dead_lettered_us > ? OR seq >= ?)", at, at, seq)


@dataclass(frozen=True, slots=True)
class _OrderedPlan:
    """A filter as index branches that each yield (time, seq) in list order."""

    index: _Index
    branches: list[_Where]
    conditions: _Where  # for every branch, text search aside
    text: _Where

    @classmethod
    def of(cls, where: DeadLetterFilter) -> _OrderedPlan:
        pinned = _pinned(where)
        index, values = _choose_index(pinned, MAX_BRANCHES)
        branches = [
            _Where([f"{column} = ?" for column in index.columns], list(combination))
            for combination in itertools.product(*values)
        ]
        return cls(index, branches, _unindexed(where, pinned, index), _text(where))

    def keys_sql(self, extra: _Where, limit: int, offset: int = 0) -> tuple[str, list[Any]]:
        """(time, seq) of the matching rows, newest first: ``limit`` of them after ``offset``."""
        if not self.branches:  # a pinned column with no values (no integration): nothing
            return "SELECT 0, 0 WHERE 0", []
        selects: list[str] = []
        params: list[Any] = []
        for branch in self.branches:
            conditions = branch + self.conditions + extra
            selects.append(
                f"SELECT dead_lettered_us, seq FROM dlq_letters INDEXED BY {self.index.name}"
                f" WHERE {conditions.sql} ORDER BY dead_lettered_us DESC, seq DESC LIMIT ?"
            )
            params += [*conditions.params, limit + offset]
        if len(selects) == 1:
            return f"{selects[0]} OFFSET ?", [*params[:-1], limit, offset]
        union = " UNION ALL ".join(f"SELECT dead_lettered_us, seq FROM ({s})" for s in selects)
        return f"{union} ORDER BY 1 DESC, 2 DESC LIMIT ? OFFSET ?", [*params, limit, offset]


def _counting(where: DeadLetterFilter, extra: _Where | None = None) -> tuple[_Index, _Where]:
    """An index and conditions for an unordered scan (counts, aggregates)."""
    pinned = _pinned(where)
    index, values = _choose_index(pinned, max_branches=math.inf)
    conditions = _Where()
    # An open status is spelled out as all three values: the same rows, but
    # SQLite can then seek each (..., status) prefix and range over the time.
    for column, column_values in zip(index.columns, values, strict=True):
        conditions += _in(column, column_values)
    conditions += _unindexed(where, pinned, index) + _text(where)
    if extra is not None:
        conditions += extra
    return index, conditions


# --- rows ---------------------------------------------------------------------


def _history(raw: str | None) -> tuple[PastFailure, ...]:
    if not raw:
        return ()
    return tuple(
        PastFailure(_to_s(at_us), Reason(reason), http_status, attempts, error)
        for at_us, reason, http_status, attempts, error in orjson.loads(raw)
    )


def _row(r: Sequence[Any]) -> DeadLetterRow:
    return DeadLetterRow(
        id=r[1],
        integration=r[2],
        event_id=r[3],
        status=Status(r[4]),
        reason=Reason(r[5]),
        http_status=r[6],
        error=r[7],
        signature=r[8],
        attempts=r[9],
        first_failure_at=_to_s(r[10]),
        dead_lettered_at=_to_s(r[11]),
        requeue_count=r[12],
        last_action=None if r[13] is None else Action(r[13]),
        last_action_by=r[14],
        last_action_at=None if r[15] is None else _to_s(r[15]),
        source_topic=r[16],
        source_partition=r[17],
        source_offset=r[18],
        key=r[19],
        stage=r[20],
        metadata=orjson.loads(r[21]),
        payload_size=r[22],
        history=_history(r[23]),
        payload=bytes(r[24]),
    )


def _payload_column(preview_bytes: int | None) -> tuple[str, list[Any]]:
    if preview_bytes is None:
        return "payload", []
    return "substr(payload, 1, ?)", [preview_bytes]


def _rows_by_seq(
    conn: sqlite3.Connection, seqs: Sequence[int], preview_bytes: int | None
) -> list[DeadLetterRow]:
    """The rows with these seqs, in the order given."""
    payload, payload_params = _payload_column(preview_bytes)
    found: dict[int, DeadLetterRow] = {}
    for chunk in _chunks(seqs, ID_CHUNK):
        cursor = conn.execute(
            f"SELECT {_ROW_COLUMNS}, {payload} FROM dlq_letters"
            f" WHERE seq IN ({_marks(len(chunk))})",
            [*payload_params, *chunk],
        )
        found.update((r[0], _row(r)) for r in cursor)
    return [found[seq] for seq in seqs if seq in found]


# --- jobs: each runs on a connection's thread ----------------------------------


def _create_schema(conn: sqlite3.Connection) -> None:
    with write_transaction(conn):
        conn.execute(SCHEMA[0])
        row = conn.execute("SELECT value FROM dlq_meta WHERE key = 'schema_version'").fetchone()
        if row is not None and int(row[0]) > SCHEMA_VERSION:
            raise DlqError(
                f"DLQ schema version {row[0]} is newer than this Nemesis ({SCHEMA_VERSION})"
            )
        for statement in SCHEMA[1:]:
            conn.execute(statement)
        for index in (*_INDEXES, _BY_TIME):
            conn.execute(index.ddl)
        conn.execute(
            "INSERT INTO dlq_meta (key, value) VALUES ('schema_version', ?)"
            " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            (str(SCHEMA_VERSION),),
        )


_INSERT_LETTER = (
    "INSERT INTO dlq_letters (id, integration, status, reason, http_status, signature,"
    " dead_lettered_us, first_failure_us, attempts, event_id, source_topic, source_partition,"
    " source_offset, msg_key, stage, payload_size, error, metadata, payload)"
    " VALUES (?, ?, 'dead', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_UPDATE_LETTER = (
    "UPDATE dlq_letters SET status = ?, reason = ?, http_status = ?, signature = ?,"
    " dead_lettered_us = ?, attempts = ?, stage = ?, error = ?, history = ? WHERE id = ?"
)
_INSERT_SIGNATURE = (
    "INSERT INTO dlq_signatures (signature, integration, reason, http_status, pattern,"
    " sample_error) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (signature) DO NOTHING"
)


def _put_job(conn: sqlite3.Connection, letters: Sequence[DeadLetter], now_us: int) -> PutResult:
    identified = [(letter.id, letter) for letter in letters]
    inserted = updated = 0
    with write_transaction(conn):
        # A batch may hold one message twice; each round applies at most one
        # failure per id, in batch order, so the second sees the first's row.
        while identified:
            seen: set[str] = set()
            this_round: list[tuple[str, DeadLetter]] = []
            later: list[tuple[str, DeadLetter]] = []
            for item in identified:
                (later if item[0] in seen else this_round).append(item)
                seen.add(item[0])
            new, old = _apply_round(conn, this_round, now_us)
            inserted += new
            updated += old
            identified = later
    return PutResult(inserted, updated)


def _apply_round(
    conn: sqlite3.Connection, letters: Sequence[tuple[str, DeadLetter]], now_us: int
) -> tuple[int, int]:
    existing: dict[str, Sequence[Any]] = {}
    for chunk in _chunks([letter_id for letter_id, _ in letters], ID_CHUNK):
        cursor = conn.execute(
            "SELECT id, status, dead_lettered_us, reason, http_status, attempts, error, history"
            f" FROM dlq_letters WHERE id IN ({_marks(len(chunk))})",
            chunk,
        )
        existing.update((r[0], r) for r in cursor)
    inserts: list[tuple[Any, ...]] = []
    updates: list[tuple[Any, ...]] = []
    signatures: dict[str, tuple[Any, ...]] = {}
    for letter_id, letter in letters:
        at_us = now_us if letter.dead_lettered_at is None else _to_us(letter.dead_lettered_at)
        pattern = normalise_error(letter.error)
        signature = pattern_signature(
            letter.integration, letter.reason, letter.http_status, pattern
        )
        if signature not in signatures:
            signatures[signature] = (
                signature,
                letter.integration,
                letter.reason.value,
                letter.http_status,
                pattern,
                _cut(letter.error, MAX_SAMPLE_ERROR_CHARS),
            )
        error = _cut(letter.error, MAX_ERROR_CHARS)
        previous = existing.get(letter_id)
        if previous is None:
            first_us = at_us if letter.first_failure_at is None else _to_us(letter.first_failure_at)
            inserts.append(
                (
                    letter_id,
                    letter.integration,
                    letter.reason.value,
                    letter.http_status,
                    signature,
                    at_us,
                    first_us,
                    letter.attempts,
                    letter.event_id,
                    letter.source_topic,
                    letter.source_partition,
                    letter.source_offset,
                    letter.key,
                    letter.stage,
                    len(letter.payload),
                    error,
                    orjson.dumps(dict(letter.metadata)).decode(),
                    letter.payload,
                )
            )
            continue
        _, status, old_at_us, old_reason, old_http, old_attempts, old_error, old_history = previous
        history = [*orjson.loads(old_history or "[]")]
        history.append(
            [
                old_at_us,
                old_reason,
                old_http,
                old_attempts,
                _cut(old_error, MAX_HISTORY_ERROR_CHARS),
            ]
        )
        # A requeued message that failed again waits for someone again; a
        # discarded one can only be a duplicate of a failure already dropped.
        status = Status.DEAD.value if status == Status.REQUEUED.value else status
        updates.append(
            (
                status,
                letter.reason.value,
                letter.http_status,
                signature,
                at_us,
                letter.attempts,
                letter.stage,
                error,
                orjson.dumps(history[-MAX_HISTORY:]).decode(),
                letter_id,
            )
        )
    conn.executemany(_INSERT_SIGNATURE, signatures.values())
    conn.executemany(_INSERT_LETTER, inserts)
    conn.executemany(_UPDATE_LETTER, updates)
    return len(inserts), len(updates)


def _get_job(conn: sqlite3.Connection, letter_ids: Sequence[str]) -> list[DeadLetterRow]:
    rows: list[DeadLetterRow] = []
    with read_transaction(conn):
        for chunk in _chunks(letter_ids, ID_CHUNK):
            cursor = conn.execute(
                f"SELECT {_ROW_COLUMNS}, payload FROM dlq_letters"
                f" WHERE id IN ({_marks(len(chunk))})",
                chunk,
            )
            rows.extend(_row(r) for r in cursor)
    rows.sort(key=lambda row: (row.dead_lettered_at, row.id), reverse=True)
    return rows


def _query_job(
    conn: sqlite3.Connection,
    plan: _OrderedPlan,
    after: tuple[int, int] | None,
    limit: int,
    preview_bytes: int,
) -> tuple[list[DeadLetterRow], tuple[int, int] | None]:
    with read_transaction(conn):
        extra = _after(after)
        bound: tuple[int, int] | None = None
        if plan.text.parts:
            # Where the scan stops: the TEXT_SCAN_ROWS-th candidate without the text test.
            sql, params = plan.keys_sql(extra, limit=1, offset=TEXT_SCAN_ROWS - 1)
            last = conn.execute(sql, params).fetchone()
            extra += plan.text
            if last is not None:
                bound = (last[0], last[1])
                extra += _not_after(bound)
        sql, params = plan.keys_sql(extra, limit + 1)
        keys = [(r[0], r[1]) for r in conn.execute(sql, params)]
        next_key = bound
        if len(keys) > limit:
            keys = keys[:limit]
            next_key = keys[-1]
        rows = _rows_by_seq(conn, [seq for _, seq in keys], preview_bytes)
    return rows, next_key


def _select_ids_job(
    conn: sqlite3.Connection, plan: _OrderedPlan, after: tuple[int, int] | None, limit: int
) -> tuple[list[str], tuple[int, int] | None]:
    """Up to ``limit`` ids after ``after``, and the key to continue from (None: no more)."""
    with read_transaction(conn):
        sql, params = plan.keys_sql(_after(after) + plan.text, limit)
        keys = [(r[0], r[1]) for r in conn.execute(sql, params)]
        ids: dict[int, str] = {}
        for chunk in _chunks([seq for _, seq in keys], ID_CHUNK):
            cursor = conn.execute(
                f"SELECT seq, id FROM dlq_letters WHERE seq IN ({_marks(len(chunk))})", chunk
            )
            ids.update((seq, letter_id) for seq, letter_id in cursor)
    next_key = keys[-1] if len(keys) == limit else None
    return [ids[seq] for _, seq in keys if seq in ids], next_key


def _count_job(conn: sqlite3.Connection, where: DeadLetterFilter, limit: int | None) -> int:
    index, conditions = _counting(where)
    source = f"dlq_letters INDEXED BY {index.name} WHERE {conditions.sql}"
    if limit is None:
        row = conn.execute(f"SELECT count(*) FROM {source}", conditions.params).fetchone()
    else:
        row = conn.execute(
            f"SELECT count(*) FROM (SELECT 1 FROM {source} LIMIT ?)", [*conditions.params, limit]
        ).fetchone()
    return int(row[0])


def _count_of(index: _Index, key: str, statuses: Sequence[str], conditions: _Where) -> _Where:
    """A correlated sub-select: how many rows of ``key`` (e.g. one signature) match."""
    scope = _Where().add(key) + _in("status", statuses) + conditions
    sql = f"(SELECT count(*) FROM dlq_letters INDEXED BY {index.name} WHERE {scope.sql})"
    return _Where([sql], scope.params)


def _extreme_of(
    function: str, index: _Index, key: str, statuses: Sequence[str], conditions: _Where
) -> _Where:
    """A correlated sub-select: the min or max dead-letter time among the rows of ``key``.

    One sub-select per status: each is a single seek to the end of an
    index range, where one over several statuses would read them all.
    """
    parts: list[str] = []
    params: list[Any] = []
    for status in statuses:
        scope = _Where().add(key).add("status = ?", status) + conditions
        parts.append(
            f"SELECT {function}(dead_lettered_us) AS v FROM dlq_letters INDEXED BY {index.name}"
            f" WHERE {scope.sql}"
        )
        params += scope.params
    return _Where([f"(SELECT {function}(v) FROM ({' UNION ALL '.join(parts)}))"], params)


def _statuses(where: DeadLetterFilter) -> tuple[str, ...]:
    return (where.status.value,) if where.status is not None else _OPEN_COLUMNS["status"]


def _groups_job(conn: sqlite3.Connection, where: DeadLetterFilter, limit: int) -> list[Group]:
    # Integration, reason and HTTP status are part of the signature, so they
    # filter the small signatures table; each signature then counts its rows
    # on the (signature, status, time) index without reading them, and only
    # the groups shown look up their first and last times (one seek each).
    # MATERIALIZED: a sub-select named again in WHERE or ORDER BY would run twice.
    chosen = _Where()
    if where.integrations is not None:
        chosen += _in("integration", sorted(where.integrations))
    if where.reason is not None:
        chosen.add("reason = ?", where.reason.value)
    if where.http_status is not None:
        chosen.add("http_status = ?", where.http_status)
    if where.signature is not None:
        chosen.add("signature = ?", where.signature)
    statuses = _statuses(where)
    conditions = _time_range(where) + _text(where)
    key = "signature = s.signature"
    count = _count_of(_BY_SIGNATURE, key, statuses, conditions)
    first = _extreme_of("min", _BY_SIGNATURE, key, statuses, conditions)
    last = _extreme_of("max", _BY_SIGNATURE, key, statuses, conditions)
    cursor = conn.execute(
        f"WITH counted AS MATERIALIZED (SELECT signature, {count.sql} AS n"
        f" FROM dlq_signatures AS s WHERE {chosen.sql}),"
        " top AS MATERIALIZED (SELECT signature, n FROM counted WHERE n > 0"
        " ORDER BY n DESC, signature LIMIT ?)"
        " SELECT s.signature, s.integration, s.reason, s.http_status, s.pattern, s.sample_error,"
        f" top.n, {first.sql}, {last.sql}"
        " FROM top JOIN dlq_signatures AS s ON s.signature = top.signature"
        " ORDER BY top.n DESC, s.signature",
        [*count.params, *chosen.params, limit, *first.params, *last.params],
    )
    return [
        Group(
            signature=r[0],
            integration=r[1],
            reason=Reason(r[2]),
            http_status=r[3],
            pattern=r[4],
            sample_error=r[5],
            count=r[6],
            first_at=_to_s(r[7]),
            last_at=_to_s(r[8]),
        )
        for r in cursor
    ]


def _stats_job(
    conn: sqlite3.Connection, where: DeadLetterFilter, now: float, bucket_s: float, buckets: int
) -> Stats:
    hour_ago_us = _to_us(now - 3600.0)
    bucket_us = max(1, _to_us(bucket_s))
    end_us = (_to_us(now) // bucket_us + 1) * bucket_us
    start_us = end_us - buckets * bucket_us
    # Per (integration, reason) pair, as groups do per signature: the pairs
    # come from the signatures table, the counts from the covering
    # (integration, reason, status, time) index, the oldest and newest from
    # one seek each.
    pairs = _Where()
    if where.integrations is not None:
        pairs += _in("integration", sorted(where.integrations))
    if where.reason is not None:
        pairs.add("reason = ?", where.reason.value)
    statuses = _statuses(where)
    conditions = _time_range(where) + _text(where)
    if where.http_status is not None:
        conditions.add("http_status = ?", where.http_status)
    if where.signature is not None:
        conditions.add("signature = ?", where.signature)
    index = _BY_INTEGRATION_REASON
    key = "integration = p.integration AND reason = p.reason"
    count = _count_of(index, key, statuses, conditions)
    recent = _count_of(
        index, key, statuses, conditions + _Where().add("dead_lettered_us >= ?", hour_ago_us)
    )
    first = _extreme_of("min", index, key, statuses, conditions)
    last = _extreme_of("max", index, key, statuses, conditions)
    window = _Where().add("dead_lettered_us >= ? AND dead_lettered_us < ?", start_us, end_us)
    bucket_index, bucket_conditions = _counting(where, window)
    with read_transaction(conn):
        per_pair = [
            r
            for r in conn.execute(
                "WITH p AS MATERIALIZED (SELECT DISTINCT integration, reason FROM dlq_signatures"
                f" WHERE {pairs.sql})"
                f" SELECT p.integration, p.reason, {count.sql}, {recent.sql}, {first.sql},"
                f" {last.sql} FROM p",
                [
                    *pairs.params,
                    *count.params,
                    *recent.params,
                    *first.params,
                    *last.params,
                ],
            )
            if r[2]
        ]
        per_bucket = dict(
            conn.execute(
                f"SELECT (dead_lettered_us - ?) / ?, count(*) FROM dlq_letters"
                f" INDEXED BY {bucket_index.name} WHERE {bucket_conditions.sql} GROUP BY 1",
                [start_us, bucket_us, *bucket_conditions.params],
            ).fetchall()
        )
    integrations: dict[str, list[Sequence[Any]]] = {}
    for pair in per_pair:
        integrations.setdefault(pair[0], []).append(pair)
    by_integration = [
        IntegrationStats(
            integration=name,
            total=sum(p[2] for p in rows),
            last_hour=sum(p[3] for p in rows),
            by_reason={Reason(p[1]): p[2] for p in rows},
            oldest_at=_to_s(min(p[4] for p in rows)),
            newest_at=_to_s(max(p[5] for p in rows)),
        )
        for name, rows in integrations.items()
    ]
    by_integration.sort(key=lambda s: (-s.last_hour, -s.total, s.integration))
    by_reason: dict[Reason, int] = {}
    for pair in per_pair:
        by_reason[Reason(pair[1])] = by_reason.get(Reason(pair[1]), 0) + pair[2]
    return Stats(
        now=now,
        total=sum(s.total for s in by_integration),
        last_hour=sum(s.last_hour for s in by_integration),
        oldest_at=min((s.oldest_at for s in by_integration), default=None),
        newest_at=max((s.newest_at for s in by_integration), default=None),
        by_integration=by_integration,
        by_reason=by_reason,
        bucket_s=bucket_us / _US,
        buckets=[
            TimeBucket(_to_s(start_us + i * bucket_us), per_bucket.get(i, 0))
            for i in range(buckets)
        ],
    )


def _mark_job(
    conn: sqlite3.Connection,
    letter_ids: Sequence[str],
    status: Status,
    action: Action,
    by: str,
    at_us: int,
    integrations: frozenset[str] | None,
) -> int:
    scope = _Where() if integrations is None else _in("integration", sorted(integrations))
    requeued = 1 if status is Status.REQUEUED else 0
    with write_transaction(conn):
        cursor = conn.execute(
            "UPDATE dlq_letters SET status = ?, requeue_count = requeue_count + ?,"
            " last_action = ?, last_action_by = ?, last_action_us = ?"
            f" WHERE id IN ({_marks(len(letter_ids))}) AND status = 'dead' AND {scope.sql}",
            [status.value, requeued, action.value, by, at_us, *letter_ids, *scope.params],
        )
        return cursor.rowcount


def _record_action_job(
    conn: sqlite3.Connection,
    at_us: int,
    who: str,
    action: Action,
    integrations: tuple[str, ...],
    count: int,
    description: str,
) -> int:
    with write_transaction(conn):
        cursor = conn.execute(
            "INSERT INTO dlq_actions (at_us, who, action, integrations, count, description)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (at_us, who, action.value, orjson.dumps(integrations).decode(), count, description),
        )
        seq = cursor.lastrowid
        assert seq is not None  # an INSERT into a rowid table always sets it
        conn.executemany(
            "INSERT INTO dlq_action_integrations (integration, action_seq) VALUES (?, ?)",
            [(name, seq) for name in integrations],
        )
    return seq


def _actions_job(
    conn: sqlite3.Connection,
    before_seq: int | None,
    limit: int,
    integrations: frozenset[str] | None,
) -> list[ActionRecord]:
    conditions = _Where()
    if before_seq is not None:
        conditions.add("seq < ?", before_seq)
    if integrations is not None:
        scope = _in("integration", sorted(integrations))
        conditions.add(
            f"seq IN (SELECT action_seq FROM dlq_action_integrations WHERE {scope.sql})",
            *scope.params,
        )
    cursor = conn.execute(
        "SELECT seq, at_us, who, action, integrations, count, description FROM dlq_actions"
        f" WHERE {conditions.sql} ORDER BY seq DESC LIMIT ?",
        [*conditions.params, limit],
    )
    return [
        ActionRecord(
            seq=r[0],
            at=_to_s(r[1]),
            who=r[2],
            action=Action(r[3]),
            integrations=tuple(orjson.loads(r[4])),
            count=r[5],
            description=r[6],
        )
        for r in cursor
    ]


def _delete_expired_job(conn: sqlite3.Connection, cutoff_us: int, batch: int) -> int:
    with write_transaction(conn):
        cursor = conn.execute(
            "DELETE FROM dlq_letters WHERE seq IN (SELECT seq FROM dlq_letters"
            f" INDEXED BY {_BY_TIME.name} WHERE dead_lettered_us < ?"
            " ORDER BY dead_lettered_us LIMIT ?)",
            (cutoff_us, batch),
        )
        return cursor.rowcount


def _prune_signatures_job(conn: sqlite3.Connection) -> int:
    with write_transaction(conn):
        cursor = conn.execute(
            "DELETE FROM dlq_signatures WHERE NOT EXISTS (SELECT 1 FROM dlq_letters"
            f" INDEXED BY {_BY_SIGNATURE.name} WHERE signature = dlq_signatures.signature)"
        )
        return cursor.rowcount


# --- the store ----------------------------------------------------------------

_LETTERS_CURSOR = "dlq"
_ACTIONS_CURSOR = "dlq-audit"


class SqliteDeadLetterStore:
    """The DLQ in one SQLite file; see the module docstring for how it stays fast."""

    def __init__(
        self,
        path: Path,
        *,
        clock: Clock = SYSTEM_CLOCK,
        retention_s: float | None = DEFAULT_RETENTION_S,
        timeout_s: float = 30.0,
        busy_timeout_s: float = 5.0,
    ) -> None:
        self.path = path
        self.retention_s = retention_s
        self._clock = clock
        self._timeout_s = timeout_s
        self._writer = SqliteThread(path, "dlq-write", busy_timeout_s=busy_timeout_s)
        self._reader = SqliteThread(
            path,
            "dlq-read",
            busy_timeout_s=busy_timeout_s,
            # A larger page cache keeps the list indexes of a million rows in memory.
            pragmas=("query_only=ON", "cache_size=-65536"),
        )

    async def open(self) -> None:
        """Opens both connections and creates (or checks) the schema."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # The write connection switches the file to WAL before the reader opens.
            await self._translated(self._writer.open(self._timeout_s))
            await self._call(self._writer, _create_schema)
            await self._translated(self._reader.open(self._timeout_s))
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Closes both connections."""
        try:
            await self._reader.close(self._timeout_s)
        finally:
            await self._writer.close(self._timeout_s)

    async def __aenter__(self) -> SqliteDeadLetterStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def put(self, letters: Sequence[DeadLetter]) -> PutResult:
        """Writes failures, one row per ``DeadLetter.id`` (see ``nemesis.dlq.port``)."""
        if not letters:
            return PutResult(0, 0)
        now_us = _to_us(self._clock.time())
        return await self._call(
            self._writer, partial(_put_job, letters=tuple(letters), now_us=now_us)
        )

    async def get(self, letter_id: str) -> DeadLetterRow | None:
        """One row with its whole payload, or None."""
        rows = await self.get_many([letter_id])
        return rows[0] if rows else None

    async def get_many(self, letter_ids: Collection[str]) -> Sequence[DeadLetterRow]:
        """The rows that exist among ``letter_ids``, whole payloads, newest first."""
        unique = sorted(set(letter_ids))
        if not unique:
            return []
        return await self._call(self._reader, partial(_get_job, letter_ids=unique))

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
        after = _letters_key(page.cursor)
        if where.matches_nothing:
            return Page([], None)
        rows, next_key = await self._call(
            self._reader,
            partial(
                _query_job,
                plan=_OrderedPlan.of(where),
                after=after,
                limit=page.limit,
                preview_bytes=preview_bytes,
            ),
        )
        return Page(rows, None if next_key is None else encode_cursor(_LETTERS_CURSOR, next_key))

    async def count(self, where: DeadLetterFilter, *, limit: int | None = None) -> int:
        """How many rows match; with ``limit``, stops counting there."""
        if limit is not None and limit < 0:
            raise InvalidQuery("a count limit cannot be negative")
        if where.matches_nothing or limit == 0:
            return 0
        return await self._call(self._reader, partial(_count_job, where=where, limit=limit))

    async def groups(self, where: DeadLetterFilter, *, limit: int = 100) -> Sequence[Group]:
        """Matching rows grouped by signature, largest group first."""
        if not 1 <= limit <= MAX_GROUPS:
            raise InvalidQuery(f"a group list holds 1 to {MAX_GROUPS} groups")
        if where.matches_nothing:
            return []
        return await self._call(self._reader, partial(_groups_job, where=where, limit=limit))

    async def stats(
        self,
        where: DeadLetterFilter,
        *,
        now: float | None = None,
        bucket_s: float = 3600.0,
        buckets: int = 24,
    ) -> Stats:
        """Counts per integration and reason, oldest and newest, and a time series."""
        if not (math.isfinite(bucket_s) and bucket_s > 0) or not 1 <= buckets <= 1000:
            raise InvalidQuery("a chart needs 1 to 1000 buckets of a positive length")
        now = self._clock.time() if now is None else now
        return await self._call(
            self._reader,
            partial(_stats_job, where=where, now=now, bucket_s=bucket_s, buckets=buckets),
        )

    async def select_ids(self, where: DeadLetterFilter, limit: int) -> Sequence[str]:
        """Ids of up to ``limit`` matching rows, newest first, for a bulk action."""
        if not 1 <= limit <= MAX_SELECT_IDS:
            raise InvalidQuery(f"a bulk action covers 1 to {MAX_SELECT_IDS} rows at a time")
        if where.matches_nothing:
            return []
        plan = _OrderedPlan.of(where)
        ids: list[str] = []
        after: tuple[int, int] | None = None
        # In rounds, each its own job: the UI's reads queue between them.
        while len(ids) < limit:
            found, after = await self._call(
                self._reader,
                partial(
                    _select_ids_job,
                    plan=plan,
                    after=after,
                    limit=min(SELECT_ROUND, limit - len(ids)),
                ),
            )
            ids += found
            if after is None:
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
        return await self._mark(letter_ids, Status.REQUEUED, Action.REQUEUE, by, at, integrations)

    async def mark_discarded(
        self,
        letter_ids: Collection[str],
        *,
        by: str,
        at: float | None = None,
        integrations: frozenset[str] | None = None,
    ) -> int:
        """Marks ``dead`` rows discarded; returns how many changed."""
        return await self._mark(letter_ids, Status.DISCARDED, Action.DISCARD, by, at, integrations)

    async def record_action(
        self,
        *,
        who: str,
        action: Action,
        integrations: Collection[str],
        count: int,
        description: str,
        at: float | None = None,
    ) -> ActionRecord:
        """Appends an entry to the audit log."""
        at = self._clock.time() if at is None else at
        names = tuple(sorted(set(integrations)))
        who = _cut(who, MAX_ACTOR_CHARS)
        description = _cut(description, MAX_DESCRIPTION_CHARS)
        seq = await self._call(
            self._writer,
            partial(
                _record_action_job,
                at_us=_to_us(at),
                who=who,
                action=action,
                integrations=names,
                count=count,
                description=description,
            ),
        )
        return ActionRecord(seq, _to_s(_to_us(at)), who, action, names, count, description)

    async def actions(
        self, page: PageRequest | None = None, *, integrations: frozenset[str] | None = None
    ) -> ActionPage:
        """The audit log, newest first; with ``integrations``, entries touching any of them."""
        page = page or PageRequest()
        before = None
        if page.cursor is not None:
            (before,) = _int_key(page.cursor, _ACTIONS_CURSOR, 1)
        if integrations is not None and not integrations:
            return ActionPage([], None)
        rows = await self._call(
            self._reader,
            partial(
                _actions_job,
                before_seq=before,
                limit=page.limit + 1,
                integrations=integrations,
            ),
        )
        if len(rows) <= page.limit:
            return ActionPage(rows, None)
        rows = rows[: page.limit]
        return ActionPage(rows, encode_cursor(_ACTIONS_CURSOR, (rows[-1].seq,)))

    async def enforce_retention(self, now: float | None = None) -> int:
        """Deletes rows dead-lettered longer ago than the retention, in small batches; how many."""
        if self.retention_s is None:
            return 0
        now = self._clock.time() if now is None else now
        cutoff_us = _to_us(now - self.retention_s)
        deleted = 0
        # One transaction per batch: puts and status changes queue between them.
        while True:
            batch = await self._call(
                self._writer,
                partial(_delete_expired_job, cutoff_us=cutoff_us, batch=DELETE_BATCH),
            )
            deleted += batch
            if batch < DELETE_BATCH:
                break
        if deleted:
            await self._call(self._writer, _prune_signatures_job)
        return deleted

    async def _mark(
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
        at_us = _to_us(self._clock.time() if at is None else at)
        by = _cut(by, MAX_ACTOR_CHARS)
        changed = 0
        for chunk in _chunks(unique, MARK_BATCH):
            changed += await self._call(
                self._writer,
                partial(
                    _mark_job,
                    letter_ids=chunk,
                    status=status,
                    action=action,
                    by=by,
                    at_us=at_us,
                    integrations=integrations,
                ),
            )
        return changed

    async def _call(self, thread: SqliteThread, job: Callable[[sqlite3.Connection], T]) -> T:
        return await self._translated(thread.run(job, timeout_s=self._timeout_s))

    async def _translated(self, call: Awaitable[T]) -> T:
        # The worker threads speak the broker's error tree; the DLQ has its own.
        try:
            return await call
        except BrokerTimeout as exc:
            raise DlqTimeout(f"{self.path}: {exc}") from exc
        except BrokerError as exc:
            raise DlqError(f"{self.path}: {exc}") from exc


def _int_key(cursor: str, kind: str, arity: int) -> tuple[int, ...]:
    # decode_cursor checked arity and types; the filter only narrows the type for mypy.
    return tuple(
        part for part in decode_cursor(cursor, kind, (int,) * arity) if isinstance(part, int)
    )


def _letters_key(cursor: str | None) -> tuple[int, int] | None:
    if cursor is None:
        return None
    at_us, seq = _int_key(cursor, _LETTERS_CURSOR, 2)
    return at_us, seq


async def open_sqlite_dlq(
    path: str | os.PathLike[str],
    *,
    clock: Clock = SYSTEM_CLOCK,
    retention_s: float | None = DEFAULT_RETENTION_S,
    timeout_s: float = 30.0,
    busy_timeout_s: float = 5.0,
) -> SqliteDeadLetterStore:
    """Opens (creating if needed) a DLQ file; ``retention_s`` None keeps rows forever."""
    if retention_s is not None and not (math.isfinite(retention_s) and retention_s > 0):
        raise ValueError("retention_s must be a positive number of seconds, or None")
    store = SqliteDeadLetterStore(
        Path(path),
        clock=clock,
        retention_s=retention_s,
        timeout_s=timeout_s,
        busy_timeout_s=busy_timeout_s,
    )
    await store.open()
    return store
