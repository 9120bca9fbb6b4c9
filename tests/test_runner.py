"""The runner in-process: ordering, batching, flow control, shutdown and revocation.

Real parts throughout: the embedded log in a SQLite file under tmp_path, and
for the cases that test the wire (connections, hanging answers, delays) the
aiohttp transport and a real handler server on 127.0.0.1. The cases that need
only the handler's answers use ``FakeTransport``, which answers in-process
through the contract's own table.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.broker.embedded.reader import EmbeddedReader
from nemesis.broker.port import ConsumerSpec, Message, OutgoingMessage, TopicReader
from nemesis.clock import SystemClock
from nemesis.config.models import EmbeddedBackendConfig, IntegrationConfig
from nemesis.delivery.http import http_transport
from nemesis.delivery.port import Event
from nemesis.metrics import Metrics
from nemesis.resilience.breaker import CircuitBreaker
from nemesis.runtime.runner import IntegrationRunner, RunnerOptions, RunnerState
from nemesis.testing import FakeRequest, FakeTransport, HandlerServer, LedgerEntry, Reply
from nemesis.testing.clock import FakeClock
from tests.operability import wait_until_true

# The URL of the cases whose transport is a FakeTransport: nothing listens there.
NOWHERE = "http://127.0.0.1:9/"
FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=5)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db"), lease_s=1.0))
    yield opened
    await opened.close()


@pytest.fixture
async def handler() -> AsyncIterator[HandlerServer]:
    async with HandlerServer(seed=1) as server:
        yield server


def config(url: str, **overrides: Any) -> IntegrationConfig:
    document: dict[str, Any] = {
        "name": "it",
        "owners": ["team"],
        "source": {"topic": "orders", "consumer": "it"},
        "target": {"url": url, "timeout_s": 5},
        "delivery": {"workers": 16, "buffer": 200},
        "retry": {"tiers": ["50ms", "100ms"]},
    }
    for key, value in overrides.items():
        document[key] = {**document.get(key, {}), **value} if isinstance(value, Mapping) else value
    return IntegrationConfig.model_validate(document)


async def publish(
    broker: EmbeddedBroker, count: int, *, keys: int | None = None, partitions: int = 4
) -> None:
    await broker.admin.create_topic(
        "orders", partitions=partitions, consumers=[ConsumerSpec("it")], exist_ok=True
    )
    writer = await broker.writer("orders")
    batch = [
        OutgoingMessage(
            value=orjson.dumps({"n": n}),
            key=f"k{n % keys}" if keys else None,
            partition=None if keys else n % partitions,
        )
        for n in range(count)
    ]
    await writer.write(batch)
    await writer.close()


def runner_for(broker: EmbeddedBroker, cfg: IntegrationConfig) -> IntegrationRunner:
    transport = http_transport(
        cfg.target, integration=cfg.name, max_connections=cfg.delivery.workers
    )
    return IntegrationRunner(cfg, broker, transport, options=FAST)


async def committed(broker: EmbeddedBroker, consumer: str = "it") -> dict[int, int]:
    description = await broker.admin.describe_topic("orders")
    return {p.partition: p.committed.get(consumer, 0) for p in description.partitions}


def n_of(entry: LedgerEntry) -> int:
    return int(json.loads(entry.body)["n"])


def n_in(event: Event) -> int:
    return int(json.loads(event.body)["n"])


async def test_key_ordering_holds_a_key_behind_its_retried_message(
    broker: EmbeddedBroker, handler: HandlerServer
) -> None:
    await publish(broker, 400, keys=8)
    handler.delay(0.0, 0.01)
    # The first message of key k0 fails twice; nothing later of k0 may arrive before it succeeds.
    handler.when(lambda e: n_of(e) == 0 and e.receipt <= 2, status=503)
    runner = runner_for(broker, config(handler.url, delivery={"ordering": "key", "workers": 16}))
    task = asyncio.create_task(runner.run())
    await handler.ledger.wait_for(400, timeout_s=30)
    runner.stop()
    await task
    by_key: dict[str, list[LedgerEntry]] = defaultdict(list)
    for entry in handler.ledger:
        by_key[entry.key or ""].append(entry)
    for key, entries in by_key.items():
        ns = [n_of(e) for e in entries]
        assert ns == sorted(ns), f"key {key} delivered out of order"
    k0 = [n_of(e) for e in by_key["k0"]]
    assert k0[:3] == [0, 0, 0], k0[:5]
    # Other keys did not wait for k0.
    first_k0_success = next(i for i, e in enumerate(handler.ledger) if n_of(e) == 0 and e.done)
    assert first_k0_success > 8


async def test_partition_ordering_runs_one_message_per_partition(
    broker: EmbeddedBroker, handler: HandlerServer
) -> None:
    await publish(broker, 200)
    handler.delay(0.002)
    runner = runner_for(
        broker, config(handler.url, delivery={"ordering": "partition", "workers": 16})
    )
    task = asyncio.create_task(runner.run())
    await handler.ledger.wait_for(200, timeout_s=30)
    runner.stop()
    await task
    for partition in range(4):
        offsets = [e.offset for e in handler.ledger if e.partition == partition]
        assert offsets == list(range(50))
    # At most 4 requests (one per partition) were ever open at once.
    assert handler.connections <= 4


async def test_batches_by_size_or_wait(broker: EmbeddedBroker) -> None:
    await publish(broker, 1000)
    transport = FakeTransport()
    cfg = config(NOWHERE, delivery={"workers": 4, "batch": {"size": 50, "max_wait_ms": 20}})
    runner = IntegrationRunner(cfg, broker, transport, options=FAST)
    task = asyncio.create_task(runner.run())
    await wait_until_true(lambda: len(transport.done_ids()) == 1000, timeout_s=30)
    await wait_until_true(lambda: runner.statistics().outstanding == 0)
    runner.stop()
    await task
    assert all(r.batch for r in transport.requests)
    assert max(len(r.events) for r in transport.requests) == 50
    assert len(transport.requests) < 1000 / 10
    assert await committed(broker) == {p: 250 for p in range(4)}


async def test_a_batch_integration_sends_a_lone_message_as_a_batch_of_one(
    broker: EmbeddedBroker,
) -> None:
    # A handler that implements only batches must get a quiet hour's messages too,
    # and their retries: every request of a batch integration is a batch.
    await publish(broker, 1)
    transport = FakeTransport(lambda request: Reply(503 if request.number == 1 else 200))
    cfg = config(NOWHERE, delivery={"workers": 4, "batch": {"size": 50, "max_wait_ms": 0}})
    runner = IntegrationRunner(cfg, broker, transport, options=FAST)
    task = asyncio.create_task(runner.run())
    await wait_until_true(lambda: len(transport.done_ids()) == 1, timeout_s=30)
    runner.stop()
    await task
    assert [(r.batch, len(r.events), r.events[0].attempt) for r in transport.requests] == [
        (True, 1, 1),
        (True, 1, 2),
    ]


async def test_poison_message_stalls_neither_other_partitions_nor_memory(
    broker: EmbeddedBroker, handler: HandlerServer
) -> None:
    buffer = 50
    await publish(broker, 2000)
    poison_id = "orders:0:10"
    rule = handler.fail_ids({poison_id}, status=503)
    runner = runner_for(broker, config(handler.url, delivery={"buffer": buffer, "workers": 8}))
    task = asyncio.create_task(runner.run())
    # Partitions 1-3 are delivered in full while partition 0 is stuck at offset 10.
    await handler.ledger.wait_until(
        lambda ledger: sum(1 for e in ledger if e.done and e.partition != 0) >= 1500, timeout_s=30
    )
    for _ in range(20):  # keeps retrying the poison message meanwhile, with bounded memory
        stats = runner.statistics()
        assert stats.unfinished <= buffer
        assert stats.outstanding <= buffer + FAST.max_receive
        await asyncio.sleep(0.05)
    assert stats.paused_partitions == 1
    assert (await committed(broker))[0] == 10
    assert len(handler.ledger.by_id(poison_id)) > 3
    # The handler is fixed: the partition resumes and everything is delivered and committed.
    handler.remove(rule)
    await handler.ledger.wait_for(2000, timeout_s=30)
    await asyncio.sleep(0.1)
    runner.stop()
    await task
    assert await committed(broker) == {p: 500 for p in range(4)}


async def test_graceful_stop_commits_what_finished_and_nothing_more(
    broker: EmbeddedBroker, handler: HandlerServer
) -> None:
    await publish(broker, 2000)
    handler.delay(0.005, 0.02)
    runner = runner_for(broker, config(handler.url))
    task = asyncio.create_task(runner.run())
    await handler.ledger.wait_for(300, timeout_s=30)
    runner.stop()
    await task
    done_offsets = {(e.partition, e.offset) for e in handler.ledger if e.done}
    for partition, offset in (await committed(broker)).items():
        assert all((partition, o) in done_offsets for o in range(offset))
    # A second run delivers the rest; only what was in flight at the stop comes twice.
    second = runner_for(broker, config(handler.url))
    task = asyncio.create_task(second.run())
    await handler.ledger.wait_for(2000, timeout_s=30)
    second.stop()
    await task
    assert len(handler.ledger.duplicates()) == 0  # drained: nothing was left in flight
    assert await committed(broker) == {p: 500 for p in range(4)}


class _CountingClock(FakeClock):
    """A fake clock counting the sleeps of each length."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeps: Counter[float] = Counter()

    async def sleep(self, seconds: float) -> None:
        self.sleeps[seconds] += 1
        await super().sleep(seconds)


