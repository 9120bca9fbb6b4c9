"""A compiled pipeline: stages run in order over one message, synchronously.

The result of a message is a value (``PipelineResult``):

* PASS: deliver ``payload``. That is ``message.value`` itself (the same
  object) when no stage changed the document, so an unchanged message is
  never encoded again; otherwise the document encoded as JSON, with
  ``content_type`` saying so.
* FILTERED: a stage dropped the message on purpose; it is acknowledged and
  committed like a delivered one.
* DEAD: a stage could not handle the message: dead-letter it with ``reason``
  (``decode_error``, ``type_error``, ``pipeline_error``), the stage's label and
  an error text that never holds payload values.

Each stage is timed (one ``perf_counter`` call per stage boundary) and
counted on a ``StageMeter``: plain numbers the Prometheus families and
``statistics()`` read. Given a list, ``process`` also appends a ``StageMark``
per stage it ran (the span of a recorded attempt shows them,
``nemesis.runtime.tracing``); without one it marks nothing.
"""

from __future__ import annotations

import enum
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import TYPE_CHECKING, Final, NamedTuple

import orjson

from nemesis.broker.port import Message

if TYPE_CHECKING:
    from nemesis.config.models import IntegrationConfig
from nemesis.pipeline.stage import PIPELINE_ERROR, Envelope, Stage, StageFailure
from nemesis.stage_meter import STAGE_BUCKETS_S, StageMeter

JSON_CONTENT_TYPE: Final = "application/json"

# Stages run over arbitrary data. A stage bug that one odd message triggers must
# dead-letter that message, not take the integration down; these are the errors
# evaluating data raises. Anything else (MemoryError, a cancelled task) propagates.
_DATA_ERRORS = (
    TypeError,
    ValueError,
    LookupError,
    AttributeError,
    ArithmeticError,
    RecursionError,
)


class Verdict(enum.Enum):
    PASS = "pass"
    FILTERED = "filtered"
    DEAD = "dead"


class PipelineResult(NamedTuple):
    """What a pipeline made of one message.

    A named tuple rather than a frozen dataclass: one is built per message,
    and a frozen dataclass costs four times as much to build.
    """

    verdict: Verdict
    # PASS: the bytes to deliver (``message.value`` itself when unchanged).
    payload: bytes | None = None
    # PASS: the content type of a re-encoded payload; None: the message's own.
    content_type: str | None = None
    # FILTERED / DEAD: the label of the stage that decided.
    stage: str | None = None
    # DEAD: decode_error | type_error | pipeline_error, and a short text without payload values.
    reason: str | None = None
    error: str | None = None


# A stage's outcome on one message, as a StageMark names it.
STAGE_PASSED: Final = "passed"  # passed on unchanged
STAGE_TRANSFORMED: Final = "transformed"  # passed on, its document changed
STAGE_FILTERED: Final = "filtered"
STAGE_ERROR: Final = "error"  # the message is dead-lettered by this stage


@dataclass(frozen=True, slots=True)
class PipelineRecipe:
    """How to build an integration's pipeline again, in another process.

    ``key`` tells builds apart: a digest of the config and of the files read.
    """

    key: str
    integration: IntegrationConfig
    pipelines_dir: Path
    integration_file: Path | None = None


class StageMark(NamedTuple):
    """One stage's run over one message: its label, ``perf_counter`` bounds and outcome."""

    stage: str
    started: float
    ended: float
    outcome: str


@dataclass(frozen=True, slots=True)
class StageStats:
    """A snapshot of one stage's counters."""

    stage: str  # the label: configured name or <index>-<type>
    type: str
    passed: int
    filtered: int
    failed: int
    seconds: float  # total time spent in the stage
    details: Mapping[str, int] = field(default_factory=dict)

    @property
    def processed(self) -> int:
        return self.passed + self.filtered + self.failed

    @property
    def mean_duration_s(self) -> float:
        return self.seconds / self.processed if self.processed else 0.0

    @property
    def filtered_share(self) -> float:
        """Share of the messages reaching this stage that it filtered out (0..1)."""
        return self.filtered / self.processed if self.processed else 0.0


@dataclass(frozen=True, slots=True)
class PipelineStats:
    """A snapshot of a pipeline for the admin API and the dry run."""

    name: str
    stages: tuple[StageStats, ...]


@dataclass(frozen=True, slots=True)
class CompiledStage:
    """A stage in a pipeline: what it does, its label, and where it is counted."""

    label: str
    type: str
    stage: Stage
    meter: StageMeter


_PASS = Verdict.PASS
# The tuple constructor without NamedTuple's keyword handling: half the cost, per message.
_new_result = tuple.__new__


