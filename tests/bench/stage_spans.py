"""Stage recording benchmark: a pipeline's stages as span events against child spans.

The choice docs/tracing.md explains, measured in one process with the
OpenTelemetry SDK: each mode records one attempt span per message with the
SDK's batching processor and an exporter that drops what it is handed (the
export's encoding is the same for both, and counted by tests/bench/tracing.py).
The message runs through pipelines/city-filter.yaml's stages, marked; the
modes differ only in how the marks become telemetry:

* ``no stages``: the attempt span alone, the pipeline run unmarked;
* ``span events``: one event per stage on the attempt span (what Nemesis does);
* ``child spans``: one span per stage, a child of the attempt span.

Each is printed as CPU microseconds per message and as a ratio to ``no
stages``, the modes taking turns, the median of the rounds.

Usage: `python tests/bench/stage_spans.py [--messages N] [--rounds R]`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import (  # noqa: E402
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace import SpanKind, Tracer, set_span_in_context  # noqa: E402

from nemesis.broker.port import Message  # noqa: E402
from nemesis.config.document import parse_yaml  # noqa: E402
from nemesis.pipeline import BuildContext, Pipeline, compile_stages, default_registry  # noqa: E402
from nemesis.runtime.tracing import STAGE_EVENT, StageTrace  # noqa: E402
from tests.bench.delivery import city_order  # noqa: E402


class Dropping(SpanExporter):
    """Takes every batch and keeps nothing."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def city_filter() -> Pipeline:
    path = HERE.parents[1] / "pipelines" / "city-filter.yaml"
    document = parse_yaml(path.read_text(), str(path))
    context = BuildContext(path.parent, "type", frozenset)
    pipeline, problems = compile_stages(
        document, ("stages",), registry=default_registry(), context=context, name="city-filter"
    )
    assert pipeline is not None, problems
    return pipeline


def no_stages(tracer: Tracer, pipeline: Pipeline, message: Message) -> None:
    span = tracer.start_span("process orders", kind=SpanKind.CONSUMER)
    pipeline.process(message)
    span.end()


def span_events(tracer: Tracer, pipeline: Pipeline, message: Message) -> None:
    marked = StageTrace()
    pipeline.process(message, marked.marks)
    span = tracer.start_span("process orders", kind=SpanKind.CONSUMER, start_time=marked.started_ns)
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
    span.end()


def child_spans(tracer: Tracer, pipeline: Pipeline, message: Message) -> None:
    marked = StageTrace()
    pipeline.process(message, marked.marks)
    span = tracer.start_span("process orders", kind=SpanKind.CONSUMER, start_time=marked.started_ns)
    context = set_span_in_context(span)
    for mark in marked.marks:
        child = tracer.start_span(
            mark.stage,
            context=context,
            attributes={"nemesis.stage.outcome": mark.outcome},
            start_time=marked.ns(mark.started),
        )
        child.end(end_time=marked.ns(mark.ended))
    span.end()


MODES: dict[str, Callable[[Tracer, Pipeline, Message], None]] = {
    "no stages": no_stages,
    "span events": span_events,
    "child spans": child_spans,
}


def main(args: argparse.Namespace) -> None:
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Dropping(), max_queue_size=1 << 16))
    tracer = provider.get_tracer("bench")
    pipeline = city_filter()
    messages = [
        Message("orders", 0, n, value) for n, value in enumerate(city_order(n) for n in range(1000))
    ]
    cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, run in MODES.items():
            started = time.process_time()
            for n in range(args.messages):
                run(tracer, pipeline, messages[n % len(messages)])
            cpu[mode].append((time.process_time() - started) / args.messages * 1e6)
    provider.shutdown()
    stages = len(pipeline.stages)
    print(f"\nStage recording benchmark ({args.messages:,} messages a round, {stages} stages)")
    base = statistics.median(cpu["no stages"])
    for mode in MODES:
        median = statistics.median(cpu[mode])
        print(
            f"  {mode:<12} {median:>6.1f} us CPU per message   x{median / base:.2f} of no stages"
            f"   (rounds: {', '.join(f'{c:.1f}' for c in cpu[mode])})"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    main(parser.parse_args())
