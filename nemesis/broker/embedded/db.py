"""The embedded broker's SQLite file: its schema, and the connections the broker keeps.

Each connection lives on its own thread (``SqliteThread``, from
``nemesis.sqlite_thread``, which also says how durable a commit is). The
broker keeps three (see ``Database``), so that a long append or a
checkpoint does not delay delivery.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from nemesis.errors import BrokerError

# The broker's names for the connection plumbing, which lives in ``nemesis.sqlite_thread``.
from nemesis.sqlite_thread import BACKGROUND_NICENESS as BACKGROUND_NICENESS
from nemesis.sqlite_thread import LOCK_POLL_FIRST_S as LOCK_POLL_FIRST_S
from nemesis.sqlite_thread import LOCK_POLL_MAX_S as LOCK_POLL_MAX_S
from nemesis.sqlite_thread import Connection as Connection
from nemesis.sqlite_thread import SqliteThread as SqliteThread
from nemesis.sqlite_thread import connect as connect
from nemesis.sqlite_thread import poll_for_locks as poll_for_locks
from nemesis.sqlite_thread import read_transaction as read_transaction
from nemesis.sqlite_thread import translate as translate
from nemesis.sqlite_thread import when_unlocked as when_unlocked
from nemesis.sqlite_thread import write_transaction as write_transaction

T = TypeVar("T")

SCHEMA_VERSION = 1
BACKSTOP_CHECKPOINT_PAGES = 50_000  # about 200 MB of WAL
# Once the WAL restarts, a file grown past this (a burst, the backstop) is cut back to it.
# Twice the size at which checkpoints restart it (see broker.RESTART_WAL_FRAMES): cutting
# back at every restart cost that append the truncation, 2-15 ms on ext4.
WAL_SIZE_LIMIT_BYTES = 128 * 1024 * 1024

# Column order matters in ``messages``: SQLite reads a row's columns in order and
# spills a large value into overflow pages, so the small columns retention and
# readers need come before the value.
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS topics (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        name TEXT NOT NULL UNIQUE,
        partitions INTEGER NOT NULL,
        retention_s REAL,
        created_at REAL NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS partitions (
        topic_id INTEGER NOT NULL,
        partition_id INTEGER NOT NULL,
        start_offset INTEGER NOT NULL,
        end_offset INTEGER NOT NULL,
        last_written_at REAL,
        PRIMARY KEY (topic_id, partition_id)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS messages (
        topic_id INTEGER NOT NULL,
        partition_id INTEGER NOT NULL,
        msg_offset INTEGER NOT NULL,
        written_at REAL NOT NULL,
        created_at REAL NOT NULL,
        seqno INTEGER,
        producer_id TEXT,
        key TEXT,
        metadata TEXT,
        value BLOB NOT NULL,
        PRIMARY KEY (topic_id, partition_id, msg_offset)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS producers (
        topic_id INTEGER NOT NULL,
        producer_id TEXT NOT NULL,
        last_seqno INTEGER NOT NULL,
        updated_at REAL NOT NULL,
        PRIMARY KEY (topic_id, producer_id)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS consumers (
        topic_id INTEGER NOT NULL,
        name TEXT NOT NULL,
        important INTEGER NOT NULL,
        created_at REAL NOT NULL,
        PRIMARY KEY (topic_id, name)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS offsets (
        topic_id INTEGER NOT NULL,
        consumer TEXT NOT NULL,
        partition_id INTEGER NOT NULL,
        committed INTEGER NOT NULL,
        committed_at REAL NOT NULL,
        PRIMARY KEY (topic_id, consumer, partition_id)
    ) WITHOUT ROWID""",
    # A lease row outlives its holder (owner NULL once released) so that the
    # generation keeps growing: it is the fencing token of every commit.
    """CREATE TABLE IF NOT EXISTS leases (
        topic_id INTEGER NOT NULL,
        consumer TEXT NOT NULL,
        partition_id INTEGER NOT NULL,
        owner TEXT,
        generation INTEGER NOT NULL,
        expires_at REAL NOT NULL,
        PRIMARY KEY (topic_id, consumer, partition_id)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS members (
        topic_id INTEGER NOT NULL,
        consumer TEXT NOT NULL,
        member_id TEXT NOT NULL,
        expires_at REAL NOT NULL,
        PRIMARY KEY (topic_id, consumer, member_id)
    ) WITHOUT ROWID""",
    # A reader's bell (see ``bells``): where writers of its topic send a
    # datagram after each append. Renewed and expired with its member row.
    # Added after version 1 without a bump: processes that do not know the
    # table neither ring nor register, and their readers poll as before.
    """CREATE TABLE IF NOT EXISTS bells (
        topic_id INTEGER NOT NULL,
        member_id TEXT NOT NULL,
        address BLOB NOT NULL,
        expires_at REAL NOT NULL,
        PRIMARY KEY (topic_id, member_id)
    ) WITHOUT ROWID""",
    # Dropped topics whose messages are still being deleted in small batches; a
    # process killed halfway leaves the id here and the next housekeeping resumes.
    "CREATE TABLE IF NOT EXISTS dropped_topics (topic_id INTEGER PRIMARY KEY)",
)


