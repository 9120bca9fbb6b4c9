"""The ``sqlite`` DLQ store: one SQLite file, every statement on a worker thread.

What a DLQ store does is ``nemesis.dlq.core``; this module holds only the
SQLite side of it: the schema, the index plans, the queries and how SQLite
spells a filter's conditions (``SqliteDialect``, for ``nemesis.dlq.sql``).

Two connections, each owned by its own thread (``nemesis.sqlite_thread``,
shared with the embedded broker): writes (``put``, status changes,
retention) queue on one, reads (the UI's lists, counts, charts) on the
other, so a slow chart never queues ahead of the runner's ``put``.

The file has a rollback journal (``TRUNCATE``, ``synchronous=FULL``), not a
WAL, and nothing of it is memory-mapped: a folder that fills up, turns
read-only or loses the file fails the calls that meet it (``DlqError``, which
the runner rides out: dead messages wait for the store) and never ends the
process with a signal, as WAL's mapped ``-shm`` index does when it is cut
under the process. The price is a sync of the journal and of the file on
every commit, and a commit that waits while a read is in progress (up to the
busy timeout). Group commit pays the first back: the puts that arrive while
a transaction is being written share the next one (``_PutGroup``), so
concurrent flows dead-lettering at once pay one commit between them.

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
``TEXT_SCAN_ROWS`` candidates per page and hands back a cursor to continue;
it reads the payload as bytes, as every store does (LIKE would read it as
text, which ends at a NUL).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import sqlite3
import threading
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import orjson

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.dlq import core
from nemesis.dlq.core import (
    AUDIT_COLUMNS,
    FAILURE_COLUMNS,
    ID_CHUNK,
    LETTER_COLUMNS,
    SCHEMA_VERSION,
    SIGNATURE_COLUMNS,
    TEXT_SCAN_ROWS,
    Key,
    Mark,
    Row,
    StoreCore,
    Window,
    check_retention,
    check_schema_version,
    chunks,
    fold_failures,
)
from nemesis.dlq.port import DEFAULT_RETENTION_S, DeadLetter, DeadLetterFilter, PutResult, Status
from nemesis.dlq.signature import escape_like
from nemesis.dlq.sql import (
    HTTP_STATUS,
    INTEGRATION,
    NOT_TEXT,
    REASON,
    SIGNATURE,
    TEXT,
    TIME,
    Bind,
    Dialect,
    Kind,
)
from nemesis.errors import BrokerError, BrokerTimeout, DlqError, DlqTimeout
from nemesis.sqlite_thread import SqliteThread, read_transaction, translate, write_transaction

T = TypeVar("T")

# A rollback journal, truncated after each commit (no -shm to map; see the module docstring).
JOURNAL_MODE = "TRUNCATE"

# Branches of one list query; a filter that would need more falls back to an
# index that needs fewer (in the end the time index, filtering as it goes).
MAX_BRANCHES = 64

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


# --- filters to SQL -----------------------------------------------------------


class SqliteDialect(Dialect):
    """SQLite's spelling: ``?`` parameters in the order they stand, LIKE, the payload as bytes."""

    times = core.SIGNED
    tiebreak = "seq"  # the rowid
    true = "1"

    def one_of(self, bind: Bind, column: str, values: Sequence[str]) -> str:
        if len(values) == 1:
            return f"{column} = {bind(values[0], Kind.TEXT)}"
        return f"{column} IN ({', '.join(bind(value, Kind.TEXT) for value in values)})"

    def contains(self, bind: Bind, in_error: str, in_payload: bytes) -> str:
        # LIKE folds ASCII letters only; the text's wildcards are escaped. The
        # payload is a BLOB of any bytes, which LIKE would read as text (up to a
        # NUL, decoding what is not UTF-8): instr() of two BLOBs compares bytes,
        # and lower() folds the ASCII letters of any bytes and keeps the rest.
        pattern = bind(f"%{escape_like(in_error)}%", Kind.TEXT)
        return (
            f"(error LIKE {pattern} ESCAPE '\\'"
            f" OR instr(CAST(lower(payload) AS BLOB), {bind(in_payload, Kind.BYTES)}) > 0)"
        )


