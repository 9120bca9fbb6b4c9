"""Write transactions on real SQLite files: waiting for a write lock another connection holds."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nemesis.broker.embedded import db
from nemesis.errors import BrokerTimeout


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A plain connection to a WAL file with one table, as another process would have."""
    conn = sqlite3.connect(tmp_path / "n.db", isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (n INTEGER)")
    yield conn
    conn.close()


WRITER = "waiting-writer"


def write_while_locked(
    holder: sqlite3.Connection, tmp_path: Path, write: Callable[[db.Connection], None]
) -> None:
    """``write`` on its own thread and polling connection, while ``holder`` holds the write lock.

    Checks that it waits, then frees the lock and checks that it finished.
    """
    connected, written = threading.Event(), threading.Event()

    def run() -> None:  # a connection lives on the thread that made it
        ours = db.connect(tmp_path / "n.db", busy_timeout_s=5.0)
        db.poll_for_locks(ours)
        connected.set()
        try:
            write(ours)
            written.set()
        finally:
            ours.close()

    holder.execute("BEGIN IMMEDIATE")
    thread = threading.Thread(target=run, name=WRITER)
    try:
        thread.start()
        assert connected.wait(5)
        time.sleep(0.05)
        assert not written.is_set()  # the lock is held: it waits (without that, fails at once)
    finally:
        holder.execute("COMMIT")
        thread.join(5)
    assert written.is_set()


def test_a_writer_waits_in_short_steps_for_a_lock_held_elsewhere(
    holder: sqlite3.Connection, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pauses: list[float] = []
    real_sleep = time.sleep

    def recording_sleep(seconds: float) -> None:
        if threading.current_thread().name == WRITER:
            pauses.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", recording_sleep)
    timeout_after: list[tuple[int]] = []

    def write(ours: db.Connection) -> None:
        with db.write_transaction(ours):
            ours.execute("INSERT INTO t VALUES (1)")
        timeout_after.append(ours.execute("PRAGMA busy_timeout").fetchone())

    write_while_locked(holder, tmp_path, write)
    assert holder.execute("SELECT n FROM t").fetchall() == [(1,)]
    # From 50 us, doubling, never above 1 ms: SQLite's own first sleep is 1 ms.
    assert pauses[:5] == pytest.approx([50e-6, 100e-6, 200e-6, 400e-6, 800e-6])
    assert max(pauses) == db.LOCK_POLL_MAX_S
    assert len(pauses) > 10
    # SQLite's busy handler is off: the connection does the waiting, up to its busy timeout.
    assert timeout_after == [(0,)]


def test_a_lock_never_released_fails_as_busy_after_the_timeout(
    holder: sqlite3.Connection, tmp_path: Path
) -> None:
    ours = db.connect(tmp_path / "n.db", busy_timeout_s=0.1)
    db.poll_for_locks(ours)
    assert ours.lock_wait_ms == 100
    holder.execute("BEGIN IMMEDIATE")
    try:
        started = time.monotonic()
        with pytest.raises(sqlite3.OperationalError) as raised, db.write_transaction(ours):
            ours.execute("INSERT INTO t VALUES (1)")
        assert time.monotonic() - started >= 0.1
        assert isinstance(db.translate(raised.value), BrokerTimeout)
    finally:
        holder.execute("ROLLBACK")
    assert not ours.in_transaction
    # Once the lock is free the same connection writes.
    with db.write_transaction(ours):
        ours.execute("INSERT INTO t VALUES (2)")
    assert holder.execute("SELECT n FROM t").fetchall() == [(2,)]
    ours.close()


def test_a_plain_connection_leaves_the_waiting_to_sqlite(
    holder: sqlite3.Connection, tmp_path: Path
) -> None:
    plain = sqlite3.connect(tmp_path / "n.db", isolation_level=None, timeout=0.05)
    holder.execute("BEGIN IMMEDIATE")
    try:
        with pytest.raises(sqlite3.OperationalError), db.write_transaction(plain):
            pass
    finally:
        holder.execute("ROLLBACK")
    with db.write_transaction(plain):
        plain.execute("INSERT INTO t VALUES (3)")
    assert holder.execute("SELECT n FROM t").fetchall() == [(3,)]
    plain.close()


def test_a_single_statement_waits_for_the_lock_too(
    holder: sqlite3.Connection, tmp_path: Path
) -> None:
    done: list[int] = []
    write_while_locked(
        holder,
        tmp_path,
        lambda ours: done.append(db.when_unlocked(ours, "INSERT INTO t VALUES (?)", (4,)).rowcount),
    )
    assert done == [1]
    assert holder.execute("SELECT n FROM t").fetchall() == [(4,)]
