"""Costly pipeline work off the event loop: in worker processes of lower priority.

Every integration of a process shares one event loop. A pipeline that
takes milliseconds per message (parsing and writing a megabyte of JSON)
would hold every other integration's deliveries up for that long, and a
thread does not help: the JSON codec holds the interpreter lock for the
whole of each call. So a runner sends the messages its pipeline is
expected to spend ``OFFLOAD_COST_S`` or more on to ``PipelineProcesses``:

* which messages: ``PipelineCost`` keeps each integration's measured cost
  per payload byte (a moving average over its recent messages, inline or
  in a worker alike) and predicts a message's cost from its size; until a
  first measurement, payloads from ``OFFLOAD_PIPELINE_BYTES`` on go;
* where: worker processes started on first use (spawned, never forked
  from a loop with threads), each running at ``WORKER_NICENESS`` more than
  the proxy: the kernel gives the event loop the CPU whenever it has work,
  and the pipelines what is left (all of it when the loop is idle);
* fairly: an integration has at most one message in the workers at a
  time, and the pool serves them in the order they asked, so integrations
  with costly pipelines take turns instead of one filling the pool;
* alike: the worker builds the pipeline from the same ``PipelineRecipe``
  (the integration's config and files) and returns the same
  ``PipelineResult``; the stages' meters of the worker's run are added to
  the runner's pipeline, so metrics and statistics count it as if inline.
  The disabled types of ``route_by_type`` are sent with each message.

A pipeline without a recipe (built from a registry of one's own, as tests
do) runs its costly messages in a thread instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

from nemesis.broker.port import Message
from nemesis.pipeline.compiled import Pipeline, PipelineRecipe, PipelineResult, StageMark
from nemesis.terminal import inert

if TYPE_CHECKING:
    pass

# Payloads from this size on are offloaded while an integration's cost is not measured yet.
OFFLOAD_PIPELINE_BYTES = 64 * 1024
# Messages predicted to cost the pipeline this long or more run in a worker process. A
# delivery's own work on the loop is tens of microseconds; sending a message to a worker
# and back costs about as much per 100 KB of payload as a millisecond of pipeline.
OFFLOAD_COST_S = 0.001
# Weight of the newest measurement in an integration's cost per byte.
COST_SMOOTHING = 0.2
# Niceness added to worker processes: 10 gives the loop ~90 times their share of a busy core.
WORKER_NICENESS = 10
# Pipelines a worker keeps built, the least recently used dropped first.
WORKER_PIPELINES = 64
# How often a worker checks that the proxy that started it is still its parent.
PARENT_WATCH_S = 1.0

log = logging.getLogger(__name__)

StageDelta = tuple[int, int, float, list[int]]  # filtered, failed, seconds, buckets


class PipelineCost:
    """An integration's measured pipeline cost per payload byte, and the offload decision."""

    __slots__ = ("_per_byte", "threshold_s")

    def __init__(self, threshold_s: float = OFFLOAD_COST_S) -> None:
        self.threshold_s = threshold_s
        self._per_byte: float | None = None  # seconds; None: nothing measured yet

    def costly(self, size: int) -> bool:
        """Whether a message of ``size`` bytes is predicted to cost ``threshold_s`` or more."""
        if self._per_byte is None:
            return size >= OFFLOAD_PIPELINE_BYTES
        return self._per_byte * size >= self.threshold_s

    def record(self, size: int, seconds: float) -> None:
        per_byte = seconds / max(size, 1)
        if self._per_byte is None:
            self._per_byte = per_byte
        else:
            self._per_byte += COST_SMOOTHING * (per_byte - self._per_byte)

    @property
    def per_byte_s(self) -> float | None:
        return self._per_byte