SQLITE = SqliteDialect()


@dataclass
class _Where:
    """Conditions joined by AND, with their parameters in order."""

    parts: list[str] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)

    @classmethod
    def built(cls, build: Callable[[Bind], Sequence[str]]) -> _Where:
        """The conditions ``build`` returns, their values bound in the order they stand."""
        found = cls()

        def bind(value: Any, kind: Kind) -> str:
            found.params.append(value)
            return "?"

        found.parts.extend(build(bind))
        return found

    def add(self, sql: str, *params: Any) -> _Where:
        self.parts.append(sql)
        self.params.extend(params)
        return self

    def __add__(self, other: _Where) -> _Where:
        return _Where([*self.parts, *other.parts], [*self.params, *other.params])

    @property
    def sql(self) -> str:
        return SQLITE.joined(self.parts)


def _filter(where: DeadLetterFilter, parts: Collection[str]) -> _Where:
    """The filter's conditions of ``parts`` (the names of ``nemesis.dlq.sql``)."""
    return _Where.built(lambda bind: SQLITE.conditions(where, bind, parts))


def _in(column: str, values: Sequence[str]) -> _Where:
    return _Where.built(lambda bind: [SQLITE.one_of(bind, column, values)])


def _after(key: Key | None) -> _Where:
    """Rows strictly after ``key`` in (time desc, seq desc) order."""
    return _Where.built(lambda bind: SQLITE.after(bind, key))


def _not_after(key: Key) -> _Where:
    """Rows up to and including ``key`` in (time desc, seq desc) order."""
    return _Where.built(lambda bind: SQLITE.not_after(bind, key))


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


def _unindexed(where: DeadLetterFilter, index: _Index) -> _Where:
    """Conditions of the filter that the index's columns do not settle (text aside)."""
    return _filter(where, NOT_TEXT - set(index.columns))


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
        return cls(index, branches, _unindexed(where, index), _filter(where, {TEXT}))

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
    conditions += _unindexed(where, index) + _filter(where, {TEXT})
    if extra is not None:
        conditions += extra
    return index, conditions


# --- rows ---------------------------------------------------------------------

# Every column but the payload, which a list selects cut (``substr``) and ``get`` whole.
_ROW_COLUMNS = ", ".join(("seq", *(c for c in LETTER_COLUMNS if c != "payload")))


def _marks(count: int) -> str:
    return ",".join("?" * count)


def _named(columns: Sequence[str]) -> str:
    return ", ".join(f":{c}" for c in columns)


def _dicts(cursor: sqlite3.Cursor) -> list[dict[str, Any]]:
    names = [d[0] for d in cursor.description]
    return [dict(zip(names, r, strict=True)) for r in cursor]


def _rows_by_seq(
    conn: sqlite3.Connection, seqs: Sequence[int], preview_bytes: int
) -> list[dict[str, Any]]:
    """The rows with these seqs, in the order given, payloads cut to ``preview_bytes``."""
    found: dict[int, dict[str, Any]] = {}
    for chunk in chunks(seqs, ID_CHUNK):
        cursor = conn.execute(
            f"SELECT {_ROW_COLUMNS}, substr(payload, 1, ?) AS payload FROM dlq_letters"
            f" WHERE seq IN ({_marks(len(chunk))})",
            [preview_bytes, *chunk],
        )
        found.update((r["seq"], r) for r in _dicts(cursor))
    return [found[seq] for seq in seqs if seq in found]


# --- jobs: each runs on a connection's thread ----------------------------------


def _create_schema(conn: sqlite3.Connection) -> None:
    with write_transaction(conn):
        conn.execute(SCHEMA[0])
        row = conn.execute("SELECT value FROM dlq_meta WHERE key = 'schema_version'").fetchone()
        check_schema_version(None if row is None else row[0], "the DLQ file")
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
    f"INSERT INTO dlq_letters ({', '.join(LETTER_COLUMNS)}) VALUES ({_named(LETTER_COLUMNS)})"
)
_UPDATE_LETTER = (
    "UPDATE dlq_letters SET "
    + ", ".join(f"{c} = :{c}" for c in FAILURE_COLUMNS if c != "id")
    + " WHERE id = :id"
)
_INSERT_SIGNATURE = (
    f"INSERT INTO dlq_signatures ({', '.join(SIGNATURE_COLUMNS)})"
    f" VALUES ({_named(SIGNATURE_COLUMNS)}) ON CONFLICT (signature) DO NOTHING"
)


