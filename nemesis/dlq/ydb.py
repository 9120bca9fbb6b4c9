"""The ``ydb`` DLQ store: ``nemesis.dlq.core`` on YDB tables, with a TTL.

What a DLQ store does is the core's; this module holds the YDB side: the
tables, and every statement as YQL with typed, declared parameters (a
filter's conditions in the spelling of ``YqlDialect``, for ``nemesis.dlq.sql``).

Tables (under ``YdbDlqConfig.path``, relative to the database), each
declared once in ``TABLES``, from which the DDL is generated:

* ``letters``: one row per dead letter, keyed by its id; the core's columns
  plus ``tiebreak``, times in microseconds (``Uint64``). A TTL on
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

Rules of the server this follows (and ``tests/ydb_fake.py`` enforces):

* ``UPSERT``/``REPLACE``/``INSERT`` from ``AS_TABLE`` must carry every
  ``NOT NULL`` column, even for a row that exists ("Missing not null column
  in input"); changing some columns of existing rows is ``UPDATE ... ON``.
* A statement answers one result set per ``SELECT`` it runs, in order;
  ``_sets`` checks the count instead of unpacking blindly.
* A cell holds at most 16 MiB (the datashard's ``NLimits::MaxWriteValueSize``;
  BAD_REQUEST): ``nemesis.dlq.core`` stores a payload cut to that, as every
  store does. A statement's parameters travel in one gRPC message, which the
  SDK sends up to 64 MB (more is BAD_REQUEST): new rows are written in
  statements of at most ``STATEMENT_BYTES``, one row alone if it is larger.
* A commit may end undetermined (it may or may not have happened). Every
  write here is idempotent (see ``nemesis.dlq.core``), so transactions run
  with ``RetrySettings(idempotent=True)`` and the SDK retries them.

Read-modify-write (``put``, status changes, the audit log) runs in
serializable transactions through ``retry_tx_async``; plain reads run
through ``execute_with_retries``. Every call is bounded by ``timeout_s``.

Not run against a server on the machine this was written on: see
``nemesis/broker/ydb/README.md`` for what was tested and how to run the
contract suite against a real YDB.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import ydb
from ydb import convert
from ydb.aio.driver import Driver
from ydb.aio.query.pool import QuerySessionPool
from ydb.aio.query.transaction import QueryTxContext

from nemesis.backends.ydb import YdbConnectionConfig, YdbDlqConfig
from nemesis.broker.ydb.connection import open_driver
from nemesis.broker.ydb.errors import table_call
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.dlq import core
from nemesis.dlq.core import (
    FAILURE_COLUMNS,
    ID_CHUNK,
    RECENT_ACTIONS,
    SCHEMA_VERSION,
    Key,
    Row,
    StoreCore,
    check_retention,
    check_schema_version,
    chunks,
    fold_failures,
    same_action,
    signature_of,
)
from nemesis.dlq.port import DEFAULT_RETENTION_S, DeadLetter, DeadLetterFilter, PutResult
from nemesis.dlq.sql import NOT_TEXT, Bind, Dialect, Kind
from nemesis.errors import BrokerError, DlqError

T = TypeVar("T")
# The parameters' bytes of one statement writing new rows: under the SDK's 64 MB
# gRPC message (ydb/connection.py, _DEFAULT_MAX_GRPC_MESSAGE_SIZE) with room for one
# largest row (a 16 MiB payload) beside others.
STATEMENT_BYTES = 32 * 1024 * 1024

_INT64_MAX = 2**63 - 1

P = ydb.PrimitiveType
ColumnType = ydb.PrimitiveType | ydb.AbstractTypeBuilder
_UTF8 = P.Utf8
_OPT_UTF8 = ydb.OptionalType(P.Utf8)
_OPT_INT32 = ydb.OptionalType(P.Int32)
_OPT_UINT64 = ydb.OptionalType(P.Uint64)


# --- the tables: declared once; the DDL and every row type come from here ---------------------


@dataclass(frozen=True)
class Table:
    """A table's columns (an ``OptionalType`` is nullable, any other NOT NULL), key and indexes."""

    name: str
    columns: tuple[tuple[str, ColumnType], ...]
    primary_key: tuple[str, ...]
    indexes: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def types(self) -> dict[str, ColumnType]:
        return dict(self.columns)

    def row_type(self, names: Sequence[str] | None = None) -> ydb.StructType:
        """The ``AS_TABLE`` row type of ``names`` (all columns by default)."""
        types = self.types
        struct = ydb.StructType()
        for name in names if names is not None else types:
            struct.add_member(name, types[name])
        return struct

    def ddl(self, path: str) -> str:
        lines = [f"`{name}` {_ddl_type(column_type)}" for name, column_type in self.columns]
        lines.append(f"PRIMARY KEY ({_names(self.primary_key)})")
        lines += [f"INDEX {name} GLOBAL SYNC ON ({_names(on)})" for name, on in self.indexes]
        body = ",\n    ".join(lines)
        return f"CREATE TABLE IF NOT EXISTS {path} (\n    {body}\n)"


