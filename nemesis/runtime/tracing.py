"""OpenTelemetry spans of delivery attempts: the optional ``tracing`` extra (docs/tracing.md).

Each attempt at an event is one span of kind CONSUMER named ``process
<topic>``, a child of the event's trace context (the producer's span, or the
context Nemesis started), with the messaging semantic conventions'
attributes. The handler receives the attempt span as its parent in
``traceparent``, so a trace reads producer -> attempt -> handler, once per
attempt, retries and requeues included.

The pipeline's stages are span events on the attempt's span, one per stage
that ran, named ``nemesis.stage`` with the stage's label, outcome
(passed, transformed, filtered, error) and duration: the span then starts
when the pipeline does. A message a stage filtered or refused still has its
attempt span, which ends there with that outcome. Events rather than child
spans: a stage takes microseconds, and a span of its own would cost the SDK
more than the stage (docs/tracing.md, "What it costs").

A requeued message's attempt spans link to the span of the attempt that
dead-lettered it (``nemesis-last-span``, kept by the dead letter and the
replay), beside being children of the producer's span as every attempt is.

Sampling: a producer's trace follows the producer's sampled flag (the W3C
way: the producer decided); a trace Nemesis started is recorded when its
trace id falls under ``tracing.sample_ratio`` (the SDK's
``TraceIdRatioBased`` rule, so every attempt at one message decides the
same). An attempt that is not recorded still gets a span id of its own and
sends the sampled flag cleared; it costs no SDK span.

Nothing here is imported unless ``tracing.enabled`` is set: without the
extra installed the proxy runs as before, and enabling tracing then fails at
start with the command that installs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter, time_ns
from typing import TYPE_CHECKING, Final

from nemesis.config.models import IntegrationConfig, TracingConfig
from nemesis.delivery.port import DeliveryResult, Event
from nemesis.errors import ConfigError, ConfigProblem
from nemesis.pipeline.compiled import PipelineResult, StageMark, Verdict
from nemesis.topology import META_LAST_SPAN
from nemesis.tracecontext import SAMPLED, TraceContext, new_span_id, parse_traceparent

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Link, Span, Tracer

    from nemesis.runtime.retries import FlowSpec
    from nemesis.runtime.scheduler import Work

INSTALL_HINT: Final = "pip install 'nemesis[tracing]'"
_LOW_64: Final = (1 << 64) - 1


STAGE_EVENT: Final = "nemesis.stage"


class StageTrace:
    """The stages one recorded attempt's pipeline ran, and the wall clock it started at."""

    __slots__ = ("marks", "started", "started_ns")

    def __init__(self) -> None:
        self.started_ns = time_ns()
        self.started = perf_counter()  # the marks' clock
        self.marks: list[StageMark] = []

    def ns(self, moment: float) -> int:
        """A ``perf_counter`` reading of the marks as wall-clock nanoseconds."""
        return self.started_ns + round((moment - self.started) * 1e9)


class DeliveryTracing:
    """The process's span recording: one tracer provider, one tracer per flow."""

    def __init__(self, provider: TracerProvider, *, sample_ratio: float, system: str) -> None:
        from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

        self.provider = provider
        self._bound = TraceIdRatioBased.get_bound_for_rate(sample_ratio)
        self._system = system

    def for_flow(self, config: IntegrationConfig, flow: FlowSpec) -> FlowTracer:
        """The tracer of one flow of one integration."""
        return FlowTracer(
            self.provider.get_tracer("nemesis"),
            integration=config.name,
            flow=flow.name,
            consumer=flow.consumer,
            system=self._system,
            bound=self._bound,
        )

    def shutdown(self) -> None:
        """Exports what is buffered and stops the exporter."""
        self.provider.shutdown()


