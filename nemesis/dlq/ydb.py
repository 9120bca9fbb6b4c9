"""The ``ydb`` DLQ store: the sqlite store's rows and queries on YDB tables, with a TTL.

Tables (under ``YdbDlqConfig.path``, relative to the database):

* ``letters``: one row per dead letter, keyed by its id; the same columns as
  the sqlite store, times in microseconds (``Uint64``). A TTL on
  ``dead_lettered_us`` lets YDB delete rows past the retention by itself;
  ``enforce_retention`` does the same on demand (and counts what it deleted).
  Secondary indexes on (time), (integration, time) and (signature, time)
  serve the lists, newest first.
* ``signatures``: one row per failure signature (what a group shows).
* ``actions`` and ``action_integrations``: the audit log and its index by integration.
* ``meta``: the schema version.

Keyset paging orders by (dead-letter time, ``tiebreak``) descending, where
``tiebreak`` is the first 60 bits of the row id: rows that share a
microsecond are told apart by it (two ids agreeing on 60 bits within one
microsecond would be needed for a page to skip a row).

Every statement is built by the ``Yql`` functions below, from typed
parameters that are declared in the text (``DECLARE $p AS Type``): no
value is ever written into YQL. Read-modify-write (``put``, status changes,
the audit log) runs in serializable transactions through
``retry_tx_async``, which retries on conflicts; plain reads run through
``execute_with_retries``. Every call is bounded by ``timeout_s``.

Not run against a server on the machine this was written on: see
``nemesis/broker/ydb/README.md`` for what was tested and how to run the
contract suite against a real YDB.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import orjson
import ydb
from ydb import convert
from ydb.aio.driver import Driver
from ydb.aio.query.pool import QuerySessionPool
from ydb.aio.query.transaction import QueryTxContext

from nemesis.broker.ydb.connection import open_driver
from nemesis.broker.ydb.errors import table_call
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import YdbConnectionConfig, YdbDlqConfig
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
from nemesis.dlq.signature import normalise_error, pattern_signature
from nemesis.dlq.sqlite import (
    MAX_ACTOR_CHARS,
    MAX_DESCRIPTION_CHARS,
    MAX_HISTORY_ERROR_CHARS,
    MAX_SAMPLE_ERROR_CHARS,
    TEXT_SCAN_ROWS,
)
from nemesis.errors import BrokerError, DlqError, InvalidQuery

T = TypeVar("T")
Row = Mapping[str, Any]

SCHEMA_VERSION = 1
ID_CHUNK = 500  # ids per statement parameter
SELECT_ROUND = 5000  # ids per query of ``select_ids``
MARK_BATCH = 1000  # ids per status-change transaction
DELETE_BATCH = 1000  # rows per retention transaction
_US = 1_000_000
_INT64_MAX = 2**63 - 1

P = ydb.PrimitiveType
_UTF8 = P.Utf8
_OPT_UTF8 = ydb.OptionalType(P.Utf8)
_OPT_INT32 = ydb.OptionalType(P.Int32)
_OPT_UINT64 = ydb.OptionalType(P.Uint64)


# --- YQL: every statement and its typed, declared parameters -------------------------------


@dataclass
class Query:
    """A YQL text and its parameters; ``text`` starts with their DECLAREs."""

    body: str
    params: dict[str, ydb.TypedValue] = field(default_factory=dict)

    @property
    def text(self) -> str:
        declares = "".join(
            f"DECLARE {name} AS {value.value_type};\n" for name, value in self.params.items()
        )
        return declares + self.body


class _Params:
    """Collects typed parameters and hands out their names."""

    def __init__(self) -> None:
        self.values: dict[str, ydb.TypedValue] = {}

    def add(self, value: object, value_type: ydb.PrimitiveType | ydb.AbstractTypeBuilder) -> str:
        name = f"$p{len(self.values)}"
        self.values[name] = ydb.TypedValue(value, value_type)
        return name

    def ids(self, values: Sequence[str]) -> str:
        return self.add(list(values), ydb.ListType(_UTF8))

    def rows(self, rows: Sequence[Mapping[str, object]], row_type: ydb.StructType) -> str:
        """A ``List<Struct<...>>`` parameter for ``AS_TABLE``: a batch in one statement."""
        return self.add([dict(r) for r in rows], ydb.ListType(row_type))

    def query(self, body: str) -> Query:
        return Query(body, dict(self.values))


def _struct(*members: tuple[str, ydb.PrimitiveType | ydb.AbstractTypeBuilder]) -> ydb.StructType:
    struct = ydb.StructType()
    for name, member_type in members:
        struct.add_member(name, member_type)
    return struct


# Column types, shared by the DDL and the AS_TABLE row types, so they cannot drift apart.
LETTER_COLUMNS: tuple[tuple[str, ydb.PrimitiveType | ydb.AbstractTypeBuilder], ...] = (
    ("id", _UTF8),
    ("tiebreak", P.Int64),
    ("integration", _UTF8),
    ("status", _UTF8),
    ("reason", _UTF8),
    ("http_status", _OPT_INT32),
    ("signature", _UTF8),
    ("dead_lettered_us", P.Uint64),
    ("first_failure_us", P.Uint64),
    ("attempts", P.Int32),
    ("requeue_count", P.Int32),
    ("last_action", _OPT_UTF8),
    ("last_action_by", _OPT_UTF8),
    ("last_action_us", _OPT_UINT64),
    ("event_id", _UTF8),
    ("source_topic", _UTF8),
    ("source_partition", P.Int32),
    ("source_offset", P.Int64),
    ("msg_key", _OPT_UTF8),
    ("stage", _OPT_UTF8),
    ("payload_size", P.Int64),
    ("error", _UTF8),
    ("history", _OPT_UTF8),
    ("metadata", _UTF8),
    ("payload", P.String),
)
_LETTER_TYPES = dict(LETTER_COLUMNS)
_UPDATED_ON_FAILURE = (
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
)
_UPDATED_ON_ACTION = (
    "id",
    "status",
    "requeue_count",
    "last_action",
    "last_action_by",
    "last_action_us",
)
SIGNATURE_COLUMNS: tuple[tuple[str, ydb.PrimitiveType | ydb.AbstractTypeBuilder], ...] = (
    ("signature", _UTF8),
    ("integration", _UTF8),
    ("reason", _UTF8),
    ("http_status", _OPT_INT32),
    ("pattern", _UTF8),
    ("sample_error", _UTF8),
)
ACTION_COLUMNS: tuple[tuple[str, ydb.PrimitiveType | ydb.AbstractTypeBuilder], ...] = (
    ("seq", P.Int64),
    ("at_us", P.Uint64),
    ("who", _UTF8),
    ("act", _UTF8),  # "action" is a YQL keyword
    ("integrations", _UTF8),
    ("affected", P.Int64),
    ("description", _UTF8),
)
_LETTER_ROW = _struct(*LETTER_COLUMNS)
_FAILURE_ROW = _struct(*((name, _LETTER_TYPES[name]) for name in _UPDATED_ON_FAILURE))
_ACTION_ROW = _struct(*((name, _LETTER_TYPES[name]) for name in _UPDATED_ON_ACTION))
_SIGNATURE_ROW = _struct(*SIGNATURE_COLUMNS)
_AUDIT_ROW = _struct(*ACTION_COLUMNS)
_LINK_ROW = _struct(("integration", _UTF8), ("action_seq", P.Int64))
_ID_ROW = _struct(("id", _UTF8))
_SIGNATURE_KEY_ROW = _struct(("signature", _UTF8))

# Everything a row of a list shows; the payload is selected apart (whole or cut).
_ROW_COLUMNS = ", ".join(name for name, _ in LETTER_COLUMNS if name != "payload")
_ORDER = "ORDER BY dead_lettered_us DESC, tiebreak DESC"


def _ddl_type(column_type: ydb.PrimitiveType | ydb.AbstractTypeBuilder) -> str:
    if isinstance(column_type, ydb.OptionalType):
        return str(column_type.item)
    return f"{column_type} NOT NULL"


def _columns_ddl(columns: Sequence[tuple[str, ydb.PrimitiveType | ydb.AbstractTypeBuilder]]) -> str:
    return ",\n    ".join(f"`{name}` {_ddl_type(column_type)}" for name, column_type in columns)


class Yql:
    """The YQL of one store: table paths and every statement it runs."""

    def __init__(self, directory: str) -> None:
        self.directory = directory.strip("/")

    def table(self, name: str) -> str:
        return f"`{self.directory}/{name}`"

    # --- schema ---------------------------------------------------------------

    def create_tables(self) -> list[str]:
        """One DDL statement each (YDB runs schema changes outside transactions)."""
        return [
            f"CREATE TABLE IF NOT EXISTS {self.table('meta')} (\n"
            "    `key` Utf8 NOT NULL,\n    `value` Utf8 NOT NULL,\n    PRIMARY KEY (`key`)\n)",
            f"CREATE TABLE IF NOT EXISTS {self.table('letters')} (\n"
            f"    {_columns_ddl(LETTER_COLUMNS)},\n"
            "    PRIMARY KEY (`id`),\n"
            "    INDEX by_time GLOBAL SYNC ON (`dead_lettered_us`, `tiebreak`),\n"
            "    INDEX by_integration GLOBAL SYNC ON"
            " (`integration`, `dead_lettered_us`, `tiebreak`),\n"
            "    INDEX by_signature GLOBAL SYNC ON (`signature`, `dead_lettered_us`, `tiebreak`)\n"
            ")",
            f"CREATE TABLE IF NOT EXISTS {self.table('signatures')} (\n"
            f"    {_columns_ddl(SIGNATURE_COLUMNS)},\n    PRIMARY KEY (`signature`)\n)",
            f"CREATE TABLE IF NOT EXISTS {self.table('actions')} (\n"
            f"    {_columns_ddl(ACTION_COLUMNS)},\n    PRIMARY KEY (`seq`)\n)",
            f"CREATE TABLE IF NOT EXISTS {self.table('action_integrations')} (\n"
            "    `integration` Utf8 NOT NULL,\n    `action_seq` Int64 NOT NULL,\n"
            "    PRIMARY KEY (`integration`, `action_seq`)\n)",
        ]

    def set_ttl(self, retention_s: float | None) -> str:
        """Rows expire ``retention_s`` after their dead-letter time; None: never."""
        if retention_s is None:
            return f"ALTER TABLE {self.table('letters')} RESET (TTL)"
        seconds = math.ceil(retention_s)
        return (
            f'ALTER TABLE {self.table("letters")} SET (TTL = Interval("PT{seconds}S")'
            " ON dead_lettered_us AS MICROSECONDS)"
        )

    def schema_version(self) -> Query:
        return Query(f"SELECT `value` FROM {self.table('meta')} WHERE `key` = 'schema_version';")

    def write_schema_version(self, version: int) -> Query:
        params = _Params()
        value = params.add(str(version), _UTF8)
        return params.query(
            f"UPSERT INTO {self.table('meta')} (`key`, `value`) VALUES ('schema_version', {value});"
        )

    # --- letters: writes --------------------------------------------------------

    def put_state(self, ids: Sequence[str], signatures: Sequence[str]) -> Query:
        """What ``put`` needs to read first: the rows it updates and the signatures known."""
        params = _Params()
        wanted, known = params.ids(ids), params.ids(signatures)
        return params.query(
            "SELECT id, status, dead_lettered_us, reason, http_status, attempts, error, history"
            f" FROM {self.table('letters')} WHERE id IN {wanted};\n"
            f"SELECT signature FROM {self.table('signatures')} WHERE signature IN {known};"
        )

    def put_rows(
        self,
        inserts: Sequence[Row],
        updates: Sequence[Row],
        signatures: Sequence[Row],
    ) -> Query | None:
        """Batch UPSERTs of new rows, changed columns of existing rows, and new signatures."""
        params = _Params()
        statements = []
        if signatures:
            rows = params.rows(signatures, _SIGNATURE_ROW)
            statements.append(
                f"UPSERT INTO {self.table('signatures')} SELECT * FROM AS_TABLE({rows});"
            )
        if inserts:
            rows = params.rows(inserts, _LETTER_ROW)
            statements.append(
                f"UPSERT INTO {self.table('letters')} SELECT * FROM AS_TABLE({rows});"
            )
        if updates:
            rows = params.rows(updates, _FAILURE_ROW)
            statements.append(
                f"UPSERT INTO {self.table('letters')} SELECT * FROM AS_TABLE({rows});"
            )
        return params.query("\n".join(statements)) if statements else None

    def dead_ids(self, ids: Sequence[str], integrations: frozenset[str] | None) -> Query:
        """The rows among ``ids`` that a status change may touch (dead, in scope)."""
        params = _Params()
        conditions = [f"id IN {params.ids(ids)}", "status = 'dead'"]
        if integrations is not None:
            conditions.append(f"integration IN {params.ids(sorted(integrations))}")
        return params.query(
            f"SELECT id, requeue_count FROM {self.table('letters')}"
            f" WHERE {' AND '.join(conditions)};"
        )

    def mark(self, changes: Sequence[Row]) -> Query:
        params = _Params()
        rows = params.rows(changes, _ACTION_ROW)
        return params.query(f"UPSERT INTO {self.table('letters')} SELECT * FROM AS_TABLE({rows});")

    def expired(self, cutoff_us: int, limit: int) -> Query:
        params = _Params()
        cutoff, batch = params.add(cutoff_us, P.Uint64), params.add(limit, P.Uint64)
        return params.query(
            f"SELECT id FROM {self.table('letters')} VIEW by_time"
            f" WHERE dead_lettered_us < {cutoff} ORDER BY dead_lettered_us LIMIT {batch};"
        )

    def delete_letters(self, ids: Sequence[str]) -> Query:
        params = _Params()
        keys = params.rows([{"id": i} for i in ids], _ID_ROW)
        return params.query(
            f"DELETE FROM {self.table('letters')} ON SELECT id FROM AS_TABLE({keys});"
        )

    def unused_signatures(self) -> Query:
        return Query(
            f"SELECT s.signature AS signature FROM {self.table('signatures')} AS s"
            f" LEFT ONLY JOIN (SELECT DISTINCT signature FROM {self.table('letters')}) AS l"
            " ON s.signature = l.signature;"
        )

    def delete_signatures(self, signatures: Sequence[str]) -> Query:
        params = _Params()
        keys = params.rows([{"signature": s} for s in signatures], _SIGNATURE_KEY_ROW)
        return params.query(
            f"DELETE FROM {self.table('signatures')} ON SELECT signature FROM AS_TABLE({keys});"
        )

    # --- letters: reads -----------------------------------------------------------

    def get(self, ids: Sequence[str]) -> Query:
        params = _Params()
        return params.query(
            f"SELECT {_ROW_COLUMNS}, payload FROM {self.table('letters')}"
            f" WHERE id IN {params.ids(ids)};"
        )

    def page(
        self,
        where: DeadLetterFilter,
        after: tuple[int, int] | None,
        limit: int,
        preview_bytes: int,
        bound: tuple[int, int] | None,
    ) -> Query:
        """Up to ``limit`` rows after ``after``, newest first, not past ``bound``."""
        params = _Params()
        conditions = _conditions(where, params) + _after(after, params)
        if bound is not None:
            conditions += _not_after(bound, params)
        preview = params.add(preview_bytes, P.Uint32)
        count = params.add(limit, P.Uint64)
        return params.query(
            f"SELECT {_ROW_COLUMNS}, Substring(payload, 0, {preview}) AS payload"
            f" FROM {self.table('letters')}{_view(where)}"
            f" WHERE {_joined(conditions)} {_ORDER} LIMIT {count};"
        )

    def scan_bound(self, where: DeadLetterFilter, after: tuple[int, int] | None) -> Query:
        """The key of the ``TEXT_SCAN_ROWS``-th candidate of a text search, text aside."""
        params = _Params()
        conditions = _conditions(where, params, text=False) + _after(after, params)
        offset = params.add(TEXT_SCAN_ROWS - 1, P.Uint64)
        return params.query(
            f"SELECT dead_lettered_us, tiebreak FROM {self.table('letters')}{_view(where)}"
            f" WHERE {_joined(conditions)} {_ORDER} LIMIT 1 OFFSET {offset};"
        )

    def ids_page(self, where: DeadLetterFilter, after: tuple[int, int] | None, limit: int) -> Query:
        params = _Params()
        conditions = _conditions(where, params) + _after(after, params)
        count = params.add(limit, P.Uint64)
        return params.query(
            f"SELECT id, dead_lettered_us, tiebreak FROM {self.table('letters')}{_view(where)}"
            f" WHERE {_joined(conditions)} {_ORDER} LIMIT {count};"
        )

    def count(self, where: DeadLetterFilter, limit: int | None) -> Query:
        params = _Params()
        source = (
            f"{self.table('letters')}{_view(where)} WHERE {_joined(_conditions(where, params))}"
        )
        if limit is None:
            return params.query(f"SELECT COUNT(*) AS n FROM {source};")
        bound = params.add(limit, P.Uint64)
        return params.query(f"SELECT COUNT(*) AS n FROM (SELECT id FROM {source} LIMIT {bound});")

    def groups(self, where: DeadLetterFilter, limit: int) -> Query:
        params = _Params()
        conditions = _joined(_conditions(where, params))
        top = params.add(limit, P.Uint64)
        return params.query(
            "$counted = SELECT signature, COUNT(*) AS n, MIN(dead_lettered_us) AS first_us,"
            f" MAX(dead_lettered_us) AS last_us FROM {self.table('letters')}{_view(where)}"
            f" WHERE {conditions} GROUP BY signature;\n"
            f"$top = SELECT * FROM $counted ORDER BY n DESC, signature LIMIT {top};\n"
            "SELECT t.signature AS signature, s.integration AS integration, s.reason AS reason,"
            " s.http_status AS http_status, s.pattern AS pattern,"
            " s.sample_error AS sample_error, t.n AS n, t.first_us AS first_us,"
            f" t.last_us AS last_us FROM $top AS t INNER JOIN {self.table('signatures')} AS s"
            " ON s.signature = t.signature;"
        )

    def stats(
        self, where: DeadLetterFilter, hour_ago_us: int, start_us: int, end_us: int, bucket_us: int
    ) -> Query:
        """Two result sets: counts per (integration, reason), then counts per time bucket."""
        params = _Params()
        conditions = _joined(_conditions(where, params))
        recent = params.add(hour_ago_us, P.Uint64)
        start, end = params.add(start_us, P.Uint64), params.add(end_us, P.Uint64)
        step = params.add(bucket_us, P.Uint64)
        letters = f"{self.table('letters')}{_view(where)}"
        return params.query(
            "SELECT integration, reason, COUNT(*) AS total,"
            f" COUNT_IF(dead_lettered_us >= {recent}) AS recent,"
            " MIN(dead_lettered_us) AS oldest, MAX(dead_lettered_us) AS newest"
            f" FROM {letters} WHERE {conditions} GROUP BY integration, reason;\n"
            f"SELECT bucket, COUNT(*) AS n FROM {letters} WHERE {conditions}"
            f" AND dead_lettered_us >= {start} AND dead_lettered_us < {end}"
            f" GROUP BY (dead_lettered_us - {start}) / {step} AS bucket;"
        )

    # --- the audit log -------------------------------------------------------------

    def last_action_seq(self) -> Query:
        return Query(f"SELECT MAX(seq) AS seq FROM {self.table('actions')};")

    def record_action(self, action: Row, links: Sequence[Row]) -> Query:
        params = _Params()
        entry = params.rows([action], _AUDIT_ROW)
        statements = [f"UPSERT INTO {self.table('actions')} SELECT * FROM AS_TABLE({entry});"]
        if links:
            rows = params.rows(links, _LINK_ROW)
            statements.append(
                f"UPSERT INTO {self.table('action_integrations')} SELECT * FROM AS_TABLE({rows});"
            )
        return params.query("\n".join(statements))

    def actions(self, before_seq: int, limit: int, integrations: frozenset[str] | None) -> Query:
        params = _Params()
        before, count = params.add(before_seq, P.Int64), params.add(limit, P.Uint64)
        columns = "seq, at_us, who, act, integrations, affected, description"
        if integrations is None:
            return params.query(
                f"SELECT {columns} FROM {self.table('actions')}"
                f" WHERE seq < {before} ORDER BY seq DESC LIMIT {count};"
            )
        scope = params.ids(sorted(integrations))
        selected = ", ".join(f"a.{c} AS {c}" for c in columns.split(", "))
        return params.query(
            "$seqs = SELECT DISTINCT action_seq AS seq"
            f" FROM {self.table('action_integrations')}"
            f" WHERE integration IN {scope} AND action_seq < {before};\n"
            f"$top = SELECT seq FROM $seqs ORDER BY seq DESC LIMIT {count};\n"
            f"SELECT {selected} FROM $top AS t"
            f" INNER JOIN {self.table('actions')} AS a ON a.seq = t.seq;"
        )


def _conditions(where: DeadLetterFilter, params: _Params, *, text: bool = True) -> list[str]:
    """The filter as YQL conditions (joined by AND)."""
    conditions: list[str] = []
    if where.integrations is not None:
        conditions.append(f"integration IN {params.ids(sorted(where.integrations))}")
    if where.reason is not None:
        conditions.append(f"reason = {params.add(where.reason.value, _UTF8)}")
    if where.status is not None:
        conditions.append(f"status = {params.add(where.status.value, _UTF8)}")
    if where.http_status is not None:
        conditions.append(f"http_status = {params.add(where.http_status, P.Int32)}")
    if where.signature is not None:
        conditions.append(f"signature = {params.add(where.signature, _UTF8)}")
    if where.since is not None:
        conditions.append(f"dead_lettered_us >= {params.add(_time_us(where.since), P.Uint64)}")
    if where.until is not None:
        conditions.append(f"dead_lettered_us < {params.add(_time_us(where.until), P.Uint64)}")
    if text and where.text:
        # ASCII case-insensitive, like the sqlite store's LIKE; a plain substring
        # test, so % _ \\ and quotes in the text mean themselves.
        needle = params.add(_ascii_lower(where.text).encode(), P.String)
        conditions.append(
            f"(String::Contains(String::AsciiToLower(error), {needle})"
            f" OR String::Contains(String::AsciiToLower(payload), {needle}))"
        )
    return conditions


def _after(key: tuple[int, int] | None, params: _Params) -> list[str]:
    """Rows strictly after ``key`` in (time desc, tiebreak desc) order."""
    if key is None:
        return []
    at, tiebreak = params.add(_clamp_us(key[0]), P.Uint64), params.add(key[1], P.Int64)
    return [
        f"dead_lettered_us <= {at}",
        f"(dead_lettered_us < {at} OR tiebreak < {tiebreak})",
    ]


def _not_after(key: tuple[int, int], params: _Params) -> list[str]:
    """Rows up to and including ``key`` in (time desc, tiebreak desc) order."""
    at, tiebreak = params.add(_clamp_us(key[0]), P.Uint64), params.add(key[1], P.Int64)
    return [
        f"dead_lettered_us >= {at}",
        f"(dead_lettered_us > {at} OR tiebreak >= {tiebreak})",
    ]


def _view(where: DeadLetterFilter) -> str:
    """The secondary index that serves a filter's list (YDB uses one only when named)."""
    if where.signature is not None:
        return " VIEW by_signature"
    if where.integrations is not None:
        return " VIEW by_integration"
    return " VIEW by_time"