async def test_an_idle_flow_commits_nothing_until_it_reads_again(
    broker: EmbeddedBroker, handler: HandlerServer
) -> None:
    await publish(broker, 100)
    clock = _CountingClock()
    cfg = config(handler.url)
    transport = http_transport(cfg.target, integration=cfg.name, max_connections=4)
    runner = IntegrationRunner(cfg, broker, transport, options=FAST, clock=clock)
    async with clock.autojump(0.002):
        task = asyncio.create_task(runner.run())
        try:
            await handler.ledger.wait_for(100, timeout_s=30)
            await wait_until_true(lambda: runner.statistics().outstanding == 0)
            ticks = clock.sleeps[FAST.commit_interval_s]
            await clock.sleep(25 * FAST.commit_interval_s)  # nothing to commit all along
            assert clock.sleeps[FAST.commit_interval_s] <= ticks + 1
            # The next read wakes the commits up again.
            await publish(broker, 40)
            await handler.ledger.wait_for(140, timeout_s=30)
            await wait_until_true(lambda: runner.statistics().outstanding == 0)
        finally:
            runner.stop()
            await task
    assert sum((await committed(broker)).values()) == 140


class _ShiftedClock(SystemClock):
    """The system clock, ``offset_s`` away from the broker's."""

    def __init__(self, offset_s: float) -> None:
        self.offset_s = offset_s

    def time(self) -> float:
        return super().time() + self.offset_s


