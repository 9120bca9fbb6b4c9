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
from tests.contract.conftest import Backend
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
