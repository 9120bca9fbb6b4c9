"""A fake ``Clock`` for tests: time moves only when the test moves it, or when every task waits.

Use it in a test::

    clock = FakeClock()
    breaker = CircuitBreaker(config, clock=clock)
    clock.advance(30)                    # jump; sleepers due by then wake up

    async with clock.autojump():         # like trio's MockClock(autojump_threshold=0)
        await limiter.acquire(1000)      # the waits take no real time

``sleep()`` parks the task on a future that ``advance()`` resolves once time
has reached its deadline. Under ``autojump()`` a helper task jumps to the
next deadline whenever no task can run: every task is waiting on this clock,
on I/O, or on something else that only time or the outside world can move.
Like trio's, autojump therefore also jumps while a task waits for a real
socket; give such tests a real-seconds ``threshold_s`` so I/O gets the time to
finish before fake time moves.

Seeing that no task can run needs the event loop's ready queue, which only
asyncio's own loops (``BaseEventLoop``) have; ``autojump()`` and
``wait_all_tasks_blocked()`` refuse other loops (uvloop) with ``RuntimeError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Sized

# A Unix time in 2023: timestamps made under a fake clock look real but are not "now".
DEFAULT_WALL_START = 1_700_000_000.0


class FakeClock:
    """A ``Clock`` whose time moves only with ``advance()`` or under ``autojump()``."""

    def __init__(self, *, start: float = 0.0, wall_start: float = DEFAULT_WALL_START) -> None:
        self._now = start
        self._wall_offset = wall_start - start
        # (deadline, order, future): order keeps sleepers with one deadline first-come first-woken.
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._activity = 0  # sleeps started; autojump's threshold watches it
        self._new_sleeper: asyncio.Event | None = None
        self._idle_waiters = 0

    # --- the Clock protocol ---------------------------------------------------

    def time(self) -> float:
        """Wall-clock seconds: ``wall_start`` plus the fake time that has passed."""
        return self._wall_offset + self._now

    def monotonic(self) -> float:
        """The fake monotonic time."""
        return self._now

    async def sleep(self, seconds: float) -> None:
        """Waits until fake time has moved ``seconds`` past now (0 or less: yields once)."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), future))
        self._activity += 1
        if self._new_sleeper is not None:
            self._new_sleeper.set()
        # A cancelled sleep leaves its cancelled future in the heap; waking skips it.
        await future

    # --- moving time ----------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Moves time forward by ``seconds`` and wakes every sleeper due by then."""
        if seconds < 0:
            raise ValueError("a clock cannot go backwards")
        self._now += seconds
        self._wake_due()

    def advance_to(self, when: float) -> None:
        """Moves time forward to ``when`` (monotonic) and wakes every sleeper due by then."""
        self.advance(max(0.0, when - self._now))

    @property
    def next_deadline(self) -> float | None:
        """The earliest deadline a task sleeps until, or None when nobody sleeps."""
        self._drop_cancelled()
        return self._sleepers[0][0] if self._sleepers else None

    @property
    def sleepers(self) -> int:
        """How many tasks sleep on this clock."""
        return sum(1 for _, _, future in self._sleepers if not future.done())

    async def wait_all_tasks_blocked(self) -> None:
        """Returns once no task can run without time passing or outside input arriving."""
        ready = _ready_queue(asyncio.get_running_loop())
        self._idle_waiters += 1
        try:
            while True:
                await asyncio.sleep(0)
                # Every other task in here also sits in the ready queue, once each,
                # between its sleep(0) calls; counting them lets two of them agree
                # that the loop is idle instead of keeping each other busy forever.
                if len(ready) <= self._idle_waiters - 1:
                    return
        finally:
            self._idle_waiters -= 1

    @contextlib.asynccontextmanager
    async def autojump(self, threshold_s: float = 0.0) -> AsyncIterator[None]:
        """Within the block, jumps to the next deadline whenever every task is blocked.

        ``threshold_s`` is real time the loop must stay idle, with no new sleep
        started, before a jump: room for real I/O to complete first.
        """
        _ready_queue(asyncio.get_running_loop())  # fail here, not inside the helper task
        jumper = asyncio.create_task(self._autojump(threshold_s), name="fake-clock-autojump")
        try:
            yield
        finally:
            jumper.cancel()
            await asyncio.wait([jumper])
            if not jumper.cancelled() and jumper.exception() is not None:
                raise RuntimeError("the fake clock's autojump failed") from jumper.exception()

    async def _autojump(self, threshold_s: float) -> None:
        self._new_sleeper = asyncio.Event()
        try:
            while True:
                await self.wait_all_tasks_blocked()
                if self.next_deadline is None:
                    self._new_sleeper.clear()
                    await self._new_sleeper.wait()
                    continue
                if threshold_s > 0:
                    seen = self._activity
                    await asyncio.sleep(threshold_s)
                    await self.wait_all_tasks_blocked()
                    if self._activity != seen:
                        continue
                deadline = self.next_deadline
                if deadline is not None:
                    self.advance_to(deadline)
        finally:
            self._new_sleeper = None

    def _wake_due(self) -> None:
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, future = heapq.heappop(self._sleepers)
            if not future.done():
                future.set_result(None)

    def _drop_cancelled(self) -> None:
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)


def _ready_queue(loop: asyncio.AbstractEventLoop) -> Sized:
    ready = getattr(loop, "_ready", None)
    if not isinstance(ready, Sized):
        # Not a type error of the caller's: this loop just lacks what autojump reads.
        raise RuntimeError(  # noqa: TRY004
            "FakeClock.autojump needs asyncio's own event loop (it reads the loop's ready queue)"
        )
    return ready
