"""Live re-tuning through the admin API while messages flow: each change shows in the ledger.

The handler answers every request after 200 ms, so the number of requests
open at a moment (the proxy's concurrency) is the number received in the
200 ms before it: the ledger alone shows the worker count.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.metrics import Metrics
from nemesis.runtime.app import Proxy
from nemesis.runtime.workers import WorkerPool, WorkerSlot
from nemesis.testing import HandlerServer, Ledger, LedgerEntry
from tests.operability import (
    AUTH,
    FAST,
    admin_client,
    committed,
    end_offsets,
    first_time,
    integration,
    publish,
    running,
    wait_until_true,
)

DELAY_S = 0.2
WITHIN_S = 1.0


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


def requests(ledger: Ledger) -> list[LedgerEntry]:
    """The first entry of every request, in arrival order."""
    seen: set[int] = set()
    first = []
    for entry in ledger:
        if entry.request not in seen:
            seen.add(entry.request)
            first.append(entry)
    return first


def concurrency(arrivals: list[float], at: float) -> int:
    """Requests open at ``at``: received within the answer delay before it."""
    return sum(1 for received in arrivals if at - DELAY_S < received <= at)


def n_of(entry: LedgerEntry) -> int:
    return int(json.loads(entry.body)["n"])


@pytest.mark.slow
async def test_workers_batch_rate_and_types_change_live_without_loss_or_duplicates(
    broker: EmbeddedBroker,
) -> None:
    count = 3000
    # Every fourth message is a refund: the type disabled at the end.
    await publish(broker, count, consumers=["it"], types=["order.created"] * 3 + ["order.refunded"])
    metrics = Metrics()
    async with HandlerServer() as handler:
        handler.delay(DELAY_S)
        config = integration("it", handler.url, delivery={"workers": 4, "buffer": 1000})
        proxy = Proxy(broker, {"it": config}, metrics=metrics, runner_options=FAST)
        async with running(proxy), admin_client(proxy) as admin:
            ledger = handler.ledger

            async def patch(body: dict[str, object]) -> float:
                answer = await admin.patch("/integrations/it", json=body, headers=AUTH)
                assert answer.status_code == 200, answer.text
                return time.monotonic()

            def arrivals() -> list[float]:
                return [entry.received_monotonic for entry in requests(ledger)]

            # 4 workers: never more than 4 requests open.
            await ledger.wait_until(lambda led: led.requests >= 20, timeout_s=10)
            assert max(concurrency(arrivals(), at) for at in arrivals()) <= 4

            # 4 -> 64: within a second, 48 or more requests are open at once.
            grown_at = await patch({"delivery": {"workers": 64}})
            await asyncio.sleep(WITHIN_S + DELAY_S)
            reached = first_time(
                [t for t in arrivals() if t >= grown_at],
                lambda at: concurrency(arrivals(), at) >= 48,
            )
            assert reached is not None
            assert reached - grown_at <= WITHIN_S
            assert proxy.runners["it"].statistics().workers == 64

            # 64 -> 2: busy workers finish their message and leave; within a second, 2 open.
            shrunk_at = await patch({"delivery": {"workers": 2}})
            await asyncio.sleep(WITHIN_S + 1.0)
            later = [t for t in arrivals() if t >= shrunk_at]
            settled = first_time(
                later,
                lambda at: all(concurrency(arrivals(), t) <= 2 for t in later if t >= at),
            )
            assert settled is not None
            assert settled - shrunk_at <= WITHIN_S
            stats = proxy.runners["it"].statistics()
            assert (stats.workers, stats.workers_retiring) == (2, 0)

            # Batches of 10: every request a second after the change is a batch of up to 10.
            batched_at = await patch({"delivery": {"batch": {"size": 10, "max_wait_ms": 20}}})
            await asyncio.sleep(WITHIN_S + 0.5)
            after = [e for e in requests(ledger) if e.received_monotonic >= batched_at + WITHIN_S]
            assert after, "no request after the batch change"
            assert all(e.mode == "batch" and 1 < e.batch_size <= 10 for e in after)
            assert max(e.batch_size for e in after) == 10

            # A rate limit of 20 messages/s: from a second after the change, at most that.
            limited_at = await patch({"rate_limits": {"main": 20}})
            await asyncio.sleep(WITHIN_S + 2.0)
            window = [
                e
                for e in ledger
                if limited_at + WITHIN_S <= e.received_monotonic < limited_at + WITHIN_S + 2.0
            ]
            # Two seconds at 20/s, and one batch that saved its tokens up at the edge.
            assert 0 < len(window) <= 20 * 2 * 1.05 + 10

            # Refunds disabled: none arrives a second after the change.
            disabled_at = await patch({"flags": {"disabled_types": ["order.refunded"]}})
            # The rest at full speed: no limit, 32 workers.
            cleared = await admin.delete(
                "/integrations/it/overrides/rate_limits.main", headers=AUTH
            )
            assert cleared.status_code == 200, cleared.text
            await patch({"delivery": {"workers": 32}})
            created = {n for n in range(count) if n % 4 != 3}
            await ledger.wait_until(
                lambda led: created <= {n_of(e) for e in led}, timeout_s=60, what="all created"
            )
            await wait_until_true(lambda: proxy.runners["it"].statistics().unfinished == 0)
            total = await end_offsets(broker)
            for _ in range(200):
                if await committed(broker, "it") == total:
                    break
                await asyncio.sleep(0.02)
            refunds_late = [
                e
                for e in ledger
                if e.type == "order.refunded" and e.received_monotonic > disabled_at + WITHIN_S
            ]
            assert refunds_late == []
            skipped = proxy.runners["it"].statistics().skipped

    # Nothing was delivered twice because of a change, nothing was lost: every message
    # was delivered once, or skipped as a disabled type, and everything is committed.
    assert handler.ledger.duplicates() == {}
    delivered = [n_of(e) for e in handler.ledger]
    assert len(delivered) == len(set(delivered))
    refunds = {n for n in range(count) if n % 4 == 3}
    assert set(delivered) == created | (refunds & set(delivered))
    assert skipped == len(refunds - set(delivered)) > 0
    assert await committed(broker, "it") == count
    skips = metrics.registry.get_sample_value(
        "nemesis_disabled_type_skips_total", {"integration": "it", "type": "order.refunded"}
    )
    assert skips == skipped


async def test_buffer_change_moves_the_intake_bound_at_once(broker: EmbeddedBroker) -> None:
    await publish(broker, 400, consumers=["it"])
    async with HandlerServer() as handler:
        handler.hang()  # nothing finishes: the buffer fills and stays full
        config = integration("it", handler.url, delivery={"workers": 4, "buffer": 20})
        proxy = Proxy(broker, {"it": config}, runner_options=FAST)
        async with running(proxy), admin_client(proxy) as admin:
            runner = proxy.runners.get("it", None)
            await wait_until_true(lambda: "it" in proxy.runners)
            runner = proxy.runners["it"]
            await wait_until_true(lambda: runner.statistics().unfinished == 20)
            answer = await admin.patch(
                "/integrations/it", json={"delivery": {"buffer": 150}}, headers=AUTH
            )
            assert answer.status_code == 200, answer.text
            await wait_until_true(lambda: runner.statistics().unfinished == 150, timeout_s=1.0)
            handler.release()


async def test_pause_stops_reading_and_resume_reads_again(broker: EmbeddedBroker) -> None:
    await publish(broker, 200, consumers=["it"])
    async with HandlerServer() as handler:
        handler.delay(0.01)
        config = integration("it", handler.url, delivery={"workers": 2, "buffer": 10})
        proxy = Proxy(broker, {"it": config}, runner_options=FAST)
        async with running(proxy), admin_client(proxy) as admin:
            await handler.ledger.wait_until(lambda led: len(led) >= 10)
            paused = await admin.post("/integrations/it/pause", headers=AUTH)
            assert paused.status_code == 200, paused.text
            assert paused.json()["paused"] is True
            await asyncio.sleep(0.5)  # what was read drains
            seen = len(handler.ledger)
            await asyncio.sleep(0.5)
            assert len(handler.ledger) == seen  # nothing new read while paused
            assert (await admin.get("/integrations/it")).json()["state"] == "paused"
            resumed = await admin.post("/integrations/it/resume", headers=AUTH)
            assert resumed.json()["paused"] is False
            assert resumed.json()["drift"] == []  # not paused is what the YAML says
            await handler.ledger.wait_for(200, timeout_s=30)
    assert handler.ledger.duplicates() == {}


async def test_shrinking_cancels_only_idle_workers_and_lets_busy_ones_finish() -> None:
    finished: list[int] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    delivered = asyncio.Event()  # a "delivery" lasts until the test lets it end

    async def work(slot: WorkerSlot) -> None:
        while not slot.retiring:
            slot.idle = True
            try:
                item = await queue.get()
            finally:
                slot.idle = False
            await delivered.wait()  # "delivering": must never be cancelled
            finished.append(item)

    async def until(condition: Callable[[], bool]) -> None:
        await wait_until_true(condition, timeout_s=30, step_s=0.001)

    async with asyncio.TaskGroup() as tasks:
        pool = WorkerPool(tasks, work, name="test")
        pool.resize(8)
        for item in range(3):
            queue.put_nowait(item)
        await until(lambda: pool.busy == 3)  # three workers hold an item, five are idle
        assert pool.size == 8
        pool.resize(1)
        assert pool.size == 1
        # The idle ones left at once; two busy ones retire after their item.
        await until(lambda: (pool.busy, pool.retiring) == (3, 2))
        assert finished == []
        delivered.set()
        await until(lambda: (pool.size, pool.busy, pool.retiring) == (1, 0, 0))
        assert sorted(finished) == [0, 1, 2]
        for item in range(3, 6):
            queue.put_nowait(item)
        pool.resize(3)  # growing again
        await until(lambda: len(finished) == 6)
        assert sorted(finished) == list(range(6))
        assert queue.empty()
        pool.close()
