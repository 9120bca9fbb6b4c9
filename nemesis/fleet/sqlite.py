"""The ``sqlite`` state store: one SQLite file the replicas of one host share.

Only its queries and its transactions live here; the logic is
``nemesis.fleet.core``. One connection on its own thread
(``nemesis.sqlite_thread``); writers of several processes serialize on
``BEGIN IMMEDIATE``, which also makes a read-then-write job atomic. The file
has a rollback journal, not WAL: nothing of it is memory-mapped, so a file cut
or removed under the process fails the calls that meet it and the member
carries on as in a store outage (see ``nemesis.sqlite_thread``). A file left
in WAL by an earlier release stays so until a process opens it alone. A fleet
spread over several hosts needs a store they all reach (PostgreSQL), not a
file.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

from nemesis.errors import BrokerError, StateError
from nemesis.fleet.core import Queries, SqlStateStore
from nemesis.fleet.logins import SQLITE_LOGINS
from nemesis.fleet.port import Tx
from nemesis.fleet.reports import SQLITE_REPORTS
from nemesis.fleet.revocations import SQLITE_REVOCATIONS
from nemesis.sqlite_thread import SqliteThread, read_transaction, write_transaction

T = TypeVar("T")

TIMEOUT_S: Final = 5.0

# A rollback journal, truncated after each commit: no -shm to map (see the module docstring).
JOURNAL_MODE: Final = "TRUNCATE"

QUERIES: Final = Queries(
    schema=(
        """CREATE TABLE IF NOT EXISTS fleet_generation (
            id INTEGER PRIMARY KEY,
            generation INTEGER NOT NULL
        )""",
        "INSERT INTO fleet_generation (id, generation) VALUES (1, 0) ON CONFLICT DO NOTHING",
        """CREATE TABLE IF NOT EXISTS fleet_members (
            member_id TEXT PRIMARY KEY,
            host TEXT NOT NULL,
            pid INTEGER NOT NULL,
            started_at REAL NOT NULL,
            heartbeat_at REAL NOT NULL,
            lease_until REAL NOT NULL,
            draining INTEGER NOT NULL
        )""",
        """CREATE TABLE IF NOT EXISTS fleet_assignments (
            integration TEXT NOT NULL,
            member_id TEXT NOT NULL,
            since REAL NOT NULL,
            PRIMARY KEY (integration, member_id)
        )""",
        """CREATE TABLE IF NOT EXISTS fleet_overrides (
            integration TEXT NOT NULL,
            field TEXT NOT NULL,
            value TEXT NOT NULL,
            version INTEGER NOT NULL,
            set_by TEXT NOT NULL,
            set_at REAL NOT NULL,
            PRIMARY KEY (integration, field)
        )""",
    ),
    generation="SELECT generation FROM fleet_generation WHERE id = 1",
    bump="UPDATE fleet_generation SET generation = generation + 1 WHERE id = 1",
    member_draining="SELECT draining FROM fleet_members WHERE member_id = ?",
    update_member="UPDATE fleet_members SET host = ?, pid = ?, started_at = ?, heartbeat_at = ?,"
    " lease_until = ?, draining = ? WHERE member_id = ?",
    insert_member="INSERT INTO fleet_members (member_id, host, pid, started_at, heartbeat_at,"
    " lease_until, draining) VALUES (?, ?, ?, ?, ?, ?, ?)",
    expired_members="SELECT member_id FROM fleet_members WHERE lease_until < ?",
    delete_member="DELETE FROM fleet_members WHERE member_id = ?",
    delete_member_assignments="DELETE FROM fleet_assignments WHERE member_id = ?",
    members="SELECT member_id, host, pid, started_at, heartbeat_at, lease_until, draining"
    " FROM fleet_members ORDER BY member_id",
    assignments="SELECT integration, member_id, since FROM fleet_assignments"
    " ORDER BY integration, member_id",
    insert_assignment="INSERT INTO fleet_assignments (integration, member_id, since)"
    " VALUES (?, ?, ?) ON CONFLICT DO NOTHING",
    delete_assignment="DELETE FROM fleet_assignments WHERE integration = ? AND member_id = ?",
    overrides="SELECT integration, field, value, version, set_by, set_at FROM fleet_overrides"
    " ORDER BY integration, field",
    delete_override="DELETE FROM fleet_overrides WHERE integration = ? AND field = ?",
    delete_override_at="DELETE FROM fleet_overrides"
    " WHERE integration = ? AND field = ? AND version = ?",
    delete_overrides="DELETE FROM fleet_overrides WHERE integration = ?",
    insert_override="INSERT INTO fleet_overrides (integration, field, value, version, set_by,"
    " set_at) VALUES (?, ?, ?, ?, ?, ?)",
)


class _SqliteTx:
    """``Tx`` over a sqlite3 connection inside ``write_transaction``."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def execute(self, sql: str, parameters: Sequence[object] = ()) -> int:
        return self._conn.execute(sql, parameters).rowcount

    def query(self, sql: str, parameters: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, parameters).fetchall()


class SqliteStateStore(SqlStateStore):
    """The fleet's state in one SQLite file."""

    queries = QUERIES
    revocation_queries = SQLITE_REVOCATIONS
    login_queries = SQLITE_LOGINS
    report_queries = SQLITE_REPORTS

    def __init__(self, path: Path, *, timeout_s: float = TIMEOUT_S) -> None:
        self.path = path
        self._timeout_s = timeout_s
        self._thread = SqliteThread(
            path,
            "fleet-state",
            busy_timeout_s=timeout_s,
            # SQLite's busy handler, not poll_locks: with a rollback journal a read
            # waits too, for a writer's commit (a few heartbeats a second at most).
            journal_mode=JOURNAL_MODE,
            journal_fallback="WAL",
        )

    @property
    def location(self) -> str:
        return f"sqlite:{self.path}"

    async def open(self) -> None:
        """Connects and creates the tables if missing."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StateError(f"{self.path}: cannot create the directory: {exc}") from exc
        try:
            await self._thread.open(self._timeout_s)
        except BrokerError as exc:
            raise StateError(f"{self.path}: {exc}") from exc
        await self._transaction(self._create_schema)

    async def close(self) -> None:
        await self._thread.close(self._timeout_s)

    async def _transaction(self, job: Callable[[Tx], T], *, write: bool = True) -> T:
        def run(conn: sqlite3.Connection) -> T:
            with write_transaction(conn) if write else read_transaction(conn):
                return job(_SqliteTx(conn))

        try:
            return await self._thread.run(run, timeout_s=self._timeout_s)
        except BrokerError as exc:  # the SQLite plumbing's errors, translated
            raise StateError(f"{self.path}: {exc}") from exc


async def open_sqlite_state(path: Path) -> SqliteStateStore:
    """The state store in ``path``, its file and tables created if missing."""
    store = SqliteStateStore(path)
    try:
        await store.open()
    except BaseException:
        await store.close()
        raise
    return store
