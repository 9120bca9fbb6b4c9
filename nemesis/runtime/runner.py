"""The runner of one integration: source -> bounded buffer -> workers -> delivery -> commit.

::

    intake ──> scheduler (ordering) ──> N workers: dispatch ──> transport
      │  bounded: at most delivery.buffer          │ delivered,     │ failed
      │  messages unfinished                       │ dropped        ▼
      │                                            │       settlement: policy.decide
      │                                            ▼         │ tier / DLQ  │ in place, halt
      └──────────── ack tracker <──── ack (done) ──┴─────────┘             └─> scheduler
                         │
                 commit loop: what the source's commit rule allows, per session

A worker's dispatch delivers and measures; what becomes of a message that
failed (a retry tier, the DLQ, a retry in place, a halted key) is decided by
``nemesis.runtime.policy`` alone and carried out by the flow's ``Settlement``.
On an unordered flow, delivered answers are finished together, once per turn
of the event loop (``_settle_turn``): the breaker, the metrics and the
acknowledgements take every answer of that turn in one step, and any other
answer first settles those before it, so nothing sees them out of order.

The runner reads a *source* (``nemesis.broker.source``): a log through its
adapter (``nemesis.broker.logsource``), or a queue. The commit rule is the
source's ``ack_order`` (``nemesis.runtime.acks``): on a log an offset is
committed only when every message before it in its partition is done; on a
queue each finished message is committed on its own. Messages of a dead
session (a revoked partition) are neither delivered further nor committed.

Memory is bounded twice: no more than ``delivery.buffer`` messages are
unfinished at once (intake waits), and no session holds more than
``delivery.buffer`` uncommitted messages (done ones included, waiting behind a
slow or failing one on a log): such a session is paused at the source while
the others flow on. Pauses go through the reader's one record of them
(``nemesis.runtime.pauses``), with their reason and its threshold rule.

Shutdown: stop reading, let the deliveries in flight finish within the grace
period (workers take nothing new: what was read and not started stays
uncommitted, for the next reader), commit what is done under
``asyncio.shield``, then cancel what is left (it is redelivered).

Live settings (``apply``): ``delivery.workers`` resizes the worker pool
(``nemesis.runtime.workers``: a worker holding messages finishes them before it
leaves), ``delivery.buffer`` moves the intake bound at once, ``delivery.batch``
is read by each worker when it starts its next batch, ``flags.disabled_types``
is checked before the pipeline and ``paused`` stops or restarts reading. None
of them touches a message in flight, so a change neither loses nor repeats one.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from nemesis import logs
from nemesis.aio import first_of
from nemesis.broker.logsource import SourceOpener
from nemesis.broker.port import Message, PartitionSession, TopicWriter
from nemesis.broker.source import AckOrder, Releases, Source
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import IntegrationConfig
from nemesis.delivery.port import DeliveryResult, Event, Outcome, Transport
from nemesis.dlq import DeadLetterStore
from nemesis.errors import BrokerError
from nemesis.metrics import LoopCounter, LoopHistogram, Metrics, status_class
from nemesis.pipeline import Pipeline, PipelineResult, Verdict
from nemesis.pipeline.compiled import StageMark
from nemesis.pipeline.offload import PipelineCost, PipelineProcesses
from nemesis.resilience.breaker import BreakerState, CircuitBreaker, is_healthy
from nemesis.resilience.limits import Flow, FlowLimits
from nemesis.runtime.acks import AckTracker, PartitionStats, SessionKey, session_key
from nemesis.runtime.events import EventFactory
from nemesis.runtime.pauses import Pauses, SharesPauses, Why, key_of
from nemesis.runtime.policy import failure_of, pipeline_failure
from nemesis.runtime.retries import (
    FlowSpec,
    attempts_so_far,
    due_at,
    first_failure_at,
    origin,
)
from nemesis.runtime.scheduler import Scheduler, Work
from nemesis.runtime.settle import Settlement
from nemesis.runtime.tracing import DeliveryTracing, StageTrace, note_attempts
from nemesis.runtime.waiting import NOT_WAITING, WaitingStatistics
from nemesis.runtime.workers import WorkerPool, WorkerSlot

log = logging.getLogger(__name__)


class RunnerState(enum.Enum):
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """Knobs of the runner that are not part of an integration's YAML."""

    # How long one receive waits for messages. Long: stop() and pause() interrupt the wait,
    # so an idle flow wakes only at this timeout (see docs/idle-cost.md).
    receive_timeout_s: float = 30.0
    max_receive: int = 500
    commit_interval_s: float = 0.1
    commit_timeout_s: float = 10.0
    shutdown_grace_s: float = 10.0
    # Spans of delivery attempts (the tracing extra); None: none recorded.
    tracing: DeliveryTracing | None = None
    # Where messages costly to the pipeline run (nemesis.pipeline.offload); None: in a thread.
    pipeline_processes: PipelineProcesses | None = None


