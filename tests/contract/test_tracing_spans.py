"""OpenTelemetry spans through the real proxy: producer -> delivery attempts -> handler.

The producer is a third party: the OpenTelemetry SDK's own propagator writes
its span's ``traceparent`` on the record (on Kafka through librdkafka, as a
record header). The handler is a real HTTP server on 127.0.0.1 that
continues the trace with the same propagator, as an instrumented handler
would. Every span goes to the SDK's in-memory exporter; the case reads the
span tree back from it, through a retry tier, the DLQ and a requeue
(docs/tracing.md).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from aiohttp import web
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from nemesis.backends.kafka import KafkaBackendConfig
from nemesis.broker.port import ConsumerSpec, Message, OutgoingMessage
from nemesis.config.models import IntegrationConfig
from nemesis.delivery.port import DeliveryResult, Outcome
from nemesis.dlq import DeadLetterFilter
from nemesis.dlq.requeue import requeue
from nemesis.runtime.app import Proxy
from nemesis.runtime.events import EventFactory
from nemesis.runtime.retries import flows_of
from nemesis.runtime.runner import RunnerOptions
from nemesis.runtime.tracing import DeliveryTracing
from tests.contract.conftest import Backend, embedded_config
from tests.kafka_broker import free_port

pytestmark = pytest.mark.timeout(120)

PROPAGATOR = TraceContextTextMapPropagator()


class TracedHandler:
    """An HTTP handler that continues each request's trace in a SERVER span of its own."""

    def __init__(self, provider: TracerProvider, answers: list[int]) -> None:
        self._tracer = provider.get_tracer("handler")
        self._answers = answers
        self.received: list[dict[str, str]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        headers = {name.lower(): value for name, value in request.headers.items()}
        self.received.append(headers)
        context = PROPAGATOR.extract(headers)
        with self._tracer.start_as_current_span("handle", context=context, kind=SpanKind.SERVER):
            status = self._answers[len(self.received) - 1]
        return web.Response(status=status)

    async def __aenter__(self) -> TracedHandler:
        app = web.Application()
        app.router.add_post("/", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}/"
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> TracerProvider:
    sdk = TracerProvider()
    sdk.add_span_processor(SimpleSpanProcessor(exporter))
    return sdk


async def write_traced_record(backend: Backend, topic: str, carrier: dict[str, str]) -> None:
    """One record with the producer's trace context: a librdkafka header on Kafka."""
    if backend.kind == "kafka":
        kafka = backend.config.backend
        assert isinstance(kafka, KafkaBackendConfig)
        producer = confluent_kafka.Producer({"bootstrap.servers": kafka.bootstrap_servers[0]})
        producer.produce(topic, value=b'{"n": 1}', headers=list(carrier.items()))
        assert producer.flush(30) == 0
        return
    broker = await backend.broker()
    writer = await broker.writer(topic)
    await writer.write([OutgoingMessage(value=b'{"n": 1}', metadata=carrier)])
    await writer.close()


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    """The spans of that name, in the order they started."""
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_time or 0)