def _ddl_type(column_type: ColumnType) -> str:
    if isinstance(column_type, ydb.OptionalType):
        return str(column_type.item)
    return f"{column_type} NOT NULL"


def _names(names: Sequence[str]) -> str:
    return ", ".join(f"`{name}`" for name in names)


LETTERS = Table(
    "letters",
    (
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
    ),
    ("id",),
    (
        ("by_time", ("dead_lettered_us", "tiebreak")),
        ("by_integration", ("integration", "dead_lettered_us", "tiebreak")),
        ("by_signature", ("signature", "dead_lettered_us", "tiebreak")),
    ),
)
SIGNATURES = Table(
    "signatures",
    (
        ("signature", _UTF8),
        ("integration", _UTF8),
        ("reason", _UTF8),
        ("http_status", _OPT_INT32),
        ("pattern", _UTF8),
        ("sample_error", _UTF8),
    ),
    ("signature",),
)
ACTIONS = Table(
    "actions",
    (
        ("seq", P.Int64),
        ("at_us", P.Uint64),
        ("who", _UTF8),
        ("act", _UTF8),  # "action" is a YQL keyword
        ("integrations", _UTF8),
        ("affected", P.Int64),  # "count" is a function
        ("description", _UTF8),
    ),
    ("seq",),
)
ACTION_INTEGRATIONS = Table(
    "action_integrations",
    (("integration", _UTF8), ("action_seq", P.Int64)),
    ("integration", "action_seq"),
)
META = Table("meta", (("key", _UTF8), ("value", _UTF8)), ("key",))
TABLES = (META, LETTERS, SIGNATURES, ACTIONS, ACTION_INTEGRATIONS)
LETTER_COLUMNS = LETTERS.columns

_AUDIT_NAMES = {"act": "action", "affected": "count"}  # the audit table's names -> the core's
_ID_ROW = LETTERS.row_type(["id"])
_SIGNATURE_KEY_ROW = SIGNATURES.row_type(["signature"])
# Everything a row of a list shows; the payload is selected apart (whole or cut).
_ROW_COLUMNS = ", ".join(name for name, _ in LETTER_COLUMNS if name != "payload")
_ORDER = "ORDER BY dead_lettered_us DESC, tiebreak DESC"


# --- YQL: every statement and its typed, declared parameters -------------------------------


@dataclass
class Query:
    """A YQL text and its parameters; ``text`` starts with their DECLAREs.

    ``selects`` is how many result sets the statement answers with.
    """

    body: str
    params: dict[str, ydb.TypedValue] = field(default_factory=dict)
    selects: int = 0

    @property
    def text(self) -> str:
        declares = "".join(
            f"DECLARE {name} AS {value.value_type};\n" for name, value in self.params.items()
        )
        return declares + self.body


class YqlDialect(Dialect):
    """YQL's spelling: typed, declared ``$pN`` parameters, ``IN`` a list, ``String::`` functions."""

    times = core.UNSIGNED  # Uint64 times start in 1970 (the TTL needs an unsigned column)
    tiebreak = "tiebreak"

    def contains(self, bind: Bind, in_error: str, in_payload: bytes) -> str:
        # A plain substring test: % _ \\ and quotes in the text mean themselves.
        error = bind(in_error.encode(), Kind.BYTES)
        # Named parameters: one serves both places when the two needles agree (no NUL).
        payload = error if in_payload == in_error.encode() else bind(in_payload, Kind.BYTES)
        return (
            f"(String::Contains(String::AsciiToLower(error), {error})"
            f" OR String::Contains(String::AsciiToLower(payload), {payload}))"
        )


