"""Faults of the SQLite DLQ's files: errors for the calls that meet them, never a signal.

Real files throughout: the store in a folder under tmp_path, or on a small
tmpfs mounted for the test (root can mount one, as in CI; where mounting is
refused those tests say so and skip). A store whose files are cut or removed
under it runs in a child process, so that a signal would show as its exit
code instead of ending the test run.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nemesis.dlq import DeadLetter, DeadLetterFilter, Reason, open_sqlite_dlq
from nemesis.errors import DlqError
from tests.test_disk_errors import fill, small_disk

__all__ = ["small_disk"]  # a fixture of this module too

# Opens a store, writes, lets the test's fault happen, then writes on and says how it went.
_CHILD = textwrap.dedent(
    """
    import asyncio, shutil, sys
    from pathlib import Path
    from nemesis.dlq import DeadLetter, Reason, open_sqlite_dlq
    from nemesis.errors import DlqError

    folder, fault = Path(sys.argv[1]), sys.argv[2]

    def letter(n):
        return DeadLetter(
            integration="orders", event_id=f"orders:0:{n}", payload=b"x" * 2000,
            reason=Reason.HTTP_4XX, error="422 no city", source_topic="orders",
            source_partition=0, source_offset=n, http_status=422,
        )

    async def main():
        store = await open_sqlite_dlq(folder / "dlq.db")
        for n in range(20):
            await store.put([letter(n)])
        if fault == "cut":
            for path in folder.iterdir():  # the file and whatever lies beside it
                with open(path, "r+b") as f:
                    f.truncate(0)
        else:
            shutil.rmtree(folder)
        failed = 0
        for n in range(20, 60):
            try:
                await store.put([letter(n)])
            except DlqError as exc:
                failed += 1
                last = exc
        print(f"failed {failed} of 40 puts; the last error: {last if failed else None}")
        await store.close()

    asyncio.run(main())
    """
)


def letter(offset: int, payload: bytes = b'{"order": 1}') -> DeadLetter:
    return DeadLetter(
        integration="orders-to-loyalty",
        event_id=f"orders:0:{offset}",
        payload=payload,
        reason=Reason.HTTP_4XX,
        error=f"422 missing field `city` in order {offset}",
        source_topic="orders",
        source_partition=0,
        source_offset=offset,
        http_status=422,
    )


@pytest.mark.parametrize("fault", ["cut", "removed"])
def test_dlq_files_cut_or_removed_under_the_store_fail_its_calls_not_the_process(
    tmp_path: Path, fault: str
) -> None:
    folder = tmp_path / "dlq"
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), fault],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # WAL's memory-mapped -shm cut under the process: SIGBUS (-7), and not a line of log.
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr}"
    assert child.stdout.startswith("failed "), child.stdout
    assert "Traceback" not in child.stderr


def leave_free(filler: Path, free: int) -> None:
    """Fills the disk with ``filler``, then gives ``free`` bytes back."""
    fill(filler)
    os.truncate(filler, filler.stat().st_size - free)


def change_counter(path: Path) -> int:
    """The file change counter of a SQLite file: one more per commit in rollback mode.

    (In WAL mode it moves only at checkpoints.)
    """
    with path.open("rb") as f:
        f.seek(24)
        return int.from_bytes(f.read(4), "big")


async def test_puts_that_arrive_while_one_commits_share_the_next_commit(tmp_path: Path) -> None:
    path = tmp_path / "dlq.db"
    async with await open_sqlite_dlq(path) as store:
        await store.put([letter(0)])
        before = change_counter(path)
        # Another connection holds the write lock: the first put waits for it, and the
        # ones after it queue behind that one.
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        puts = [asyncio.ensure_future(store.put([letter(n)])) for n in range(1, 21)]
        for _ in range(5):
            await asyncio.sleep(0)
        holder.execute("COMMIT")
        holder.close()
        results = await asyncio.gather(*puts)
        assert [r.inserted for r in results] == [1] * 20
        assert await store.count(DeadLetterFilter()) == 21
        # The first put's commit, then one for the other nineteen (one for all is fine too).
        assert 1 <= change_counter(path) - before <= 2


async def test_a_full_disk_fails_puts_with_the_cause_until_space_is_freed(
    small_disk: Path,
) -> None:
    path = small_disk / "dlq" / "dlq.db"
    async with await open_sqlite_dlq(path) as store:
        await store.put([letter(0)])
        filler = small_disk / "filler"
        fill(filler)
        with pytest.raises(DlqError, match="the disk is full"):
            await store.put([letter(1, payload=os.urandom(64 * 1024))])
        filler.unlink()
        # Nothing of the failed put is left half-done: the store writes on at once.
        assert (await store.put([letter(1, payload=os.urandom(64 * 1024))])).inserted == 1
        assert await store.count(DeadLetterFilter()) == 2


async def test_a_put_that_does_not_fit_fails_alone_in_its_group(small_disk: Path) -> None:
    path = small_disk / "dlq" / "dlq.db"
    async with await open_sqlite_dlq(path) as store:
        await store.put([letter(0)])
        leave_free(small_disk / "filler", 160 * 1024)
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        first = asyncio.ensure_future(store.put([letter(1)]))
        await asyncio.sleep(0.05)  # its job waits for the lock: the next puts make a group
        big = asyncio.ensure_future(store.put([letter(2, payload=os.urandom(400 * 1024))]))
        small = [asyncio.ensure_future(store.put([letter(n)])) for n in range(3, 8)]
        for _ in range(5):
            await asyncio.sleep(0)
        holder.execute("COMMIT")
        holder.close()
        assert (await first).inserted == 1
        assert [(await s).inserted for s in small] == [1] * 5
        with pytest.raises(DlqError, match="the disk is full"):
            await big
        assert await store.count(DeadLetterFilter()) == 7