@dataclass(frozen=True, slots=True)
class RunnerStats:
    """A snapshot of a runner for metrics and the admin API."""

    integration: str
    state: RunnerState
    workers: int
    buffered: int  # read, not yet started by a worker
    in_flight: int  # being delivered right now
    delayed: int  # waiting for a retry in place
    unfinished: int  # read, not done (the buffer's fill)
    outstanding: int  # read, not committed
    messages_read: int
    last_read_at: float | None  # monotonic time messages last arrived
    last_commit_at: float | None
    paused_partitions: int
    partitions: Sequence[PartitionStats] = field(default_factory=tuple)
    flow: str = "main"
    started_at: float = 0.0  # monotonic time the runner was made
    workers_busy: int = 0  # workers holding messages (retiring ones included)
    workers_retiring: int = 0  # shrunk away, finishing their messages
    assigned_partitions: int = 0  # partition sessions the reader holds now
    requests: int = 0  # delivery requests answered (a batch is one)
    request_seconds: float = 0.0  # their summed duration
    attempted: int = 0  # messages those requests carried
    skipped: int = 0  # messages of disabled types, acknowledged without delivery
    halted: int = 0  # keys (or partitions) halted behind a message past its retries
    # Partitions the reader holds and cannot deliver from, by (topic, partition): the reason.
    stalled: Mapping[tuple[str, int], str] = field(default_factory=dict)
    # Dead messages waiting for the dead-letter store, which cannot write now.
    dlq_waiting: WaitingStatistics = NOT_WAITING