YQL = YqlDialect()
_TYPES: dict[Kind, ColumnType] = {
    Kind.TEXT: _UTF8,
    Kind.TEXTS: ydb.ListType(_UTF8),
    Kind.HTTP_STATUS: P.Int32,
    Kind.TIME: P.Uint64,
    Kind.TIEBREAK: P.Int64,
    Kind.BYTES: P.String,
}


class _Params:
    """Collects typed parameters and hands out their names."""

    def __init__(self) -> None:
        self.values: dict[str, ydb.TypedValue] = {}

    def __call__(self, value: Any, kind: Kind) -> str:
        """A filter's value, typed as its kind is in YQL."""
        return self.add(value, _TYPES[kind])

    def add(self, value: object, value_type: ColumnType) -> str:
        name = f"$p{len(self.values)}"
        self.values[name] = ydb.TypedValue(value, value_type)
        return name

    def ids(self, values: Sequence[str]) -> str:
        return self.add(list(values), ydb.ListType(_UTF8))

    def rows(self, rows: Sequence[Mapping[str, object]], row_type: ydb.StructType) -> str:
        """A ``List<Struct<...>>`` parameter for ``AS_TABLE``: a batch in one statement."""
        return self.add([dict(r) for r in rows], ydb.ListType(row_type))

    def query(self, body: str, selects: int = 0) -> Query:
        return Query(body, dict(self.values), selects)


