"""Injected time: components take a Clock so tests can jump instead of sleep."""

from __future__ import annotations

from time import monotonic as _monotonic
from time import time as _wall_time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Wall-clock Unix seconds (for timestamps that leave the process)."""
        ...

    def monotonic(self) -> float:
        """Monotonic seconds (for durations and deadlines)."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock."""

    # The C functions themselves: read on every delivery, a Python frame around them costs more.
    time = staticmethod(_wall_time)
    monotonic = staticmethod(_monotonic)

    async def sleep(self, seconds: float) -> None:
        import asyncio  # only a proxy that runs sleeps: validating loads no event loop

        await asyncio.sleep(seconds)


SYSTEM_CLOCK = SystemClock()
