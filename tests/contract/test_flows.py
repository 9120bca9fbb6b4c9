"""Retry tiers, the DLQ, requeue and ``nemesis init`` over each backend, end to end.

The same proxy, runner and settler run over the backend under test and its
DLQ store, delivering to a real handler server on 127.0.0.1; retry tiers
are fractions of a second so the cases take seconds.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
import pytest

from nemesis.broker.port import Broker, ConsumerSpec, OutgoingMessage
from nemesis.config.models import IntegrationConfig
from nemesis.dlq import DeadLetterFilter, Reason, Status
from nemesis.dlq.requeue import requeue
from nemesis.runtime.app import Proxy
from nemesis.runtime.init import Outcome, init_backend
from nemesis.runtime.runner import RunnerOptions
from nemesis.testing import HandlerServer, LedgerEntry
from nemesis.topology import META_TRACEPARENT, internal_consumer, replay_topic, tier_topic
from nemesis.tracecontext import parse_traceparent
from tests.contract.conftest import Backend
from tests.kafka_broker import Namespace

pytestmark = pytest.mark.timeout(120)

FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=2)


def integration(ns: Namespace, name: str, url: str, **sections: Any) -> IntegrationConfig:
    """Integration ``name`` (in the case's namespace) reading the case's ``orders``."""
    document: dict[str, Any] = {
        "name": ns(name),
        "owners": [f"team-{name}"],
        "source": {"topic": ns("orders"), "consumer": ns(name)},
        "target": {"url": url, "timeout_s": 2},
        "delivery": {"workers": 8, "buffer": 200},
        "retry": {"tiers": ["200ms", "400ms"]},
        "breaker": {"min_requests": 100_000},  # the breaker has cases of its own
    }
    document.update(sections)
    return IntegrationConfig.model_validate(document)


async def publish(broker: Broker, ns: Namespace, count: int, consumer: str = "it") -> None:
    await broker.admin.create_topic(
        ns("orders"), partitions=2, consumers=[ConsumerSpec(ns(consumer))], exist_ok=True
    )
    writer = await broker.writer(ns("orders"))
    await writer.write(
        [
            OutgoingMessage(value=orjson.dumps({"n": n}), metadata={"type": "order.created"})
            for n in range(count)
        ]
    )
    await writer.close()


def n_of(entry: LedgerEntry) -> int:
    return int(json.loads(entry.body)["n"])


async def test_each_retry_tier_waits_its_delay(backend: Backend) -> None:
    ns = backend.names
    count = 20
    broker = await backend.broker()
    dlq = await backend.dlq(broker)
    await publish(broker, ns, count)
    async with HandlerServer() as handler:
        handler.fail_first(2, status=503)
        proxy = Proxy(
            broker, {ns("it"): integration(ns, "it", handler.url)}, dlq=dlq, runner_options=FAST
        )
        task = asyncio.create_task(proxy.run())
        await handler.ledger.wait_for(count, timeout_s=60)
        proxy.stop()
        await task
    assert await dlq.count(DeadLetterFilter()) == 0
    for event_id in handler.ledger.ids():
        arrivals = handler.ledger.by_id(event_id)
        assert [e.attempt for e in arrivals] == [1, 2, 3]
        # One ce-id, at the source coordinates, on every attempt.
        assert {(e.topic, e.partition, e.offset) for e in arrivals} == {
            (ns("orders"), arrivals[0].partition, arrivals[0].offset)
        }
        first, second, third = (e.received_wall for e in arrivals)
        assert second - first >= 0.2 - 0.01
        assert third - second >= 0.4 - 0.01


async def test_a_rejected_message_is_dead_lettered_once_and_requeue_brings_it_back(
    backend: Backend,
) -> None:
    ns = backend.names
    count = 30
    broker = await backend.broker()
    dlq = await backend.dlq(broker)
    await publish(broker, ns, count)
    async with HandlerServer() as handler:
        handler.when(lambda e: e.attempt is not None and n_of(e) % 5 == 0, status=422)
        proxy = Proxy(
            broker, {ns("it"): integration(ns, "it", handler.url)}, dlq=dlq, runner_options=FAST
        )
        task = asyncio.create_task(proxy.run())
        try:
            await handler.ledger.wait_for(count - count // 5, timeout_s=60)
            for _ in range(600):  # the last moves to the DLQ may trail the deliveries
                if await dlq.count(DeadLetterFilter()) >= count // 5:
                    break
                await asyncio.sleep(0.05)
            rows = (await dlq.query(DeadLetterFilter())).rows
            assert {row.reason for row in rows} == {Reason.HTTP_4XX}
            assert {row.http_status for row in rows} == {422}
            assert sorted(json.loads(row.payload)["n"] for row in rows) == list(range(0, count, 5))
            ids = [row.id for row in rows]

            handler.reset()  # the fix is deployed
            result = await requeue(dlq, broker, ids, by="alice", description="contract")
            assert result.count == count // 5
            await handler.ledger.wait_for(count, timeout_s=60)
        finally:
            proxy.stop()
            await task
    requeued = await dlq.get_many(ids)
    assert {row.status for row in requeued} == {Status.REQUEUED}
    assert {row.requeue_count for row in requeued} == {1}
    # The replay carried the ce-id of the first delivery: one id per source message.
    assert len(handler.ledger.ids()) == count
    assert (await dlq.actions()).rows[0].who == "alice"


async def test_init_carries_the_former_internal_consumers_offsets_over(
    backend: Backend,
) -> None:
    """Internal topics read as the integration's name before: the new consumer starts there."""
    ns = backend.names
    alpha, internal = ns("alpha"), internal_consumer(ns("alpha"))
    broker = await backend.broker()
    await broker.admin.create_topic(ns("orders"), partitions=2)
    tier = tier_topic(alpha, 1)
    await broker.admin.create_topic(tier, partitions=2, consumers=[ConsumerSpec(alpha)])
    writer = await broker.writer(tier)
    await writer.write([OutgoingMessage(b"x", partition=n % 2) for n in range(10)])
    await writer.close()
    await broker.admin.seek(tier, alpha, 0, 3)
    await broker.admin.seek(tier, alpha, 1, 5)
    report = await init_backend(
        backend.config, [integration(ns, "alpha", "http://127.0.0.1:9/")], broker=broker
    )
    assert f"consumer {tier}/{internal}: added ({alpha})" in report.lines()
    described = await broker.admin.describe_topic(tier)
    assert {p.partition: p.committed[internal] for p in described.partitions} == {0: 3, 1: 5}
    # A topic the former consumer never read starts at its oldest message, as any new one.
    assert internal in (await broker.admin.describe_topic(replay_topic(alpha))).consumers


async def test_init_creates_what_a_configuration_needs_and_is_idempotent(
    backend: Backend,
) -> None:
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(ns("orders"), partitions=2)
    configs = [
        integration(ns, "alpha", "http://127.0.0.1:9/"),
        integration(ns, "beta", "http://127.0.0.1:9/", delivery={"ordering": "key"}),
        integration(
            ns,
            "gamma",
            "http://127.0.0.1:9/",
            source={"topic": ns("nowhere"), "consumer": ns("g")},
        ),
    ]
    first = await init_backend(backend.config, configs, broker=broker)
    assert not first.ok
    assert [(s.name, s.integration) for s in first.missing] == [(ns("nowhere"), ns("gamma"))]
    created = {s.name for s in first.steps if s.kind == "topic" and s.outcome is Outcome.CREATED}
    # Unordered alpha gets its tiers; ordered beta retries in place: only its replay topic.
    assert created == {
        tier_topic(ns("alpha"), 1),
        tier_topic(ns("alpha"), 2),
        replay_topic(ns("alpha")),
        replay_topic(ns("beta")),
    }
    orders = await broker.admin.describe_topic(ns("orders"))
    assert orders.consumers == [ns("alpha"), ns("beta")]
    # The internal flows read as a consumer of their own, never the main flow's.
    assert (await broker.admin.describe_topic(tier_topic(ns("alpha"), 2))).consumers == [
        internal_consumer(ns("alpha"))
    ]
    assert first.steps[-1].kind == "dlq"
    assert first.steps[-1].outcome is Outcome.READY

    again = await init_backend(backend.config, configs, broker=broker)
    assert again.changed == ()
    assert [str(s) for s in again.missing] == [f"topic {ns('nowhere')}: missing ({ns('gamma')})"]
    dlq = await backend.dlq(broker)
    assert await dlq.count(DeadLetterFilter()) == 0


async def test_a_producers_trace_context_reaches_the_handler_through_a_tier_the_dlq_and_a_requeue(
    backend: Backend,
) -> None:
    """A producer's W3C trace context on every backend (Kafka headers, YDB and embedded
    metadata) continued unchanged when no span is recorded (docs/tracing.md)."""
    ns = backend.names
    count = 5
    broker = await backend.broker()
    dlq = await backend.dlq(broker)
    await broker.admin.create_topic(
        ns("orders"), partitions=1, consumers=[ConsumerSpec(ns("it"))], exist_ok=True
    )
    traces = {n: (f"00-{n + 1:032x}-{n + 1:016x}-01", f"shop=t{n},edge=e{n}") for n in range(count)}
    writer = await broker.writer(ns("orders"))
    await writer.write(
        [
            OutgoingMessage(
                value=orjson.dumps({"n": n}),
                metadata={"traceparent": parent, "tracestate": state, "x-other": "no"},
            )
            for n, (parent, state) in traces.items()
        ]
    )
    await writer.close()
    async with HandlerServer() as handler:
        handler.when(lambda e: e.receipt == 1, status=503)  # to the retry tier
        handler.when(lambda e: e.receipt == 2, status=422)  # from the tier to the DLQ
        config = integration(ns, "it", handler.url, retry={"tiers": ["100ms"]})
        proxy = Proxy(broker, {ns("it"): config}, dlq=dlq, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        try:
            for _ in range(1200):
                if await dlq.count(DeadLetterFilter()) >= count:
                    break
                await asyncio.sleep(0.05)
            ids = [row.id for row in (await dlq.query(DeadLetterFilter())).rows]
            assert len(ids) == count
            await requeue(dlq, broker, ids, by="alice")
            await handler.ledger.wait_for(count, timeout_s=60)
        finally:
            proxy.stop()
            await task
    arrivals = list(handler.ledger)
    assert len(arrivals) == 3 * count
    for entry in arrivals:
        parent, state = traces[n_of(entry)]
        assert (entry.headers.get("traceparent"), entry.headers.get("tracestate")) == (
            parent,
            state,
        )
        assert "x-other" not in entry.headers  # not on the integration's list


async def test_a_trace_nemesis_starts_goes_on_through_a_tier_the_dlq_and_a_requeue(
    backend: Backend,
) -> None:
    """A record without a trace context gets one at its first attempt, and every later
    attempt continues it: the retry tier's copy, the dead letter and the requeue keep it
    (docs/tracing.md)."""
    ns = backend.names
    count = 4
    broker = await backend.broker()
    dlq = await backend.dlq(broker)
    await publish(broker, ns, count)
    async with HandlerServer() as handler:
        handler.when(lambda e: e.receipt == 1, status=503)  # to the retry tier
        handler.when(lambda e: e.receipt == 2, status=422)  # from the tier to the DLQ
        config = integration(ns, "it", handler.url, retry={"tiers": ["100ms"]})
        proxy = Proxy(broker, {ns("it"): config}, dlq=dlq, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        try:
            for _ in range(1200):
                if await dlq.count(DeadLetterFilter()) >= count:
                    break
                await asyncio.sleep(0.05)
            rows = (await dlq.query(DeadLetterFilter())).rows
            assert len(rows) == count
            await requeue(dlq, broker, [row.id for row in rows], by="alice")
            await handler.ledger.wait_for(count, timeout_s=60)
        finally:
            proxy.stop()
            await task
    arrivals = list(handler.ledger)
    assert len(arrivals) == 3 * count
    by_n: dict[int, set[str]] = {}
    for entry in arrivals:
        parsed = parse_traceparent(entry.headers.get("traceparent"))
        assert parsed is not None, entry.headers
        by_n.setdefault(n_of(entry), set()).add(parsed[0])
    # One trace per message over its three attempts, a different one for each message.
    assert all(len(trace_ids) == 1 for trace_ids in by_n.values()), by_n
    assert len(set().union(*by_n.values())) == count
    # The dead letter shows the trace it carries on.
    kept = {parse_traceparent(row.metadata[META_TRACEPARENT]) for row in rows}
    assert {p[0] for p in kept if p is not None} == set().union(*by_n.values())


async def test_a_cloudevent_records_tracing_extension_is_continued(backend: Backend) -> None:
    """A record in the CloudEvents binding without a ``traceparent`` header: its
    distributed-tracing extension (``ce_traceparent``) is the context the handler continues."""
    ns = backend.names
    broker = await backend.broker()
    await broker.admin.create_topic(
        ns("orders"), partitions=1, consumers=[ConsumerSpec(ns("it"))], exist_ok=True
    )
    parent = f"00-{'ab' * 16}-{'cd' * 8}-01"
    writer = await broker.writer(ns("orders"))
    await writer.write(
        [
            OutgoingMessage(
                value=b'{"n": 0}',
                metadata={
                    "ce_specversion": "1.0",
                    "ce_id": "evt-1",
                    "ce_source": "/shop",
                    "ce_type": "order.created",
                    "ce_traceparent": parent,
                    "ce_tracestate": "shop=1",
                    "content-type": "application/json",
                },
            )
        ]
    )
    await writer.close()
    async with HandlerServer() as handler:
        proxy = Proxy(broker, {ns("it"): integration(ns, "it", handler.url)}, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        try:
            await handler.ledger.wait_for(1, timeout_s=60)
        finally:
            proxy.stop()
            await task
    [entry] = list(handler.ledger)
    assert (entry.headers.get("traceparent"), entry.headers.get("tracestate")) == (parent, "shop=1")
    # The extension itself reaches the handler as it came (the event's own attribute).
    assert entry.headers.get("ce-traceparent") == parent
