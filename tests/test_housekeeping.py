"""DLQ retention runs on its own: expired rows go, fresh ones stay."""

from __future__ import annotations

import asyncio
from pathlib import Path

from nemesis.dlq import DeadLetter, DeadLetterFilter, Reason, open_sqlite_dlq
from nemesis.runtime.housekeeping import enforce_dlq_retention
from nemesis.testing.clock import FakeClock


def letter(offset: int, at: float) -> DeadLetter:
    return DeadLetter(
        integration="it",
        event_id=f"orders:0:{offset}",
        payload=b"{}",
        reason=Reason.HTTP_4XX,
        error="HTTP 422",
        source_topic="orders",
        source_partition=0,
        source_offset=offset,
        dead_lettered_at=at,
    )


async def test_retention_loop_deletes_expired_rows_every_interval(tmp_path: Path) -> None:
    clock = FakeClock(wall_start=1_000_000.0)
    day = 86400.0
    store = await open_sqlite_dlq(tmp_path / "dlq.db", clock=clock, retention_s=30 * day)
    try:
        await store.put([letter(1, clock.time() - 31 * day), letter(2, clock.time() - 29 * day)])
        loop = asyncio.create_task(enforce_dlq_retention(store, interval_s=day, clock=clock))
        await clock.wait_all_tasks_blocked()
        for _ in range(500):
            if await store.count(DeadLetterFilter()) == 1:
                break
            await asyncio.sleep(0.01)
        assert await store.count(DeadLetterFilter()) == 1  # the 31-day-old row went at once
        # The round's result travels back from the store's thread before the loop sleeps:
        # time may only move once it does, or its sleep would start after the jump.
        for _ in range(500):
            if clock.sleepers:
                break
            await asyncio.sleep(0.01)
        clock.advance(2 * day)  # the other one is now 31 days old: the next round takes it
        for _ in range(500):
            if await store.count(DeadLetterFilter()) == 0:
                break
            await asyncio.sleep(0.01)
        assert await store.count(DeadLetterFilter()) == 0
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    finally:
        await store.close()
