"""Real SQLite files: waiting for a write lock held elsewhere; the threads connections live on."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from nemesis.broker.embedded import db
from nemesis.errors import BrokerError, BrokerTimeout


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


# --- SqliteThread: one connection, one thread, jobs one at a time ---------------------------


@pytest.fixture
async def thread(tmp_path: Path) -> AsyncIterator[db.SqliteThread]:
    connection = db.SqliteThread(tmp_path / "t.db", "test", busy_timeout_s=5.0)
    await connection.open(5.0)
    yield connection
    await connection.close()


class Gate:
    """A job that blocks its thread until the test lets it go, and says what happened."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = False

    def __call__(self, conn: sqlite3.Connection) -> int:
        self.started.set()
        assert self.release.wait(10)
        self.finished = True
        return 1

    async def wait_started(self) -> None:
        assert await asyncio.to_thread(self.started.wait, 10)


async def test_jobs_run_in_order_on_one_thread_that_owns_the_connection(
    thread: db.SqliteThread,
) -> None:
    seen: list[tuple[int, int]] = []

    def job(n: int) -> Callable[[sqlite3.Connection], int]:
        def run(conn: sqlite3.Connection) -> int:
            seen.append((n, threading.get_ident()))
            return int(conn.execute("SELECT ? * 2", (n,)).fetchone()[0])

        return run

    results = await asyncio.gather(*(thread.run(job(n), timeout_s=5.0) for n in range(50)))

    assert results == [n * 2 for n in range(50)]
    assert [n for n, _ in seen] == list(range(50))
    idents = {ident for _, ident in seen}
    assert len(idents) == 1
    assert threading.get_ident() not in idents


async def test_a_sqlite_error_comes_back_as_a_broker_error_and_the_thread_goes_on(
    thread: db.SqliteThread,
) -> None:
    def not_sqlite(conn: sqlite3.Connection) -> None:
        raise ValueError("not SQLite's")

    with pytest.raises(BrokerError, match="no such table: missing"):
        await thread.run(lambda conn: conn.execute("SELECT * FROM missing"), timeout_s=5.0)
    with pytest.raises(ValueError, match="not SQLite's"):
        await thread.run(not_sqlite, timeout_s=5.0)

    seven = await thread.run(lambda conn: conn.execute("SELECT 7").fetchone()[0], timeout_s=5.0)
    assert seven == 7


async def test_a_job_that_raises_stop_iteration_fails_its_caller_without_hanging_it(
    thread: db.SqliteThread,
) -> None:
    def job(conn: sqlite3.Connection) -> int:
        raise StopIteration

    with pytest.raises(RuntimeError, match="StopIteration"):
        await thread.run(job, timeout_s=5.0)


async def test_on_timeout_the_running_job_ends_whole_and_a_queued_one_never_starts(
    thread: db.SqliteThread,
) -> None:
    running, queued = Gate(), Gate()
    first = asyncio.ensure_future(thread.run(running, timeout_s=0.05))
    await running.wait_started()
    with pytest.raises(BrokerTimeout, match=r"test: no answer within 0.05s"):
        await first
    with pytest.raises(BrokerTimeout):
        await thread.run(queued, timeout_s=0.05)

    running.release.set()
    queued.release.set()
    # The thread is free again: a later job runs, and the abandoned one was skipped.
    assert await thread.run(lambda conn: 5, timeout_s=5.0) == 5
    assert running.finished
    assert not queued.started.is_set()


async def test_a_cancelled_caller_s_queued_job_never_starts(thread: db.SqliteThread) -> None:
    running, queued = Gate(), Gate()
    first = asyncio.ensure_future(thread.run(running, timeout_s=5.0))
    await running.wait_started()
    second = asyncio.ensure_future(thread.run(queued, timeout_s=5.0))
    await asyncio.sleep(0)  # queued behind the running one
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second

    running.release.set()
    queued.release.set()
    assert await first == 1
    assert await thread.run(lambda conn: 5, timeout_s=5.0) == 5
    assert not queued.started.is_set()


async def test_close_ends_the_thread_and_later_jobs_fail(tmp_path: Path) -> None:
    connection = db.SqliteThread(tmp_path / "t.db", "test", busy_timeout_s=5.0)
    await connection.open(5.0)
    owner = await connection.run(lambda conn: threading.current_thread(), timeout_s=5.0)

    await connection.close()

    assert not owner.is_alive()
    assert owner.name == "nemesis-test"
    with pytest.raises(BrokerError, match="test: the connection is closed"):
        await connection.run(lambda conn: 1, timeout_s=5.0)


def test_a_job_that_outlives_its_event_loop_leaves_the_thread_serving(tmp_path: Path) -> None:
    connection = db.SqliteThread(tmp_path / "t.db", "test", busy_timeout_s=5.0)
    slow = Gate()

    async def first_loop() -> None:
        await connection.open(5.0)
        pending = asyncio.ensure_future(connection.run(slow, timeout_s=0.05))
        await slow.wait_started()
        with pytest.raises(BrokerTimeout):
            await pending

    asyncio.run(first_loop())  # closes its loop while the job still runs
    slow.release.set()  # its answer has no loop to go to

    async def second_loop() -> int:
        try:
            three = await connection.run(
                lambda conn: conn.execute("SELECT 3").fetchone()[0], timeout_s=5.0
            )
            return int(three)
        finally:
            await connection.close()

    assert asyncio.run(second_loop()) == 3
    assert slow.finished


async def test_a_full_database_names_the_file_and_the_limit(tmp_path: Path) -> None:
    """SQLITE_FULL with room left on the disk: the file's page limit, named with the file."""
    path = tmp_path / "n.db"
    thread = db.SqliteThread(path, "test", busy_timeout_s=1.0, pragmas=("max_page_count = 40",))
    await thread.open(timeout_s=5)

    def fill(conn: sqlite3.Connection) -> None:
        conn.execute("CREATE TABLE t (b BLOB)")
        for _ in range(200):
            conn.execute("INSERT INTO t VALUES (zeroblob(4000))")

    try:
        with pytest.raises(BrokerError) as info:
            await thread.run(fill, timeout_s=10)
    finally:
        await thread.close()
    assert str(info.value).startswith(
        f"{path}: the database file reached its size limit (PRAGMA max_page_count)"
    )


def test_translate_names_the_file_even_without_a_known_cause(tmp_path: Path) -> None:
    error = sqlite3.OperationalError("no such table: t")
    error.sqlite_errorcode = sqlite3.SQLITE_ERROR
    assert str(db.translate(error, tmp_path / "n.db")) == (
        f"{tmp_path / 'n.db'}: sqlite: no such table: t"
    )
