"""The ``postgres`` DLQ store: ``nemesis.dlq.core`` on PostgreSQL tables (asyncpg).

What a DLQ store does is the core's; this module holds the PostgreSQL
side: the DDL and every statement. Replicas on any number of hosts share
one database, so everything here is safe to run from several processes at
once:

* ``put`` locks the rows it changes (``FOR UPDATE``, in id order, so two
  puts cannot deadlock) before folding failures into them; two replicas
  inserting the same new row meet at the id's unique index, and the loser
  runs again, now folding its failure into the winner's row.
* A status change is one ``UPDATE ... WHERE status = 'dead'``: of two
  replicas requeueing a row, one changes it.
* Deleting unused signatures takes an advisory lock that puts take shared,
  so a put never links a row to a signature being deleted.
* Retention deletes in batches with ``SKIP LOCKED``: replicas sharing the
  chore do not wait for each other.

Tables (in ``schema_name``, each name after ``table_prefix``): ``letters``
(the core's columns; ``seq``, an identity, is the keyset's tie-breaker),
``signatures``, ``actions`` with ``action_integrations`` (the audit log and
its index by integration), and ``meta`` (the schema version). Times are
``bigint`` microseconds (signed: times before 1970 too). ``nemesis init``
and every open create what is missing.

Filters become conditions as in every store (``nemesis.dlq.sql``); this
module spells them (``PostgresDialect``). Text search: ``lower()`` under the
C collation folds ASCII letters only. The payload (``bytea``, any bytes, not
always UTF-8) is compared as ``encode(payload, 'escape')``, where each byte
is itself or one escape token, against a pattern that matches only from a
token's boundary (see ``_escaped_pattern``). A search examines at most
``TEXT_SCAN_ROWS`` rows per page, as the core asks.

An audit entry equal to one of the newest (``same_action``) is a write
retried after its commit went unanswered, and is not appended again.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import asyncpg

from nemesis.backends.postgres import PostgresDlqConfig
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.dlq import core
from nemesis.dlq.core import (
    AUDIT_COLUMNS,
    FAILURE_COLUMNS,
    ID_CHUNK,
    LETTER_COLUMNS,
    RECENT_ACTIONS,
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
    no_nul,
    same_action,
)
from nemesis.dlq.port import DEFAULT_RETENTION_S, DeadLetter, DeadLetterFilter, PutResult
from nemesis.dlq.sql import NOT_TEXT, Bind, Dialect, Kind
from nemesis.errors import DlqError, DlqTimeout
from nemesis.postgres import Translated, close_pool, describe, open_pool

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

T = TypeVar("T")
Conn: TypeAlias = "PoolConnectionProxy[asyncpg.Record]"  # a connection lent by the pool

# A put that lost a race for a new row's id runs again this many times at most.
PUT_ATTEMPTS = 5
CLOSE_TIMEOUT_S = 10.0  # for calls under way to finish before their connections are cut


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


class Sql:
    """The statements of one store: its table names and every query."""

    def __init__(self, schema: str, prefix: str) -> None:
        self.schema = schema
        self.prefix = prefix
        self.letters = self.table("letters")
        self.signatures = self.table("signatures")
        self.actions = self.table("actions")
        self.action_integrations = self.table("action_integrations")
        self.meta = self.table("meta")
        # An advisory lock of this store's tables: puts take it shared; pruning
        # signatures and creating the tables take it alone (see the module docstring).
        self.lock = zlib.crc32(f"{schema}.{prefix}".encode()) - 2**31

    def table(self, name: str) -> str:
        return f"{_quoted(self.schema)}.{_quoted(self.prefix + name)}"

    def index(self, name: str) -> str:
        return _quoted(f"{self.prefix}{name}")

    def schema_ddl(self) -> list[str]:
        statements = (
            []
            if self.schema == "public"
            else [f"CREATE SCHEMA IF NOT EXISTS {_quoted(self.schema)}"]
        )
        letters = self.letters
        return [
            *statements,
            f"CREATE TABLE IF NOT EXISTS {self.meta} (key text PRIMARY KEY, value text NOT NULL)",
            f"""CREATE TABLE IF NOT EXISTS {letters} (
                seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                id text NOT NULL UNIQUE,
                integration text NOT NULL,
                status text NOT NULL,
                reason text NOT NULL,
                http_status integer,
                signature text NOT NULL,
                dead_lettered_us bigint NOT NULL,
                first_failure_us bigint NOT NULL,
                attempts integer NOT NULL,
                requeue_count integer NOT NULL DEFAULT 0,
                last_action text,
                last_action_by text,
                last_action_us bigint,
                event_id text NOT NULL,
                source_topic text NOT NULL,
                source_partition integer NOT NULL,
                source_offset bigint NOT NULL,
                msg_key text,
                stage text,
                payload_size bigint NOT NULL,
                error text NOT NULL,
                history text,
                metadata text NOT NULL,
                payload bytea NOT NULL
            )""",
            # Each list walks one of these backwards: (its equality columns, time, seq).
            f"CREATE INDEX IF NOT EXISTS {self.index('letters_by_time')}"
            f" ON {letters} (dead_lettered_us, seq)",
            f"CREATE INDEX IF NOT EXISTS {self.index('letters_by_integration')}"
            f" ON {letters} (integration, status, dead_lettered_us, seq)",
            f"CREATE INDEX IF NOT EXISTS {self.index('letters_by_signature')}"
            f" ON {letters} (signature, status, dead_lettered_us, seq)",
            f"CREATE INDEX IF NOT EXISTS {self.index('letters_by_status')}"
            f" ON {letters} (status, dead_lettered_us, seq)",
            f"""CREATE TABLE IF NOT EXISTS {self.signatures} (
                signature text PRIMARY KEY,
                integration text NOT NULL,
                reason text NOT NULL,
                http_status integer,
                pattern text NOT NULL,
                sample_error text NOT NULL
            )""",
            f"""CREATE TABLE IF NOT EXISTS {self.actions} (
                seq bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                at_us bigint NOT NULL,
                who text NOT NULL,
                action text NOT NULL,
                integrations text NOT NULL,
                count bigint NOT NULL,
                description text NOT NULL
            )""",
            f"""CREATE TABLE IF NOT EXISTS {self.action_integrations} (
                integration text NOT NULL,
                action_seq bigint NOT NULL,
                PRIMARY KEY (integration, action_seq)
            )""",
        ]


class PostgresDialect(Dialect):
    """PostgreSQL's spelling: ``$n`` parameters cast to their column's type, arrays, row values."""

    times = core.SIGNED
    tiebreak = "seq"
    row_values = True  # (dead_lettered_us, seq) < ($1, $2) walks the index from there

    def one_of(self, bind: Bind, column: str, values: Sequence[str]) -> str:
        return f"{column} = ANY({bind(list(values), Kind.TEXTS)})"

    def contains(self, bind: Bind, in_error: str, in_payload: bytes) -> str:
        # lower() under the C collation folds ASCII letters only, as every store does
        # (and, unlike translate(), costs about what reading the value does).
        error = bind(in_error, Kind.TEXT)
        pattern = bind(_escaped_pattern(in_payload), Kind.TEXT)
        return (
            f'(strpos(lower(error COLLATE "C"), {error}) > 0'
            f""" OR lower(encode(payload, 'escape') COLLATE "C") ~ {pattern})"""
        )


POSTGRES = PostgresDialect()
_CASTS = {
    Kind.TEXTS: "::text[]",
    Kind.HTTP_STATUS: "::integer",
    Kind.TIME: "::bigint",
    Kind.TIEBREAK: "::bigint",
}


class _Params:
    """Positional parameters ($1, $2, ...) collected as a statement is built."""

    def __init__(self) -> None:
        self.values: list[Any] = []

    def __call__(self, value: Any, kind: Kind | None = None) -> str:
        """The next parameter, cast to the type of a ``kind`` that needs one."""
        self.values.append(_safe(value))
        return f"${len(self.values)}{'' if kind is None else _CASTS.get(kind, '')}"


def _safe(value: Any) -> Any:
    """A caller's text as a parameter: a NUL (which no stored text holds) cannot be sent."""
    if isinstance(value, str):
        return no_nul(value)
    if isinstance(value, list):
        return [_safe(item) for item in value]
    return value