async def _deliver_with_metrics(
    broker: EmbeddedBroker,
    transport: FakeTransport,
    count: int,
    clock: SystemClock,
    batch: int = 1,
) -> Metrics:
    metrics = Metrics()
    cfg = config(NOWHERE, delivery={"batch": {"size": batch, "max_wait_ms": 20}})
    runner = IntegrationRunner(cfg, broker, transport, options=FAST, metrics=metrics, clock=clock)
    task = asyncio.create_task(runner.run())
    try:
        await wait_until_true(lambda: len(transport.done_ids()) >= count, timeout_s=30)
        await wait_until_true(lambda: runner.statistics().outstanding == 0)
    finally:
        runner.stop()
        await task
    return metrics


def _age(metrics: Metrics, sample: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(
        f"nemesis_delivery_age_seconds_{sample}", {"integration": "it", "flow": "main", **labels}
    )
    assert value is not None, f"no {sample} sample"
    return value


async def test_delivery_age_counts_each_accepted_message_once_from_its_write(
    broker: EmbeddedBroker,
) -> None:
    await publish(broker, 200)

    def answer(request: FakeRequest) -> Reply:
        (event,) = request.events
        # A tenth fail at first: retried in place, their age counts once, when accepted.
        if n_in(event) % 10 == 0 and event.attempt == 1:
            return Reply(503)
        # Eight are dropped by the handler: finished, but not accepted.
        if n_in(event) % 25 == 7:
            return Reply(200, {"nemesis-verdict": "drop"})
        return Reply(200)

    transport = FakeTransport(answer)
    # The runner's clock 0.3 s ahead of the broker's: every message is at least that old.
    metrics = await _deliver_with_metrics(broker, transport, 200, _ShiftedClock(0.3))
    assert len(transport.requests) >= 220
    assert _age(metrics, "count") == 192
    assert _age(metrics, "bucket", le="0.25") == 0
    assert 0.3 <= _age(metrics, "sum") / 192 < 30


async def test_delivery_age_counts_each_message_of_a_batch(broker: EmbeddedBroker) -> None:
    await publish(broker, 200)
    transport = FakeTransport()
    metrics = await _deliver_with_metrics(broker, transport, 200, _ShiftedClock(0.3), batch=20)
    assert len(transport.requests) < 200
    assert _age(metrics, "count") == 200
    assert _age(metrics, "bucket", le="0.25") == 0
    assert 0.3 <= _age(metrics, "sum") / 200 < 30


@pytest.mark.parametrize("batch", [1, 10])
async def test_delivery_age_is_never_negative_when_the_broker_clock_runs_ahead(
    broker: EmbeddedBroker, batch: int
) -> None:
    await publish(broker, 50)
    transport = FakeTransport()
    metrics = await _deliver_with_metrics(broker, transport, 50, _ShiftedClock(-3600.0), batch)
    assert _age(metrics, "bucket", le="0.001") == 50
    assert _age(metrics, "sum") == 0


async def test_revoked_partitions_are_not_committed_by_the_old_owner(
    broker: EmbeddedBroker, handler: HandlerServer, tmp_path: Path
) -> None:
    await publish(broker, 40)  # 10 per partition: all of them in flight at once
    handler.hang()
    first = runner_for(broker, config(handler.url, delivery={"workers": 40, "buffer": 100}))
    first_task = asyncio.create_task(first.run())
    await handler.ledger.wait_until(lambda ledger: len(ledger) == 40, timeout_s=10)
    # A second process joins the consumer: two partitions move to it.
    other = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db"), lease_s=1.0))
    try:
        second = runner_for(other, config(handler.url))
        second_task = asyncio.create_task(second.run())
        # The old owner lets go of two partitions at its next heartbeat; the new one takes them.
        await handler.ledger.wait_until(lambda ledger: len(ledger) > 40, timeout_s=10)
        handler.reset()  # answers everything held, 200 from now on
        await handler.ledger.wait_until(lambda ledger: len(ledger) >= 60, timeout_s=10)
        await asyncio.sleep(0.3)
        second.stop()
        first.stop()
        await asyncio.gather(first_task, second_task)
    finally:
        await other.close()
    # The moved partitions were delivered again by the new owner: the old owner's
    # acknowledgements of its dead sessions were never committed.
    redelivered = {(e.partition, e.offset) for e in handler.ledger if e.receipt > 1}
    moved = {p for p, _ in redelivered}
    assert len(moved) == 2
    assert redelivered == {(p, o) for p in moved for o in range(10)}
    assert await committed(broker) == {p: 10 for p in range(4)}


def _writes_in_a_task(log: list[str]) -> FakeTransport:
    """A transport that sends each request in a task of its own, as aiohttp does on Python 3.11."""

    async def send(event: Event) -> None:
        log.append(f"sent {event.message.offset}")

    async def answer(request: FakeRequest) -> Reply:
        assert not request.batch
        await asyncio.create_task(send(request.events[0]))
        return Reply(200)

    return FakeTransport(answer)


async def test_a_woken_worker_sends_before_the_intake_reads_again(
    broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Latency: the intake's round back to the reader must not sit between a
    # message's admission and its request going out.
    log: list[str] = []
    receive = EmbeddedReader.receive

    async def logged_receive(self: EmbeddedReader, max_messages: int, timeout_s: float) -> Any:
        log.append("receive")
        got = await receive(self, max_messages, timeout_s)
        log.extend(f"read {m.offset}" for m in got)
        return got

    monkeypatch.setattr(EmbeddedReader, "receive", logged_receive)
    await publish(broker, 0, partitions=1)
    cfg = config(NOWHERE, delivery={"workers": 4})
    runner = IntegrationRunner(cfg, broker, _writes_in_a_task(log), options=FAST)
    task = asyncio.create_task(runner.run())
    try:
        writer = await broker.writer("orders")
        for n in range(3):
            await writer.write([OutgoingMessage(value=orjson.dumps({"n": n}), partition=0)])
            await wait_until_true(lambda n=n: f"sent {n}" in log, timeout_s=10)
        await writer.close()
    finally:
        runner.stop()
        await task
    for n in range(3):
        read = log.index(f"read {n}")
        assert log[read + 1 : read + 3] == [f"sent {n}", "receive"], log[read - 1 : read + 4]


async def test_the_breaker_hears_the_answers_of_a_turn_in_their_order(
    broker: EmbeddedBroker,
) -> None:
    # Delivered answers are settled together once per turn of the loop; a failure in the
    # same turn must still find the successes before it in the breaker's window (and the
    # failure policy its view of the handler's health).
    await publish(broker, 11, partitions=1)
    cfg = config(NOWHERE, delivery={"workers": 16})
    # Every request is held until the gate opens, then all are answered in one turn.
    gate = asyncio.Event()

    async def answer(request: FakeRequest) -> Reply:
        await gate.wait()
        return Reply(503 if request.events[0].message.offset == 10 else 204)

    transport = FakeTransport(answer)
    breaker = CircuitBreaker(cfg.breaker)
    seen: list[tuple[int, int]] = []
    record = breaker.record

    def spied(healthy: bool, attempt: int = 1) -> None:
        stats = breaker.statistics()
        seen.append((stats.window_requests, stats.window_failures))
        record(healthy, attempt)

    breaker.record = spied  # type: ignore[method-assign]
    runner = IntegrationRunner(cfg, broker, transport, breaker=breaker, options=FAST)
    task = asyncio.create_task(runner.run())
    try:
        await wait_until_true(lambda: transport.in_flight == 11, timeout_s=10)
        gate.set()
        await wait_until_true(lambda: bool(seen), timeout_s=10)
        stats = runner.statistics()
    finally:
        runner.stop()
        await task
    assert seen[0] == (10, 0)
    assert (stats.requests, stats.attempted) == (11, 11)
    assert breaker.statistics().window_requests >= 11


async def test_a_failure_settling_a_turn_of_answers_fails_the_run_instead_of_stalling(
    broker: EmbeddedBroker,
) -> None:
    # The delivered answers are settled by a callback of the loop, where an exception
    # would only be logged and the messages left unacknowledged for ever.
    await publish(broker, 20, partitions=1)
    cfg = config(NOWHERE)
    breaker = CircuitBreaker(cfg.breaker)

    def broken(count: int) -> None:
        raise RuntimeError("a listener failed")

    breaker.record_healthy = broken  # type: ignore[method-assign]
    transport = FakeTransport(lambda request: Reply(204))
    runner = IntegrationRunner(cfg, broker, transport, breaker=breaker, options=FAST)
    with pytest.raises(ExceptionGroup) as raised:
        await asyncio.wait_for(runner.run(), timeout=10)
    assert raised.group_contains(RuntimeError, match="a listener failed")
    assert runner.state is RunnerState.STOPPED


class _HeldCommits:
    """A real reader whose commits wait until ``release``: a broker slow to confirm them."""

    def __init__(self, reader: TopicReader) -> None:
        self._reader = reader
        self.released = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)

    async def commit(self, messages: Sequence[Message]) -> None:
        await self.released.wait()
        await self._reader.commit(messages)


async def test_what_is_delivered_and_not_committed_stays_within_the_buffer(
    broker: EmbeddedBroker, handler: HandlerServer
) -> None:
    buffer = 50
    await publish(broker, 2000, partitions=1)
    held: list[_HeldCommits] = []

    async def open_reader() -> TopicReader:
        held.append(_HeldCommits(await broker.reader("orders", "it")))
        return cast(TopicReader, held[0])

    cfg = config(handler.url, delivery={"buffer": buffer, "workers": 8})
    transport = http_transport(cfg.target, integration=cfg.name, max_connections=8)
    runner = IntegrationRunner(cfg, broker, transport, options=FAST, open_reader=open_reader)
    task = asyncio.create_task(runner.run())
    await handler.ledger.wait_for(buffer, timeout_s=30)
    # The handler is fast and the commits do not come back: a crash now would deliver
    # again everything delivered so far, so the flow takes no more than the buffer.
    await asyncio.sleep(0.5)
    assert len([e for e in handler.ledger if e.done]) == buffer
    held[0].released.set()
    await handler.ledger.wait_for(2000, timeout_s=60)
    await wait_until_true(lambda: runner.statistics().outstanding == 0)
    runner.stop()
    await task
    assert await committed(broker) == {0: 2000}