def _put_letters(conn: sqlite3.Connection, letters: Sequence[DeadLetter], now_us: int) -> PutResult:
    """One put's statements, inside the caller's write transaction."""
    ids = sorted({letter.id for letter in letters})
    existing: dict[str, Row] = {}
    for chunk in chunks(ids, ID_CHUNK):
        cursor = conn.execute(
            f"SELECT {', '.join(FAILURE_COLUMNS)} FROM dlq_letters"
            f" WHERE id IN ({_marks(len(chunk))})",
            chunk,
        )
        existing.update((r["id"], r) for r in _dicts(cursor))
    # INSERT ... DO NOTHING: the signatures table needs no read first.
    folded = fold_failures(letters, existing, (), now_us)
    conn.executemany(_INSERT_SIGNATURE, folded.signatures)
    conn.executemany(_INSERT_LETTER, folded.inserts)
    conn.executemany(_UPDATE_LETTER, folded.updates)
    return folded.result


_Put = tuple[Sequence[DeadLetter], int]  # a put's letters and its time


class _PutGroup:
    """Puts that share one write transaction: every one that joins before its job starts.

    The loop adds puts (``join``) while the job waits in the writer's queue;
    the writer's thread seals it as the job starts (``seal``), and a put that
    comes later starts the next group. One lock, held for an append.
    """

    __slots__ = ("_lock", "_puts", "_sealed", "answers")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._puts: list[_Put] = []
        self._sealed = False
        # The job's answer: one per put, in the order they joined.
        self.answers: asyncio.Future[list[PutResult | BrokerError]] | None = None

    def join(self, put: _Put) -> int | None:
        """Adds a put and returns its place; None once the job has started."""
        with self._lock:
            if self._sealed:
                return None
            self._puts.append(put)
            return len(self._puts) - 1

    def seal(self) -> list[_Put]:
        """Called by the job as it starts: the group is what it holds now."""
        with self._lock:
            self._sealed = True
            return self._puts


def _put_group_job(
    conn: sqlite3.Connection, group: _PutGroup, path: Path
) -> list[PutResult | BrokerError]:
    """The group's puts in one transaction; if it fails, each put alone.

    Alone, a put that cannot be written (its own letters, or the disk) fails
    only its own caller; a failure of the file fails each of them the same.
    """
    puts = group.seal()
    if len(puts) > 1:
        try:
            with write_transaction(conn):
                return [_put_letters(conn, letters, now_us) for letters, now_us in puts]
        except sqlite3.Error:
            pass
    answers: list[PutResult | BrokerError] = []
    for letters, now_us in puts:
        answer: PutResult | BrokerError
        try:
            with write_transaction(conn):
                answer = _put_letters(conn, letters, now_us)
        except sqlite3.Error as exc:  # in the body or in the COMMIT
            answer = translate(exc, path)
        answers.append(answer)
    return answers


def _rows_job(conn: sqlite3.Connection, letter_ids: Sequence[str]) -> list[dict[str, Any]]:
    cursor = conn.execute(
        f"SELECT {_ROW_COLUMNS}, payload FROM dlq_letters WHERE id IN ({_marks(len(letter_ids))})",
        letter_ids,
    )
    return _dicts(cursor)


def _list_job(
    conn: sqlite3.Connection, plan: _OrderedPlan, after: Key | None, limit: int, preview_bytes: int
) -> tuple[list[dict[str, Any]], Key | None]:
    with read_transaction(conn):
        extra = _after(after)
        bound: Key | None = None
        if plan.text.parts:
            # Where the scan stops: the TEXT_SCAN_ROWS-th candidate without the text test.
            sql, params = plan.keys_sql(extra, limit=1, offset=TEXT_SCAN_ROWS - 1)
            last = conn.execute(sql, params).fetchone()
            extra += plan.text
            if last is not None:
                bound = (last[0], last[1])
                extra += _not_after(bound)
        sql, params = plan.keys_sql(extra, limit)
        seqs = [r[1] for r in conn.execute(sql, params)]
        return _rows_by_seq(conn, seqs, preview_bytes), bound


