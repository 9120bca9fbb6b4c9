"""The dry run for pull-request review: a pipeline over a sample of real messages.

``nemesis test-pipelines PIPELINE --sample FILE`` prints, per stage, how many
messages reached it, passed, were filtered and failed, and the time per
message, so a reviewer sees "this filter drops 74%" before it is merged.

The sample is JSON lines. A line is one message's payload as it is, or an
envelope with the message around it, as in pipeline tests::

    {"order": {"city": "msk", "amount": 1500}}
    {"payload": {"order": {...}}, "metadata": {"type": "order.created"}, "key": "o-1"}
    {"raw": "bytes as text", "metadata": {...}}

An object is taken as an envelope when its keys are all among payload, raw,
key, metadata, topic, partition and offset and it has payload or raw. A
line that is not JSON is a payload too (the pipeline decides what to do with
it, as it would in production).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter

import orjson

from nemesis.broker.port import Message
from nemesis.pipeline.compiled import Pipeline, StageStats, Verdict
from nemesis.pipeline.compiler import load_pipeline
from nemesis.pipeline.registry import StageRegistry
from nemesis.pipeline.stage import BuildContext

ENVELOPE_KEYS = frozenset({"payload", "raw", "key", "metadata", "topic", "partition", "offset"})


@dataclass(frozen=True, slots=True)
class DryRunReport:
    """What a pipeline did with a sample, overall and per stage."""

    pipeline: str
    sample: str
    messages: int
    passed: int
    filtered: int
    dead: int
    seconds: float  # wall time spent in Pipeline.process, all messages
    stages: tuple[StageStats, ...]
    dead_reasons: Mapping[str, int] = field(default_factory=dict)

    @property
    def seconds_per_message(self) -> float:
        return self.seconds / self.messages if self.messages else 0.0

    def format(self) -> str:
        """A table per stage and a summary line, for a terminal or a PR comment."""
        lines = [f"dry run of {self.pipeline} over {self.sample}: {self.messages} messages"]
        header = ("stage", "type", "in", "passed", "filtered", "failed", "drops", "us/msg")
        rows = [header] + [
            (
                stage.stage,
                stage.type,
                str(stage.processed),
                str(stage.passed),
                str(stage.filtered),
                str(stage.failed),
                f"{stage.filtered_share:.1%}",
                f"{stage.mean_duration_s * 1e6:.2f}",
            )
            for stage in self.stages
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines += [
            "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
            for row in rows
        ]
        lines.append(
            f"result: {self.passed} pass ({_share(self.passed, self.messages)}),"
            f" {self.filtered} filtered ({_share(self.filtered, self.messages)}),"
            f" {self.dead} dead-lettered ({_share(self.dead, self.messages)});"
            f" {self.seconds_per_message * 1e6:.2f} us per message in the pipeline"
        )
        if self.dead_reasons:
            reasons = ", ".join(f"{reason}: {n}" for reason, n in sorted(self.dead_reasons.items()))
            lines.append(f"dead-letter reasons: {reasons}")
        return "\n".join(lines)


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def read_sample(path: Path, *, topic: str = "sample") -> Iterator[Message]:
    """The messages of a JSON-lines sample file; blank lines are skipped."""
    with path.open("rb") as lines:
        offset = 0
        for line in lines:
            text = line.strip()
            if not text:
                continue
            yield sample_message(text, offset, topic)
            offset += 1


def sample_message(line: bytes, offset: int, topic: str = "sample") -> Message:
    """One sample line as a message (see the module docstring for the two forms)."""
    try:
        data = orjson.loads(line)
    except orjson.JSONDecodeError:
        return Message(topic, 0, offset, line)
    if not (
        isinstance(data, dict)
        and data.keys() <= ENVELOPE_KEYS
        and ("payload" in data or "raw" in data)
    ):
        return Message(topic, 0, offset, line)
    raw = data.get("raw")
    value = raw.encode() if isinstance(raw, str) else orjson.dumps(data.get("payload"))
    metadata = data.get("metadata")
    key = data.get("key")
    partition = data.get("partition")
    return Message(
        topic=str(data.get("topic", topic)),
        partition=partition if isinstance(partition, int) else 0,
        offset=offset,
        value=value,
        key=None if key is None else str(key),
        metadata=(
            {str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, dict) else {}
        ),
    )


def dry_run(
    pipeline: Pipeline, messages: Iterable[Message], *, sample: str = "sample"
) -> DryRunReport:
    """Runs ``pipeline`` over ``messages``; build the pipeline with its own meters."""
    passed = filtered = dead = count = 0
    reasons: dict[str, int] = {}
    seconds = 0.0
    process = pipeline.process
    clock = perf_counter
    for message in messages:
        start = clock()
        result = process(message)
        seconds += clock() - start
        count += 1
        if result.verdict is Verdict.PASS:
            passed += 1
        elif result.verdict is Verdict.FILTERED:
            filtered += 1
        else:
            dead += 1
            reason = result.reason or "unknown"
            reasons[reason] = reasons.get(reason, 0) + 1
    return DryRunReport(
        pipeline=pipeline.name,
        sample=sample,
        messages=count,
        passed=passed,
        filtered=filtered,
        dead=dead,
        seconds=seconds,
        stages=pipeline.statistics().stages,
        dead_reasons=reasons,
    )


def dry_run_file(
    pipeline_file: Path,
    sample_file: Path,
    *,
    registry: StageRegistry | None = None,
    disabled_types: Collection[str] = (),
    type_key: str = "type",
    env: Mapping[str, str] | None = None,
) -> DryRunReport:
    """Loads a pipeline file and dry-runs it over a JSON-lines sample.

    Raises ConfigError for an invalid pipeline, OSError for an unreadable sample.
    """
    types = frozenset(disabled_types)
    context = BuildContext(pipeline_file.parent, type_key, lambda: types)
    pipeline = load_pipeline(pipeline_file, registry=registry, context=context, env=env)
    return dry_run(pipeline, read_sample(sample_file), sample=str(sample_file))
