"""SQLite connections that each live on their own thread, and the transactions run on them.

The event loop never touches a ``sqlite3.Connection``. Each connection is
created, used and closed by one worker thread (``SqliteThread``), so jobs
on it run one at a time, in submission order. The embedded broker
(``nemesis.broker.embedded``) and the ``sqlite`` DLQ store both run on
these; a job's ``sqlite3.Error`` comes back as a ``BrokerError`` (a busy
file as ``BrokerTimeout``), which the DLQ store translates into its own tree.

Durability: WAL with ``synchronous=NORMAL`` survives a process kill (the WAL
is written before the commit returns; only an OS crash or power loss can
drop the last transactions). Several processes may open the same file;
writers serialize on ``BEGIN IMMEDIATE`` and wait up to the busy timeout
(see ``write_transaction``).

Faults of the files: no connection maps the database into memory
(``mmap_size=0``), so a file that shrinks or vanishes under the process is an
error on the job that meets it, never a signal. WAL's index (the ``-shm``
file) is memory-mapped whatever the settings: a ``-shm`` truncated under the
process ends it with SIGBUS. The stores that must outlive a fault of their
folder (the DLQ, the fleet's state) open with a rollback journal
(``journal_mode="TRUNCATE"``) and have no ``-shm``. The embedded log keeps
WAL: its readers in other processes read while a writer appends, which a
rollback journal would serialize.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Generic, TypeVar

from nemesis.errors import BrokerError, BrokerTimeout

_log = logging.getLogger(__name__)

T = TypeVar("T")


# An I/O error with less free space than this left is taken for a full disk.
DISK_FULL_BYTES = 1 << 20


def translate(exc: sqlite3.Error, path: Path | None = None) -> BrokerError:
    """Maps a sqlite3 error to the Nemesis tree: a busy or locked file is a timeout.

    The message names the file and, where SQLite's own words hide it, the
    cause an operator acts on: a full disk (SQLite says "disk I/O error" when
    the WAL cannot grow), a read-only file system or folder, a missing folder.
    """
    code = getattr(exc, "sqlite_errorcode", None)
    primary = None if code is None else code & 0xFF
    where = "sqlite" if path is None else str(path)
    if primary in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
        return BrokerTimeout(f"{where}: {exc}")
    if path is not None:
        cause = _cause(primary, path)
        if cause is not None:
            return BrokerError(f"{where}: {cause} (sqlite: {exc})")
    return BrokerError(f"{where}: sqlite: {exc}")


def _cause(primary: int | None, path: Path) -> str | None:
    """Why SQLite could not write or open ``path``, in an operator's words; None if unknown."""
    if primary not in (
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_READONLY,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_PERM,
    ):
        return None
    folder = path.absolute().parent
    try:
        stats = os.statvfs(folder)
    except OSError as exc:
        return f"cannot use the folder {folder}: {exc.strerror or exc}"
    free = stats.f_bavail * stats.f_frsize
    if primary in (sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR) and free < DISK_FULL_BYTES:
        return f"the disk is full ({free} bytes free in {folder}): free space or move the file"
    if primary == sqlite3.SQLITE_FULL:  # with room on the disk: the file's own page limit
        return "the database file reached its size limit (PRAGMA max_page_count)"
    if stats.f_flag & os.ST_RDONLY:
        return f"the file system holding {folder} is mounted read-only"
    if primary == sqlite3.SQLITE_IOERR:
        return None
    # SQLite writes the -wal and -shm files beside the database: the folder must be writable.
    for target, needs in ((folder, os.W_OK | os.X_OK), (path, os.R_OK | os.W_OK)):
        if target.exists() and not os.access(target, needs):
            return f"permission denied: {target} is read-only for this user (uid {os.getuid()})"
    return None


# Waiting for a lock another connection holds. SQLite's own busy handler sleeps
# 1 ms, then 2, 5, 10 ms..., while the write lock is mostly held for a fraction of
# a millisecond (another process's append or offset commit): at 1,000 appends a
# second beside a proxy committing every 100 ms, 0.3-0.45% of appends slept that
# millisecond. A connection that polls (``poll_for_locks``) asks again from 50 us
# on, doubling to 1 ms.
LOCK_POLL_FIRST_S = 50e-6
LOCK_POLL_MAX_S = 0.001


