"""The ``ydb`` state store: the fleet's tables in a YDB database every host reaches.

Only its YQL and its transactions live here; the logic is
``nemesis.fleet.core``. Each statement of ``QUERIES`` starts with the
``DECLARE`` of its parameters ``$p0, $p1, ...``, in the core's positional
order: the transaction reads their types from there and sends typed values.

YDB answers no row counts, so a write the core counts (a delete, the insert
of an assignment) is a ``SELECT`` of the rows it will change followed by the
write, in one statement; ``execute`` answers that first value. An
assignment that exists keeps its ``since`` (the upsert writes back the
stored one).

Transactions are YDB's serializable ones, run by the SDK's
``retry_tx_async``: YDB has no advisory lock, so two replicas writing at
once conflict and the loser's job runs again from the start on a fresh
snapshot. The core's jobs only read and write through the transaction, so
running one again is safe. A commit that ends undetermined is retried too
(``RetrySettings(idempotent=True)``): a job run again over its own commit
finds its rows written and, at most, moves the generation once more, which
only makes the members read the fleet again.

The query service streams a result set as several parts that share its
``result_set_index``; ``_ThreadTx`` joins them with the SDK's own
aggregation (as ``nemesis.dlq.ydb`` does) before counting result sets.

The core's jobs are plain functions that call ``Tx`` and wait for each
answer: one runs on a worker thread, and each statement is sent on the event
loop in the transaction.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, Final, TypeVar, cast

import ydb
from ydb import convert
from ydb.aio.driver import Driver
from ydb.aio.query.pool import QuerySessionPool
from ydb.aio.query.transaction import QueryTxContext

from nemesis.backends.ydb import YdbConnectionConfig, YdbStateConfig
from nemesis.broker.ydb.connection import open_driver
from nemesis.broker.ydb.errors import table_call
from nemesis.errors import BrokerError, DlqError, StateError
from nemesis.fleet.core import Queries, SqlStateStore
from nemesis.fleet.logins import ydb_logins
from nemesis.fleet.port import Tx
from nemesis.fleet.reports import ydb_reports
from nemesis.fleet.revocations import ydb_revocations

T = TypeVar("T")

P = ydb.PrimitiveType
# The types a statement here declares, by their YQL name.
TYPES: Final[Mapping[str, ydb.PrimitiveType]] = {
    "Utf8": P.Utf8,
    "Int64": P.Int64,
    "Double": P.Double,
}
_DECLARE = re.compile(r"DECLARE (\$p\d+) AS (\w+);")


_aggregate = cast(
    Callable[[AsyncIterator[Any]], Coroutine[Any, Any, list[Any]]],
    convert.aggregate_result_sets_by_index_async,  # untyped in the SDK
)


def _yql(declares: str, body: str) -> str:
    """``body`` after the DECLAREs of ``declares`` ("Utf8 Double": ``$p0`` Utf8, ``$p1`` Double)."""
    return "".join(f"DECLARE $p{n} AS {name};\n" for n, name in enumerate(declares.split())) + body


def queries(directory: str) -> Queries:
    """The store's YQL, its tables under ``directory`` (relative to the database)."""
    d = directory.strip("/")
    gen, members = f"`{d}/generation`", f"`{d}/members`"
    assignments, overrides = f"`{d}/assignments`", f"`{d}/overrides`"
    member_columns = "member_id, host, pid, started_at, heartbeat_at, lease_until, draining"
    return Queries(
        schema=(
            f"CREATE TABLE IF NOT EXISTS {gen} (\n"
            "    `id` Int64 NOT NULL,\n"
            "    `generation` Int64 NOT NULL,\n"
            "    PRIMARY KEY (`id`)\n)",
            f"CREATE TABLE IF NOT EXISTS {members} (\n"
            "    `member_id` Utf8 NOT NULL,\n"
            "    `host` Utf8 NOT NULL,\n"
            "    `pid` Int64 NOT NULL,\n"
            "    `started_at` Double NOT NULL,\n"
            "    `heartbeat_at` Double NOT NULL,\n"
            "    `lease_until` Double NOT NULL,\n"
            "    `draining` Int64 NOT NULL,\n"
            "    PRIMARY KEY (`member_id`)\n)",
            f"CREATE TABLE IF NOT EXISTS {assignments} (\n"
            "    `integration` Utf8 NOT NULL,\n"
            "    `member_id` Utf8 NOT NULL,\n"
            "    `since` Double NOT NULL,\n"
            "    PRIMARY KEY (`integration`, `member_id`)\n)",
            f"CREATE TABLE IF NOT EXISTS {overrides} (\n"
            "    `integration` Utf8 NOT NULL,\n"
            "    `field` Utf8 NOT NULL,\n"
            "    `value` Utf8 NOT NULL,\n"
            "    `version` Int64 NOT NULL,\n"
            "    `set_by` Utf8 NOT NULL,\n"
            "    `set_at` Double NOT NULL,\n"
            "    PRIMARY KEY (`integration`, `field`)\n)",
        ),
        generation=f"SELECT generation FROM {gen} WHERE id = 1;",
        bump=f"UPDATE {gen} SET generation = generation + 1 WHERE id = 1;",
        member_draining=_yql("Utf8", f"SELECT draining FROM {members} WHERE member_id = $p0;"),
        update_member=_yql(
            "Utf8 Int64 Double Double Double Int64 Utf8",
            f"UPSERT INTO {members} (`host`, `pid`, `started_at`, `heartbeat_at`,"
            " `lease_until`, `draining`, `member_id`) VALUES ($p0, $p1, $p2, $p3, $p4, $p5, $p6);",
        ),
        insert_member=_yql(
            "Utf8 Utf8 Int64 Double Double Double Int64",
            f"UPSERT INTO {members} (`member_id`, `host`, `pid`, `started_at`, `heartbeat_at`,"
            " `lease_until`, `draining`) VALUES ($p0, $p1, $p2, $p3, $p4, $p5, $p6);",
        ),
        expired_members=_yql("Double", f"SELECT member_id FROM {members} WHERE lease_until < $p0;"),
        delete_member=_yql(
            "Utf8",
            f"SELECT COUNT(*) AS n FROM {members} WHERE member_id = $p0;\n"
            f"DELETE FROM {members} WHERE member_id = $p0;",
        ),
        delete_member_assignments=_yql(
            "Utf8",
            f"SELECT COUNT(*) AS n FROM {assignments} WHERE member_id = $p0;\n"
            f"DELETE FROM {assignments} WHERE member_id = $p0;",
        ),
        members=f"SELECT {member_columns} FROM {members} ORDER BY member_id;",
        assignments=f"SELECT integration, member_id, since FROM {assignments}"
        " ORDER BY integration, member_id;",
        # Counts 1 when the row is new; an existing row keeps its since.
        insert_assignment=_yql(
            "Utf8 Utf8 Double",
            f"SELECT 1 - COUNT(*) AS n FROM {assignments}"
            " WHERE integration = $p0 AND member_id = $p1;\n"
            f"UPSERT INTO {assignments} (`integration`, `member_id`, `since`)"
            " SELECT $p0 AS integration, $p1 AS member_id, COALESCE(MAX(since), $p2) AS since"
            f" FROM {assignments} WHERE integration = $p0 AND member_id = $p1;",
        ),
        delete_assignment=_yql(
            "Utf8 Utf8",
            f"SELECT COUNT(*) AS n FROM {assignments}"
            " WHERE integration = $p0 AND member_id = $p1;\n"
            f"DELETE FROM {assignments} WHERE integration = $p0 AND member_id = $p1;",
        ),
        overrides=f"SELECT integration, field, value, version, set_by, set_at FROM {overrides}"
        " ORDER BY integration, field;",
        delete_override=_yql(
            "Utf8 Utf8",
            f"SELECT COUNT(*) AS n FROM {overrides} WHERE integration = $p0 AND field = $p1;\n"
            f"DELETE FROM {overrides} WHERE integration = $p0 AND field = $p1;",
        ),
        delete_override_at=_yql(
            "Utf8 Utf8 Int64",
            f"SELECT COUNT(*) AS n FROM {overrides}"
            " WHERE integration = $p0 AND field = $p1 AND version = $p2;\n"
            f"DELETE FROM {overrides} WHERE integration = $p0 AND field = $p1 AND version = $p2;",
        ),
        delete_overrides=_yql(
            "Utf8",
            f"SELECT COUNT(*) AS n FROM {overrides} WHERE integration = $p0;\n"
            f"DELETE FROM {overrides} WHERE integration = $p0;",
        ),
        insert_override=_yql(
            "Utf8 Utf8 Utf8 Int64 Utf8 Double",
            f"UPSERT INTO {overrides} (`integration`, `field`, `value`, `version`, `set_by`,"
            " `set_at`) VALUES ($p0, $p1, $p2, $p3, $p4, $p5);",
        ),
    )