class FlowTracer:
    """Starts an attempt's spans before its request and ends them with its answer."""

    __slots__ = (
        "_bound",
        "_consumer",
        "_flow",
        "_integration",
        "_offset_key",
        "_otel",
        "_system",
        "_tracer",
    )

    def __init__(
        self,
        tracer: Tracer,
        *,
        integration: str,
        flow: str,
        consumer: str,
        system: str,
        bound: int,
    ) -> None:
        from opentelemetry import trace as otel

        self._tracer = tracer
        # Looked up once: an import statement per request costs more than the span itself.
        self._otel = (
            otel.NonRecordingSpan,
            otel.SpanContext,
            otel.SpanKind,
            otel.TraceFlags,
            otel.TraceState,
            otel.set_span_in_context,
            otel.Status,
            otel.StatusCode,
            otel.Link,
        )
        self._integration = integration
        self._flow = flow
        self._consumer = consumer
        self._system = system
        self._bound = bound
        self._offset_key = "messaging.kafka.offset" if system == "kafka" else "nemesis.offset"

    def _flags(self, trace: TraceContext) -> int:
        """The attempt's trace flags: SAMPLED set exactly when its span is recorded."""
        flags = trace.flags
        if trace.started:
            # Nemesis' own trace: sampled by its trace id, the same way on every attempt.
            low = int(trace.trace_id, 16) & _LOW_64
            flags = flags | SAMPLED if low < self._bound else flags & ~SAMPLED
        return flags

    def stages(self, trace: TraceContext) -> StageTrace | None:
        """Where the pipeline marks its stages for an attempt in ``trace``; None: not recorded."""
        return StageTrace() if self._flags(trace) & SAMPLED else None

    def begin(
        self, events: Sequence[Event], stages: Sequence[StageTrace | None] | None = None
    ) -> list[Span]:
        """One span per event, each a child of its event's trace; the events then carry it.

        ``stages``: per event, what its pipeline marked (``stages``), shown as the
        span's events; the span then starts when the pipeline did.
        """
        otel = self._otel
        NonRecordingSpan, SpanContext, SpanKind, TraceFlags, TraceState = otel[:5]
        set_span_in_context = otel[5]
        spans: list[Span] = []
        batch = len(events)
        for index, event in enumerate(events):
            trace = event.trace
            if trace is None:
                continue
            flags = self._flags(trace)
            if not flags & SAMPLED:
                # Not recorded (ParentBased would drop it): a span id of its own for the
                # handler, without the SDK's span machinery.
                event.trace = TraceContext(
                    trace.trace_id, new_span_id(), flags, trace.state, trace.started
                )
                continue
            state = TraceState.from_header([trace.state]) if trace.state else None
            parent = SpanContext(
                int(trace.trace_id, 16),
                int(trace.span_id, 16),
                is_remote=True,
                trace_flags=TraceFlags(flags),
                trace_state=state,
            )
            message = event.message
            attributes: dict[str, str | int] = {
                "messaging.system": self._system,
                "messaging.operation.name": "process",
                "messaging.operation.type": "process",
                "messaging.destination.name": message.topic,
                "messaging.destination.partition.id": str(message.partition),
                "messaging.consumer.group.name": self._consumer,
                "messaging.message.id": event.id,
                self._offset_key: message.offset,
                "nemesis.integration": self._integration,
                "nemesis.flow": self._flow,
                "nemesis.attempt": event.attempt,
            }
            if batch > 1:
                attributes["messaging.batch.message_count"] = batch
            marked = None if stages is None else stages[index]
            span = self._tracer.start_span(
                f"process {message.topic}",
                context=set_span_in_context(NonRecordingSpan(parent)),
                kind=SpanKind.CONSUMER,
                attributes=attributes,
                links=self._links(message.metadata.get(META_LAST_SPAN)),
                start_time=None if marked is None else marked.started_ns,
            )
            if marked is not None:
                self._stage_events(span, marked)
            own = span.get_span_context()
            event.trace = TraceContext(
                trace.trace_id,
                "%016x" % own.span_id,  # noqa: UP031
                int(own.trace_flags),
                trace.state,
                trace.started,
            )
            spans.append(span)
        return spans

    def _links(self, last_span: str | None) -> list[Link] | None:
        """A requeued message's link to the span of the attempt that dead-lettered it."""
        if last_span is None:
            return None
        parsed = parse_traceparent(last_span)
        if parsed is None:
            return None
        trace_id, span_id, flags = parsed
        SpanContext, TraceFlags, Link = self._otel[1], self._otel[3], self._otel[8]
        context = SpanContext(
            int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(flags)
        )
        return [Link(context, {"nemesis.link": "dead_lettered_attempt"})]

    def _stage_events(self, span: Span, marked: StageTrace) -> None:
        for mark in marked.marks:
            span.add_event(
                STAGE_EVENT,
                {
                    "nemesis.stage.name": mark.stage,
                    "nemesis.stage.outcome": mark.outcome,
                    "nemesis.stage.duration_s": mark.ended - mark.started,
                },
                timestamp=marked.ns(mark.started),
            )

    def stopped(self, event: Event, marked: StageTrace, result: PipelineResult) -> None:
        """Records the span of an attempt its pipeline ended (a stage filtered or refused it)."""
        spans = self.begin([event], [marked])
        Status, StatusCode = self._otel[6:8]
        for span in spans:
            span.set_attribute("nemesis.stage", result.stage or "")
            if result.verdict is Verdict.FILTERED:
                span.set_attribute("nemesis.outcome", "filtered")
            else:
                span.set_attribute("nemesis.outcome", "dead")
                span.set_attribute("error.type", result.reason or "pipeline_error")
                span.set_status(Status(StatusCode.ERROR, result.error or result.reason))
            span.end()

    def end(self, spans: Sequence[Span], result: DeliveryResult | None) -> None:
        """Ends the spans with the attempt's outcome (None: the attempt was cancelled)."""
        Status, StatusCode = self._otel[6:8]
        for span in spans:
            if not span.is_recording():
                span.end()
                continue
            if result is None:
                span.set_attribute("nemesis.outcome", "cancelled")
                span.set_status(Status(StatusCode.ERROR, "cancelled"))
                span.end()
                continue
            outcome = result.outcome
            span.set_attribute("nemesis.outcome", outcome.value)
            if result.status is not None:
                key = (
                    "http.response.status_code"
                    if result.protocol == "http"
                    else "rpc.grpc.status_code"
                )
                span.set_attribute(key, result.status)
            if not outcome.done:
                # The error text is the contract's: one line, redacted, never the payload.
                span.set_attribute("error.type", outcome.value)
                span.set_status(Status(StatusCode.ERROR, result.error or outcome.value))
            span.end()