async def test_each_attempt_is_a_child_of_the_producers_span_and_the_parent_of_the_handlers(
    backend: Backend, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    ns = backend.names
    broker = await backend.broker()
    dlq = await backend.dlq(broker)
    await broker.admin.create_topic(
        ns("orders"), partitions=1, consumers=[ConsumerSpec(ns("it"))], exist_ok=True
    )
    producer_tracer = provider.get_tracer("shop")
    carrier: dict[str, str] = {}
    with producer_tracer.start_as_current_span("publish orders", kind=SpanKind.PRODUCER) as span:
        PROPAGATOR.inject(carrier)
        producer_span = span.get_span_context()
    await write_traced_record(backend, ns("orders"), carrier)

    tracing = DeliveryTracing(provider, sample_ratio=1.0, system=backend.kind)
    options = RunnerOptions(
        receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=2, tracing=tracing
    )
    # 503: to the retry tier; 422 from the tier: to the DLQ; after the requeue: taken.
    async with TracedHandler(provider, [503, 422, 200]) as handler:
        document: dict[str, Any] = {
            "name": ns("it"),
            "owners": ["team-it"],
            "source": {"topic": ns("orders"), "consumer": ns("it")},
            "target": {"url": handler.url, "timeout_s": 2},
            "retry": {"tiers": ["100ms"]},
            "breaker": {"min_requests": 100_000},
        }
        config = IntegrationConfig.model_validate(document)
        proxy = Proxy(broker, {ns("it"): config}, dlq=dlq, runner_options=options)
        task = asyncio.create_task(proxy.run())
        try:
            for _ in range(1200):
                if await dlq.count(DeadLetterFilter()) >= 1:
                    break
                await asyncio.sleep(0.05)
            rows = (await dlq.query(DeadLetterFilter())).rows
            assert len(rows) == 1
            await requeue(dlq, broker, [rows[0].id], by="alice")
            for _ in range(1200):
                finished = by_name(exporter.get_finished_spans(), f"process {ns('orders')}")
                if len(finished) >= 3:
                    break
                await asyncio.sleep(0.05)
        finally:
            proxy.stop()
            await task

    spans = exporter.get_finished_spans()
    attempts = by_name(spans, f"process {ns('orders')}")
    handled = by_name(spans, "handle")
    assert all(not a.events for a in attempts)  # no pipeline: no stage events
    assert len(attempts) == 3, [s.name for s in spans]
    assert len(handled) == 3
    for number, attempt in enumerate(attempts, start=1):
        context = attempt.context
        assert context is not None
        assert attempt.parent is not None
        # A child of the producer's span, in the producer's trace, every time.
        assert context.trace_id == producer_span.trace_id
        assert attempt.parent.span_id == producer_span.span_id
        assert attempt.parent.is_remote
        assert attempt.kind is SpanKind.CONSUMER
        attributes = dict(attempt.attributes or {})
        # A requeue is the first attempt of the message's replay.
        assert attributes["nemesis.attempt"] == [1, 2, 1][number - 1]
        assert attributes["messaging.system"] == backend.kind
        assert attributes["messaging.operation.type"] == "process"
        assert attributes["messaging.destination.name"] == ns("orders")
        assert attributes["messaging.destination.partition.id"] == "0"
        if number == 1:
            assert attributes["messaging.consumer.group.name"] == ns("it")
        assert attributes["messaging.message.id"] == f"{ns('orders')}:0:0"
        assert attributes["http.response.status_code"] == [503, 422, 200][number - 1]
    assert [a.status.status_code for a in attempts] == [
        StatusCode.ERROR,
        StatusCode.ERROR,
        StatusCode.UNSET,
    ]
    assert [dict(a.attributes or {})["nemesis.flow"] for a in attempts] == [
        "main",
        "retry-1",
        "replay",
    ]
    # Each handler span is the child of the attempt that called it.
    parents = {h.parent.span_id for h in handled if h.parent is not None}
    assert parents == {a.context.span_id for a in attempts if a.context is not None}
    assert {h.context.trace_id for h in handled if h.context is not None} == {
        producer_span.trace_id
    }
    first = attempts[0].context
    assert first is not None
    assert trace.format_span_id(first.span_id) in handler.received[0]["traceparent"]
    # The requeued attempt links to the attempt that dead-lettered the message.
    assert [len(a.links) for a in attempts] == [0, 0, 1]
    [link] = attempts[2].links
    assert (link.context.trace_id, link.context.span_id) == (
        producer_span.trace_id,
        attempts[1].context.span_id if attempts[1].context else None,
    )
    assert dict(link.attributes or {}) == {"nemesis.link": "dead_lettered_attempt"}


def test_sampling_follows_the_producer_and_the_ratio_for_traces_nemesis_starts(
    provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    config = IntegrationConfig.model_validate(
        {
            "name": "it",
            "owners": ["team"],
            "source": {"topic": "orders", "consumer": "it"},
            "target": {"url": "http://127.0.0.1:9/"},
        }
    )
    events = EventFactory(config)
    sampled = f"00-{'ab' * 16}-{'cd' * 8}-01"
    unsampled = f"00-{'12' * 16}-{'34' * 8}-00"
    batch = [
        events(Message("orders", 0, 0, b"{}"), 1),  # Nemesis starts its trace
        events(Message("orders", 0, 1, b"{}", metadata={"traceparent": sampled}), 1),
        events(Message("orders", 0, 2, b"{}", metadata={"traceparent": unsampled}), 1),
    ]
    origins = [event.trace for event in batch]
    tracer = DeliveryTracing(provider, sample_ratio=0.0, system="embedded").for_flow(
        config, flows_of(config)[0]
    )
    spans = tracer.begin(batch)
    tracer.end(spans, DeliveryResult(Outcome.DELIVERED, status=200))
    [recorded] = exporter.get_finished_spans()
    # Only the producer's sampled trace is recorded at a ratio of 0.
    assert recorded.context is not None
    assert trace.format_trace_id(recorded.context.trace_id) == "ab" * 16
    assert dict(recorded.attributes or {})["messaging.batch.message_count"] == 3
    for origin, event in zip(origins, batch, strict=True):
        assert origin is not None
        assert event.trace is not None
        # Each attempt has a span id of its own in its event's trace...
        assert event.trace.trace_id == origin.trace_id
        assert event.trace.span_id != origin.span_id
    # ...and the handler hears whether it was recorded.
    assert [event.trace.sampled for event in batch if event.trace] == [False, True, False]


def stage_events(span: ReadableSpan) -> list[tuple[str, str]]:
    """(stage, outcome) of each stage event on an attempt span, in order."""
    found = []
    for event in span.events:
        assert event.name == "nemesis.stage"
        attributes = dict(event.attributes or {})
        duration = attributes["nemesis.stage.duration_s"]
        assert isinstance(duration, float)
        assert duration >= 0
        assert span.start_time is not None
        assert event.timestamp >= span.start_time
        found.append(
            (str(attributes["nemesis.stage.name"]), str(attributes["nemesis.stage.outcome"]))
        )
    return found


async def wait_for_spans(
    exporter: InMemorySpanExporter, name: str, count: int
) -> list[ReadableSpan]:
    """The finished spans of that name once there are ``count`` (a generous deadline)."""
    for _ in range(1200):
        found = by_name(exporter.get_finished_spans(), name)
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"{len(found)} spans {name!r}, not {count}")


async def test_the_pipelines_stages_are_events_on_the_attempt_span_and_name_the_one_that_ended_it(
    backend: Backend, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    ns = backend.names
    broker = await backend.broker()
    dlq = await backend.dlq(broker)
    await broker.admin.create_topic(
        ns("orders"), partitions=1, consumers=[ConsumerSpec(ns("it"))], exist_ok=True
    )
    writer = await broker.writer(ns("orders"))
    await writer.write(
        [
            OutgoingMessage(value=b'{"amount": 500, "card": "4111"}'),  # both stages
            OutgoingMessage(value=b'{"amount": 5, "card": "4111"}'),  # the filter drops it
            OutgoingMessage(value=b"not json"),  # the decoding before the filter refuses it
        ]
    )
    await writer.close()
    tracing = DeliveryTracing(provider, sample_ratio=1.0, system=backend.kind)
    options = RunnerOptions(
        receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=2, tracing=tracing
    )
    async with TracedHandler(provider, [200]) as handler:
        config = IntegrationConfig.model_validate(
            {
                "name": ns("it"),
                "owners": ["team-it"],
                "source": {"topic": ns("orders"), "consumer": ns("it")},
                "target": {"url": handler.url, "timeout_s": 2},
                "pipeline": [
                    {"filter": {"name": "big-orders", "match": {"amount": {"gt": 100}}}},
                    {"transform": {"name": "no-card", "drop": ["card"]}},
                ],
                "breaker": {"min_requests": 100_000},
            }
        )
        proxy = Proxy(broker, {ns("it"): config}, dlq=dlq, runner_options=options)
        task = asyncio.create_task(proxy.run())
        try:
            attempts = await wait_for_spans(exporter, f"process {ns('orders')}", 3)
        finally:
            proxy.stop()
            await task
    assert len(attempts) == 3
    by_offset = {dict(a.attributes or {})[offset_key(backend)]: a for a in attempts}
    delivered, filtered, refused = by_offset[0], by_offset[1], by_offset[2]
    # In order, each with its outcome; the delivered span covers them and the request.
    # (The compiler puts a decode stage before the first stage that reads the document.)
    assert stage_events(delivered) == [
        ("auto-decode", "passed"),
        ("big-orders", "passed"),
        ("no-card", "transformed"),
    ]
    assert dict(delivered.attributes or {})["nemesis.outcome"] == "delivered"
    [handled] = by_name(exporter.get_finished_spans(), "handle")
    assert handled.parent is not None
    assert delivered.context is not None
    assert handled.parent.span_id == delivered.context.span_id
    assert delivered.events[-1].timestamp <= (handled.start_time or 0)
    # A filtered message: its span says which stage dropped it, and there was no request.
    assert stage_events(filtered) == [("auto-decode", "passed"), ("big-orders", "filtered")]
    attributes = dict(filtered.attributes or {})
    assert (attributes["nemesis.outcome"], attributes["nemesis.stage"]) == (
        "filtered",
        "big-orders",
    )
    assert filtered.status.status_code is StatusCode.UNSET
    # A refused one: which stage, why, and the stage's error text.
    assert stage_events(refused) == [("auto-decode", "error")]
    attributes = dict(refused.attributes or {})
    assert (attributes["nemesis.outcome"], attributes["nemesis.stage"]) == ("dead", "auto-decode")
    assert attributes["error.type"] == "decode_error"
    assert refused.status.status_code is StatusCode.ERROR
    assert len(handler.received) == 1


def offset_key(backend: Backend) -> str:
    return "messaging.kafka.offset" if backend.kind == "kafka" else "nemesis.offset"


async def test_a_message_requeued_with_the_cli_links_to_the_attempt_that_dead_lettered_it(
    tmp_path: Path, provider: TracerProvider, exporter: InMemorySpanExporter
) -> None:
    config = embedded_config(tmp_path)
    (tmp_path / "nemesis.yaml").write_text(
        f"backend: {{kind: embedded, path: {tmp_path / 'nemesis.db'}, lease_s: 30}}\n"
        f"dlq: {{kind: sqlite, path: {tmp_path / 'dlq.db'}}}\n"
        f"data_dir: {tmp_path}\n"
    )
    backend = Backend("embedded", config)
    try:
        broker = await backend.broker()
        dlq = await backend.dlq(broker)
        await broker.admin.create_topic(
            "orders", partitions=1, consumers=[ConsumerSpec("it")], exist_ok=True
        )
        carrier: dict[str, str] = {}
        with provider.get_tracer("shop").start_as_current_span("publish", kind=SpanKind.PRODUCER):
            PROPAGATOR.inject(carrier)
        [published] = by_name(exporter.get_finished_spans(), "publish")
        assert published.context is not None
        await write_traced_record(backend, "orders", carrier)
        tracing = DeliveryTracing(provider, sample_ratio=1.0, system="embedded")
        options = RunnerOptions(
            receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=2, tracing=tracing
        )
        # 422: to the DLQ at once; after the requeue: taken.
        async with TracedHandler(provider, [422, 200]) as handler:
            integration = IntegrationConfig.model_validate(
                {
                    "name": "it",
                    "owners": ["team-it"],
                    "source": {"topic": "orders", "consumer": "it"},
                    "target": {"url": handler.url, "timeout_s": 2},
                    "breaker": {"min_requests": 100_000},
                }
            )
            proxy = Proxy(broker, {"it": integration}, dlq=dlq, runner_options=options)
            task = asyncio.create_task(proxy.run())
            try:
                for _ in range(1200):
                    if await dlq.count(DeadLetterFilter()) >= 1:
                        break
                    await asyncio.sleep(0.05)
                [row] = (await dlq.query(DeadLetterFilter())).rows
                cli = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "nemesis",
                    "dlq",
                    "requeue",
                    row.id,
                    "--yes",
                    "-c",
                    str(tmp_path / "nemesis.yaml"),
                    cwd=tmp_path,
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )
                out, err = await cli.communicate()
                assert cli.returncode == 0, err.decode()
                assert "requeued 1 dead letter(s)" in out.decode()
                attempts = await wait_for_spans(exporter, "process orders", 2)
            finally:
                proxy.stop()
                await task
    finally:
        await backend.close()
    dead, replayed = attempts
    assert dead.context is not None
    assert replayed.context is not None
    # The dead letter kept the span of the attempt that gave up...
    assert row.metadata["nemesis-last-span"] == (
        f"00-{trace.format_trace_id(dead.context.trace_id)}"
        f"-{trace.format_span_id(dead.context.span_id)}-{int(dead.context.trace_flags):02x}"
    )
    # ...and the replay, still a child of the producer's span, links to it.
    for attempt in (dead, replayed):
        assert attempt.parent is not None
        assert attempt.parent.span_id == published.context.span_id
        assert attempt.context is not None
        assert attempt.context.trace_id == published.context.trace_id
    assert dict(replayed.attributes or {})["nemesis.flow"] == "replay"
    [link] = replayed.links
    assert (link.context.trace_id, link.context.span_id) == (
        dead.context.trace_id,
        dead.context.span_id,
    )
    assert not dead.links
    # The handler heard the same trace both times, under each attempt's span.
    assert [h["traceparent"].split("-")[1:3] for h in handler.received] == [
        [trace.format_trace_id(a.context.trace_id), trace.format_span_id(a.context.span_id)]
        for a in (dead, replayed)
        if a.context is not None
    ]
