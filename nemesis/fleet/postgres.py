"""The ``postgres`` state store: the fleet's tables in a PostgreSQL database every host reaches.

Only its queries and its transactions live here; the logic is
``nemesis.fleet.core``. The statements are the sqlite store's, with
PostgreSQL's placeholders (``$1, $2, ...``); the tables are found through
the connections' ``search_path`` (``schema_name``), and their text columns
sort by code point (``COLLATE "C"``), as SQLite's do.

Transactions behave as the sqlite store's: a write job first takes an
advisory lock, so writers of every replica run one at a time (as SQLite's
``BEGIN IMMEDIATE`` makes them), and a read job runs in one read-only
snapshot. The core's jobs are plain functions that call ``Tx`` and wait for
each answer; here one runs on a worker thread, and each of its statements
is sent on the event loop over the transaction's connection (asyncpg).
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeVar

import asyncpg

from nemesis.backends.postgres import PostgresStateConfig
from nemesis.errors import StateError
from nemesis.fleet.core import Queries, SqlStateStore
from nemesis.fleet.logins import FAILURES_TABLE, NONCES_TABLE, postgres_logins
from nemesis.fleet.port import Tx
from nemesis.fleet.reports import TABLE as REPORTS_TABLE
from nemesis.fleet.reports import postgres_reports
from nemesis.fleet.revocations import TABLE, postgres_revocations
from nemesis.fleet.sqlite import QUERIES as SQLITE_QUERIES
from nemesis.postgres import Translated, close_pool, describe, open_pool

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

T = TypeVar("T")
CLOSE_TIMEOUT_S: Final = 10.0  # for calls under way to finish before their connections are cut
Conn: TypeAlias = "PoolConnectionProxy[asyncpg.Record]"

SCHEMA: Final = (
    """CREATE TABLE IF NOT EXISTS fleet_generation (
        id integer PRIMARY KEY,
        generation bigint NOT NULL
    )""",
    "INSERT INTO fleet_generation (id, generation) VALUES (1, 0) ON CONFLICT DO NOTHING",
    """CREATE TABLE IF NOT EXISTS fleet_members (
        member_id text COLLATE "C" PRIMARY KEY,
        host text NOT NULL,
        pid bigint NOT NULL,
        started_at double precision NOT NULL,
        heartbeat_at double precision NOT NULL,
        lease_until double precision NOT NULL,
        draining integer NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS fleet_assignments (
        integration text COLLATE "C" NOT NULL,
        member_id text COLLATE "C" NOT NULL,
        since double precision NOT NULL,
        PRIMARY KEY (integration, member_id)
    )""",
    """CREATE TABLE IF NOT EXISTS fleet_overrides (
        integration text COLLATE "C" NOT NULL,
        field text COLLATE "C" NOT NULL,
        value text NOT NULL,
        version bigint NOT NULL,
        set_by text NOT NULL,
        set_at double precision NOT NULL,
        PRIMARY KEY (integration, field)
    )""",
)
TABLES: Final = (
    "fleet_generation",
    "fleet_members",
    "fleet_assignments",
    "fleet_overrides",
    TABLE,  # the viewer's signed-out sessions (nemesis.fleet.revocations)
    FAILURES_TABLE,  # the viewer's failed sign-ins (nemesis.fleet.logins)
    NONCES_TABLE,  # the viewer's spent sign-in forms
    REPORTS_TABLE,  # the members' reports for the team console (nemesis.fleet.reports)
)


def numbered(sql: str) -> str:
    """SQLite's ``?`` placeholders as PostgreSQL's ``$1, $2, ...`` (no ``?`` is quoted here)."""
    first, *rest = sql.split("?")
    return first + "".join(f"${n}{part}" for n, part in enumerate(rest, start=1))


QUERIES: Final = dataclasses.replace(
    SQLITE_QUERIES,
    schema=SCHEMA,
    **{
        field.name: numbered(getattr(SQLITE_QUERIES, field.name))
        for field in dataclasses.fields(Queries)
        if field.name != "schema"
    },
)


def _row_count(status: str) -> int:
    """The rows a command changed, from its status ("UPDATE 3", "INSERT 0 1"); 0 for DDL."""
    last = status.rsplit(" ", 1)[-1]
    return int(last) if last.isdigit() else 0


class _ThreadTx:
    """``Tx`` for a job on a worker thread: each statement runs on the loop, the thread waits."""

    def __init__(self, conn: Conn, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self._conn = conn
        self._loop = loop
        self._timeout_s = timeout_s
        self.cancelled = False

    def _wait(self, call: Coroutine[Any, Any, T]) -> T:
        if self.cancelled:  # the caller gave up: the transaction is being rolled back
            call.close()
            raise asyncio.CancelledError
        return asyncio.run_coroutine_threadsafe(call, self._loop).result(self._timeout_s)

    def execute(self, sql: str, parameters: Sequence[object] = ()) -> int:
        return _row_count(self._wait(self._conn.execute(sql, *_safe(parameters))))

    def query(self, sql: str, parameters: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in self._wait(self._conn.fetch(sql, *_safe(parameters)))]


def _safe(parameters: Sequence[object]) -> list[object]:
    """Text without NUL (each becomes U+FFFD): PostgreSQL's text cannot hold one."""
    return [v.replace("\x00", "\ufffd") if isinstance(v, str) else v for v in parameters]


class PostgresStateStore(SqlStateStore):
    """The fleet's state in PostgreSQL tables."""

    queries = QUERIES
    revocation_queries = postgres_revocations(numbered)
    login_queries = postgres_logins(numbered)
    report_queries = postgres_reports(numbered)

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        address: str,
        schema: str,
        translated: Translated,
        timeout_s: float,
    ) -> None:
        self._pool = pool
        self._address = address
        self._schema = schema
        self._translated = translated
        self._timeout_s = timeout_s
        # Writers of every replica take it, one at a time (see the module docstring).
        self._write_lock = zlib.crc32(f"{schema}.fleet".encode()) - 2**31
        self._closed = False

    @property
    def location(self) -> str:
        return f"postgres:{self._address} {self._schema}"

    async def open(self) -> None:
        """Creates the tables if missing (a database that has them is only read)."""

        async def present(conn: Conn) -> bool:
            found = await conn.fetchval(
                "SELECT count(*) FROM pg_tables"
                " WHERE schemaname = current_schema() AND tablename = ANY($1::text[])",
                list(TABLES),
            )
            return int(found) == len(TABLES)

        async def create(conn: Conn) -> None:
            if await present(conn):
                return
            if self._schema != "public":
                await conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{self._schema}"')
            await self._in_transaction(conn, self._create_schema, write=True)

        await self._call("create the fleet's tables", create)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await close_pool(self._pool, CLOSE_TIMEOUT_S)

    async def _transaction(self, job: Callable[[Tx], T], *, write: bool = True) -> T:
        async def run(conn: Conn) -> T:
            return await self._in_transaction(conn, job, write=write)

        return await self._call(
            "write the fleet's state" if write else "read the fleet's state", run
        )

    async def _call(self, what: str, work: Callable[[Conn], Coroutine[Any, Any, T]]) -> T:
        if self._closed:
            raise StateError(f"{self._translated.where}: the state store is closed")

        async def run() -> T:
            async with self._pool.acquire() as conn:
                return await work(conn)

        return await self._translated(what, run())

    async def _in_transaction(self, conn: Conn, job: Callable[[Tx], T], *, write: bool) -> T:
        isolation: Final = "read_committed" if write else "repeatable_read"
        async with conn.transaction(isolation=isolation, readonly=not write):
            if write:
                await conn.execute("SELECT pg_advisory_xact_lock($1)", self._write_lock)
            tx = _ThreadTx(conn, asyncio.get_running_loop(), self._timeout_s)
            running = asyncio.get_running_loop().run_in_executor(None, job, tx)
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                # The thread may be waiting on a statement: let it finish (or stop at its
                # next one) before the transaction is rolled back under it.
                tx.cancelled = True
                await asyncio.wait([running])
                if not running.cancelled():
                    # Taken, so that asyncio does not log it: the job stopped as asked.
                    running.exception()
                raise


async def open_postgres_state(config: PostgresStateConfig) -> PostgresStateStore:
    """The fleet's state store in ``config``'s database, its tables created if missing."""
    translated = describe(config, "the PostgreSQL state store", StateError, StateError)
    pool = await open_pool(config, translated, search_path=f'"{config.schema_name}"')
    store = PostgresStateStore(
        pool,
        address=config.address(),
        schema=config.schema_name,
        translated=translated,
        timeout_s=config.statement_timeout_s + 1.0,
    )
    try:
        await store.open()
    except BaseException:
        await store.close()
        raise
    return store
