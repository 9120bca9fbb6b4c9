"""Requeue and discard from the viewer: a few rows at once, or a whole filter in the background.

Both go through ``nemesis.dlq.requeue``, the one path the CLI shares: a
requeued message is written to its own integration's replay topic, which
the proxy's replay flow delivers at that integration's
``rate_limits.replay``. So however many rows a person requeues, the
handler sees them at the replay rate, and no other integration sees them.

An action on a filter or a group can cover millions of rows, so it runs as
a ``BulkJob`` in rounds: select up to ``round_size`` dead ids, act on them,
let other work in, repeat. A round's rows leave the ``dead`` status, so the
next selection finds the next rows; the filter carries an upper time bound
fixed when the person confirmed, so rows that die meanwhile (a requeued
message that fails again, a new failure) are not swept in. Each round
writes its own audit entry (``nemesis.dlq.requeue`` records one per
call), all naming the job.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import secrets
from collections.abc import Collection
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

from nemesis.broker.port import Broker
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.dlq import Action, DeadLetterFilter, DeadLetterStore
from nemesis.dlq.requeue import ActionResult, discard, matching_ids, requeue
from nemesis.errors import NemesisError

log = logging.getLogger(__name__)

ROUND_SIZE = 1000
BULK_PAUSE_S = 0.02  # between rounds, so page requests get the store's threads too
MAX_RUNNING = 2  # jobs acting at once; later ones wait their turn
MAX_UNFINISHED = 20  # queued + running; more is refused (HTTP 429)
KEEP_FINISHED = 100  # finished jobs remembered for their progress pages
MAX_IDLE_ROUNDS = 3  # rounds in a row that moved nothing before a job gives up
IDLE_PAUSE_S = 0.05


class Requeuer(Protocol):
    """Sends dead rows back to their integrations' replay flows (``replay_requeuer``)."""

    async def __call__(
        self, ids: Collection[str], *, by: str, allowed: frozenset[str] | None, description: str
    ) -> ActionResult:
        """Requeues the dead rows among ``ids`` that ``allowed`` covers; returns what moved."""
        ...


def replay_requeuer(
    store: DeadLetterStore,
    broker: Broker,
    *,
    clock: Clock = SYSTEM_CLOCK,
) -> Requeuer:
    """The requeue path of ``nemesis.dlq.requeue`` over ``store`` and ``broker``."""

    async def send_back(
        ids: Collection[str], *, by: str, allowed: frozenset[str] | None, description: str
    ) -> ActionResult:
        return await requeue(
            store,
            broker,
            ids,
            by=by,
            allowed=allowed,
            description=description,
            clock=clock,
        )

    return send_back


class JobState(enum.StrEnum):
    """Where a bulk job stands."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass
class BulkJob:
    """One bulk action's progress, read by the job page and ``GET /api/jobs/{id}``."""

    id: str
    action: Action
    actor: str  # who the audit log names
    owner: str  # the identity that may watch and stop it (and admins)
    scope: frozenset[str] | None
    where: DeadLetterFilter
    description: str  # the filter in words
    expected: int  # matching dead rows when the person confirmed
    created_at: float
    state: JobState = JobState.QUEUED
    done: int = 0
    rounds: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    by_integration: dict[str, int] = field(default_factory=dict)
    stop_requested: bool = False

    @property
    def finished(self) -> bool:
        """True once the job will do nothing more."""
        return self.state in {JobState.DONE, JobState.FAILED, JobState.CANCELLED}

    @property
    def percent(self) -> float:
        """Progress against the confirmed count, 0 to 100."""
        if self.finished:
            return 100.0
        if self.expected <= 0:
            return 0.0
        return min(100.0, 100.0 * self.done / self.expected)


class JobsBusy(Exception):
    """Too many bulk jobs are queued or running; try again when one finishes."""