def _ids_job(
    conn: sqlite3.Connection, plan: _OrderedPlan, after: Key | None, limit: int
) -> tuple[list[str], Key | None]:
    """Up to ``limit`` ids after ``after``, and the last one's key."""
    with read_transaction(conn):
        sql, params = plan.keys_sql(_after(after) + plan.text, limit)
        keys = [(r[0], r[1]) for r in conn.execute(sql, params)]
        ids: dict[int, str] = {}
        for chunk in chunks([seq for _, seq in keys], ID_CHUNK):
            cursor = conn.execute(
                f"SELECT seq, id FROM dlq_letters WHERE seq IN ({_marks(len(chunk))})", chunk
            )
            ids.update((seq, letter_id) for seq, letter_id in cursor)
    return [ids[seq] for _, seq in keys if seq in ids], (keys[-1] if keys else None)


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


def _groups_job(
    conn: sqlite3.Connection, where: DeadLetterFilter, limit: int
) -> list[dict[str, Any]]:
    # Integration, reason and HTTP status are part of the signature, so they
    # filter the small signatures table; each signature then counts its rows
    # on the (signature, status, time) index without reading them, and only
    # the groups shown look up their first and last times (one seek each).
    # MATERIALIZED: a sub-select named again in WHERE or ORDER BY would run twice.
    chosen = _filter(where, {INTEGRATION, REASON, HTTP_STATUS, SIGNATURE})
    statuses = _statuses(where)
    conditions = _filter(where, {TIME, TEXT})
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
        f" top.n AS n, {first.sql} AS first_us, {last.sql} AS last_us"
        " FROM top JOIN dlq_signatures AS s ON s.signature = top.signature"
        " ORDER BY top.n DESC, s.signature",
        [*count.params, *chosen.params, limit, *first.params, *last.params],
    )
    return _dicts(cursor)


def _stats_job(
    conn: sqlite3.Connection, where: DeadLetterFilter, window: Window
) -> tuple[list[dict[str, Any]], dict[int, int]]:
    # Per (integration, reason) pair, as groups do per signature: the pairs
    # come from the signatures table, the counts from the covering
    # (integration, reason, status, time) index, the oldest and newest from
    # one seek each.
    pairs = _filter(where, {INTEGRATION, REASON})
    statuses = _statuses(where)
    conditions = _filter(where, {HTTP_STATUS, SIGNATURE, TIME, TEXT})
    index = _BY_INTEGRATION_REASON
    key = "integration = p.integration AND reason = p.reason"
    count = _count_of(index, key, statuses, conditions)
    recent = _count_of(
        index, key, statuses, conditions + _Where().add("dead_lettered_us >= ?", window.hour_ago_us)
    )
    first = _extreme_of("min", index, key, statuses, conditions)
    last = _extreme_of("max", index, key, statuses, conditions)
    in_window = _Where().add(
        "dead_lettered_us >= ? AND dead_lettered_us < ?", window.first_us, window.end_us
    )
    bucket_index, bucket_conditions = _counting(where, in_window)
    with read_transaction(conn):
        per_pair = _dicts(
            conn.execute(
                "WITH p AS MATERIALIZED (SELECT DISTINCT integration, reason FROM dlq_signatures"
                f" WHERE {pairs.sql})"
                f" SELECT p.integration AS integration, p.reason AS reason, {count.sql} AS total,"
                f" {recent.sql} AS recent, {first.sql} AS oldest, {last.sql} AS newest FROM p",
                [*pairs.params, *count.params, *recent.params, *first.params, *last.params],
            )
        )
        per_bucket = dict(
            conn.execute(
                f"SELECT (dead_lettered_us - ?) / ?, count(*) FROM dlq_letters"
                f" INDEXED BY {bucket_index.name} WHERE {bucket_conditions.sql} GROUP BY 1",
                [window.first_us, window.bucket_us, *bucket_conditions.params],
            ).fetchall()
        )
    return per_pair, per_bucket


