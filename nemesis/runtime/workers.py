"""A pool of worker tasks whose size changes while it runs (``delivery.workers`` live).

Growing spawns workers in the runner's task group. Shrinking never cancels a
delivery: a worker waiting for its next message holds nothing and is
cancelled at once; a worker holding messages is marked retiring and leaves
after it has finished them. The wait it is cancelled in is the scheduler's
``asyncio.Queue.get``, which leaves the item in the queue when cancelled (even
if the item had already woken it), so no message is lost that way either.

A worker body follows one protocol so that this holds::

    async def work(slot: WorkerSlot) -> None:
        while not slot.retiring:
            slot.idle = True                   # the only place a worker may be cancelled
            try:
                first = await queue.get()
            finally:
                slot.idle = False
            ...                                # take more for a batch, deliver, settle

(A plain flag rather than a context manager: it is set twice per message.)
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from typing import Any


class WorkerSlot:
    """One worker's standing in the pool: idle (holding nothing) or retiring."""

    __slots__ = ("idle", "number", "retiring", "task")

    def __init__(self, number: int) -> None:
        self.number = number
        self.idle = False
        self.retiring = False
        self.task: asyncio.Task[None] | None = None


WorkerBody = Callable[[WorkerSlot], Coroutine[Any, Any, None]]


class WorkerPool:
    """Worker tasks in a task group, resized at run time without cancelling work in hand."""

    def __init__(self, tasks: asyncio.TaskGroup, body: WorkerBody, *, name: str) -> None:
        self._tasks = tasks
        self._body = body
        self._name = name
        self._slots: set[WorkerSlot] = set()
        self._numbers = itertools.count()
        self._closed = False
        self._emptied = asyncio.Event()  # set while no worker is left
        self._emptied.set()

    @property
    def size(self) -> int:
        """Workers that will take another message (retiring ones are not counted)."""
        return sum(1 for slot in self._slots if not slot.retiring)

    @property
    def busy(self) -> int:
        """Workers holding messages now, retiring ones included."""
        return sum(1 for slot in self._slots if not slot.idle)

    @property
    def retiring(self) -> int:
        """Workers finishing their messages before they leave."""
        return sum(1 for slot in self._slots if slot.retiring)

    def resize(self, size: int) -> None:
        """Grows or shrinks the pool to ``size`` workers; takes effect at once."""
        if size < 0:
            raise ValueError("a pool cannot have fewer than zero workers")
        if self._closed:
            return
        active = [slot for slot in self._slots if not slot.retiring]
        if len(active) < size:
            # Called back before they left: retiring workers are the cheapest to add.
            for slot in [slot for slot in self._slots if slot.retiring]:
                if len(active) >= size:
                    break
                slot.retiring = False
                active.append(slot)
            for _ in range(size - len(active)):
                self._spawn()
            return
        excess = len(active) - size
        # Idle workers first: they leave at once, busy ones only after their messages.
        for slot in sorted(active, key=lambda s: not s.idle)[:excess]:
            slot.retiring = True
            if slot.idle and slot.task is not None:
                slot.task.cancel()

    async def wait_empty(self) -> None:
        """Returns once every worker has left (after ``resize(0)``: once none holds messages)."""
        await self._emptied.wait()

    def close(self) -> None:
        """Cancels every worker (after the runner drained) and refuses to grow again."""
        self._closed = True
        for slot in self._slots:
            if slot.task is not None:
                slot.task.cancel()

    def _spawn(self) -> None:
        slot = WorkerSlot(next(self._numbers))
        task = self._tasks.create_task(self._body(slot), name=f"{self._name}:worker-{slot.number}")
        slot.task = task
        self._slots.add(slot)
        self._emptied.clear()
        task.add_done_callback(lambda _: self._left(slot))

    def _left(self, slot: WorkerSlot) -> None:
        self._slots.discard(slot)
        if not self._slots:
            self._emptied.set()