class Yql:
    """The YQL of one store: table paths and every statement it runs."""

    def __init__(self, directory: str) -> None:
        self.directory = directory.strip("/")

    def table(self, name: str) -> str:
        return f"`{self.directory}/{name}`"

    # --- schema ---------------------------------------------------------------

    def create_tables(self) -> list[str]:
        """One DDL statement each (YDB runs schema changes outside transactions)."""
        return [table.ddl(self.table(table.name)) for table in TABLES]

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
        return Query(
            f"SELECT `value` FROM {self.table('meta')} WHERE `key` = 'schema_version';", selects=1
        )

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
            f"SELECT {', '.join(FAILURE_COLUMNS)} FROM {self.table('letters')}"
            f" WHERE id IN {wanted};\n"
            f"SELECT signature FROM {self.table('signatures')} WHERE signature IN {known};",
            selects=2,
        )

    def put_rows(
        self, inserts: Sequence[Row], updates: Sequence[Row], signatures: Sequence[Row]
    ) -> Query | None:
        """Whole new rows and signatures (UPSERT), the failure columns of existing rows (UPDATE)."""
        params = _Params()
        statements = []
        if signatures:
            rows = params.rows(signatures, SIGNATURES.row_type())
            statements.append(
                f"UPSERT INTO {self.table('signatures')} SELECT * FROM AS_TABLE({rows});"
            )
        if inserts:
            rows = params.rows(inserts, LETTERS.row_type())
            statements.append(
                f"UPSERT INTO {self.table('letters')} SELECT * FROM AS_TABLE({rows});"
            )
        if updates:
            rows = params.rows(updates, LETTERS.row_type(FAILURE_COLUMNS))
            statements.append(f"UPDATE {self.table('letters')} ON SELECT * FROM AS_TABLE({rows});")
        return params.query("\n".join(statements)) if statements else None

    def mark_state(self, ids: Sequence[str], integrations: frozenset[str] | None) -> Query:
        """The rows among ``ids`` that a status change may concern (in scope), as they are."""
        params = _Params()
        conditions = [f"id IN {params.ids(ids)}"]
        if integrations is not None:
            conditions.append(YQL.one_of(params, "integration", sorted(integrations)))
        return params.query(
            f"SELECT {', '.join(core.ACTION_COLUMNS)} FROM {self.table('letters')}"
            f" WHERE {' AND '.join(conditions)};",
            selects=1,
        )

    def mark(self, changes: Sequence[Row]) -> Query:
        params = _Params()
        rows = params.rows(changes, LETTERS.row_type(core.ACTION_COLUMNS))
        return params.query(f"UPDATE {self.table('letters')} ON SELECT * FROM AS_TABLE({rows});")

    def expired(self, cutoff_us: int, limit: int) -> Query:
        params = _Params()
        cutoff, batch = params.add(cutoff_us, P.Uint64), params.add(limit, P.Uint64)
        return params.query(
            f"SELECT id FROM {self.table('letters')} VIEW by_time"
            f" WHERE dead_lettered_us < {cutoff} ORDER BY dead_lettered_us LIMIT {batch};",
            selects=1,
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
            " ON s.signature = l.signature;",
            selects=1,
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
            f" WHERE id IN {params.ids(ids)};",
            selects=1,
        )

    def page(
        self,
        where: DeadLetterFilter,
        after: Key | None,
        limit: int,
        preview_bytes: int,
        bound: Key | None,
    ) -> Query:
        """Up to ``limit`` rows after ``after``, newest first, not past ``bound``."""
        params = _Params()
        conditions = YQL.conditions(where, params) + YQL.after(params, after)
        if bound is not None:
            conditions += YQL.not_after(params, bound)
        preview = params.add(preview_bytes, P.Uint32)
        count = params.add(limit, P.Uint64)
        return params.query(
            f"SELECT {_ROW_COLUMNS}, Substring(payload, 0, {preview}) AS payload"
            f" FROM {self.table('letters')}{_view(where, ordered=True)}"
            f" WHERE {YQL.joined(conditions)} {_ORDER} LIMIT {count};",
            selects=1,
        )

    def scan_bound(self, where: DeadLetterFilter, after: Key | None) -> Query:
        """The key of the ``core.TEXT_SCAN_ROWS``-th candidate of a text search, text aside."""
        params = _Params()
        conditions = YQL.conditions(where, params, NOT_TEXT) + YQL.after(params, after)
        offset = params.add(core.TEXT_SCAN_ROWS - 1, P.Uint64)
        return params.query(
            f"SELECT dead_lettered_us, tiebreak FROM {self.table('letters')}"
            f"{_view(where, ordered=True)}"
            f" WHERE {YQL.joined(conditions)} {_ORDER} LIMIT 1 OFFSET {offset};",
            selects=1,
        )

    def ids_page(self, where: DeadLetterFilter, after: Key | None, limit: int) -> Query:
        params = _Params()
        conditions = YQL.conditions(where, params) + YQL.after(params, after)
        count = params.add(limit, P.Uint64)
        return params.query(
            f"SELECT id, dead_lettered_us, tiebreak FROM {self.table('letters')}"
            f"{_view(where, ordered=True)}"
            f" WHERE {YQL.joined(conditions)} {_ORDER} LIMIT {count};",
            selects=1,
        )

    def count(self, where: DeadLetterFilter, limit: int | None) -> Query:
        params = _Params()
        conditions = YQL.joined(YQL.conditions(where, params))
        source = f"{self.table('letters')}{_view(where)} WHERE {conditions}"
        if limit is None:
            return params.query(f"SELECT COUNT(*) AS n FROM {source};", selects=1)
        bound = params.add(limit, P.Uint64)
        return params.query(
            f"SELECT COUNT(*) AS n FROM (SELECT id FROM {source} LIMIT {bound});", selects=1
        )

    def groups(self, where: DeadLetterFilter, limit: int) -> Query:
        params = _Params()
        conditions = YQL.joined(YQL.conditions(where, params))
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
            " ON s.signature = t.signature;",
            selects=1,
        )

    def stats(self, where: DeadLetterFilter, window: core.Window) -> Query:
        """Two result sets: counts per (integration, reason), then counts per time bucket."""
        params = _Params()
        conditions = YQL.joined(YQL.conditions(where, params))
        recent = params.add(window.hour_ago_us, P.Uint64)
        start, end = params.add(window.first_us, P.Uint64), params.add(window.end_us, P.Uint64)
        step = params.add(window.bucket_us, P.Uint64)
        letters = f"{self.table('letters')}{_view(where)}"
        in_window = f"{self.table('letters')}{_view(where, ranged=True)}"
        return params.query(
            "SELECT integration, reason, COUNT(*) AS total,"
            f" COUNT_IF(dead_lettered_us >= {recent}) AS recent,"
            " MIN(dead_lettered_us) AS oldest, MAX(dead_lettered_us) AS newest"
            f" FROM {letters} WHERE {conditions} GROUP BY integration, reason;\n"
            f"SELECT bucket, COUNT(*) AS n FROM {in_window} WHERE {conditions}"
            f" AND dead_lettered_us >= {start} AND dead_lettered_us < {end}"
            f" GROUP BY (dead_lettered_us - {start}) / {step} AS bucket;",
            selects=2,
        )

    # --- the audit log -------------------------------------------------------------

    def recent_actions(self, limit: int) -> Query:
        """The newest entries: the next seq follows the first, a retried write finds itself."""
        params = _Params()
        count = params.add(limit, P.Uint64)
        return params.query(
            f"SELECT {_AUDIT_COLUMNS} FROM {self.table('actions')}"
            f" ORDER BY seq DESC LIMIT {count};",
            selects=1,
        )

    def record_action(self, action: Row, links: Sequence[Row]) -> Query:
        params = _Params()
        entry = params.rows([action], ACTIONS.row_type())
        statements = [f"UPSERT INTO {self.table('actions')} SELECT * FROM AS_TABLE({entry});"]
        if links:
            rows = params.rows(links, ACTION_INTEGRATIONS.row_type())
            statements.append(
                f"UPSERT INTO {self.table('action_integrations')} SELECT * FROM AS_TABLE({rows});"
            )
        return params.query("\n".join(statements))

    def actions(self, before_seq: int, limit: int, integrations: frozenset[str] | None) -> Query:
        params = _Params()
        before, count = params.add(before_seq, P.Int64), params.add(limit, P.Uint64)
        if integrations is None:
            return params.query(
                f"SELECT {_AUDIT_COLUMNS} FROM {self.table('actions')}"
                f" WHERE seq < {before} ORDER BY seq DESC LIMIT {count};",
                selects=1,
            )
        scope = YQL.one_of(params, "integration", sorted(integrations))
        selected = ", ".join(f"a.{c} AS {c}" for c, _ in ACTIONS.columns)
        return params.query(
            "$seqs = SELECT DISTINCT action_seq AS seq"
            f" FROM {self.table('action_integrations')}"
            f" WHERE {scope} AND action_seq < {before};\n"
            f"$top = SELECT seq FROM $seqs ORDER BY seq DESC LIMIT {count};\n"
            f"SELECT {selected} FROM $top AS t"
            f" INNER JOIN {self.table('actions')} AS a ON a.seq = t.seq;",
            selects=1,
        )


