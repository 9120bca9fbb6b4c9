"""Crash safety across the retry path: kill -9 while messages move to tiers and the DLQ."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter

import orjson
import pytest

from nemesis.dlq import DeadLetterFilter, open_sqlite_dlq
from nemesis.testing import HandlerServer, Ledger
from tests.conftest import Workspace, integration_yaml, kill_hard, stop_gracefully

pytestmark = pytest.mark.slow


async def test_kill_9_during_retries_and_dead_letters_loses_nothing(workspace: Workspace) -> None:
    count, kills = 3000, 3
    created = workspace.cli("topics", "create", "orders", "--partitions", "4")
    assert created.returncode == 0, created.stderr
    lines = workspace.root / "orders.jsonl"
    lines.write_bytes(b"".join(orjson.dumps({"n": n}) + b"\n" for n in range(count)))
    published = workspace.cli("publish", "orders", "--file", str(lines), "--lines", timeout=120)
    assert published.returncode == 0, published.stderr

    def n_of(body: bytes) -> int:
        return int(json.loads(body)["n"])

    # Every third message fails twice (two trips through the retry tiers), every
    # seventh is rejected for good (the DLQ); the rest are delivered at once.
    rejected = {n for n in range(count) if n % 7 == 0}
    rng = random.Random(4)
    async with HandlerServer(seed=2) as handler:
        handler.delay(0.0, 0.004)
        handler.when(lambda e: n_of(e.body) in rejected, status=422)
        handler.when(lambda e: n_of(e.body) % 3 == 0 and e.receipt <= 2, status=503)
        workspace.write_integration(
            "it",
            integration_yaml(
                "it",
                handler.url,
                workers=16,
                buffer=200,
                tiers=("300ms", "600ms"),
                extra="breaker: {min_requests: 100000}\n",
            ),
        )
        for _ in range(kills):
            proxy = await workspace.start("run")
            before = len(handler.ledger)

            def progressed(ledger: Ledger, before: int = before) -> bool:
                return len(ledger) > before + 200

            await handler.ledger.wait_until(progressed, timeout_s=60)
            await asyncio.sleep(rng.uniform(0.2, 1.5))
            kill_hard(proxy)
            await proxy.wait()
        proxy = await workspace.start("run")
        expected = set(range(count)) - rejected
        try:
            await handler.ledger.wait_for(len(expected), timeout_s=180)
            store = await open_sqlite_dlq(workspace.root / "dlq.db")
            try:
                for _ in range(200):
                    if await store.count(DeadLetterFilter()) >= len(rejected):
                        break
                    await asyncio.sleep(0.1)
                rows = (await store.query(DeadLetterFilter(), None)).rows
                dead_count = await store.count(DeadLetterFilter())
            finally:
                await store.close()
        finally:
            assert await stop_gracefully(proxy) == 0, workspace.logs()
    delivered = Counter(n_of(e.body) for e in handler.ledger if e.done)
    assert set(delivered) == expected, f"lost {sorted(expected - set(delivered))[:10]}"
    # Each rejected message is one DLQ row, however often a crash made it fail again.
    assert dead_count == len(rejected)
    assert all(row.reason.value == "http_4xx" for row in rows)
