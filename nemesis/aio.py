"""Small asyncio helpers the runtime shares."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
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