class Database:
    """The connections of one broker, each on its own thread.

    ``writer`` takes every write (appends, leases, commits, retention);
    ``reader`` serves reads; ``maintenance`` runs WAL checkpoints and other
    slow read-only work, so neither of the others waits behind an fsync.
    """

    def __init__(self, path: Path, *, busy_timeout_s: float = 5.0) -> None:
        self.path = path
        # The write connection leaves checkpoints to the maintenance one: a
        # checkpoint on commit stalls that append for tens of milliseconds.
        # The threshold is only a backstop should maintenance stop running.
        self.writer = SqliteThread(
            path,
            "sqlite-write",
            busy_timeout_s=busy_timeout_s,
            poll_locks=True,
            pragmas=(
                f"wal_autocheckpoint={BACKSTOP_CHECKPOINT_PAGES}",
                # The write that restarts the WAL is the one that truncates it.
                f"journal_size_limit={WAL_SIZE_LIMIT_BYTES}",
            ),
        )
        self.reader = SqliteThread(
            path, "sqlite-read", busy_timeout_s=busy_timeout_s, pragmas=("query_only=ON",)
        )
        self.maintenance = SqliteThread(
            path, "sqlite-maintenance", busy_timeout_s=busy_timeout_s, background=True
        )

    async def open(self, timeout_s: float) -> None:
        """Opens every connection and creates (or checks) the schema."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BrokerError(
                f"{self.path}: cannot create the folder {self.path.parent}: {exc.strerror or exc}"
            ) from exc
        try:
            # The write connection switches the file to WAL before the others open.
            await self.writer.open(timeout_s)
            await self.writer.run(_create_schema, timeout_s=timeout_s)
            await self.reader.open(timeout_s)
            await self.maintenance.open(timeout_s)
        except BaseException:
            await self.close()
            raise

    async def close(self, timeout_s: float = 5.0) -> None:
        """Closes every connection."""
        try:
            await self.maintenance.close(timeout_s)
            await self.reader.close(timeout_s)
        finally:
            await self.writer.close(timeout_s)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """Frames in the WAL when a checkpoint began, and how many of them the database file holds.

    Frames appended while it ran are in neither count.
    """

    wal_frames: int
    copied: int


def checkpoint(conn: sqlite3.Connection) -> Checkpoint:
    """Copies committed WAL frames into the database file, blocking no one."""
    _busy, frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    return Checkpoint(wal_frames=max(int(frames), 0), copied=max(int(copied), 0))


def _create_schema(conn: sqlite3.Connection) -> None:
    with write_transaction(conn):
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise BrokerError(
                f"schema version {version} is newer than this Nemesis ({SCHEMA_VERSION})"
            )
        for statement in SCHEMA:
            conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