class PipelineProcesses:
    """Worker processes that run costly pipelines (see the module docstring)."""

    def __init__(self, workers: int | None = None, niceness: int = WORKER_NICENESS) -> None:
        # One core is the loop's: the workers take the others, at least one.
        self._workers = workers or max(1, (os.cpu_count() or 1) - 1)
        self._niceness = niceness
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._turns: dict[str, asyncio.Lock] = {}
        self._closed = False
        self._warned: set[str] = set()
        self.offloaded = 0

    async def process(
        self,
        pipeline: Pipeline,
        message: Message,
        disabled_types: Collection[str],
        marks: list[StageMark] | None = None,
    ) -> tuple[PipelineResult, float]:
        """The pipeline's result for ``message`` and the seconds it took, run in a worker.

        Without a recipe (or once closed), in a thread of this process; so too when the
        workers fail (a worker killed, a pipeline its process cannot build): that is
        logged, and a pool that broke is replaced for the next message.
        """
        recipe = pipeline.recipe
        started = time.perf_counter()
        if recipe is None or self._closed:
            result = await asyncio.to_thread(pipeline.process, message, marks)
            return result, time.perf_counter() - started
        # Only what the stages read crosses: no session, a plain dict of metadata.
        bare = dataclasses.replace(message, session=None, metadata=dict(message.metadata))
        name = recipe.integration.name
        turn = self._turns.get(name)
        if turn is None:
            turn = self._turns[name] = asyncio.Lock()
        try:
            async with turn:
                pool = self._executor()
                future = pool.submit(
                    run_in_worker, recipe, bare, frozenset(disabled_types), marks is not None
                )
                result, deltas, seconds, marked = await asyncio.wrap_future(future)
        except Exception as exc:  # noqa: BLE001 - the workers' fault, not the message's
            self._failed(name, exc)
            result = await asyncio.to_thread(pipeline.process, message, marks)
            return result, time.perf_counter() - started
        _add_meters(pipeline, deltas)
        if marks is not None:
            marks.extend(marked)
        self.offloaded += 1
        return result, seconds

    def _failed(self, integration: str, exc: Exception) -> None:
        if isinstance(exc, concurrent.futures.BrokenExecutor):
            # A worker died (killed, out of memory): this pool takes no more work.
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        if integration not in self._warned:
            self._warned.add(integration)
            log.warning(
                "integration %s: its pipeline ran in this process, not in a worker: %s",
                integration,
                inert(f"{type(exc).__name__}: {exc}"),
            )

    def close(self) -> None:
        """Ends the workers; a process() after this runs in a thread."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self._workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(self._niceness,),
            )
        return self._pool


def _add_meters(pipeline: Pipeline, deltas: Sequence[StageDelta]) -> None:
    for compiled, (filtered, failed, seconds, buckets) in zip(
        pipeline.stages, deltas, strict=False
    ):
        meter = compiled.meter
        meter.filtered += filtered
        meter.failed += failed
        meter.seconds += seconds
        counts = meter.buckets
        for index, count in enumerate(buckets):
            counts[index] += count


# --- in the worker ------------------------------------------------------------------


class _Built:
    """A worker's pipelines, by recipe, and the disabled types its route stages read."""

    def __init__(self) -> None:
        self.pipelines: OrderedDict[str, Pipeline] = OrderedDict()
        self.disabled_types: Collection[str] = ()

    def pipeline(self, recipe: PipelineRecipe) -> Pipeline:
        pipeline = self.pipelines.get(recipe.key)
        if pipeline is None:
            from nemesis.pipeline.compiler import build_integration_pipeline

            pipeline = build_integration_pipeline(
                recipe.integration,
                pipelines_dir=recipe.pipelines_dir,
                disabled_types=lambda: self.disabled_types,
                integration_file=recipe.integration_file,
            )
            self.pipelines[recipe.key] = pipeline
            while len(self.pipelines) > WORKER_PIPELINES:
                self.pipelines.popitem(last=False)
        else:
            self.pipelines.move_to_end(recipe.key)
        return pipeline


_built: _Built | None = None  # the worker process's own, set by _start_worker


def _start_worker(niceness: int) -> None:
    global _built  # one per worker process, made as it starts
    _built = _Built()
    with contextlib.suppress(OSError):
        os.nice(niceness)
    # A proxy killed with SIGKILL closes no pipe its workers wait on (each holds both
    # ends of the call queue): they watch for their parent to change and end with it.
    parent = os.getppid()
    threading.Thread(target=_end_with, args=(parent,), name="parent-watch", daemon=True).start()


def _end_with(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_WATCH_S)
    os._exit(0)


def run_in_worker(
    recipe: PipelineRecipe, message: Message, disabled_types: frozenset[str], marking: bool
) -> tuple[PipelineResult, list[StageDelta], float, list[StageMark]]:
    """In a worker: the result, what the stages' meters counted, the seconds it took and,
    when ``marking``, the stages' marks (``perf_counter`` is the host's monotonic clock, so
    their times mean the same in the proxy)."""
    built = _built if _built is not None else _Built()
    pipeline = built.pipeline(recipe)
    built.disabled_types = disabled_types
    before = [
        (m.filtered, m.failed, m.seconds, list(m.buckets))
        for m in (s.meter for s in pipeline.stages)
    ]
    marks: list[StageMark] = []
    started = time.perf_counter()
    result = pipeline.process(message, marks if marking else None)
    seconds = time.perf_counter() - started
    deltas: list[StageDelta] = []
    for compiled, (filtered, failed, spent, buckets) in zip(pipeline.stages, before, strict=True):
        meter = compiled.meter
        deltas.append(
            (
                meter.filtered - filtered,
                meter.failed - failed,
                meter.seconds - spent,
                [now - then for now, then in zip(meter.buckets, buckets, strict=True)],
            )
        )
    return result, deltas, seconds, marks