def _mark_job(conn: sqlite3.Connection, letter_ids: Sequence[str], mark: Mark) -> int:
    scope = _Where() if mark.integrations is None else _in("integration", sorted(mark.integrations))
    with write_transaction(conn):
        cursor = conn.execute(
            "UPDATE dlq_letters SET status = ?, requeue_count = requeue_count + ?,"
            " last_action = ?, last_action_by = ?, last_action_us = ?"
            f" WHERE id IN ({_marks(len(letter_ids))}) AND status = 'dead' AND {scope.sql}",
            [
                mark.status.value,
                mark.requeued,
                mark.action.value,
                mark.by,
                mark.at_us,
                *letter_ids,
                *scope.params,
            ],
        )
        return cursor.rowcount


_AUDIT_ENTRY = AUDIT_COLUMNS[1:]  # the seq is the table's


def _append_action_job(conn: sqlite3.Connection, entry: Row) -> int:
    with write_transaction(conn):
        cursor = conn.execute(
            f"INSERT INTO dlq_actions ({', '.join(_AUDIT_ENTRY)}) VALUES ({_named(_AUDIT_ENTRY)})",
            dict(entry),
        )
        seq = cursor.lastrowid
        assert seq is not None  # an INSERT into a rowid table always sets it
        conn.executemany(
            "INSERT INTO dlq_action_integrations (integration, action_seq) VALUES (?, ?)",
            [(name, seq) for name in orjson.loads(entry["integrations"])],
        )
    return seq


def _actions_job(
    conn: sqlite3.Connection,
    before_seq: int | None,
    limit: int,
    integrations: frozenset[str] | None,
) -> list[dict[str, Any]]:
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
        f"SELECT {', '.join(AUDIT_COLUMNS)} FROM dlq_actions"
        f" WHERE {conditions.sql} ORDER BY seq DESC LIMIT ?",
        [*conditions.params, limit],
    )
    return _dicts(cursor)


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