def _joined(conditions: Sequence[str]) -> str:
    return " AND ".join(conditions) or "TRUE"


# --- values ------------------------------------------------------------------------


def tiebreak(letter_id: str) -> int:
    """The keyset tie-breaker of a row: the first 60 bits of its (hex) id."""
    return int(letter_id[:15], 16)


def _to_us(seconds: float) -> int:
    return round(seconds * _US)


def _time_us(seconds: float) -> int:
    return _clamp_us(_to_us(seconds))


def _clamp_us(us: int) -> int:
    # Times before 1970 match nothing stored; Uint64 cannot carry them.
    return max(us, 0)


def _to_s(us: int) -> float:
    return us / _US


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _ascii_lower(text: str) -> str:
    return text.translate(_ASCII_LOWER)


def _chunks(items: Sequence[T], size: int) -> list[Sequence[T]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


def _history(raw: str | None) -> tuple[PastFailure, ...]:
    if not raw:
        return ()
    return tuple(
        PastFailure(_to_s(at_us), Reason(reason), http_status, attempts, error)
        for at_us, reason, http_status, attempts, error in orjson.loads(raw)
    )


def _row(r: Row) -> DeadLetterRow:
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
        first_failure_at=_to_s(r["first_failure_us"]),
        dead_lettered_at=_to_s(r["dead_lettered_us"]),
        requeue_count=r["requeue_count"],
        last_action=None if r["last_action"] is None else Action(r["last_action"]),
        last_action_by=r["last_action_by"],
        last_action_at=None if r["last_action_us"] is None else _to_s(r["last_action_us"]),
        source_topic=r["source_topic"],
        source_partition=r["source_partition"],
        source_offset=r["source_offset"],
        key=r["msg_key"],
        stage=r["stage"],
        metadata=orjson.loads(r["metadata"]),
        payload=bytes(r["payload"]),
        payload_size=r["payload_size"],
        history=_history(r["history"]),
    )


