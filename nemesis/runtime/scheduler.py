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
import heapq
import itertools
from collections import deque
from collections.abc import Hashable
from typing import Literal

from nemesis.broker.port import Message
from nemesis.clock import Clock

Ordering = Literal["none", "key", "partition"]


class Work:
    """One message on its way through the runner, with its retry state."""

    __slots__ = ("attempt", "first_failure_at", "last_error", "message")

    def __init__(self, message: Message) -> None:
        self.message = message
        self.attempt = 1
        self.first_failure_at: float | None = None
        self.last_error: str | None = None


def ordering_key(ordering: Ordering, message: Message) -> Hashable | None:
    """What must not run concurrently with this message; None when anything may."""
    if ordering == "partition":
        return (message.topic, message.partition)
    if ordering == "key" and message.key is not None:
        return (message.topic, message.key)
    return None


class Scheduler:
    """Ready queue + per-key waiting lines + delayed retries."""

    def __init__(self, ordering: Ordering, clock: Clock) -> None:
        self._ordering: Ordering = ordering
        self._clock = clock
        self._ready: asyncio.Queue[Work] = asyncio.Queue()
        self._busy: set[Hashable] = set()
        self._waiting: dict[Hashable, deque[Work]] = {}
        self._delayed: list[tuple[float, int, Work]] = []
        self._delayed_changed = asyncio.Event()
        self._sequence = itertools.count()

    @property
    def ready(self) -> int:
        return self._ready.qsize()

    @property
    def waiting(self) -> int:
        return sum(len(line) for line in self._waiting.values())

    @property
    def delayed(self) -> int:
        return len(self._delayed)

    def put(self, work: Work) -> None:
        """Admits a newly read message."""
        key = ordering_key(self._ordering, work.message)
        if key is None:
            self._ready.put_nowait(work)
        elif key in self._busy:
            self._waiting.setdefault(key, deque()).append(work)
        else:
            self._busy.add(key)
            self._ready.put_nowait(work)

    def put_later(self, work: Work, delay_s: float) -> None:
        """Re-queues a message after ``delay_s``; it keeps its key meanwhile."""
        due = self._clock.monotonic() + delay_s
        heapq.heappush(self._delayed, (due, next(self._sequence), work))
        self._delayed_changed.set()

    async def get(self) -> Work:
        return await self._ready.get()

    def get_nowait(self) -> Work | None:
        try:
            return self._ready.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def done(self, work: Work) -> None:
        """The message is finished (or abandoned): the next one of its key may run."""
        key = ordering_key(self._ordering, work.message)
        if key is None:
            return
        line = self._waiting.get(key)
        if line:
            self._ready.put_nowait(line.popleft())
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
                self._ready.put_nowait(work)
            if not self._delayed:
                await self._delayed_changed.wait()
                continue
            wait_s = self._delayed[0][0] - now
            sleeper = asyncio.ensure_future(self._clock.sleep(wait_s))
            changed = asyncio.ensure_future(self._delayed_changed.wait())
            try:
                await asyncio.wait({sleeper, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                changed.cancel()
