"""A kill -9 of the proxy on Kafka redelivers at most ``delivery.buffer`` (docs/offsets.md).

The real CLI in subprocesses on the session's Apache Kafka broker, under
names of the case's own (``Namespace``); the helpers are
``test_kafka_e2e.py``'s.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from nemesis.testing import HandlerServer, Ledger
from tests.conftest import Workspace, integration_yaml, kill_hard, stop_gracefully
from tests.kafka_broker import KafkaBroker, Namespace
from tests.test_kafka_e2e import committed, init, kafka_config, publish, wait_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.parametrize("partitions", [1, 4])
async def test_a_crash_redelivers_at_most_delivery_buffer(
    workspace: Workspace, kafka: KafkaBroker, partitions: int
) -> None:
    """What a kill -9 leaves delivered and not committed at the broker (docs/offsets.md)."""
    ns = Namespace()
    topic, name = ns("orders"), ns("loyalty")
    count, kills, buffer = 30_000, 3, 200
    kafka_config(workspace, kafka.bootstrap)
    publish(workspace, topic, count, partitions=partitions)
    rng = random.Random(3)
    above: list[int] = []
    async with HandlerServer() as handler:  # fast: commits, not deliveries, fall behind
        workspace.write_integration(
            name, integration_yaml(name, handler.url, topic=topic, workers=32, buffer=buffer)
        )
        init(workspace)
        for _ in range(kills):
            proxy = await workspace.start("run")
            before = len(handler.ledger)

            def delivering(ledger: Ledger, before: int = before) -> bool:
                return len(ledger) > before + 3000

            await handler.ledger.wait_until(delivering, timeout_s=90)
            await asyncio.sleep(rng.uniform(0.1, 0.5))
            kill_hard(proxy)
            await proxy.wait()
            offsets = await asyncio.to_thread(committed, workspace, topic, name)
            # Delivered by this run and not committed: what the next run delivers again.
            run = list(handler.ledger)[before:]
            above.append(
                len(
                    {
                        (e.partition, e.offset)
                        for e in run
                        if e.done
                        and e.partition is not None
                        and (e.offset or 0) >= offsets[e.partition][0]
                    }
                )
            )
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(count, timeout_s=240)
        await wait_committed(workspace, topic, name, timeout_s=60)
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    print(f"delivered above the committed offsets at each kill: {above} (buffer {buffer})")
    # The bound: the buffer, plus for each partition held back behind a message still in
    # flight, what it held (one such partition at the kill: twice the buffer). One
    # partition cannot be held back while others read: the buffer exactly.
    assert max(above) <= (buffer if partitions == 1 else 2 * buffer), above