def _escaped_pattern(needle: bytes) -> str:
    """A regular expression finding ``needle`` in ``encode(payload, 'escape')``.

    That encoding writes a NUL or a byte from 0x80 as ``\\nnn`` (octal) and a
    backslash as ``\\\\``; every other byte is itself. The needle is encoded
    the same way, and must start where a token does: after whole tokens
    from the start, so "30" never matches inside the ``\\301`` of one byte.
    """
    escaped = "".join(
        "\\\\" if byte == 0x5C else f"\\{byte:03o}" if byte == 0 or byte >= 0x80 else chr(byte)
        for byte in needle
    )
    literal = re.sub(r"([^A-Za-z0-9])", r"\\\1", escaped)
    return r"^(?:[^\\]|\\\\|\\[0-7]{3})*" + literal


_ORDER = "ORDER BY dead_lettered_us DESC, seq DESC"
_ROW_COLUMNS = ", ".join(("seq", *(c for c in LETTER_COLUMNS if c != "payload")))
_AUDIT_ENTRY = AUDIT_COLUMNS[1:]  # the seq is the table's


def _dicts(records: Sequence[asyncpg.Record]) -> list[dict[str, Any]]:
    return [dict(r) for r in records]


# --- the store --------------------------------------------------------------------------


class PostgresDeadLetterStore(StoreCore):
    """The DLQ in PostgreSQL tables; see the module docstring."""

    tiebreak_column = POSTGRES.tiebreak  # its times are the core's: signed

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        sql: Sql,
        translated: Translated,
        clock: Clock = SYSTEM_CLOCK,
        retention_s: float | None = DEFAULT_RETENTION_S,
    ) -> None:
        super().__init__(clock=clock, retention_s=retention_s)
        self._pool = pool
        self._sql = sql
        self._translated = translated
        self._closed = False

    # --- plumbing -----------------------------------------------------------------

    async def _call(self, what: str, work: Callable[[Conn], Awaitable[T]]) -> T:
        """``work`` on a connection of the pool, its errors translated."""
        if self._closed:
            raise DlqError(f"{self._translated.where}: the store is closed")

        async def run() -> T:
            async with self._pool.acquire() as conn:
                return await work(conn)

        return await self._translated(what, run())

    async def _fetch(self, what: str, query: str, *args: Any) -> list[dict[str, Any]]:
        async def work(conn: Conn) -> list[dict[str, Any]]:
            return _dicts(await conn.fetch(query, *args))

        return await self._call(what, work)

    # --- lifecycle ----------------------------------------------------------------------

    async def open(self) -> None:
        """Creates what is missing of the schema, checks its version.

        A database whose tables are there at this version is only read: the
        role a replica runs as needs no right to create tables (``nemesis
        init`` may run as another).
        """
        sql = self._sql
        where = f"PostgreSQL {sql.schema}.{sql.prefix}meta"

        async def version(conn: Conn) -> str | None:
            if await conn.fetchval("SELECT to_regclass($1)", sql.meta) is None:
                return None
            found = await conn.fetchval(
                f"SELECT value FROM {sql.meta} WHERE key = 'schema_version'"
            )
            return None if found is None else str(found)

        async def work(conn: Conn) -> None:
            found = await version(conn)
            check_schema_version(found, where)
            if found == str(SCHEMA_VERSION):
                return
            async with conn.transaction():
                # Replicas starting together: one creates, the others wait and find it made.
                await conn.execute("SELECT pg_advisory_xact_lock($1)", sql.lock)
                for statement in sql.schema_ddl():
                    await conn.execute(statement)
                found = await version(conn)
                check_schema_version(found, where)
                if found is None:
                    await conn.execute(
                        f"INSERT INTO {sql.meta} (key, value) VALUES ('schema_version', $1)",
                        str(SCHEMA_VERSION),
                    )

        await self._call("create the DLQ tables", work)

    async def close(self) -> None:
        """Closes the pool's connections."""
        if self._closed:
            return
        self._closed = True
        await close_pool(self._pool, CLOSE_TIMEOUT_S)

    async def __aenter__(self) -> PostgresDeadLetterStore:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- the primitives of ``StoreCore``: writes ----------------------------------------

    async def _put(self, letters: Sequence[DeadLetter], now_us: int) -> PutResult:
        sql = self._sql
        ids = sorted({letter.id for letter in letters})
        insert = (
            f"INSERT INTO {sql.letters} ({', '.join(LETTER_COLUMNS)})"
            f" VALUES ({', '.join(f'${n}' for n in range(1, len(LETTER_COLUMNS) + 1))})"
        )
        changed = [c for c in FAILURE_COLUMNS if c != "id"]
        update = (
            f"UPDATE {sql.letters} SET "
            + ", ".join(f"{c} = ${n}" for n, c in enumerate(changed, start=2))
            + " WHERE id = $1"
        )
        add_signature = (
            f"INSERT INTO {sql.signatures} ({', '.join(SIGNATURE_COLUMNS)})"
            f" VALUES ({', '.join(f'${n}' for n in range(1, len(SIGNATURE_COLUMNS) + 1))})"
            " ON CONFLICT (signature) DO NOTHING"
        )

        async def attempt(conn: Conn) -> PutResult:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock_shared($1)", sql.lock)
                existing: dict[str, Row] = {}
                for chunk in chunks(ids, ID_CHUNK):
                    rows = await conn.fetch(
                        f"SELECT {', '.join(FAILURE_COLUMNS)} FROM {sql.letters}"
                        " WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE",
                        list(chunk),
                    )
                    existing.update((r["id"], dict(r)) for r in rows)
                folded = fold_failures(letters, existing, (), now_us, self.times)
                if folded.signatures:
                    await conn.executemany(
                        add_signature,
                        [tuple(s[c] for c in SIGNATURE_COLUMNS) for s in folded.signatures],
                    )
                if folded.inserts:
                    await conn.executemany(
                        insert, [tuple(r[c] for c in LETTER_COLUMNS) for r in folded.inserts]
                    )
                if folded.updates:
                    await conn.executemany(
                        update, [(r["id"], *(r[c] for c in changed)) for r in folded.updates]
                    )
                return folded.result

        async def work(conn: Conn) -> PutResult:
            for _ in range(PUT_ATTEMPTS - 1):
                try:
                    return await attempt(conn)
                except (asyncpg.UniqueViolationError, asyncpg.DeadlockDetectedError):
                    # Another replica inserted one of these rows first (or the two
                    # deadlocked): the next attempt finds its row and folds into it.
                    continue
            return await attempt(conn)

        return await self._call(f"put {len(letters)} dead letters", work)

    async def _mark(self, letter_ids: Sequence[str], mark: Mark) -> int:
        sql = self._sql
        p = _Params()
        conditions = [POSTGRES.one_of(p, "id", letter_ids), "status = 'dead'"]
        if mark.integrations is not None:
            conditions.append(POSTGRES.one_of(p, "integration", sorted(mark.integrations)))
        query = (
            f"WITH changed AS (UPDATE {sql.letters} SET status = {p(mark.status.value)},"
            f" requeue_count = requeue_count + {p(mark.requeued)}::integer,"
            f" last_action = {p(mark.action.value)}, last_action_by = {p(mark.by)},"
            f" last_action_us = {p(mark.at_us, Kind.TIME)}"
            f" WHERE {POSTGRES.joined(conditions)} RETURNING 1) SELECT count(*) FROM changed"
        )

        async def work(conn: Conn) -> int:
            return int(await conn.fetchval(query, *p.values))

        return await self._call(f"mark {len(letter_ids)} rows {mark.status.value}", work)

    async def _append_action(self, entry: Row) -> int:
        sql = self._sql
        names = [str(name) for name in core.action_record({**entry, "seq": 0}).integrations]

        async def work(conn: Conn) -> int:
            async with conn.transaction():
                recent = await conn.fetch(
                    f"SELECT {', '.join(AUDIT_COLUMNS)} FROM {sql.actions}"
                    " ORDER BY seq DESC LIMIT $1",
                    RECENT_ACTIONS,
                )
                replayed = same_action(entry, _dicts(recent))
                if replayed is not None:  # a retried write that had committed
                    return replayed
                seq = await conn.fetchval(
                    f"INSERT INTO {sql.actions} ({', '.join(_AUDIT_ENTRY)})"
                    f" VALUES ($1, $2, $3, $4, $5, $6) RETURNING seq",
                    *(entry[c] for c in _AUDIT_ENTRY),
                )
                await conn.executemany(
                    f"INSERT INTO {sql.action_integrations} (integration, action_seq)"
                    " VALUES ($1, $2) ON CONFLICT DO NOTHING",
                    [(name, seq) for name in names],
                )
                return int(seq)

        return await self._call("record an action", work)

    async def _delete_expired(self, cutoff_us: int, limit: int) -> int:
        letters = self._sql.letters
        query = (
            f"WITH gone AS (DELETE FROM {letters} WHERE seq IN (SELECT seq FROM {letters}"
            " WHERE dead_lettered_us < $1 ORDER BY dead_lettered_us LIMIT $2"
            " FOR UPDATE SKIP LOCKED) RETURNING 1) SELECT count(*) FROM gone"
        )

        async def work(conn: Conn) -> int:
            return int(await conn.fetchval(query, cutoff_us, limit))

        return await self._call("delete expired dead letters", work)

    async def _prune_signatures(self) -> None:
        sql = self._sql

        async def work(conn: Conn) -> None:
            async with conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock($1)", sql.lock)
                await conn.execute(
                    f"DELETE FROM {sql.signatures} AS s WHERE NOT EXISTS"
                    f" (SELECT 1 FROM {sql.letters} AS l WHERE l.signature = s.signature)"
                )

        await self._call("delete unused signatures", work)

    # --- the primitives of ``StoreCore``: reads -----------------------------------------

    async def _rows(self, letter_ids: Sequence[str]) -> Sequence[Row]:
        return await self._fetch(
            "get dead letters",
            f"SELECT {_ROW_COLUMNS}, payload FROM {self._sql.letters} WHERE id = ANY($1::text[])",
            _safe(list(letter_ids)),
        )

    async def _list(
        self, where: DeadLetterFilter, after: Key | None, limit: int, preview_bytes: int
    ) -> tuple[Sequence[Row], Key | None]:
        letters = self._sql.letters
        bound: Key | None = None
        if where.text:
            # Where the scan stops: the TEXT_SCAN_ROWS-th candidate without the text test.
            p = _Params()
            conditions = POSTGRES.conditions(where, p, NOT_TEXT) + POSTGRES.after(p, after)
            found = await self._fetch(
                "bound a text search",
                f"SELECT dead_lettered_us, seq FROM {letters} WHERE {POSTGRES.joined(conditions)}"
                f" {_ORDER} LIMIT 1 OFFSET {p(TEXT_SCAN_ROWS - 1)}",
                *p.values,
            )
            if found:
                bound = (found[0]["dead_lettered_us"], found[0]["seq"])
        p = _Params()
        conditions = POSTGRES.conditions(where, p) + POSTGRES.after(p, after)
        if bound is not None:
            conditions += POSTGRES.not_after(p, bound)
        rows = await self._fetch(
            "list dead letters",
            f"SELECT {_ROW_COLUMNS}, substring(payload FROM 1 FOR {p(preview_bytes)}::integer)"
            f" AS payload FROM {letters} WHERE {POSTGRES.joined(conditions)}"
            f" {_ORDER} LIMIT {p(limit)}",
            *p.values,
        )
        return rows, bound

    async def _ids(
        self, where: DeadLetterFilter, after: Key | None, limit: int
    ) -> tuple[Sequence[str], Key | None]:
        p = _Params()
        conditions = POSTGRES.conditions(where, p) + POSTGRES.after(p, after)
        rows = await self._fetch(
            "select dead letter ids",
            f"SELECT id, dead_lettered_us, seq FROM {self._sql.letters}"
            f" WHERE {POSTGRES.joined(conditions)} {_ORDER} LIMIT {p(limit)}",
            *p.values,
        )
        last = (rows[-1]["dead_lettered_us"], rows[-1]["seq"]) if rows else None
        return [r["id"] for r in rows], last

    async def _count(self, where: DeadLetterFilter, limit: int | None) -> int:
        p = _Params()
        source = f"{self._sql.letters} WHERE {POSTGRES.joined(POSTGRES.conditions(where, p))}"
        if limit is None:
            query = f"SELECT count(*) AS n FROM {source}"
        else:
            query = f"SELECT count(*) AS n FROM (SELECT 1 FROM {source} LIMIT {p(limit)}) AS s"
        rows = await self._fetch("count dead letters", query, *p.values)
        return int(rows[0]["n"])

    async def _groups(self, where: DeadLetterFilter, limit: int) -> Sequence[Row]:
        sql = self._sql
        p = _Params()
        conditions = POSTGRES.joined(POSTGRES.conditions(where, p))
        # COLLATE "C": ties in size are broken as the core sorts them (by code point).
        return await self._fetch(
            "group dead letters",
            "WITH top AS (SELECT signature, count(*) AS n, min(dead_lettered_us) AS first_us,"
            f" max(dead_lettered_us) AS last_us FROM {sql.letters} WHERE {conditions}"
            f' GROUP BY signature ORDER BY n DESC, signature COLLATE "C" LIMIT {p(limit)})'
            " SELECT s.signature, s.integration, s.reason, s.http_status, s.pattern,"
            " s.sample_error, top.n, top.first_us, top.last_us"
            f" FROM top JOIN {sql.signatures} AS s ON s.signature = top.signature",
            *p.values,
        )

    async def _stats(
        self, where: DeadLetterFilter, window: Window
    ) -> tuple[Sequence[Row], Mapping[int, int]]:
        letters = self._sql.letters
        p = _Params()
        conditions = POSTGRES.joined(POSTGRES.conditions(where, p))
        pairs_query = (
            "SELECT integration, reason, count(*) AS total,"
            f" count(*) FILTER (WHERE dead_lettered_us >= {p(window.hour_ago_us, Kind.TIME)})"
            " AS recent, min(dead_lettered_us) AS oldest, max(dead_lettered_us) AS newest"
            f" FROM {letters} WHERE {conditions} GROUP BY integration, reason"
        )
        pairs_args = p.values
        b = _Params()
        bucket_conditions = POSTGRES.conditions(where, b)
        start = b(window.first_us, Kind.TIME)
        bucket_conditions.append(
            f"dead_lettered_us >= {start} AND dead_lettered_us < {b(window.end_us, Kind.TIME)}"
        )
        buckets_query = (
            f"SELECT (dead_lettered_us - {start}) / {b(window.bucket_us)}::bigint"
            f" AS bucket, count(*) AS n FROM {letters}"
            f" WHERE {POSTGRES.joined(bucket_conditions)} GROUP BY 1"
        )

        async def work(conn: Conn) -> tuple[list[dict[str, Any]], dict[int, int]]:
            # One snapshot: the series and the totals agree.
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                pairs = _dicts(await conn.fetch(pairs_query, *pairs_args))
                if window.empty:
                    return pairs, {}
                counted = await conn.fetch(buckets_query, *b.values)
            return pairs, {int(r["bucket"]): int(r["n"]) for r in counted}

        return await self._call("summarise dead letters", work)

    async def _actions(
        self, before: int | None, limit: int, integrations: frozenset[str] | None
    ) -> Sequence[Row]:
        sql = self._sql
        p = _Params()
        conditions: list[str] = []
        if before is not None:
            conditions.append(f"seq < {p(before)}::bigint")
        if integrations is not None:
            conditions.append(
                f"seq IN (SELECT action_seq FROM {sql.action_integrations}"
                f" WHERE {POSTGRES.one_of(p, 'integration', sorted(integrations))})"
            )
        return await self._fetch(
            "read the audit log",
            f"SELECT {', '.join(AUDIT_COLUMNS)} FROM {sql.actions}"
            f" WHERE {POSTGRES.joined(conditions)} ORDER BY seq DESC LIMIT {p(limit)}",
            *p.values,
        )


async def open_postgres_dlq(
    config: PostgresDlqConfig, *, clock: Clock = SYSTEM_CLOCK
) -> PostgresDeadLetterStore:
    """Connects, and creates (or checks) the DLQ's tables; ``config.retention`` 0 keeps rows."""
    retention_s = config.retention or None
    check_retention(retention_s)
    translated = describe(config, "the PostgreSQL DLQ", DlqError, DlqTimeout)
    pool = await open_pool(config, translated)
    store = PostgresDeadLetterStore(
        pool,
        sql=Sql(config.schema_name, config.table_prefix),
        translated=translated,
        clock=clock,
        retention_s=retention_s,
    )
    try:
        await store.open()
    except BaseException:
        await store.close()
        raise
    return store