class SqliteDeadLetterStore(StoreCore):
    """The DLQ in one SQLite file; see the module docstring for how it stays fast."""

    tiebreak_column = SQLITE.tiebreak  # its times are the core's: signed

    def __init__(
        self,
        path: Path,
        *,
        clock: Clock = SYSTEM_CLOCK,
        retention_s: float | None = DEFAULT_RETENTION_S,
        timeout_s: float = 30.0,
        busy_timeout_s: float = 5.0,
    ) -> None:
        super().__init__(clock=clock, retention_s=retention_s)
        self.path = path
        self._timeout_s = timeout_s
        self._writer = SqliteThread(
            path, "dlq-write", busy_timeout_s=busy_timeout_s, journal_mode=JOURNAL_MODE
        )
        self._reader = SqliteThread(
            path,
            "dlq-read",
            busy_timeout_s=busy_timeout_s,
            # A larger page cache keeps the list indexes of a million rows in memory.
            pragmas=("query_only=ON", "cache_size=-65536"),
            journal_mode=JOURNAL_MODE,
        )
        self._puts: _PutGroup | None = None  # the group new puts join, while it waits

    async def open(self) -> None:
        """Opens both connections and creates (or checks) the schema."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # The write connection sets the journal mode before the reader opens (a file
            # of an earlier version is in WAL: switching needs the only connection).
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

    # --- the primitives of ``StoreCore`` --------------------------------------------

    async def _put(self, letters: Sequence[DeadLetter], now_us: int) -> PutResult:
        put = (letters, now_us)
        group = self._puts
        place = None if group is None else group.join(put)
        if group is None or place is None:
            group = _PutGroup()
            place = group.join(put)
            assert place is not None  # nobody has started its job yet
            try:
                answers = self._writer.start(
                    partial(_put_group_job, group=group, path=self.path), timeout_s=self._timeout_s
                )
            except BrokerError as exc:  # closed
                raise self._translate(exc) from exc
            self._puts = group
            answers.add_done_callback(partial(self._answered, group))
            group.answers = answers
        assert group.answers is not None
        # Shielded: a caller that is cancelled leaves the job to the group's other puts.
        answer = (await self._translated(asyncio.shield(group.answers)))[place]
        if isinstance(answer, BrokerError):
            raise self._translate(answer) from answer
        return answer

    def _answered(self, group: _PutGroup, answers: asyncio.Future[Any]) -> None:
        if self._puts is group:
            self._puts = None  # its letters need not stay in memory
        if not answers.cancelled():
            answers.exception()  # every caller may have gone: the failure was theirs

    async def _rows(self, letter_ids: Sequence[str]) -> Sequence[Row]:
        return await self._call(self._reader, partial(_rows_job, letter_ids=letter_ids))

    async def _list(
        self, where: DeadLetterFilter, after: Key | None, limit: int, preview_bytes: int
    ) -> tuple[Sequence[Row], Key | None]:
        job = partial(
            _list_job,
            plan=_OrderedPlan.of(where),
            after=after,
            limit=limit,
            preview_bytes=preview_bytes,
        )
        return await self._call(self._reader, job)

    async def _ids(
        self, where: DeadLetterFilter, after: Key | None, limit: int
    ) -> tuple[Sequence[str], Key | None]:
        job = partial(_ids_job, plan=_OrderedPlan.of(where), after=after, limit=limit)
        return await self._call(self._reader, job)

    async def _count(self, where: DeadLetterFilter, limit: int | None) -> int:
        return await self._call(self._reader, partial(_count_job, where=where, limit=limit))

    async def _groups(self, where: DeadLetterFilter, limit: int) -> Sequence[Row]:
        return await self._call(self._reader, partial(_groups_job, where=where, limit=limit))

    async def _stats(
        self, where: DeadLetterFilter, window: Window
    ) -> tuple[Sequence[Row], Mapping[int, int]]:
        return await self._call(self._reader, partial(_stats_job, where=where, window=window))

    async def _mark(self, letter_ids: Sequence[str], mark: Mark) -> int:
        return await self._call(self._writer, partial(_mark_job, letter_ids=letter_ids, mark=mark))

    async def _append_action(self, entry: Row) -> int:
        return await self._call(self._writer, partial(_append_action_job, entry=entry))

    async def _actions(
        self, before: int | None, limit: int, integrations: frozenset[str] | None
    ) -> Sequence[Row]:
        job = partial(_actions_job, before_seq=before, limit=limit, integrations=integrations)
        return await self._call(self._reader, job)

    async def _delete_expired(self, cutoff_us: int, limit: int) -> int:
        return await self._call(
            self._writer, partial(_delete_expired_job, cutoff_us=cutoff_us, batch=limit)
        )

    async def _prune_signatures(self) -> None:
        await self._call(self._writer, _prune_signatures_job)

    async def _call(self, thread: SqliteThread, job: Callable[[sqlite3.Connection], T]) -> T:
        return await self._translated(thread.run(job, timeout_s=self._timeout_s))

    async def _translated(self, call: Awaitable[T]) -> T:
        # The worker threads speak the broker's error tree; the DLQ has its own.
        try:
            return await call
        except BrokerError as exc:
            raise self._translate(exc) from exc

    def _translate(self, exc: BrokerError) -> DlqError:
        if isinstance(exc, BrokerTimeout):
            return DlqTimeout(f"{self.path}: {exc}")
        return DlqError(f"{self.path}: {exc}")


async def open_sqlite_dlq(
    path: str | os.PathLike[str],
    *,
    clock: Clock = SYSTEM_CLOCK,
    retention_s: float | None = DEFAULT_RETENTION_S,
    timeout_s: float = 30.0,
    busy_timeout_s: float = 5.0,
) -> SqliteDeadLetterStore:
    """Opens (creating if needed) a DLQ file; ``retention_s`` None keeps rows forever."""
    check_retention(retention_s)
    store = SqliteDeadLetterStore(
        Path(path),
        clock=clock,
        retention_s=retention_s,
        timeout_s=timeout_s,
        busy_timeout_s=busy_timeout_s,
    )
    await store.open()
    return store