def note_attempts(works: Sequence[Work], events: Sequence[Event]) -> None:
    """Notes on each message the span of its recorded attempt, for a dead letter to keep."""
    for work, event in zip(works, events, strict=True):
        trace = event.trace
        if trace is not None and trace.sampled:
            work.last_span = trace.traceparent


def delivery_tracing(config: TracingConfig, system: str) -> DeliveryTracing | None:
    """The span recording ``tracing`` asks for; None when off.

    Raises ``ConfigError`` when it is on and the ``tracing`` extra is not installed.
    """
    if not config.enabled:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as exc:
        problem = ConfigProblem(
            file="nemesis.yaml",
            line=None,
            field="tracing.enabled",
            message=f"the OpenTelemetry SDK is not installed ({exc.name}): {INSTALL_HINT}",
        )
        raise ConfigError([problem]) from exc
    # Every span has a parent (the event's trace): ParentBased follows its sampled flag,
    # which begin() sets for the traces Nemesis started.
    provider = TracerProvider(
        resource=Resource.create({"service.name": config.service_name}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    exporter = (
        OTLPSpanExporter(endpoint=config.otlp_endpoint)
        if config.otlp_endpoint
        else OTLPSpanExporter()
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return DeliveryTracing(provider, sample_ratio=config.sample_ratio, system=system)