_AUDIT_COLUMNS = ", ".join(name for name, _ in ACTIONS.columns)


def _view(where: DeadLetterFilter, *, ordered: bool = False, ranged: bool = False) -> str:
    """The secondary index a read names, or none: the main table's own scan.

    YDB reads a secondary index only when a statement names it (``VIEW``),
    and then looks each row it finds up in the main table. That pays when
    the filter constrains the index's leading column (a signature, the
    integrations, a time range: ``ranged`` when the statement adds one), or
    when an ``ordered`` read with a LIMIT takes the head of ``by_time``;
    for a count, groups or statistics of an unconstrained filter it is the
    whole index plus a lookup per row, where a scan of the table is one pass.
    """
    if where.signature is not None:
        return " VIEW by_signature"
    if where.integrations is not None:
        return " VIEW by_integration"
    if ordered or ranged or where.since is not None or where.until is not None:
        return " VIEW by_time"
    return ""


def tiebreak(letter_id: str) -> int:
    """The keyset tie-breaker of a row: the first 60 bits of its (hex) id."""
    return int(letter_id[:15], 16)


# --- execution ------------------------------------------------------------------------

_aggregate = cast(
    Callable[[AsyncIterator[Any]], Awaitable[list[Any]]],
    convert.aggregate_result_sets_by_index_async,
)