class Pipeline:
    """Stages compiled once, run per message by ``process``."""

    __slots__ = ("_filtered", "_steps", "name", "recipe", "sources", "stages")

    def __init__(self, stages: Sequence[CompiledStage] = (), *, name: str = "") -> None:
        self.name = name
        self.stages = tuple(stages)
        # The files it was built from (its pipeline file, descriptor sets) and the digest
        # of each as read: see BuildContext.sources. Set by build_integration_pipeline.
        self.sources: Mapping[Path, str] = {}
        # How to build it again in a worker process (nemesis.pipeline.offload); None: it
        # cannot be (built from a registry of one's own). Set by build_integration_pipeline.
        self.recipe: PipelineRecipe | None = None
        self._steps = tuple(
            (compiled.stage.process, compiled.meter, compiled.label) for compiled in self.stages
        )
        # Filtered results carry nothing per message: one per stage, built once.
        self._filtered = {
            compiled.label: PipelineResult(Verdict.FILTERED, stage=compiled.label)
            for compiled in self.stages
        }

    @classmethod
    def empty(cls, name: str = "") -> Pipeline:
        """The identity pipeline: every message passes unchanged."""
        return cls(name=name)

    @property
    def is_empty(self) -> bool:
        return not self._steps

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(compiled.label for compiled in self.stages)

    def process(self, message: Message, marks: list[StageMark] | None = None) -> PipelineResult:
        """Runs every stage over ``message``; never raises for anything in the message.

        ``marks``: where to append a ``StageMark`` for each stage that ran.
        """
        steps = self._steps
        if not steps:
            return _new_result(PipelineResult, (_PASS, message.value, None, None, None, None))
        envelope = Envelope(message)
        clock = perf_counter
        bounds = STAGE_BUCKETS_S
        changed = False
        # One clock read per stage boundary: a stage ends when the next starts.
        start = clock()
        for process, meter, label in steps:
            if marks is not None:
                # Whether this stage changed the document: the flag is made its own for it.
                changed, envelope.changed = envelope.changed, False
            try:
                keep = process(envelope)
            except StageFailure as failure:
                return self._fail(meter, start, label, failure.reason, failure.text, marks)
            except _DATA_ERRORS as exc:
                # The exception text may quote payload values: keep only its class.
                text = f"{label}: unexpected {type(exc).__name__}"
                return self._fail(meter, start, label, PIPELINE_ERROR, text, marks)
            end = clock()
            elapsed = end - start
            meter.seconds += elapsed
            meter.buckets[bisect_left(bounds, elapsed)] += 1
            if marks is not None:
                outcome = (
                    STAGE_FILTERED
                    if not keep
                    else STAGE_TRANSFORMED
                    if envelope.changed
                    else STAGE_PASSED
                )
                marks.append(StageMark(label, start, end, outcome))
                envelope.changed = envelope.changed or changed
            start = end
            if not keep:
                meter.filtered += 1
                return self._filtered[label]
        if not envelope.changed:
            return _new_result(PipelineResult, (_PASS, message.value, None, None, None, None))
        try:
            payload = orjson.dumps(envelope.document)
        except orjson.JSONEncodeError as exc:
            # A value JSON cannot hold (an integer beyond 64 bits set by a transform).
            text = f"cannot encode the result as JSON: {exc}"
            return PipelineResult(
                Verdict.DEAD, stage=steps[-1][2], reason=PIPELINE_ERROR, error=text
            )
        return PipelineResult(Verdict.PASS, payload, envelope.content_type or JSON_CONTENT_TYPE)

    @staticmethod
    def _fail(
        meter: StageMeter,
        start: float,
        label: str,
        reason: str,
        text: str,
        marks: list[StageMark] | None,
    ) -> PipelineResult:
        end = perf_counter()
        elapsed = end - start
        if marks is not None:
            marks.append(StageMark(label, start, end, STAGE_ERROR))
        meter.seconds += elapsed
        meter.buckets[bisect_left(STAGE_BUCKETS_S, elapsed)] += 1
        meter.failed += 1
        return PipelineResult(Verdict.DEAD, stage=label, reason=reason, error=text)

    def statistics(self) -> PipelineStats:
        """Per stage: passed, filtered, failed, time; for the admin API and the dry run."""
        return PipelineStats(
            self.name,
            tuple(
                StageStats(
                    stage=compiled.label,
                    type=compiled.type,
                    passed=compiled.meter.passed,
                    filtered=compiled.meter.filtered,
                    failed=compiled.meter.failed,
                    seconds=compiled.meter.seconds,
                    details=dict(compiled.stage.details()),
                )
                for compiled in self.stages
            ),
        )

    def __repr__(self) -> str:
        return f"Pipeline({self.name!r}, stages={list(self.labels)})"