@dataclass
class _Letter:
    """A row as ``put`` builds it: all columns of a new row, or the failure columns."""

    columns: dict[str, object]
    new: bool


def fold_failures(
    letters: Sequence[DeadLetter], existing: Mapping[str, Row], now_us: int
) -> tuple[list[_Letter], dict[str, dict[str, object]], int, int]:
    """Applies failures in batch order to the rows they concern (see ``nemesis.dlq.port``).

    Returns the rows to write, the signatures seen (by signature), and how
    many failures inserted and updated rows. A message twice in the batch is
    folded here, in memory, so the transaction reads once and writes once.
    """
    rows: dict[str, _Letter] = {}
    signatures: dict[str, dict[str, object]] = {}
    inserted = updated = 0
    for letter in letters:
        letter_id = letter.id
        at_us = now_us if letter.dead_lettered_at is None else _time_us(letter.dead_lettered_at)
        pattern = normalise_error(letter.error)
        signature = pattern_signature(
            letter.integration, letter.reason, letter.http_status, pattern
        )
        signatures.setdefault(
            signature,
            {
                "signature": signature,
                "integration": letter.integration,
                "reason": letter.reason.value,
                "http_status": letter.http_status,
                "pattern": pattern,
                "sample_error": _cut(letter.error, MAX_SAMPLE_ERROR_CHARS),
            },
        )
        error = _cut(letter.error, MAX_ERROR_CHARS)
        current = rows.get(letter_id)
        previous: Row | None = current.columns if current is not None else existing.get(letter_id)
        if previous is None:
            first_us = at_us if letter.first_failure_at is None else _to_us(letter.first_failure_at)
            rows[letter_id] = _Letter(
                {
                    "id": letter_id,
                    "tiebreak": tiebreak(letter_id),
                    "integration": letter.integration,
                    "status": Status.DEAD.value,
                    "reason": letter.reason.value,
                    "http_status": letter.http_status,
                    "signature": signature,
                    "dead_lettered_us": at_us,
                    "first_failure_us": _clamp_us(first_us),
                    "attempts": letter.attempts,
                    "requeue_count": 0,
                    "last_action": None,
                    "last_action_by": None,
                    "last_action_us": None,
                    "event_id": letter.event_id,
                    "source_topic": letter.source_topic,
                    "source_partition": letter.source_partition,
                    "source_offset": letter.source_offset,
                    "msg_key": letter.key,
                    "stage": letter.stage,
                    "payload_size": len(letter.payload),
                    "error": error,
                    "history": None,
                    "metadata": orjson.dumps(dict(letter.metadata)).decode(),
                    "payload": letter.payload,
                },
                new=True,
            )
            inserted += 1
            continue
        history = [*orjson.loads(cast(str | None, previous["history"]) or "[]")]
        history.append(
            [
                previous["dead_lettered_us"],
                previous["reason"],
                previous["http_status"],
                previous["attempts"],
                _cut(cast(str, previous["error"]), MAX_HISTORY_ERROR_CHARS),
            ]
        )
        # A requeued message that failed again waits for someone again; a
        # discarded one can only be a duplicate of a failure already dropped.
        status = previous["status"]
        if status == Status.REQUEUED.value:
            status = Status.DEAD.value
        changed: dict[str, object] = {
            "id": letter_id,
            "status": status,
            "reason": letter.reason.value,
            "http_status": letter.http_status,
            "signature": signature,
            "dead_lettered_us": at_us,
            "attempts": letter.attempts,
            "stage": letter.stage,
            "error": error,
            "history": orjson.dumps(history[-MAX_HISTORY:]).decode(),
        }
        if current is not None:
            current.columns.update(changed)
        else:
            rows[letter_id] = _Letter(changed, new=False)
        updated += 1
    return list(rows.values()), signatures, inserted, updated