class Connection(sqlite3.Connection):
    """A connection that may wait for locks itself (see ``poll_for_locks``)."""

    lock_wait_ms = 0  # 0: SQLite's busy handler waits


def connect(path: Path, *, busy_timeout_s: float) -> Connection:
    """A connection in autocommit mode (transactions are explicit) for this thread only."""
    return sqlite3.connect(
        path,
        timeout=busy_timeout_s,
        isolation_level=None,  # transactions are explicit: BEGIN IMMEDIATE / COMMIT
        check_same_thread=True,
        factory=Connection,
    )


def poll_for_locks(conn: Connection) -> None:
    """From now on, a lock held elsewhere is waited for in short steps, up to the busy timeout.

    SQLite's busy handler is switched off (switching it for each transaction
    costs as much as the transaction), so every statement that may need the
    write lock must go through ``write_transaction`` or ``when_unlocked``.
    Reads need none in WAL mode, short of recovering from a writer that died
    mid-commit; one that meets that fails as busy (BrokerTimeout: retry).
    """
    conn.lock_wait_ms = int(conn.execute("PRAGMA busy_timeout").fetchone()[0])
    conn.execute("PRAGMA busy_timeout = 0")


def when_unlocked(
    conn: sqlite3.Connection, sql: str, parameters: Sequence[object] = ()
) -> sqlite3.Cursor:
    """``conn.execute(sql, parameters)``, asked again while a lock it needs is held elsewhere.

    For one statement in autocommit mode (or ``BEGIN``): failing busy, it did nothing.
    """
    wait_ms = getattr(conn, "lock_wait_ms", 0)
    if not wait_ms:
        return conn.execute(sql, parameters)
    deadline = None
    pause = LOCK_POLL_FIRST_S
    while True:
        try:
            cursor = conn.execute(sql, parameters)
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc):
                raise
            now = time.monotonic()
            if deadline is None:
                deadline = now + wait_ms / 1000
            elif now >= deadline:
                raise
        else:
            return cursor
        time.sleep(pause)
        pause = min(pause * 2, LOCK_POLL_MAX_S)


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF == sqlite3.SQLITE_BUSY


