"""Request deadlines of a transport, kept with one loop timer for all its requests.

aiohttp enforces a request's ``ClientTimeout`` with a loop timer armed and
cancelled per request and a timer context entered at each of its reads.
Measured in the proxy at 1 message per request (``tests/bench/delivery.py``, part
(a), CPU per delivered message): about 30 of its 300 us. Every request of a
transport has the same timeout (``target.timeout_s``), so their deadlines
fall in the order the requests started: one timer, set for the oldest
request still running, serves them all. It fires about once per timeout
while requests keep finishing in time, and re-arms itself for the oldest one
then running.

A request past its deadline is stopped by cancelling its task, as
``asyncio.timeout`` does; ``Deadline.timed_out`` tells that cancellation
apart from one that came from elsewhere (a shutdown), which must go on.
"""

from __future__ import annotations

import asyncio


class Deadline:
    """One request's deadline (loop time), and whether it was reached."""

    __slots__ = ("at", "cancelling", "consumed", "expired", "task")

    def __init__(self, task: asyncio.Task[object], at: float) -> None:
        self.task = task
        self.at = at
        self.cancelling = task.cancelling()  # cancellations already asked of the task
        self.expired = False
        self.consumed = False  # its cancellation was taken back by timed_out()

    def timed_out(self) -> bool:
        """In ``except CancelledError``: True if the cancellation was this deadline's alone.

        It is then consumed (the task is no longer being cancelled) and the
        caller reports a timeout instead of raising.
        """
        if not self.expired or self.consumed:
            return False
        self.consumed = True
        return self.task.uncancel() <= self.cancelling


class Deadlines:
    """Deadlines ``timeout_s`` after each ``start``, for requests run in their own tasks."""

    def __init__(self, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.timeout_s = timeout_s
        # Insertion order is deadline order: every deadline is start + timeout_s.
        self._running: dict[Deadline, None] = {}
        self._timer: asyncio.TimerHandle | None = None

    def __len__(self) -> int:
        return len(self._running)

    def start(self) -> Deadline:
        """A deadline for the current task, ``timeout_s`` from now; ``finish`` it in a finally.

        Until then, the task is cancelled when the deadline passes.
        """
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadlines.start needs to run in a task")
        loop = task.get_loop()
        deadline = Deadline(task, loop.time() + self.timeout_s)
        self._running[deadline] = None
        if self._timer is None:
            self._timer = loop.call_at(deadline.at, self._expire, loop)
        return deadline

    def finish(self, deadline: Deadline) -> None:
        """Forgets ``deadline``: its task is never cancelled for it from now on.

        A deadline that expired without ``Deadline.timed_out`` taking its
        cancellation back had it swallowed on the way (the request ended
        normally): the task's count of cancellations asked is put back, as if
        it had never been asked.
        """
        del self._running[deadline]
        if deadline.expired and not deadline.consumed:
            deadline.task.uncancel()

    def left(self, deadline: Deadline) -> float:
        """Seconds until ``deadline`` (negative once passed)."""
        return deadline.at - deadline.task.get_loop().time()

    def close(self) -> None:
        """Stops the timer (the requests still running keep their tasks, uncancelled)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        for deadline in self._running:  # oldest first
            if deadline.at > now:
                self._timer = loop.call_at(deadline.at, self._expire, loop)
                return
            if not deadline.expired:
                deadline.expired = True
                deadline.task.cancel()