def _seed(directory: str) -> tuple[str, str]:
    """The generation row's read and its first write (run when it is missing)."""
    gen = f"`{directory.strip('/')}/generation`"
    return (
        f"SELECT generation FROM {gen} WHERE id = 1;",
        f"UPSERT INTO {gen} (`id`, `generation`) VALUES (1, 0);",
    )


def _rewrite(directory: str) -> str:
    """The generation row written back as it is (a write that changes nothing)."""
    gen = f"`{directory.strip('/')}/generation`"
    return f"UPDATE {gen} SET generation = generation WHERE id = 1;"


def _typed(sql: str, parameters: Sequence[object]) -> dict[str, ydb.TypedValue]:
    """``parameters`` as the typed values the statement's DECLAREs name, in order."""
    declared = _DECLARE.findall(sql)
    if len(declared) != len(parameters):
        raise StateError(f"a statement declares {len(declared)} parameters, got {len(parameters)}")
    typed = {}
    for (name, type_name), value in zip(declared, parameters, strict=True):
        if type_name == "Double":
            value = float(cast(float, value))
        typed[name] = ydb.TypedValue(value, TYPES[type_name])
    return typed


class _ThreadTx:
    """``Tx`` for a job on a worker thread: each statement runs on the loop, the thread waits."""

    def __init__(self, tx: QueryTxContext, loop: asyncio.AbstractEventLoop, timeout_s: float):
        self._tx = tx
        self._loop = loop
        self._timeout_s = timeout_s
        self.cancelled = False

    def _wait(self, call: Coroutine[Any, Any, T]) -> T:
        if self.cancelled:  # the caller gave up: the transaction is being rolled back
            call.close()
            raise asyncio.CancelledError
        return asyncio.run_coroutine_threadsafe(call, self._loop).result(self._timeout_s)

    async def _sets(self, sql: str, parameters: Sequence[object]) -> list[list[tuple[Any, ...]]]:
        # The server streams one result set as several parts sharing its index: join them.
        found = await _aggregate(await self._tx.execute(sql, _typed(sql, parameters)))
        return [[tuple(row.values()) for row in result_set.rows] for result_set in found]

    def execute(self, sql: str, parameters: Sequence[object] = ()) -> int:
        sets = self._wait(self._sets(sql, parameters))
        return int(sets[0][0][0]) if sets and sets[0] else 0

    def query(self, sql: str, parameters: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        sets = self._wait(self._sets(sql, parameters))
        if len(sets) != 1:
            raise StateError(f"the server answered {len(sets)} result sets to one SELECT")
        return sets[0]


class YdbStateStore(SqlStateStore):
    """The fleet's state in YDB tables; see the module docstring."""

    def __init__(
        self,
        pool: QuerySessionPool,
        *,
        directory: str,
        timeout_s: float = 30.0,
        driver: Driver | None = None,
        retry_settings: ydb.RetrySettings | None = None,
    ) -> None:
        self.queries = queries(directory)
        self.revocation_queries = ydb_revocations(directory)
        self.login_queries = ydb_logins(directory)
        self.report_queries = ydb_reports(directory)
        self._pool = pool
        self._directory = directory.strip("/")
        self._timeout_s = timeout_s
        self._driver = driver  # stopped on close when the store opened it
        # The jobs are safe to run again (see the module docstring): undetermined commits too.
        self._retry = retry_settings or ydb.RetrySettings(idempotent=True)
        self._closed = False

    @property
    def location(self) -> str:
        return f"ydb:{self._directory}"

    async def open(self) -> None:
        """Creates the tables and the generation row if missing."""
        self._check_open()
        # YDB runs schema changes outside transactions.
        for statement in self.schema():
            await self._call(
                "create the fleet's tables", self._pool.execute_with_retries(statement)
            )
        read, write = _seed(self._directory)

        def seed(tx: Tx) -> None:
            if not tx.query(read):
                tx.execute(write)
            # The core's jobs read what they wrote in the same transaction: a server
            # without immediate effects refuses this read, here, at the start
            # (nemesis.broker.ydb.errors.IMMEDIATE_EFFECTS_NEEDED).
            tx.execute(_rewrite(self._directory))
            tx.query(read)

        await self._transaction(seed)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        stop = cast(Callable[[], Coroutine[Any, Any, None]], self._pool.stop)  # untyped
        await stop()
        if self._driver is not None:
            await self._driver.stop(timeout=1)

    def _check_open(self) -> None:
        if self._closed:
            raise StateError(f"ydb:{self._directory}: the state store is closed")

    async def _call(self, what: str, call: Coroutine[Any, Any, T]) -> T:
        try:
            return await table_call(what, call, self._timeout_s)
        except DlqError as exc:  # the YDB plumbing's errors, translated
            raise StateError(f"ydb:{self._directory}: {exc}") from exc

    async def _transaction(self, job: Callable[[Tx], T], *, write: bool = True) -> T:
        self._check_open()
        loop = asyncio.get_running_loop()

        async def work(tx: QueryTxContext) -> T:
            thread_tx = _ThreadTx(tx, loop, self._timeout_s)
            running = loop.run_in_executor(None, job, thread_tx)
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                # The thread may be waiting on a statement: let it finish (or stop at its
                # next one) before the transaction is rolled back under it.
                thread_tx.cancelled = True
                await asyncio.wait([running])
                raise

        what = "write the fleet's state" if write else "read the fleet's state"
        outcome = await self._call(
            what, self._pool.retry_tx_async(work, retry_settings=self._retry)
        )
        return cast(T, outcome)


async def open_ydb_state(
    config: YdbStateConfig,
    *,
    connection: YdbConnectionConfig | None = None,
    driver: Driver | None = None,
    sessions: int = 4,
) -> YdbStateStore:
    """The fleet's state store in ``config.path``, its tables created if missing.

    ``driver``: a connected driver to share; otherwise one is opened from
    ``config.connection`` or ``connection`` and stopped on close.
    """
    settings = config.connection or connection
    owned: Driver | None = None
    if driver is None:
        if settings is None:
            raise StateError("state.kind ydb needs state.connection unless the backend is ydb")
        try:
            owned = driver = await open_driver(settings)
        except BrokerError as exc:
            raise StateError(str(exc)) from exc
    store = YdbStateStore(
        QuerySessionPool(driver, size=sessions),
        directory=config.path,
        timeout_s=settings.request_timeout_s if settings is not None else 30.0,
        driver=owned,
    )
    try:
        await store.open()
    except BaseException:
        await store.close()
        raise
    return store