class IntegrationRunner:
    """Runs one integration until ``stop()``."""

    def __init__(
        self,
        config: IntegrationConfig,
        source: SourceOpener,
        transport: Transport,
        *,
        flow: FlowSpec | None = None,
        dlq: DeadLetterStore | None = None,
        tier_writers: Sequence[TopicWriter] = (),
        pipeline: Pipeline | None = None,
        breaker: CircuitBreaker | None = None,
        limits: FlowLimits | None = None,
        metrics: Metrics | None = None,
        clock: Clock = SYSTEM_CLOCK,
        options: RunnerOptions = RunnerOptions(),
        owns_transport: bool = True,
    ) -> None:
        self.config = config
        self.name = config.name
        self.flow = flow or FlowSpec("main", config.source.topic, config.source.consumer)
        self._breaker = breaker
        self._limits = limits
        self._limit_flow = Flow(self.flow.limiter)
        # The flow's own limiter: its rate changes in place (apply, set_runners).
        self._limiter = None if limits is None else limits[self._limit_flow]
        # Messages of retry tiers and replays are shown to handlers at their source coordinates.
        self._view: Callable[[Message], Message] = _same if self.flow.name == "main" else origin
        # Opens what the flow reads when it runs: the source of the main flow (a log's
        # topic or a queue), or a retry tier's or the replay topic's reader on the log.
        self._open_source = source
        self._transport = transport
        self._owns_transport = owns_transport
        self._pipeline = pipeline or Pipeline.empty(config.name)
        self._pipeline_cost = PipelineCost()
        self._metrics = metrics or Metrics()
        self._clock = clock
        self._options = options
        self._events = EventFactory(config)
        self._tracer = (
            None if options.tracing is None else options.tracing.for_flow(config, self.flow)
        )
        self._type_key = config.source.type_key
        self._take_live_settings(config)
        self._log = logs.bind(log, integration=config.name, flow=self.flow.name)
        self._tracker = AckTracker()  # takes the source's commit rule when it opens (run)
        self._any_order = False  # the source acknowledges each message on its own (a queue)
        # The attempt a newly read message is, where the source counts them (retries by
        # release); None: its first.
        self._attempt_of: Callable[[Message], int] | None = None
        self._scheduler = Scheduler(config.delivery.ordering, clock)
        self._unordered = self._scheduler.unordered
        # Answers of the delivered path, settled together once per turn of the event loop
        # (``_settle_turn``); ``_call_soon`` is the running loop's, set by ``run``.
        self._delivered: list[tuple[list[Work], DeliveryResult]] = []
        self._filtered: list[Work] = []  # dropped by the pipeline, finished with them
        self._settling = False  # a call of _settle_turn is scheduled
        self._call_soon: Callable[[Callable[[], object]], object] | None = None
        self._tasks: asyncio.TaskGroup | None = None  # the run's, while it runs
        # Where failed messages go: the failure policy, carried out for this flow.
        self._settlement = Settlement(
            config,
            self.flow,
            self._scheduler,
            self._finish,
            clock=clock,
            dlq=dlq,
            tier_writers=tier_writers,
            breaker=breaker,
            metrics=self._metrics,
        )
        # The settlement's halted messages: finishing one, or losing its partition, frees it.
        self._halted = self._settlement.halted
        self._state = RunnerState.STARTING
        self._stopping = asyncio.Event()
        self._resumed = asyncio.Event()
        if not config.paused:
            self._resumed.set()
        self._progress = asyncio.Event()  # set whenever a message finishes or a session is dropped
        self._admitted = asyncio.Event()  # set by every read that admitted messages
        self._commit_lock = asyncio.Lock()
        self._pauses: Pauses | None = None  # the reader's record of paused sessions (run)
        # Messages taken from the tracker for a commit the broker has not confirmed yet, by
        # partition session, in offset order: uncommitted until it does (``_uncommitted``),
        # and committed again at the next round when it failed.
        self._unconfirmed: dict[SessionKey, list[Message]] = {}
        self._failed_commits: dict[SessionKey, int] = {}  # the last offset logged as failed
        self._commit_soon = asyncio.Event()  # the intake waits for a commit: commit now
        self._pool: WorkerPool | None = None
        self._source: Source | None = None
        self._in_flight = 0
        self._messages_read = 0
        self._requests = 0
        self._request_s = 0.0
        self._attempted = 0
        self._skipped = 0
        self._started_at = clock.monotonic()
        self._last_read_at: float | None = None
        self._last_commit_at: float | None = None
        self._bind_metrics()

    def _bind_metrics(self) -> None:
        m, name, topic = self._metrics, self.name, self.config.source.topic
        self._m_read = m.messages_read.labels(name, topic)
        # By outcome, each child made at its first use: no series for outcomes never seen.
        self._m_duration: dict[Outcome, LoopHistogram] = {}
        self._m_batch = m.delivery_batch_size.labels(name)
        self._m_age = m.delivery_age.labels(name, self.flow.name)
        self._m_commits = m.commits.labels(name, topic)
        self._m_committed = m.committed_messages.labels(name, topic)
        self._m_commit_failures = m.commit_failures.labels(name, topic)
        self._m_stale = m.stale_dropped.labels(name)
        # Children by (outcome, status): a labels() lookup per delivery costs more than the count.
        self._m_deliveries: dict[tuple[Outcome, int | None], LoopCounter] = {}
        self._m_skipped: dict[str, LoopCounter] = {}

    # --- control ------------------------------------------------------------

    @property
    def state(self) -> RunnerState:
        return self._state

    def stop(self) -> None:
        """Asks the runner to drain and stop; ``run()`` returns when it has."""
        self._stopping.set()
        self._progress.set()  # the intake may be waiting for room in the buffer
        self._interrupt()

    def pause(self) -> None:
        """Stops reading new messages; what is in flight finishes."""
        if self._resumed.is_set():
            self._resumed.clear()
            self._interrupt()

    def _interrupt(self) -> None:
        """Ends the intake's wait in receive (it waits for messages as long as it likes)."""
        if self._source is not None:
            self._source.interrupt()

    def resume(self) -> None:
        """Reads again after ``pause()``."""
        self._resumed.set()

    def apply(self, config: IntegrationConfig) -> None:
        """Takes the live settings of ``config`` at once (see the module docstring).

        Only ``delivery.workers``, ``delivery.buffer``, ``delivery.batch``,
        ``flags.disabled_types`` and ``paused`` are taken; the caller restarts
        the runner for a change of anything else.
        """
        if config.name != self.name:
            raise ValueError(f"runner {self.name} cannot take the settings of {config.name}")
        self.config = config
        self._take_live_settings(config)
        if self._pool is not None and not self._stopping.is_set():
            # Not while draining: the workers are leaving on purpose.
            self._pool.resize(config.delivery.workers)
        if config.paused:
            self.pause()
        else:
            self.resume()
        # The intake may be waiting for room under the old buffer bound.
        self._progress.set()

    def _take_live_settings(self, config: IntegrationConfig) -> None:
        self._disabled = frozenset(config.flags.disabled_types)
        self._batch_size = config.delivery.batch.size
        # Nothing to do between reading and delivering: no pipeline, no disabled types,
        # messages shown as they were read (the main flow).
        self._plain = not self._disabled and self._pipeline.is_empty and self._view is _same

    @property
    def source(self) -> Source | None:
        """What the runner reads now (None before it opened and after it closed its source)."""
        return self._source

    def statistics(self) -> RunnerStats:
        """A snapshot of the queues, the workers and the counters."""
        self._settle_turn()
        pool, reader = self._pool, self._source
        return RunnerStats(
            integration=self.name,
            state=self._state,
            workers=self.config.delivery.workers if pool is None else pool.size,
            buffered=self._scheduler.ready + self._scheduler.waiting,
            in_flight=self._in_flight,
            delayed=self._scheduler.delayed,
            unfinished=self._tracker.unfinished,
            outstanding=self._tracker.outstanding,
            messages_read=self._messages_read,
            last_read_at=self._last_read_at,
            last_commit_at=self._last_commit_at,
            paused_partitions=self._paused_here(),
            partitions=tuple(self._tracker.statistics()),
            flow=self.flow.name,
            started_at=self._started_at,
            workers_busy=0 if pool is None else pool.busy,
            workers_retiring=0 if pool is None else pool.retiring,
            assigned_partitions=0 if reader is None else len(reader.sessions()),
            requests=self._requests,
            request_seconds=self._request_s,
            attempted=self._attempted,
            skipped=self._skipped,
            halted=len(self._halted),
            stalled={} if reader is None else dict(reader.stalled()),
            dlq_waiting=self.dlq_waiting,
        )

    @property
    def dlq_waiting(self) -> WaitingStatistics:
        """Dead messages waiting for the dead-letter store (none while it writes)."""
        waiting = self._settlement.waiting
        return NOT_WAITING if waiting is None else waiting.statistics()

    # --- the run ------------------------------------------------------------

    async def run(self) -> None:
        """Reads, delivers and commits until ``stop()``, then drains and returns."""
        reader = await self._open_source()
        # The source's commit rule: a log's contiguous prefix, or a queue's one at a time.
        self._tracker.use(reader.ack_order)
        self._any_order = reader.ack_order is AckOrder.ANY
        self._source = reader
        # Failed messages released to the source come back counted by it (its receive count).
        self._settlement.use_source(reader)
        if isinstance(reader, Releases) and self._settlement.policy.releases:
            self._attempt_of = reader.attempt
        # The reader's one record of paused sessions: the internal flows' shared reader
        # has one for all of its views; any other source gets its own.
        pauses = reader.pauses if isinstance(reader, SharesPauses) else Pauses(reader)
        self._pauses = pauses
        self._call_soon = asyncio.get_running_loop().call_soon
        if self._stopping.is_set():
            reader.interrupt()
        label = f"{self.name}:{self.flow.name}"
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                intake = tasks.create_task(self._intake(reader, pauses), name=f"{label}:intake")
                helpers = [
                    tasks.create_task(self._commit_loop(reader, pauses), name=f"{label}:commit"),
                    tasks.create_task(self._scheduler.run_timers(), name=f"{label}:timers"),
                ]
                if self._settlement.waiting is not None:
                    helpers.append(
                        tasks.create_task(
                            self._settlement.waiting.run(), name=f"{label}:dead-letters"
                        )
                    )
                pool = self._pool = WorkerPool(tasks, self._worker, name=label)
                pool.resize(self.config.delivery.workers)
                await self._stopping.wait()
                await intake
                self._state = RunnerState.DRAINING
                await self._drain(pool, self._options.shutdown_grace_s)
                pool.close()
                for task in helpers:
                    task.cancel()
        finally:
            self._tasks = None
            try:
                self._settle_turn()
            finally:
                # Commit what finished, even when cancelled: it is only ever less redelivery.
                await asyncio.shield(self._commit(reader))
                self._source = None
                await reader.close()
                if self._owns_transport:
                    await self._transport.close()
                self._state = RunnerState.STOPPED

    async def _drain(self, pool: WorkerPool, grace_s: float) -> None:
        """Lets the deliveries in flight finish; workers leave instead of taking more."""
        pool.resize(0)
        try:
            async with asyncio.timeout(grace_s):
                await pool.wait_empty()
        except TimeoutError:
            self._log.warning(
                "integration %s: %d deliveries still in flight after the %.1fs grace period;"
                " they will be delivered again",
                self.name,
                pool.busy,
                grace_s,
            )
        self._settle_turn()
        left = self._tracker.unfinished
        if left:
            self._log.info(
                "integration %s, flow %s: %d messages read and not delivered stay uncommitted"
                " for the next reader",
                self.name,
                self.flow.name,
                left,
            )

    async def _intake(self, reader: Source, pauses: Pauses) -> None:
        while not self._stopping.is_set():
            if not self._resumed.is_set():
                self._state = RunnerState.PAUSED
                await first_of(self._resumed.wait(), self._stopping.wait())
                continue
            self._state = RunnerState.RUNNING
            # Read every round: the buffer may be changed while running.
            buffer = self.config.delivery.buffer
            free = self._free(buffer)
            refill = _refill_at(buffer, self._options.max_receive)
            if free < refill:
                # Under load the buffer is refilled in reads of some size, not a read per
                # finished message (each read is a trip to the broker). stop() sets
                # _progress too, so a plain wait on it is enough.
                self._progress.clear()
                if self._free(buffer) < refill and not self._hold_back(pauses, buffer, refill):
                    await self._progress.wait()
                continue
            self._flow_control(pauses)
            if (
                self._breaker is not None
                and self._breaker.state is BreakerState.OPEN
                and not self.flow.delayed
            ):
                # The handler is down: leave new messages in the topic until it may be probed.
                # A retry tier reads on (bounded by the buffer): its messages are owed, and
                # they wait for a permit here, first in line for the probes (the most attempts).
                await first_of(self._breaker.wait_until_not_open(), self._stopping.wait())
                continue
            messages = await reader.receive(
                min(free, self._options.max_receive), self._options.receive_timeout_s
            )
            if messages:
                self._admit(messages)
                # The workers this woke send their requests first: the intake's round
                # back to the reader would otherwise delay each of them by its length.
                # Two turns of the loop: in the first the workers run; aiohttp (before
                # Python 3.12) writes each request in a task of its own, which runs in
                # the second, before the intake's round.
                await asyncio.sleep(0)
                await asyncio.sleep(0)

    def _free(self, buffer: int) -> int:
        """Room for more messages: the buffer less what is unfinished, or less what is uncommitted.

        The bound of a crash's redelivery: no more than ``delivery.buffer``
        messages are read and not committed at the broker (done ones included),
        outside the partitions paused behind a message that does not finish
        (each of those holds up to ``delivery.buffer`` of its own). When done
        messages wait for their commit, the commit loop is woken to send it.
        """
        uncommitted = self._uncommitted()
        if uncommitted >= buffer // 2:
            self._commit_soon.set()
        return buffer - max(self._tracker.unfinished, uncommitted)

    def _hold_back(self, pauses: Pauses, buffer: int, refill: int) -> bool:
        """Pauses the partitions whose uncommitted messages wait behind an unfinished one.

        Called when the flow cannot read for its uncommitted messages: those of
        a partition whose first message has not finished cannot be committed,
        and would keep the others from reading until it does. Held back, they
        count apart (up to ``delivery.buffer`` each, as any paused partition);
        the partition reads again once that message finishes. Whether any was.
        """
        held = False
        if buffer - self._tracker.unfinished < refill:
            return held  # the unfinished ones fill the buffer: holding back frees nothing
        for acks in self._tracker.partitions():
            session = acks.session
            if session is None or not acks.blocked or acks.outstanding < refill:
                continue
            if not pauses.counted_apart(key_of(session)):
                held = True  # counted apart from now on: room for the others
            pauses.pause(session, Why.BLOCKED)
        return held

    def _uncommitted(self) -> int:
        """Read and not committed at the broker, outside the sessions counted apart (paused)."""
        pauses = self._pauses
        held = 0
        if pauses is None or not pauses:
            return self._tracker.outstanding + sum(map(len, self._unconfirmed.values()))
        apart = pauses.counted_apart
        for acks in self._tracker.partitions():
            session = acks.session
            if session is None or not apart(key_of(session)):
                held += acks.outstanding
        for key, messages in self._unconfirmed.items():
            if not apart(key):
                held += len(messages)
        return held

    def _admit(self, messages: Sequence[Message]) -> None:
        admitted = 0
        main = self.flow.name == "main"
        # A read returns runs of one partition session each: tracked and queued a run at a time.
        for run in _session_runs(messages):
            session = run[0].session
            if session is not None and not session.alive:
                continue
            acks = self._tracker.extend(run)
            admitted += len(run)
            attempt_of = self._attempt_of
            if main and attempt_of is None:
                self._scheduler.put_all(run, acks)
                continue
            if main and attempt_of is not None:
                for message in run:
                    work = Work(message, acks)
                    work.attempt = attempt_of(message)
                    self._scheduler.put(work)
                continue
            for message in run:
                work = Work(message, acks)
                work.attempt = attempts_so_far(message) + 1
                work.first_failure_at = first_failure_at(message)
                wait_s = due_at(message) - self._clock.time() if self.flow.delayed else 0.0
                if wait_s > 0:
                    self._scheduler.put_later(work, wait_s)
                else:
                    self._scheduler.put(work)
        self._messages_read += admitted
        self._last_read_at = self._clock.monotonic()
        self._m_read.inc(admitted)
        self._admitted.set()

    def _flow_control(self, pauses: Pauses) -> None:
        """Pauses sessions with a buffer of uncommitted messages; resumes the drained and the
        held back whose first message finished."""
        buffer = self.config.delivery.buffer
        unconfirmed = self._unconfirmed
        for acks in self._tracker.partitions():
            session = acks.session
            if session is None:
                continue
            key = key_of(session)
            # Taken for a commit the broker has not confirmed: still uncommitted.
            outstanding = acks.outstanding
            if unconfirmed:
                outstanding += len(unconfirmed.get(key, ()))
            if pauses.paused_for(key, Why.BLOCKED) and not acks.blocked:
                pauses.resume(session, Why.BLOCKED)  # what held it back finished
            pauses.weigh(session, Why.UNCOMMITTED, outstanding, buffer)
        if pauses:
            pauses.forget_ended()

    def _paused_here(self) -> int:
        """This flow's sessions paused behind what it has not finished (counted apart)."""
        pauses = self._pauses
        if pauses is None or not pauses:
            return 0
        return sum(
            1
            for acks in self._tracker.partitions()
            if acks.session is not None and pauses.counted_apart(key_of(acks.session))
        )

    # --- workers ------------------------------------------------------------

    async def _worker(self, slot: WorkerSlot) -> None:
        scheduler = self._scheduler
        while not slot.retiring:
            first = scheduler.get_nowait()
            if first is None:
                slot.idle = True  # holding nothing: a shrinking pool may cancel it here
                try:
                    first = await scheduler.get()
                finally:
                    slot.idle = False
            if self._batch_size == 1:
                await self._dispatch([first])
            else:
                await self._dispatch(await self._next_batch(first))

    async def _next_batch(self, first: Work) -> list[Work]:
        # Read per batch: the batch settings may be changed while running.
        settings = self.config.delivery.batch
        size = settings.size
        if size == 1:
            return [first]
        batch = [first]
        batch += self._scheduler.take(size - 1)
        if len(batch) >= size:
            return batch
        deadline = self._clock.monotonic() + settings.max_wait_ms / 1000
        while len(batch) < size:
            remaining = deadline - self._clock.monotonic()
            if remaining <= 0:
                break
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation
            # that lands as the get completes, and the worker would never stop.
            try:
                async with asyncio.timeout(remaining):
                    work = await self._scheduler.get()
            except TimeoutError:
                break
            batch.append(work)
            batch += self._scheduler.take(size - len(batch))
        return batch

    async def _dispatch(self, batch: list[Work]) -> None:
        """Delivers a batch: events, breaker permit, rate limit, in-flight count, transport,
        metrics. A delivered or dropped batch finishes here; any other outcome goes to the
        settlement (``nemesis.runtime.settle``: the failure policy and its executor)."""
        live = batch if _all_alive(batch) else self._drop_stale(batch)
        if not live:
            return
        stages: list[StageTrace | None] | None = None
        if self._plain:
            make_event = self._events
            if len(live) == 1:
                work = live[0]
                event = make_event(work.message, work.attempt, None, None, work.trace)
                work.trace = event.trace
                events = [event]
            else:
                events = [make_event(w.message, w.attempt, None, None, w.trace) for w in live]
                for work, event in zip(live, events, strict=True):
                    work.trace = event.trace
        elif self._disabled or not self._pipeline.is_empty:
            live, events, stages = await self._prepare(live)
            if not live:
                return
        else:
            make_event, view = self._events, self._view
            events = [make_event(view(w.message), w.attempt, None, None, w.trace) for w in live]
            for work, event in zip(live, events, strict=True):
                work.trace = event.trace
        # Delivery is awaited here, not in a helper coroutine: every frame between the
        # worker's task and aiohttp is resumed again at each of a request's suspensions.
        breaker, limiter, count = self._breaker, self._limiter, len(live)
        permit = None
        if breaker is not None and not breaker.closed:
            # Half-open probes are counted out, the most attempts first; while closed a
            # request needs no permit.
            attempt = _attempt_of(live)
            permit = breaker.try_acquire(attempt) or await breaker.acquire(attempt)
        try:
            if limiter is not None and not limiter.try_acquire(count):
                await limiter.acquire(count)
            self._in_flight += count
            tracer = self._tracer
            spans = None if tracer is None else tracer.begin(events, stages)
            answer: DeliveryResult | None = None
            try:
                # A batch integration sends the batch form even for one message: its
                # handler may implement only batches.
                if count == 1 and self._batch_size == 1:
                    result = answer = await self._transport.deliver(events[0])
                else:
                    result = answer = await self._transport.deliver_batch(events)
            finally:
                self._in_flight -= count
                if tracer is not None and spans is not None:
                    tracer.end(spans, answer)
            if permit is not None:
                permit.record(is_healthy(result.failure))
        finally:
            if permit is not None:
                permit.release()  # no answer (cancelled): give the probe slot back
        outcome = result.outcome
        if outcome is Outcome.DELIVERED and permit is None and self._unordered:
            # The common case: finished, counted and told to the breaker with the other
            # answers of this turn of the loop.
            self._delivered.append((live, result))
            if not self._settling:
                self._settle_later()
            return
        # The breaker hears the answers in the order they came.
        self._settle_turn()
        if breaker is not None and permit is None:
            breaker.record(is_healthy(result.failure), _attempt_of(live))
        self._observe(result, count)
        if outcome is Outcome.DELIVERED or outcome is Outcome.DROPPED:
            # Delivered or dropped: finished by the contract, nothing to decide.
            if outcome is Outcome.DELIVERED:
                self._observe_age(live)
            self._finish_all(live)
            return
        failure = failure_of(result)
        if spans:
            note_attempts(live, events)  # a dead letter links the replay to its last attempt
        settle = self._settlement.settle
        for work in live:
            await settle(work, failure)

    def _settle_later(self) -> None:
        if self._call_soon is not None:
            self._settling = True
            self._call_soon(self._settle_scheduled)

    def _settle_scheduled(self) -> None:
        try:
            self._settle_turn()
        except Exception as exc:
            # Called by the loop, not by a task: a failure here would only be logged, and
            # its messages would stay unacknowledged in silence. The run fails instead, as
            # it does when a worker raises, and the supervisor restarts the flow.
            if self._tasks is None:
                raise
            self._tasks.create_task(_reraise(exc))

    def _settle_turn(self) -> None:
        """Finishes the delivered answers and filtered messages since the last call, at once.

        What ``_dispatch`` would do for each answer (tell the breaker, count the
        request, its duration and the messages' age, acknowledge the messages),
        once per turn of the event loop for every answer of that turn: with 64
        requests in flight, a turn often brings several.
        """
        self._settling = False
        delivered, finished = self._delivered, self._filtered
        if not delivered:
            if finished:
                self._filtered = []
                self._finish_all(finished)
            return
        self._delivered, self._filtered = [], []
        breaker = self._breaker
        if breaker is not None:
            # A delivered retry vouches for its earlier attempts: told apart from the rest.
            retried = [attempt for works, _ in delivered if (attempt := _attempt_of(works)) > 1]
            breaker.record_healthy(len(delivered) - len(retried))
            for attempt in retried:
                breaker.record(True, attempt)
        request_s = 0.0
        durations: list[float] = []
        sizes: list[int] = []
        works_delivered: list[Work] = []
        answers: dict[tuple[int | None, str], int] = {}  # messages by (status, protocol)
        for works, result in delivered:
            count = len(works)
            request_s += result.duration_s
            durations.append(result.duration_s)
            sizes.append(count)
            answer = (result.status, result.protocol)
            answers[answer] = answers.get(answer, 0) + count
            works_delivered += works
        self._requests += len(delivered)
        self._request_s += request_s
        self._attempted += len(works_delivered)
        self._histogram(Outcome.DELIVERED).observe_many(durations)
        self._m_batch.observe_many(sizes)
        self._observe_age(works_delivered)
        for (status, protocol), count in answers.items():
            self._counter(Outcome.DELIVERED, status, protocol).inc(count)
        finished += works_delivered
        self._finish_all(finished)

    def _drop_stale(self, batch: list[Work]) -> list[Work]:
        live: list[Work] = []
        for work in batch:
            if work.message.alive:
                live.append(work)
            else:
                # Its partition now belongs to another reader, which delivers it again.
                self._scheduler.done(work)
                self._m_stale.inc()
                self._halted.discard(work)
        return live

    async def _prepare(
        self, batch: list[Work]
    ) -> tuple[list[Work], list[Event], list[StageTrace | None] | None]:
        """Runs the pipeline: filtered messages finish here, dead ones go to the settlement.

        With tracing, also what the pipeline marked for each passed event's span."""
        if self._disabled:
            batch = self._skip_disabled(batch)
        pipeline, make_event, view = self._pipeline, self._events, self._view
        events: list[Event]
        if pipeline.is_empty:
            events = [make_event(view(w.message), w.attempt, None, None, w.trace) for w in batch]
            for work, event in zip(batch, events, strict=True):
                work.trace = event.trace
            return batch, events, None
        passed: list[Work] = []
        events = []
        tracer = self._tracer
        stages: list[StageTrace | None] | None = None if tracer is None else []
        marked: StageTrace | None = None
        cost, clock = self._pipeline_cost, time.perf_counter
        for work in batch:
            message = work.message
            if tracer is not None:
                if work.trace is None:
                    work.trace = make_event.trace_of(message)
                marked = tracer.stages(work.trace)
            marks = None if marked is None else marked.marks
            size = len(message.value)
            if not cost.costly(size):
                started = clock()
                result = pipeline.process(message, marks)
                cost.record(size, clock() - started)
            else:
                # Milliseconds of pipeline: off the event loop, so the other integrations'
                # deliveries go on (nemesis.pipeline.offload).
                result, seconds = await self._offload(pipeline, message, marks)
                cost.record(size, seconds)
            if result.verdict is Verdict.PASS:
                payload = None if result.payload is message.value else result.payload
                event = make_event(
                    view(message), work.attempt, payload, result.content_type, work.trace
                )
                work.trace = event.trace
                events.append(event)
                passed.append(work)
                if stages is not None:
                    stages.append(marked)
                continue
            if tracer is not None and marked is not None:
                # Its attempt ends here: the span says which stage ended it.
                event = make_event(view(message), work.attempt, None, None, work.trace)
                tracer.stopped(event, marked, result)
                note_attempts([work], [event])
            if result.verdict is Verdict.FILTERED:
                # Acknowledged and committed like a delivered one, with this turn's answers.
                if self._unordered:
                    self._filtered.append(work)
                    if not self._settling:
                        self._settle_later()
                else:
                    self._finish(work)
            else:
                failure = pipeline_failure(result.reason, result.error, result.stage)
                await self._settlement.settle(work, failure)
        return passed, events, stages

    async def _offload(
        self, pipeline: Pipeline, message: Message, marks: list[StageMark] | None
    ) -> tuple[PipelineResult, float]:
        processes = self._options.pipeline_processes
        if processes is None:
            started = time.perf_counter()
            result = await asyncio.to_thread(pipeline.process, message, marks)
            return result, time.perf_counter() - started
        return await processes.process(pipeline, message, self._disabled, marks)

    def _skip_disabled(self, batch: list[Work]) -> list[Work]:
        """Acknowledges messages whose type (``ce-type``) is in ``flags.disabled_types`` now."""
        kept: list[Work] = []
        disabled, type_key = self._disabled, self._type_key
        for work in batch:
            kind = work.message.metadata.get(type_key)
            if kind is None or kind not in disabled:
                kept.append(work)
                continue
            counter = self._m_skipped.get(kind)
            if counter is None:
                # Bounded: only types that were disabled at some point get a label.
                counter = self._m_skipped[kind] = self._metrics.disabled_type_skips.labels(
                    self.name, kind
                )
            counter.inc()
            self._skipped += 1
            self._finish(work)
        return kept

    def _observe(self, result: DeliveryResult, count: int) -> None:
        self._requests += 1
        self._request_s += result.duration_s
        self._attempted += count
        self._histogram(result.outcome).observe(result.duration_s)
        self._m_batch.observe(count)
        self._counter(result.outcome, result.status, result.protocol).inc(count)

    def _histogram(self, outcome: Outcome) -> LoopHistogram:
        duration = self._m_duration.get(outcome)
        if duration is None:
            duration = self._m_duration[outcome] = self._metrics.delivery_duration.labels(
                self.name, outcome.value
            )
        return duration

    def _counter(self, outcome: Outcome, status: int | None, protocol: str) -> LoopCounter:
        key = (outcome, status)
        counter = self._m_deliveries.get(key)
        if counter is None:
            counter = self._m_deliveries[key] = self._metrics.deliveries.labels(
                self.name, outcome.value, status_class(status, protocol)
            )
        return counter

    def _observe_age(self, works: list[Work]) -> None:
        now = self._clock.time()
        if len(works) == 1:
            written_at = works[0].message.written_at
            if written_at > 0:  # 0: the backend did not say
                # Clamped: the broker's clock (YDB's) may run ahead of ours.
                self._m_age.observe(max(now - written_at, 0.0))
            return
        ages = [now - work.message.written_at for work in works]
        if min(ages) < 0 or max(ages) >= now:  # as above: a clock ahead, or no time at all
            ages = [max(age, 0.0) for age in ages if age < now]
        self._m_age.observe_many(ages)

    def _finish(self, work: Work) -> None:
        self._finish_all([work])

    def _finish_all(self, works: list[Work]) -> None:
        if self._halted:
            self._halted.difference_update(works)
        first = works[0].acks
        if first is not None and len(works) == 1:
            self._tracker.acked(first.ack(works[0].message))
        elif first is not None and all(w.acks is first for w in works):
            # A batch from one partition, the usual case: one call for all of it.
            self._tracker.acked(first.ack_all([w.message for w in works]))
        else:
            acked = 0
            for work in works:
                acks = work.acks
                if acks is None:
                    self._tracker.ack(work.message)  # counts itself
                elif acks.ack(work.message):
                    acked += 1
            self._tracker.acked(acked)
        if not self._scheduler.unordered:
            done = self._scheduler.done
            for work in works:
                done(work)
        self._progress.set()

    # --- commits ------------------------------------------------------------

    async def _commit_loop(self, reader: Source, pauses: Pauses) -> None:
        tracker = self._tracker
        while True:
            # Every interval, or at once when the intake waits for the commit.
            await first_of(
                self._clock.sleep(self._options.commit_interval_s), self._commit_soon.wait()
            )
            self._commit_soon.clear()
            # Shielded: the runs are taken from the tracker before they are sent, so a
            # cancelled commit would lose them; the final commit waits for this one.
            await asyncio.shield(self._commit(reader))
            self._flow_control(pauses)
            if tracker.outstanding == 0 and not self._unconfirmed and not self._paused_here():
                # Nothing read and not yet committed, nothing paused: nothing to do until
                # the next read, so an idle flow (a retry tier, say) does not wake on a timer.
                self._admitted.clear()
                await self._admitted.wait()

    async def _commit(self, reader: Source) -> None:
        async with self._commit_lock:
            await self._commit_runs(reader)

    async def _commit_runs(self, reader: Source) -> None:
        unfinished_before = self._tracker.unfinished
        runs = self._tracker.take_committable()
        dropped = unfinished_before - self._tracker.unfinished
        if dropped:
            self._progress.set()
        unconfirmed = self._unconfirmed
        for key, messages in list(unconfirmed.items()):
            if not messages[0].alive:
                del unconfirmed[key]  # its next owner reads them again, whatever we did
                self._failed_commits.pop(key, None)
        for run in runs:
            key = session_key(run[0])
            unconfirmed[key] = [*unconfirmed.get(key, ()), *run]
        for key, run in list(unconfirmed.items()):
            try:
                async with asyncio.timeout(self._options.commit_timeout_s):
                    await reader.commit(run)
            except (BrokerError, TimeoutError) as exc:
                # Not fatal: the next round commits them again with what finished since;
                # after a crash meanwhile they are delivered again (at-least-once).
                self._m_commit_failures.inc()
                last = run[-1]
                if self._failed_commits.get(key) == last.offset:
                    continue  # the same commit again: said once
                self._failed_commits[key] = last.offset
                what = f"{len(run)} messages" if self._any_order else f"up to {last.offset}"
                self._log.warning(
                    "integration %s: commit of %s/%s %s failed: %s",
                    self.name,
                    last.topic,
                    last.partition,
                    what,
                    exc,
                    extra={"topic": last.topic, "partition": last.partition, "offset": last.offset},
                )
                continue
            del unconfirmed[key]
            self._failed_commits.pop(key, None)
            self._progress.set()
            self._m_commits.inc()
            self._m_committed.inc(len(run))
            self._last_commit_at = self._clock.monotonic()


