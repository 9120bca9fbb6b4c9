"""Embedded log bench: WAL (what the log uses) against a rollback journal, in one run.

A rollback journal (``journal_mode=TRUNCATE``, as the DLQ and the fleet's
SQLite stores keep) has no memory-mapped ``-shm``, so no fault of the files can
end the process with SIGBUS; its price on the embedded log is what this
prints: the append and read rates of tests/bench/delivery.py's part (d), once
per journal mode and round, alternating, and the rollback journal's rates over
WAL's. A round whose log fails (a commit that waited out the busy timeout
behind a read: a rollback journal lets no commit past a reader) is reported
as such.

Usage: `python tests/bench/log_journal.py [--messages N] [--rounds R]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import nemesis.sqlite_thread as sqlite_thread  # noqa: E402
from nemesis.errors import BrokerError  # noqa: E402
from tests.bench.delivery import log_rates  # noqa: E402

MODES = ("WAL", "TRUNCATE")
_open = sqlite_thread.SqliteThread.__init__


def use_journal(mode: str) -> None:
    """Every SQLite connection opened from here on asks for ``mode`` (the bench's switch)."""

    def init(self: sqlite_thread.SqliteThread, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("journal_mode", mode)
        _open(self, *args, **kwargs)

    sqlite_thread.SqliteThread.__init__ = init  # type: ignore[method-assign]


async def main(args: argparse.Namespace) -> None:
    rates: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    failed: dict[str, int] = dict.fromkeys(MODES, 0)
    for n in range(args.rounds):
        for mode in MODES if n % 2 == 0 else MODES[::-1]:
            use_journal(mode)
            with tempfile.TemporaryDirectory(prefix="nemesis-journal-") as tmp:
                try:
                    got = await log_rates(Path(tmp), args.messages)
                except BrokerError as exc:
                    failed[mode] += 1
                    print(f"round {n} {mode}: the log failed: {exc}", flush=True)
                    continue
            print(f"round {n} {mode}: " + ", ".join(f"{k} {v:,.0f}/s" for k, v in got.items()))
            for key, value in got.items():
                rates[mode].setdefault(key, []).append(value)
    for mode in MODES:
        print(f"{mode}: {failed[mode]} of {args.rounds} rounds failed")
    wal, journal = rates["WAL"], rates["TRUNCATE"]
    for key in wal.keys() & journal.keys():
        ratio = statistics.median(journal[key]) / statistics.median(wal[key])
        print(
            f"{key}: WAL {statistics.median(wal[key]):,.0f}/s,"
            f" TRUNCATE {statistics.median(journal[key]):,.0f}/s, TRUNCATE / WAL = {ratio:.2f}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