class BulkJobs:
    """Runs bulk jobs in the background, a few at a time; owns their tasks.

    Use as an async context manager around the application's lifetime:
    leaving it stops the running jobs between rounds and waits for them.
    """

    def __init__(
        self,
        store: DeadLetterStore,
        requeuer: Requeuer,
        *,
        clock: Clock = SYSTEM_CLOCK,
        round_size: int = ROUND_SIZE,
        max_running: int = MAX_RUNNING,
        max_unfinished: int = MAX_UNFINISHED,
        keep_finished: int = KEEP_FINISHED,
        pause_s: float = BULK_PAUSE_S,
    ) -> None:
        self._store = store
        self._requeue = requeuer
        self._clock = clock
        self._round_size = round_size
        self._slots = asyncio.Semaphore(max_running)
        self._max_unfinished = max_unfinished
        self._keep_finished = keep_finished
        self._pause_s = pause_s
        self._jobs: collections.OrderedDict[str, BulkJob] = collections.OrderedDict()
        self._tasks: asyncio.TaskGroup | None = None

    async def __aenter__(self) -> BulkJobs:
        self._tasks = asyncio.TaskGroup()
        await self._tasks.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for job in self._jobs.values():
            job.stop_requested = True
        tasks, self._tasks = self._tasks, None
        if tasks is not None:
            # Jobs stop after their current round; wait for that. Whatever ended the
            # block goes on as it was (a TaskGroup would wrap it in an ExceptionGroup).
            await tasks.__aexit__(None, None, None)

    def submit(
        self,
        action: Action,
        where: DeadLetterFilter,
        *,
        actor: str,
        owner: str,
        scope: frozenset[str] | None,
        description: str,
        expected: int,
    ) -> BulkJob:
        """Queues a job over the dead rows ``where`` matches; raises ``JobsBusy`` when full."""
        if self._tasks is None:
            raise JobsBusy("the viewer is shutting down")
        if sum(1 for job in self._jobs.values() if not job.finished) >= self._max_unfinished:
            raise JobsBusy(
                f"{self._max_unfinished} bulk actions are queued or running; wait for one to finish"
            )
        job = BulkJob(
            id=secrets.token_hex(8),
            action=action,
            actor=actor,
            owner=owner,
            scope=scope,
            where=where,
            description=description,
            expected=expected,
            created_at=self._clock.time(),
        )
        self._jobs[job.id] = job
        self._forget_old()
        self._tasks.create_task(self._run(job), name=f"viewer-job:{job.id}")
        return job

    def get(self, job_id: str) -> BulkJob | None:
        """The job with this id, if it is still remembered."""
        return self._jobs.get(job_id)

    def recent(self) -> list[BulkJob]:
        """Remembered jobs, newest first."""
        return list(reversed(self._jobs.values()))

    def stop(self, job_id: str) -> BulkJob | None:
        """Asks a job to stop after its current round."""
        job = self._jobs.get(job_id)
        if job is not None and not job.finished:
            job.stop_requested = True
        return job

    def _forget_old(self) -> None:
        finished = [job_id for job_id, job in self._jobs.items() if job.finished]
        for job_id in finished[: max(0, len(finished) - self._keep_finished)]:
            del self._jobs[job_id]

    async def _run(self, job: BulkJob) -> None:
        async with self._slots:
            if job.stop_requested:
                self._finish(job, JobState.CANCELLED)
                return
            job.state = JobState.RUNNING
            job.started_at = self._clock.time()
            try:
                finished = await self._rounds(job)
            except NemesisError as exc:
                log.exception("bulk %s job %s failed", job.action, job.id)
                job.error = str(exc) or type(exc).__name__
                self._finish(job, JobState.FAILED)
            except Exception:
                log.exception("bulk %s job %s failed", job.action, job.id)
                job.error = "an internal error stopped the job (see the viewer's log)"
                self._finish(job, JobState.FAILED)
            else:
                self._finish(job, JobState.DONE if finished else JobState.CANCELLED)

    async def _rounds(self, job: BulkJob) -> bool:
        """Acts round by round; True when no matching row is left, False when stopped."""
        idle_rounds = 0
        while not job.stop_requested:
            ids = await matching_ids(self._store, job.where, limit=self._round_size)
            if not ids:
                return True
            description = (
                f"everything dead matching {job.description} (bulk job {job.id},"
                f" part {job.rounds + 1})"
            )
            if job.action is Action.REQUEUE:
                result = await self._requeue(
                    ids, by=job.actor, allowed=job.scope, description=description
                )
            else:
                result = await discard(
                    self._store,
                    ids,
                    by=job.actor,
                    allowed=job.scope,
                    description=description,
                    clock=self._clock,
                )
            job.rounds += 1
            job.done += result.count
            for name, count in result.by_integration.items():
                job.by_integration[name] = job.by_integration.get(name, 0) + count
            if result.count == 0:
                # Selected but not moved: another action took these rows first. Its marks
                # land in a moment and the next selection moves past them; rows that
                # stay dead but cannot move would bring us here again and again.
                idle_rounds += 1
                if idle_rounds >= MAX_IDLE_ROUNDS:
                    return True
                await asyncio.sleep(IDLE_PAUSE_S)
                continue
            idle_rounds = 0
            # Let page requests in between rounds (the store serves both on one thread).
            await asyncio.sleep(self._pause_s)
        return False

    def _finish(self, job: BulkJob, state: JobState) -> None:
        job.state = state
        job.finished_at = self._clock.time()


async def act_on_ids(
    action: Action,
    ids: Collection[str],
    *,
    store: DeadLetterStore,
    requeuer: Requeuer,
    actor: str,
    scope: frozenset[str] | None,
    description: str,
    clock: Clock = SYSTEM_CLOCK,
) -> ActionResult:
    """Requeues or discards a few rows now (one message, or a page's selection)."""
    if action is Action.REQUEUE:
        return await requeuer(ids, by=actor, allowed=scope, description=description)
    return await discard(store, ids, by=actor, allowed=scope, description=description, clock=clock)