def _sets(found: Sequence[Any], query: Query, what: str) -> list[list[Row]]:
    """The rows of each result set, after checking there is one per SELECT of ``query``."""
    if len(found) != query.selects:
        raise DlqError(
            f"{what}: the server answered {len(found)} result sets"
            f" to a statement with {query.selects} SELECTs"
        )
    return [list(result_set.rows) for result_set in found]


async def _execute(tx: QueryTxContext, query: Query, what: str) -> list[list[Row]]:
    """Runs one statement in ``tx``; the caller's ``retry_tx_async`` commits it.

    Never ``commit_tx=True``: that would skip the SDK's commit hooks (a
    transaction that also moves topic offsets relies on them).
    """
    return _sets(await _aggregate(await tx.execute(query.text, query.params)), query, what)


def _audit_row(row: Row) -> dict[str, Any]:
    """An audit table row under the core's names."""
    return {_AUDIT_NAMES.get(name, name): value for name, value in row.items()}


# --- the store --------------------------------------------------------------------------


class YdbDeadLetterStore(StoreCore):
    """The DLQ in YDB tables; see the module docstring."""

    tiebreak_column = YQL.tiebreak
    times = YQL.times

    def __init__(
        self,
        pool: QuerySessionPool,
        *,
        directory: str,
        clock: Clock = SYSTEM_CLOCK,
        retention_s: float | None = DEFAULT_RETENTION_S,
        timeout_s: float = 30.0,
        driver: Driver | None = None,
        retry_settings: ydb.RetrySettings | None = None,
    ) -> None:
        super().__init__(clock=clock, retention_s=retention_s)
        self._pool = pool
        self._yql = Yql(directory)
        self._timeout_s = timeout_s
        self._driver = driver  # stopped on close when the store opened it
        # Every write is idempotent: a commit that ended undetermined is retried.
        self._retry = retry_settings or ydb.RetrySettings(idempotent=True)
        self._closed = False

    @property
    def directory(self) -> str:
        return self._yql.directory

    # --- plumbing -----------------------------------------------------------

    async def _read(self, what: str, query: Query) -> list[list[Row]]:
        self._check_open()
        found = await table_call(
            what, self._pool.execute_with_retries(query.text, query.params), self._timeout_s
        )
        return _sets(found, query, what)

    async def _read_one(self, what: str, query: Query) -> list[Row]:
        (rows,) = await self._read(what, query)  # _sets checked that there is one
        return rows

    async def _transaction(self, what: str, work: Callable[[QueryTxContext], Awaitable[T]]) -> T:
        self._check_open()
        outcome = await table_call(
            what, self._pool.retry_tx_async(work, retry_settings=self._retry), self._timeout_s
        )
        return cast(T, outcome)

    async def _run(self, what: str, query: Query) -> None:
        """One statement in a transaction of its own."""

        async def work(tx: QueryTxContext) -> None:
            await _execute(tx, query, what)

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
        rows = await self._read_one("read the DLQ schema version", self._yql.schema_version())
        check_schema_version(rows[0]["value"] if rows else None, f"YDB {self.directory}")
        await self._write_and_read_version(int(rows[0]["value"]) if rows else SCHEMA_VERSION)

    async def _write_and_read_version(self, version: int) -> None:
        """Writes the schema version (as it is, or the first) and reads it back in one
        transaction.

        The store's transactions read what they wrote (``put`` writes the
        letters table twice, a status change reads before and after): a server
        without immediate effects refuses that, and is refused here, at the
        start, with ``IMMEDIATE_EFFECTS_NEEDED`` rather than at the first put.
        """
        what = "write the DLQ schema version"

        async def work(tx: QueryTxContext) -> None:
            await _execute(tx, self._yql.write_schema_version(version), what)
            (rows,) = await _execute(tx, self._yql.schema_version(), what)
            if [r["value"] for r in rows] != [str(version)]:
                raise DlqError(f"{what}: read back {[r['value'] for r in rows]}")

        await self._transaction(what, work)

    async def close(self) -> None:
        """Releases the sessions (and the driver, if the store opened it)."""
        if self._closed:
            return
        self._closed = True
        stop = cast(Callable[[], Awaitable[None]], self._pool.stop)  # untyped in the SDK
        await stop()
        if self._driver is not None:
            await self._driver.stop(timeout=1)

    async def __aenter__(self) -> YdbDeadLetterStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- the primitives of ``StoreCore``: writes ---------------------------------------

    async def _put(self, letters: Sequence[DeadLetter], now_us: int) -> PutResult:
        what = f"put {len(letters)} dead letters"
        ids = sorted({letter.id for letter in letters})
        signatures = sorted({signature_of(letter) for letter in letters})

        async def work(tx: QueryTxContext) -> PutResult:
            existing: dict[str, Row] = {}
            known: set[str] = set()
            for id_chunk, signature_chunk in _paired_chunks(ids, signatures, ID_CHUNK):
                rows, found = await _execute(
                    tx, self._yql.put_state(id_chunk, signature_chunk), what
                )
                existing.update((r["id"], dict(r)) for r in rows)
                known.update(r["signature"] for r in found)
            folded = fold_failures(letters, existing, known, now_us, self.times)
            inserts = [{**row, "tiebreak": tiebreak(row["id"])} for row in folded.inserts]
            insert_chunks = _sized_chunks(inserts, ID_CHUNK, STATEMENT_BYTES)
            rest = max(len(folded.updates), len(folded.signatures))
            for round_ in range(max(len(insert_chunks), math.ceil(rest / ID_CHUNK))):
                start, end = round_ * ID_CHUNK, (round_ + 1) * ID_CHUNK
                query = self._yql.put_rows(
                    insert_chunks[round_] if round_ < len(insert_chunks) else [],
                    folded.updates[start:end],
                    folded.signatures[start:end],
                )
                if query is not None:
                    await _execute(tx, query, what)
            return folded.result

        return await self._transaction(what, work)

    async def _mark(self, letter_ids: Sequence[str], mark: core.Mark) -> int:
        what = f"mark {len(letter_ids)} rows {mark.status.value}"

        async def work(tx: QueryTxContext) -> int:
            (rows,) = await _execute(tx, self._yql.mark_state(letter_ids, mark.integrations), what)
            changes = [
                {
                    "id": r["id"],
                    "status": mark.status.value,
                    "requeue_count": r["requeue_count"] + mark.requeued,
                    "last_action": mark.action.value,
                    "last_action_by": mark.by,
                    "last_action_us": mark.at_us,
                }
                for r in rows
                if r["status"] == "dead"
            ]
            # Rows this very change marked already: a retry after an undetermined commit.
            done = sum(
                1
                for r in rows
                if (r["status"], r["last_action"], r["last_action_by"], r["last_action_us"])
                == (mark.status.value, mark.action.value, mark.by, mark.at_us)
            )
            if changes:
                await _execute(tx, self._yql.mark(changes), what)
            return len(changes) + done

        return await self._transaction(what, work)

    async def _append_action(self, entry: Row) -> int:
        what = "record an action"

        async def work(tx: QueryTxContext) -> int:
            (found,) = await _execute(tx, self._yql.recent_actions(RECENT_ACTIONS), what)
            recent = [_audit_row(r) for r in found]
            replayed = same_action(entry, recent)
            if replayed is not None:
                return replayed
            seq = max((int(r["seq"]) for r in recent), default=0) + 1
            row = {
                "seq": seq,
                "at_us": entry["at_us"],
                "who": entry["who"],
                "act": entry["action"],
                "integrations": entry["integrations"],
                "affected": entry["count"],
                "description": entry["description"],
            }
            names = sorted(core.action_record({**entry, "seq": seq}).integrations)
            links = [{"integration": name, "action_seq": seq} for name in names]
            await _execute(tx, self._yql.record_action(row, links), what)
            return seq

        return await self._transaction(what, work)

    async def _delete_expired(self, cutoff_us: int, limit: int) -> int:
        what = "delete expired dead letters"

        async def work(tx: QueryTxContext) -> int:
            (rows,) = await _execute(tx, self._yql.expired(cutoff_us, limit), what)
            if rows:
                await _execute(tx, self._yql.delete_letters([r["id"] for r in rows]), what)
            return len(rows)

        return await self._transaction(what, work)

    async def _prune_signatures(self) -> None:
        unused = await self._read_one("find unused signatures", self._yql.unused_signatures())
        for chunk in chunks([r["signature"] for r in unused], ID_CHUNK):
            await self._run("delete unused signatures", self._yql.delete_signatures(chunk))

    # --- the primitives of ``StoreCore``: reads ------------------------------------------

    async def _rows(self, letter_ids: Sequence[str]) -> Sequence[Row]:
        return await self._read_one("get dead letters", self._yql.get(letter_ids))

    async def _list(
        self, where: DeadLetterFilter, after: Key | None, limit: int, preview_bytes: int
    ) -> tuple[Sequence[Row], Key | None]:
        bound: Key | None = None
        if where.text:
            found = await self._read_one("bound a text search", self._yql.scan_bound(where, after))
            if found:
                bound = (found[0]["dead_lettered_us"], found[0]["tiebreak"])
        page = self._yql.page(where, after, limit, preview_bytes, bound)
        return await self._read_one("list dead letters", page), bound

    async def _ids(
        self, where: DeadLetterFilter, after: Key | None, limit: int
    ) -> tuple[Sequence[str], Key | None]:
        query = self._yql.ids_page(where, after, limit)
        rows = await self._read_one("select dead letter ids", query)
        last = (rows[-1]["dead_lettered_us"], rows[-1]["tiebreak"]) if rows else None
        return [r["id"] for r in rows], last

    async def _count(self, where: DeadLetterFilter, limit: int | None) -> int:
        rows = await self._read_one("count dead letters", self._yql.count(where, limit))
        return int(rows[0]["n"]) if rows else 0

    async def _groups(self, where: DeadLetterFilter, limit: int) -> Sequence[Row]:
        return await self._read_one("group dead letters", self._yql.groups(where, limit))

    async def _stats(
        self, where: DeadLetterFilter, window: core.Window
    ) -> tuple[Sequence[Row], Mapping[int, int]]:
        if window.empty:  # all before 1970: nothing a Uint64 time can hold
            return [], {}
        pairs, counted = await self._read("summarise dead letters", self._yql.stats(where, window))
        return pairs, {int(r["bucket"]): int(r["n"]) for r in counted if r["bucket"] is not None}

    async def _actions(
        self, before: int | None, limit: int, integrations: frozenset[str] | None
    ) -> Sequence[Row]:
        query = self._yql.actions(_INT64_MAX if before is None else before, limit, integrations)
        return [_audit_row(r) for r in await self._read_one("read the audit log", query)]


