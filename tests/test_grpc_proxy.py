"""A whole Proxy delivering over grpc:// to a real grpcio handler on loopback.

Real parts: the embedded log and the sqlite DLQ under tmp_path, the gRPC
transport the default registry (``nemesis.transports``) makes for
grpc://, and ``GrpcHandler`` serving ``nemesis.v1.HandlerService``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.broker.port import Broker, ConsumerSpec, OutgoingMessage
from nemesis.config.models import EmbeddedBackendConfig, IntegrationConfig
from nemesis.dlq import DeadLetterFilter, Reason, SqliteDeadLetterStore, open_sqlite_dlq
from nemesis.proto.nemesis.v1 import handler_pb2 as pb
from nemesis.runtime.app import Proxy
from nemesis.runtime.runner import RunnerOptions
from tests.test_grpc_delivery import Answer, GrpcHandler

FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=2)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


@pytest.fixture
async def dlq(tmp_path: Path) -> AsyncIterator[SqliteDeadLetterStore]:
    store = await open_sqlite_dlq(tmp_path / "dlq.db")
    yield store
    await store.close()


def integration(url: str, **sections: Any) -> IntegrationConfig:
    document: dict[str, Any] = {
        "name": "it",
        "owners": ["team-it"],
        "source": {"topic": "orders", "consumer": "it"},
        "target": {"url": url, "timeout_s": 2},
        "delivery": {"workers": 8, "buffer": 200},
        "retry": {"tiers": ["100ms", "200ms"]},
        # Failures in these tests are on purpose: the breaker has its own tests.
        "breaker": {"min_requests": 100_000},
    }
    document.update(sections)
    return IntegrationConfig.model_validate(document)


async def publish(broker: EmbeddedBroker, count: int) -> None:
    await broker.admin.create_topic(
        "orders", partitions=2, consumers=[ConsumerSpec("it")], exist_ok=True
    )
    writer = await broker.writer("orders")
    await writer.write(
        [
            OutgoingMessage(
                value=orjson.dumps({"n": n}), key=f"k{n % 7}", metadata={"type": "order.created"}
            )
            for n in range(count)
        ]
    )
    await writer.close()


async def all_committed(broker: Broker, timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while True:
            described = await broker.admin.describe_topic("orders")
            if all(p.committed.get("it") == p.end_offset for p in described.partitions):
                return
            await asyncio.sleep(0.05)


async def run_until(proxy: Proxy, handler: GrpcHandler, delivered: int) -> None:
    task = asyncio.create_task(proxy.run())
    try:
        await handler.wait_for(delivered, timeout_s=30)
        await all_committed(proxy.broker)
    finally:
        proxy.stop()
        await task


def number(event: pb.Event) -> int:
    return int(orjson.loads(event.data)["n"])


async def test_proxy_delivers_every_message_over_grpc(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore
) -> None:
    await publish(broker, 300)
    async with GrpcHandler() as handler:
        proxy = Proxy(
            broker,
            {"it": integration(handler.url)},
            dlq=dlq,
            runner_options=FAST,
        )
        await run_until(proxy, handler, 300)
    events = [event for call in handler.calls for event in call.events]
    assert {call.method for call in handler.calls} == {"Deliver"}
    assert sorted(number(e) for e in events) == list(range(300))
    assert {e.source for e in events} == {"nemesis/it"}
    assert {e.type for e in events} == {"order.created"}
    assert {e.attempt for e in events} == {1}
    assert all(e.HasField("partition_key") and e.HasField("time") for e in events)
    assert await dlq.count(DeadLetterFilter()) == 0


async def test_proxy_delivers_batches_over_grpc(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore
) -> None:
    await publish(broker, 200)
    async with GrpcHandler() as handler:
        config = integration(
            handler.url,
            delivery={"workers": 4, "buffer": 200, "batch": {"size": 25, "max_wait_ms": 20}},
        )
        proxy = Proxy(broker, {"it": config}, dlq=dlq, runner_options=FAST)
        await run_until(proxy, handler, 200)
    assert "DeliverBatch" in {call.method for call in handler.calls}
    assert max(len(call.events) for call in handler.calls) > 1
    assert all(len(call.events) <= 25 for call in handler.calls)
    assert handler.delivered_ids() == {event.id for call in handler.calls for event in call.events}
    assert len(handler.delivered_ids()) == 200


async def test_a_lone_message_of_a_batch_integration_goes_through_deliver_batch(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore
) -> None:
    # A handler that implements only DeliverBatch gets the quiet hours' messages too.
    await publish(broker, 1)
    async with GrpcHandler() as handler:
        config = integration(
            handler.url,
            delivery={"workers": 4, "buffer": 200, "batch": {"size": 25, "max_wait_ms": 0}},
        )
        proxy = Proxy(broker, {"it": config}, dlq=dlq, runner_options=FAST)
        await run_until(proxy, handler, 1)
    assert [(call.method, len(call.events)) for call in handler.calls] == [("DeliverBatch", 1)]


async def test_statuses_retry_dead_letter_and_time_out_through_the_proxy(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore
) -> None:
    await publish(broker, 40)
    seen: dict[int, int] = {}

    def script(events: Sequence[pb.Event]) -> Answer:
        [event] = events
        n = number(event)
        seen[n] = seen.get(n, 0) + 1
        first = seen[n] == 1
        if n == 3:
            return Answer(grpc.StatusCode.INVALID_ARGUMENT, "order 3 has no city")
        if n == 5 and first:
            return Answer(grpc.StatusCode.UNAVAILABLE, "restarting")
        if n == 7 and first:
            return Answer(delay_s=4.0)  # beyond the 2 s deadline
        if n == 9:
            return Answer(trailers=(("nemesis-verdict", "drop"),))
        if n == 11:
            return Answer(trailers=(("nemesis-verdict", "dead"),))
        return Answer()

    async with GrpcHandler(script) as handler:
        # A deadline no answer meets only when it is made to wait (on a busy host a short
        # one would cut ordinary answers too, and retry them).
        config = integration(handler.url, target={"url": handler.url, "timeout_s": 2.0})
        proxy = Proxy(broker, {"it": config}, dlq=dlq, runner_options=FAST)
        # 40 messages; 3, 9 and 11 are never answered plain OK.
        await run_until(proxy, handler, 37)
    attempts = {
        number(event): [e.attempt for c in handler.calls for e in c.events if e.id == event.id]
        for call in handler.calls
        for event in call.events
    }
    assert attempts[3] == [1]  # INVALID_ARGUMENT: dead at once, no retry
    assert attempts[5] == [1, 2]  # UNAVAILABLE: retried from the first tier
    assert attempts[7] == [1, 2]  # the deadline passed: retried
    assert attempts[9] == [1]  # dropped on purpose
    assert attempts[11] == [1]  # dead by verdict
    rows = (await dlq.query(DeadLetterFilter())).rows
    dead = {}
    for row in rows:
        full = await dlq.get(row.id)
        assert full is not None
        dead[orjson.loads(full.payload)["n"]] = full
    assert sorted(dead) == [3, 11]
    assert dead[3].attempts == 1
    assert dead[3].error == "gRPC INVALID_ARGUMENT: order 3 has no city"
    # A gRPC code is not an HTTP status: its own reason, and no http_status.
    assert (dead[3].reason, dead[3].http_status) == (Reason.GRPC_STATUS, None)
    assert (dead[11].reason, dead[11].http_status) == (Reason.VERDICT_DEAD, None)
    assert (dead[3].source_topic, dead[3].source_offset) == ("orders", attempts_offset(handler, 3))


def attempts_offset(handler: GrpcHandler, n: int) -> int:
    return next(e.offset for c in handler.calls for e in c.events if number(e) == n)
