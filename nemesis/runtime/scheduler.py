"""Hands read messages to workers, honouring the integration's ordering.

``ordering: none`` lets any number of messages of a partition run at once.
``key`` runs one message per key at a time (messages without a key are not
ordered); ``partition`` one per partition. A message waiting for its key keeps
its place behind the one in flight, and a message retried in place keeps its
key busy until it is finally done, so nothing overtakes it.

The scheduler holds no more than the runner lets in: the runner admits a
message only while fewer than ``delivery.buffer`` are unfinished, so the
queues here are bounded by that count.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Sequence
from typing import Literal

from nemesis.aio import first_of
from nemesis.broker.port import Message
from nemesis.clock import Clock
from nemesis.runtime.acks import SessionAcks
from nemesis.tracecontext import TraceContext

Ordering = Literal["none", "key", "partition"]


class Work:
    """One message on its way through the runner, with its retry state.

    ``acks`` is where the message is tracked for commits (``AckTracker.extend``
    returned it), so finishing it needs no lookup.
    """

    # failed_at (monotonic, the last failure here) is set on the failure path only and
    # read with getattr: a message that never fails does not pay for it. So is last_span,
    # the traceparent of its last recorded attempt span (nemesis.runtime.tracing).
    __slots__ = (
        "acks",
        "attempt",
        "failed_at",
        "first_failure_at",
        "last_error",
        "last_span",
        "message",
        "trace",
    )
    failed_at: float
    last_span: str

    def __init__(self, message: Message, acks: SessionAcks | None = None) -> None:
        self.message = message
        self.acks = acks
        self.attempt = 1
        self.first_failure_at: float | None = None
        self.last_error: str | None = None
        # The trace context of its first attempt, kept for the next ones (tracecontext).
        self.trace: TraceContext | None = None


def ordering_key(ordering: Ordering, message: Message) -> Hashable | None:
    """What must not run concurrently with this message; None when anything may."""
    if ordering == "partition":
        return (message.topic, message.partition)
    if ordering == "key" and message.key is not None:
        return (message.topic, message.key)
    return None


class Scheduler:
    """Ready queue + per-key waiting lines + delayed retries.

    The ready queue is a deque with a line of waiting workers rather than an
    ``asyncio.Queue``: admitting a read batch is one ``extend`` and a worker
    fills its batch with one ``take``. It keeps the one property of
    ``asyncio.Queue.get`` the worker pool relies on: a worker cancelled in
    ``get`` takes nothing with it, even when an item had already woken it (the
    item stays, and the next waiter is woken for it).
    """

    def __init__(self, ordering: Ordering, clock: Clock) -> None:
        self._ordering: Ordering = ordering
        self._clock = clock
        self._ready: deque[Work] = deque()
        self._getters: deque[asyncio.Future[None]] = deque()
        self._busy: set[Hashable] = set()
        self._waiting: dict[Hashable, deque[Work]] = {}
        self._delayed: list[tuple[float, int, Work]] = []
        self._delayed_changed = asyncio.Event()
        self._sequence = itertools.count()

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def waiting(self) -> int:
        return sum(len(line) for line in self._waiting.values())

    @property
    def delayed(self) -> int:
        return len(self._delayed)

    @property
    def unordered(self) -> bool:
        """``ordering: none``: ``done`` has nothing to do and may be skipped."""
        return self._ordering == "none"

    def put(self, work: Work) -> None:
        """Admits a newly read message."""
        key = ordering_key(self._ordering, work.message)
        if key is None:
            self._push(work)
        elif key in self._busy:
            self._waiting.setdefault(key, deque()).append(work)
        else:
            self._busy.add(key)
            self._push(work)

    def put_all(self, messages: Sequence[Message], acks: SessionAcks | None = None) -> None:
        """Admits newly read messages (first attempts) in their order."""
        if self._ordering != "none":
            for message in messages:
                self.put(Work(message, acks))
            return
        self._ready.extend([Work(message, acks) for message in messages])
        self._wake(len(messages))

    def put_later(self, work: Work, delay_s: float) -> None:
        """Re-queues a message after ``delay_s``; it keeps its key meanwhile."""
        due = self._clock.monotonic() + delay_s
        heapq.heappush(self._delayed, (due, next(self._sequence), work))
        self._delayed_changed.set()

    async def get(self) -> Work:
        """The next ready message; waits for one."""
        ready = self._ready
        while not ready:
            waiter = asyncio.get_running_loop().create_future()
            self._getters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                waiter.cancel()  # no-op unless it is still waiting
                with contextlib.suppress(ValueError):
                    self._getters.remove(waiter)
                if ready and not waiter.cancelled():
                    # It had been woken for an item it now leaves: wake another for it.
                    self._wake(1)
                raise
        return ready.popleft()

    def get_nowait(self) -> Work | None:
        ready = self._ready
        return ready.popleft() if ready else None

    def take(self, limit: int) -> list[Work]:
        """Up to ``limit`` ready messages at once, without waiting."""
        ready = self._ready
        count = min(limit, len(ready))
        if count == len(ready):
            taken = list(ready)
            ready.clear()
            return taken
        return [ready.popleft() for _ in range(count)]

    def done(self, work: Work) -> None:
        """The message is finished (or abandoned): the next one of its key may run."""
        key = ordering_key(self._ordering, work.message)
        if key is None:
            return
        line = self._waiting.get(key)
        if line:
            self._push(line.popleft())
            if not line:
                del self._waiting[key]
        else:
            self._busy.discard(key)

    async def run_timers(self) -> None:
        """Moves delayed retries to the ready queue when they fall due; runs until cancelled."""
        while True:
            self._delayed_changed.clear()
            now = self._clock.monotonic()
            while self._delayed and self._delayed[0][0] <= now:
                _, _, work = heapq.heappop(self._delayed)
                self._push(work)
            if not self._delayed:
                await self._delayed_changed.wait()
                continue
            wait_s = self._delayed[0][0] - now
            await first_of(self._clock.sleep(wait_s), self._delayed_changed.wait())

    def _push(self, work: Work) -> None:
        self._ready.append(work)
        self._wake(1)

    def _wake(self, count: int) -> None:
        """Wakes up to ``count`` waiting workers (each takes one item, or more for a batch)."""
        getters = self._getters
        while count > 0 and getters:
            waiter = getters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                count -= 1