# --- execution ------------------------------------------------------------------------

_stop_pool = cast(Callable[[QuerySessionPool], Awaitable[None]], QuerySessionPool.stop)
_aggregate = cast(
    Callable[[AsyncIterator[Any]], Awaitable[list[Any]]],
    convert.aggregate_result_sets_by_index_async,
)


async def _result_sets(results: AsyncIterator[Any]) -> list[list[Row]]:
    """The rows of every result set of one statement's answer, in statement order."""
    return [list(result_set.rows) for result_set in await _aggregate(results)]


async def _execute(tx: QueryTxContext, query: Query) -> list[list[Row]]:
    """Runs one statement in ``tx``; the caller's ``retry_tx_async`` commits it.

    Never ``commit_tx=True``: a transaction that also moves topic offsets
    (``nemesis.broker.ydb.tx``) would skip the SDK's topic commit hooks.
    """
    return await _result_sets(await tx.execute(query.text, query.params))


# --- the store --------------------------------------------------------------------------

_LETTERS_CURSOR = "dlq"
_ACTIONS_CURSOR = "dlq-audit"


class YdbDeadLetterStore:
    """The DLQ in YDB tables; see the module docstring."""

    def __init__(
        self,
        pool: QuerySessionPool,
        *,
        directory: str,
        clock: Clock = SYSTEM_CLOCK,
        retention_s: float | None = DEFAULT_RETENTION_S,
        timeout_s: float = 30.0,
        driver: Driver | None = None,
    ) -> None:
        self._pool = pool
        self._yql = Yql(directory)
        self._clock = clock
        self.retention_s = retention_s
        self._timeout_s = timeout_s
        self._driver = driver  # stopped on close when the store opened it
        self._closed = False

    @property
    def directory(self) -> str:
        return self._yql.directory

    # --- plumbing -----------------------------------------------------------

    async def _read(self, what: str, query: Query) -> list[list[Row]]:
        self._check_open()
        results = await table_call(
            what, self._pool.execute_with_retries(query.text, query.params), self._timeout_s
        )
        return [list(result_set.rows) for result_set in results]

    async def _transaction(self, what: str, work: Callable[[QueryTxContext], Awaitable[T]]) -> T:
        self._check_open()
        outcome = await table_call(what, self._pool.retry_tx_async(work), self._timeout_s)
        return cast(T, outcome)

    async def _run(self, what: str, query: Query) -> None:
        """One statement in a transaction of its own."""

        async def work(tx: QueryTxContext) -> None:
            await _execute(tx, query)

        await self._transaction(what, work)

    async def _schema(self, what: str, statement: str) -> None:
        self._check_open()
        await table_call(what, self._pool.execute_with_retries(statement), self._timeout_s)

    def _check_open(self) -> None:
        if self._closed:
            raise DlqError("the DLQ store is closed")

    # --- lifecycle -------------------------------------------------------------

    async def open(self) -> None:
        """Creates the tables (if missing), sets the TTL, checks the schema version."""
        for statement in self._yql.create_tables():
            await self._schema("create the DLQ tables", statement)
        await self._schema("set the DLQ retention", self._yql.set_ttl(self.retention_s))
        (rows,) = await self._read("read the DLQ schema version", self._yql.schema_version())
        if rows and int(rows[0]["value"]) > SCHEMA_VERSION:
            raise DlqError(
                f"DLQ schema version {rows[0]['value']} is newer than this Nemesis"
                f" ({SCHEMA_VERSION})"
            )
        if not rows:
            query = self._yql.write_schema_version(SCHEMA_VERSION)
            await self._transaction("write the DLQ schema version", lambda tx: _execute(tx, query))

    async def close(self) -> None:
        """Releases the sessions (and the driver, if the store opened it)."""
        if self._closed:
            return
        self._closed = True
        await _stop_pool(self._pool)
        if self._driver is not None:
            await self._driver.stop(timeout=1)

    async def __aenter__(self) -> YdbDeadLetterStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- writing -------------------------------------------------------------------

    async def put(self, letters: Sequence[DeadLetter]) -> PutResult:
        """Writes failures, one row per ``DeadLetter.id`` (see ``nemesis.dlq.port``)."""
        if not letters:
            return PutResult(0, 0)
        now_us = _to_us(self._clock.time())
        batch = tuple(letters)
        return await self._transaction(
            f"put {len(batch)} dead letters", lambda tx: self.put_in(tx, batch, now_us)
        )

    async def put_in(
        self, tx: QueryTxContext, letters: Sequence[DeadLetter], now_us: int | None = None
    ) -> PutResult:
        """``put`` inside the caller's transaction (one that also moves topic offsets)."""
        if now_us is None:
            now_us = _to_us(self._clock.time())
        ids = sorted({letter.id for letter in letters})
        signatures = sorted(
            {
                pattern_signature(
                    letter.integration,
                    letter.reason,
                    letter.http_status,
                    normalise_error(letter.error),
                )
                for letter in letters
            }
        )
        existing: dict[str, Row] = {}
        known: set[str] = set()
        for id_chunk, signature_chunk in _paired_chunks(ids, signatures, ID_CHUNK):
            rows, found = await _execute(tx, self._yql.put_state(id_chunk, signature_chunk))
            existing.update((r["id"], r) for r in rows)
            known.update(r["signature"] for r in found)
        written, seen, inserted, updated = fold_failures(letters, existing, now_us)
        new_signatures = [row for signature, row in seen.items() if signature not in known]
        inserts = [w.columns for w in written if w.new]
        updates = [w.columns for w in written if not w.new]
        for start in range(0, max(len(inserts), len(updates), len(new_signatures)), ID_CHUNK):
            end = start + ID_CHUNK
            query = self._yql.put_rows(
                inserts[start:end], updates[start:end], new_signatures[start:end]
            )
            if query is not None:
                await _execute(tx, query)
        return PutResult(inserted, updated)

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
        at_us = _time_us(self._clock.time() if at is None else at)
        by = _cut(by, MAX_ACTOR_CHARS)
        increment = 1 if status is Status.REQUEUED else 0
        changed = 0
        for chunk in _chunks(unique, MARK_BATCH):

            async def work(tx: QueryTxContext, chunk: Sequence[str] = chunk) -> int:
                (rows,) = await _execute(tx, self._yql.dead_ids(chunk, integrations))
                if rows:
                    changes = [
                        {
                            "id": r["id"],
                            "status": status.value,
                            "requeue_count": r["requeue_count"] + increment,
                            "last_action": action.value,
                            "last_action_by": by,
                            "last_action_us": at_us,
                        }
                        for r in rows
                    ]
                    await _execute(tx, self._yql.mark(changes))
                return len(rows)

            changed += await self._transaction(f"mark {len(chunk)} rows {status.value}", work)
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
    ) -> ActionRecord:
        """Appends an entry to the audit log (its number: the last one + 1, serializably)."""
        at_us = _time_us(self._clock.time() if at is None else at)
        names = tuple(sorted(set(integrations)))
        who = _cut(who, MAX_ACTOR_CHARS)
        description = _cut(description, MAX_DESCRIPTION_CHARS)

        async def work(tx: QueryTxContext) -> int:
            (rows,) = await _execute(tx, self._yql.last_action_seq())
            seq = (rows[0]["seq"] or 0) + 1 if rows else 1
            entry = {
                "seq": seq,
                "at_us": at_us,
                "who": who,
                "act": action.value,
                "integrations": orjson.dumps(names).decode(),
                "affected": count,
                "description": description,
            }
            links = [{"integration": name, "action_seq": seq} for name in names]
            await _execute(tx, self._yql.record_action(entry, links))
            return int(seq)

        seq = await self._transaction("record an action", work)
        return ActionRecord(seq, _to_s(at_us), who, action, names, count, description)

    async def enforce_retention(self, now: float | None = None) -> int:
        """Deletes rows dead-lettered longer ago than the retention, in batches; how many.

        YDB's TTL does the same in the background; this is for an exact cut now.
        """
        if self.retention_s is None:
            return 0
        now = self._clock.time() if now is None else now
        cutoff_us = _to_us(now - self.retention_s)
        if cutoff_us <= 0:
            return 0
        deleted = 0
        while True:

            async def work(tx: QueryTxContext) -> int:
                (rows,) = await _execute(tx, self._yql.expired(cutoff_us, DELETE_BATCH))
                if rows:
                    await _execute(tx, self._yql.delete_letters([r["id"] for r in rows]))
                return len(rows)

            batch = await self._transaction("delete expired dead letters", work)
            deleted += batch
            if batch < DELETE_BATCH:
                break
        if deleted:
            (unused,) = await self._read("find unused signatures", self._yql.unused_signatures())
            for chunk in _chunks([r["signature"] for r in unused], ID_CHUNK):
                await self._run("delete unused signatures", self._yql.delete_signatures(chunk))
        return deleted

    # --- reading ---------------------------------------------------------------------

    async def get(self, letter_id: str) -> DeadLetterRow | None:
        """One row with its whole payload, or None."""
        rows = await self.get_many([letter_id])
        return rows[0] if rows else None

    async def get_many(self, letter_ids: Collection[str]) -> Sequence[DeadLetterRow]:
        """The rows that exist among ``letter_ids``, whole payloads, newest first."""
        rows: list[DeadLetterRow] = []
        for chunk in _chunks(sorted(set(letter_ids)), ID_CHUNK):
            (found,) = await self._read("get dead letters", self._yql.get(chunk))
            rows.extend(_row(r) for r in found)
        rows.sort(key=lambda row: (row.dead_lettered_at, row.id), reverse=True)
        return rows

    async def query(
        self,
        where: DeadLetterFilter,
        page: PageRequest | None = None,
        *,
        preview_bytes: int = PREVIEW_BYTES,
    ) -> Page:
        """One page of matching rows, newest first (payloads cut to ``preview_bytes``).

        A text search examines at most ``TEXT_SCAN_ROWS`` candidates per page,
        as in the sqlite store: its page may come back short, with a cursor.
        """
        page = page or PageRequest()
        if preview_bytes < 0:
            raise InvalidQuery("preview_bytes cannot be negative")
        after = _letters_key(page.cursor)
        if where.matches_nothing:
            return Page([], None)
        bound: tuple[int, int] | None = None
        if where.text:
            (found,) = await self._read("bound a text search", self._yql.scan_bound(where, after))
            if found:
                bound = (found[0]["dead_lettered_us"], found[0]["tiebreak"])
        preview = min(preview_bytes, 2**32 - 1)
        (found,) = await self._read(
            "list dead letters", self._yql.page(where, after, page.limit + 1, preview, bound)
        )
        rows = [_row(r) for r in found]
        next_key = bound
        if len(rows) > page.limit:
            rows = rows[: page.limit]
            last = found[page.limit - 1]
            next_key = (last["dead_lettered_us"], last["tiebreak"])
        return Page(rows, None if next_key is None else encode_cursor(_LETTERS_CURSOR, next_key))

    async def count(self, where: DeadLetterFilter, *, limit: int | None = None) -> int:
        """How many rows match; with ``limit``, stops counting there."""
        if limit is not None and limit < 0:
            raise InvalidQuery("a count limit cannot be negative")
        if where.matches_nothing or limit == 0:
            return 0
        (rows,) = await self._read("count dead letters", self._yql.count(where, limit))
        return int(rows[0]["n"]) if rows else 0

    async def groups(self, where: DeadLetterFilter, *, limit: int = 100) -> Sequence[Group]:
        """Matching rows grouped by signature, largest group first."""
        if not 1 <= limit <= MAX_GROUPS:
            raise InvalidQuery(f"a group list holds 1 to {MAX_GROUPS} groups")
        if where.matches_nothing:
            return []
        (rows,) = await self._read("group dead letters", self._yql.groups(where, limit))
        groups = [
            Group(
                signature=r["signature"],
                integration=r["integration"],
                reason=Reason(r["reason"]),
                http_status=r["http_status"],
                pattern=r["pattern"],
                sample_error=r["sample_error"],
                count=int(r["n"]),
                first_at=_to_s(r["first_us"]),
                last_at=_to_s(r["last_us"]),
            )
            for r in rows
        ]
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
        if not (math.isfinite(bucket_s) and bucket_s > 0) or not 1 <= buckets <= 1000:
            raise InvalidQuery("a chart needs 1 to 1000 buckets of a positive length")
        now = self._clock.time() if now is None else now
        bucket_us = max(1, _to_us(bucket_s))
        end_us = (_to_us(now) // bucket_us + 1) * bucket_us
        start_us = end_us - buckets * bucket_us
        per_pair: list[Row] = []
        per_bucket: dict[int, int] = {}
        if not where.matches_nothing:
            # Buckets before 1970 stay empty: Uint64 times start there.
            skipped = max(0, -(start_us // bucket_us))
            first_us = start_us + skipped * bucket_us
            per_pair, counted = await self._read(
                "summarise dead letters",
                self._yql.stats(where, _time_us(now - 3600.0), first_us, end_us, bucket_us),
            )
            per_bucket = {
                int(r["bucket"]) + skipped: int(r["n"]) for r in counted if r["bucket"] is not None
            }
        integrations: dict[str, list[Row]] = {}
        for pair in per_pair:
            integrations.setdefault(pair["integration"], []).append(pair)
        by_integration = [
            IntegrationStats(
                integration=name,
                total=sum(int(p["total"]) for p in rows),
                last_hour=sum(int(p["recent"]) for p in rows),
                by_reason={Reason(p["reason"]): int(p["total"]) for p in rows},
                oldest_at=_to_s(min(p["oldest"] for p in rows)),
                newest_at=_to_s(max(p["newest"] for p in rows)),
            )
            for name, rows in integrations.items()
        ]
        by_integration.sort(key=lambda s: (-s.last_hour, -s.total, s.integration))
        by_reason: dict[Reason, int] = {}
        for pair in per_pair:
            reason = Reason(pair["reason"])
            by_reason[reason] = by_reason.get(reason, 0) + int(pair["total"])
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

    async def select_ids(self, where: DeadLetterFilter, limit: int) -> Sequence[str]:
        """Ids of up to ``limit`` matching rows, newest first, for a bulk action."""
        if not 1 <= limit <= MAX_SELECT_IDS:
            raise InvalidQuery(f"a bulk action covers 1 to {MAX_SELECT_IDS} rows at a time")
        if where.matches_nothing:
            return []
        ids: list[str] = []
        after: tuple[int, int] | None = None
        while len(ids) < limit:
            size = min(SELECT_ROUND, limit - len(ids))
            (rows,) = await self._read(
                "select dead letter ids", self._yql.ids_page(where, after, size)
            )
            ids += [r["id"] for r in rows]
            if len(rows) < size:
                break
            after = (rows[-1]["dead_lettered_us"], rows[-1]["tiebreak"])
        return ids

    async def actions(
        self, page: PageRequest | None = None, *, integrations: frozenset[str] | None = None
    ) -> ActionPage:
        """The audit log, newest first; with ``integrations``, entries touching any of them."""
        page = page or PageRequest()
        before = _INT64_MAX
        if page.cursor is not None:
            (before,) = _int_key(page.cursor, _ACTIONS_CURSOR, 1)
        if integrations is not None and not integrations:
            return ActionPage([], None)
        (rows,) = await self._read(
            "read the audit log", self._yql.actions(before, page.limit + 1, integrations)
        )
        records = sorted(
            (
                ActionRecord(
                    seq=int(r["seq"]),
                    at=_to_s(r["at_us"]),
                    who=r["who"],
                    action=Action(r["act"]),
                    integrations=tuple(orjson.loads(r["integrations"])),
                    count=int(r["affected"]),
                    description=r["description"],
                )
                for r in rows
            ),
            key=lambda record: record.seq,
            reverse=True,
        )
        if len(records) <= page.limit:
            return ActionPage(records, None)
        records = records[: page.limit]
        return ActionPage(records, encode_cursor(_ACTIONS_CURSOR, (records[-1].seq,)))


def _paired_chunks(
    first: Sequence[str], second: Sequence[str], size: int
) -> list[tuple[Sequence[str], Sequence[str]]]:
    rounds = max(math.ceil(len(first) / size), math.ceil(len(second) / size), 1)
    return [
        (first[i * size : (i + 1) * size], second[i * size : (i + 1) * size]) for i in range(rounds)
    ]


def _int_key(cursor: str, kind: str, arity: int) -> tuple[int, ...]:
    # decode_cursor checked arity and types; the filter only narrows the type for mypy.
    return tuple(
        part for part in decode_cursor(cursor, kind, (int,) * arity) if isinstance(part, int)
    )


def _letters_key(cursor: str | None) -> tuple[int, int] | None:
    if cursor is None:
        return None
    at_us, tie = _int_key(cursor, _LETTERS_CURSOR, 2)
    return at_us, tie


async def open_ydb_dlq(
    config: YdbDlqConfig,
    *,
    driver: Driver | None = None,
    connection: YdbConnectionConfig | None = None,
    clock: Clock = SYSTEM_CLOCK,
    sessions: int = 10,
) -> YdbDeadLetterStore:
    """Opens (creating what is missing) the DLQ tables.

    ``driver``: a connected driver to share (the broker's); otherwise one is
    opened from ``config.connection`` or ``connection`` and stopped on close.
    ``sessions`` bounds the store's concurrent queries.
    """
    settings = config.connection or connection
    owned: Driver | None = None
    if driver is None:
        if settings is None:
            raise ValueError("a YDB DLQ needs a driver or a connection to open one")
        try:
            owned = driver = await open_driver(settings)
        except BrokerError as exc:
            raise DlqError(str(exc)) from exc
    store = YdbDeadLetterStore(
        QuerySessionPool(driver, size=sessions),
        directory=config.path,
        clock=clock,
        retention_s=config.retention or None,
        timeout_s=settings.request_timeout_s if settings is not None else 30.0,
        driver=owned,
    )
    try:
        await store.open()
    except BaseException:
        await store.close()
        raise
    return store
