"""Small asyncio helpers the runtime shares."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any


async def first_of(*waits: Awaitable[Any], timeout_s: float | None = None) -> None:
    """Waits until the first of ``waits`` finishes (or ``timeout_s`` passes), then cancels the rest.

    Each is run as a task of its own and every one is cancelled and awaited
    before this returns, so nothing is left running. An exception of the one
    that finished first is raised; the others' are dropped with them.
    """
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in done:
        error = None if task.cancelled() else task.exception()
        if error is not None:
            raise error


class TaskScope:
    """The task group of an object whose life is no one ``async with`` (a broker, a reader).

    Like ``asyncio.TaskGroup``: it holds every task it started, the first
    failure cancels the others, and ``aclose()`` cancels and awaits them all.
    Where a task group would cancel its parent task, a scope hands the
    failure to its owner's ``on_failure`` at once, so the owner acts on it
    (ends its sessions, restarts the loop) instead of a line in the log when
    the task is collected.
    """

    def __init__(self, name: str, on_failure: Callable[[BaseException], None]) -> None:
        self._name = name
        self._on_failure = on_failure
        self._tasks: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self._closed = False

    @property
    def failure(self) -> BaseException | None:
        """The first failure of a task of this scope, if any."""
        return self._failure

    def start(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Runs ``work`` as a task of this scope."""
        if self._closed:
            work.close()
            raise RuntimeError(f"task scope {self._name} is closed")
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self._closed:
            return
        error = task.exception()
        if error is None:
            return
        if self._failure is None:
            self._failure = error
        for other in list(self._tasks):
            other.cancel()
        self._on_failure(error)

    async def aclose(self) -> None:
        """Cancels and awaits every task (a failure went to ``on_failure`` when it happened)."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