def _row_bytes(row: Row) -> int:
    """About what a row weighs in a statement's parameters: its text and bytes."""
    return 256 + sum(len(value) for value in row.values() if isinstance(value, str | bytes))


def _sized_chunks(rows: Sequence[Row], count: int, size: int) -> list[Sequence[Row]]:
    """``rows`` in runs of at most ``count`` rows and ``size`` bytes (a larger row alone)."""
    found: list[Sequence[Row]] = []
    run: list[Row] = []
    weight = 0
    for row in rows:
        row_bytes = _row_bytes(row)
        if run and (len(run) == count or weight + row_bytes > size):
            found.append(run)
            run, weight = [], 0
        run.append(row)
        weight += row_bytes
    if run:
        found.append(run)
    return found


def _paired_chunks(
    first: Sequence[str], second: Sequence[str], size: int
) -> list[tuple[Sequence[str], Sequence[str]]]:
    rounds = max(math.ceil(len(first) / size), math.ceil(len(second) / size), 1)
    return [
        (first[i * size : (i + 1) * size], second[i * size : (i + 1) * size]) for i in range(rounds)
    ]


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
    retention_s = config.retention or None
    check_retention(retention_s)
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
        retention_s=retention_s,
        timeout_s=settings.request_timeout_s if settings is not None else 30.0,
        driver=owned,
    )
    try:
        await store.open()
    except BaseException:
        await store.close()
        raise
    return store