@contextmanager
def write_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """``BEGIN IMMEDIATE`` ... ``COMMIT``; rolls back on any exception.

    IMMEDIATE takes the write lock up front, so a transaction that reads
    before it writes (end offsets, lease rows) cannot be invalidated by
    another process and fail with SQLITE_BUSY half-way. A connection that
    polls for locks waits for the write lock in steps far shorter than
    SQLite's (see ``LOCK_POLL_FIRST_S``).
    """
    when_unlocked(conn, "BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        # SQLite rolls back by itself on some errors (a full disk, an I/O error): a
        # ROLLBACK then would fail and hide the cause. A COMMIT that failed (busy readers
        # of a rollback journal) may leave it open, and the next BEGIN would fail.
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


@contextmanager
def read_transaction(conn: sqlite3.Connection) -> Iterator[None]:
    """One snapshot for several SELECTs."""
    conn.execute("BEGIN")
    try:
        yield
    finally:
        conn.execute("COMMIT")


# Niceness of the maintenance thread (Linux schedules threads on their own): a checkpoint
# copying the WAL should not take CPU from the event loop on a busy core. With
# tests/bench/delivery.py (e), the latency p99 moved by less than the run-to-run noise (six runs
# each way: 1.3-2.0 ms added with it, 1.5-1.8 ms without); kept because it cannot hurt the loop.
BACKGROUND_NICENESS = 10


def _lower_priority() -> None:
    """Lowers the calling thread's scheduling priority, where the system allows it."""
    if sys.platform != "linux":
        return  # elsewhere the niceness is the whole process's
    with contextlib.suppress(OSError):
        tid = threading.get_native_id()
        os.setpriority(
            os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICENESS
        )


class SqliteThread:
    """One sqlite3 connection owned by one thread; jobs run there one at a time.

    A job goes to the thread through a queue and its result comes back with
    one ``call_soon_threadsafe``; one timer handle keeps its deadline.
    ``run_in_executor`` under ``asyncio.timeout`` did the same with futures
    chained across threads, a condition variable per job and a timeout
    context: 146 us of CPU per job against 81 here at 1,000 jobs a second,
    98 against 37 back to back (``tests/bench/sqlite_thread.py``). A one-message
    append pays that on top of its transaction.

    The thread is a daemon: ``close`` is how a connection is meant to end. A
    process that exits without it loses at most the job in flight, as a kill
    would, and SQLite recovers from that.
    """

    def __init__(
        self,
        path: Path,
        name: str,
        *,
        busy_timeout_s: float,
        pragmas: Sequence[str] = (),
        background: bool = False,
        poll_locks: bool = False,
        journal_mode: str = "WAL",
        journal_fallback: str | None = None,
    ) -> None:
        self._path = path
        self._journal_mode = journal_mode
        self._journal_fallback = journal_fallback
        self._name = name
        self._busy_timeout_s = busy_timeout_s
        self._pragmas = tuple(pragmas)
        self._background = background
        self._poll_locks = poll_locks
        self._jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # started by the first job
        self._conn: sqlite3.Connection | None = None
        self._closed = False

    async def open(self, timeout_s: float) -> None:
        """Connects on the worker thread and applies the pragmas."""
        await self._submit(self._connect, timeout_s)

    async def run(self, job: Callable[[sqlite3.Connection], T], *, timeout_s: float) -> T:
        """Runs ``job(conn)`` on the connection's thread.

        On timeout (BrokerTimeout) or cancellation the job is abandoned, not
        interrupted: one that already started runs to its end (its transaction
        commits or rolls back whole); one still queued never starts.
        """
        return await self._submit(lambda: job(self._connection()), timeout_s)

    def start(
        self, job: Callable[[sqlite3.Connection], T], *, timeout_s: float
    ) -> asyncio.Future[T]:
        """Queues ``job(conn)`` and returns the future of its answer, for several to await.

        Cancelling one awaiting caller does not abandon the job (await the
        future under ``asyncio.shield``); one that has not started within
        ``timeout_s`` never starts, and the future fails with BrokerTimeout.
        """
        work = self._queue(lambda: job(self._connection()), timeout_s)
        return work.future

    async def close(self, timeout_s: float = 5.0) -> None:
        """Closes the connection on its thread, then stops the thread."""
        if self._closed:
            return
        try:
            await self._submit(self._disconnect, timeout_s)
        finally:
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._jobs.put(None)  # the thread ends once it takes this
                # It is idle unless the close timed out; then it is left to finish its
                # job and end on its own rather than block the loop.
                if self._conn is None:
                    thread.join()

    async def _submit(self, job: Callable[[], T], timeout_s: float) -> T:
        work = self._queue(job, timeout_s)
        try:
            return await work.future
        finally:
            # Timed out, cancelled or done: a job that has not started yet never will.
            work.abandoned = True

    def _queue(self, job: Callable[[], T], timeout_s: float) -> _Job[T]:
        if self._closed:
            raise BrokerError(f"{self._name}: the connection is closed")
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._serve, name=f"nemesis-{self._name}", daemon=True
            )
            self._thread.start()
        loop = asyncio.get_running_loop()
        work: _Job[T] = _Job(job, loop.create_future())
        self._jobs.put(work)
        expiry = loop.call_later(timeout_s, work.expire, self._name, timeout_s)

        def answered(_: object) -> None:
            work.abandoned = True  # answered, timed out or cancelled: it need not start now
            expiry.cancel()

        work.future.add_done_callback(answered)
        return work

    def _serve(self) -> None:
        jobs = self._jobs
        while (work := jobs.get()) is not None:
            if work.abandoned:
                continue
            try:
                result = self._translated(work.job)
            except BaseException as exc:  # noqa: BLE001  # the caller's to handle, as from an executor
                work.answer(False, exc)
            else:
                work.answer(True, result)

    def _translated(self, job: Callable[[], T]) -> T:
        try:
            return job()
        except sqlite3.Error as exc:
            raise translate(exc, self._path) from exc

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise BrokerError(f"{self._name}: the connection is not open")
        return self._conn

    def _connect(self) -> None:
        if self._conn is not None:
            return
        if self._background:
            _lower_priority()
        conn = connect(self._path, busy_timeout_s=self._busy_timeout_s)
        try:
            self._configure(conn)
            if self._poll_locks:
                poll_for_locks(conn)
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _configure(self, conn: sqlite3.Connection) -> None:
        wanted = self._journal_mode
        mode = self._switch_journal(conn, wanted)
        if mode != wanted.upper():
            fallback = self._journal_fallback
            if fallback is None or mode != fallback.upper():
                raise BrokerError(f"{self._path}: cannot use journal mode {wanted} (got {mode!r})")
            _log.warning(
                "%s: kept in journal mode %s while another process has it open;"
                " it moves to %s when one opens it alone",
                self._path,
                mode,
                wanted,
            )
        # WAL: the WAL is written before a commit returns, which survives a process kill.
        # A rollback journal: FULL syncs the journal before the database is changed.
        conn.execute("PRAGMA synchronous=NORMAL" if mode == "WAL" else "PRAGMA synchronous=FULL")
        conn.execute("PRAGMA mmap_size=0")  # see the module docstring: errors, not signals
        conn.execute("PRAGMA temp_store=MEMORY")
        conn.execute("PRAGMA cache_size=-16000")
        for pragma in self._pragmas:
            conn.execute(f"PRAGMA {pragma}")

    def _switch_journal(self, conn: sqlite3.Connection, wanted: str) -> str:
        """Sets the journal mode; the mode the file has after it, upper case.

        A file in WAL leaves it only for a connection alone on the file; with
        a fallback of WAL, a file another process holds in WAL is kept so at
        once rather than after the busy timeout.
        """
        fallback = self._journal_fallback
        if fallback is None or fallback.upper() != "WAL":
            return str(conn.execute(f"PRAGMA journal_mode={wanted}").fetchone()[0]).upper()
        if str(conn.execute("PRAGMA journal_mode").fetchone()[0]).upper() != "WAL":
            return str(conn.execute(f"PRAGMA journal_mode={wanted}").fetchone()[0]).upper()
        conn.execute("PRAGMA busy_timeout=0")
        try:
            return str(conn.execute(f"PRAGMA journal_mode={wanted}").fetchone()[0]).upper()
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            return "WAL"
        finally:
            conn.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_s * 1000)}")

    def _disconnect(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class _Job(Generic[T]):
    """One job on its way to a ``SqliteThread`` and its answer on the way back."""

    __slots__ = ("abandoned", "future", "job")

    def __init__(self, job: Callable[[], T], future: asyncio.Future[T]) -> None:
        self.job = job
        self.future = future
        # Set on the loop once nobody waits for the answer; read by the thread
        # before it starts the job (a plain attribute: one word, no lock needed).
        self.abandoned = False

    def answer(self, ok: bool, value: Any) -> None:
        """Called on the thread: hands the result (or the exception) to the loop."""
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            self.future.get_loop().call_soon_threadsafe(self._settle, ok, value)

    def _settle(self, ok: bool, value: Any) -> None:
        if self.future.done():
            return  # timed out or cancelled meanwhile
        if ok:
            self.future.set_result(value)
        elif isinstance(value, StopIteration):
            # A future refuses StopIteration (it would end the awaiting coroutine).
            self.future.set_exception(RuntimeError(f"job raised StopIteration: {value}"))
        else:
            self.future.set_exception(value)

    def expire(self, name: str, timeout_s: float) -> None:
        """Called on the loop when the job's time is up."""
        self.abandoned = True
        if not self.future.done():
            self.future.set_exception(BrokerTimeout(f"{name}: no answer within {timeout_s:g}s"))