async def _reraise(exc: Exception) -> None:
    raise exc


def _same(message: Message) -> Message:
    return message


def _refill_at(buffer: int, max_receive: int) -> int:
    """The free room in the buffer at which the intake reads again: a quarter of it."""
    return max(1, min(max_receive, buffer // 4))


def _session_runs(messages: Sequence[Message]) -> list[Sequence[Message]]:
    """Splits a read into runs of consecutive messages of one partition session."""
    if not messages:
        return []
    session = messages[0].session
    # Readers return a partition's messages together: one session per read is common.
    if session is not None and all(m.session is session for m in messages):
        return [messages]
    runs: list[Sequence[Message]] = []
    start = 0
    for index in range(1, len(messages)):
        previous, message = messages[index - 1], messages[index]
        if (
            message.session is not previous.session
            or message.partition != previous.partition
            or message.topic != previous.topic
        ):
            runs.append(messages[start:index])
            start = index
    runs.append(messages[start:])
    return runs


def _attempt_of(batch: list[Work]) -> int:
    """The attempt a request counts as for the breaker: its message's, a batch's smallest."""
    if len(batch) == 1:
        return batch[0].attempt
    return min(work.attempt for work in batch)


def _all_alive(batch: list[Work]) -> bool:
    """Whether every message of a batch still belongs to a live partition session."""
    if len(batch) == 1:
        session = batch[0].message.session
        return session is None or session.alive
    seen: PartitionSession | None = None
    for work in batch:
        session = work.message.session
        if session is not seen and session is not None:
            if not session.alive:
                return False
            seen = session
    return True
