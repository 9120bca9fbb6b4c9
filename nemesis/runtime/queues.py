"""The lag of a queue source (docs/sqs.md): the queue's own counts, read in the background.

A queue has no offsets to compare, so the lag monitor of ``runtime.lag`` has
nothing to describe. A source that counts its queue (``CountsQueue``: an SQS
queue) is asked for its counts every refresh instead (GetQueueAttributes:
visible, in flight, delayed, approximate), and the snapshot shows them as the
commit lag of partition 0 of the integration's main flow:

- messages: visible + in flight, what the queue holds that nobody deleted
  (delayed ones are counted apart: they are not due yet);
- seconds: the age of the oldest message this process received and has not
  deleted (its SentTimestamp), exact in the log's sense; 0 when the queue
  is empty. SQS does not tell the age of a message nobody received (only
  CloudWatch does), so a backlog that no reader here holds has no age.

A queue's "last read" is its last receive, an empty long poll included: a
reader that waits on an idle queue is reading.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.errors import NemesisError

log = logging.getLogger(__name__)


class QueueCounts(Protocol):
    """What a queue says about itself (``nemesis.broker.sqs.QueueStats`` is one)."""

    @property
    def queue(self) -> str: ...
    @property
    def visible(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def delayed(self) -> int: ...
    @property
    def oldest_held_age_s(self) -> float | None: ...


@runtime_checkable
class CountsQueue(Protocol):
    """A source that can count its queue, and tell when it last received (monotonic)."""

    @property
    def last_receive_at(self) -> float | None: ...

    async def stats(self) -> QueueCounts: ...


@dataclass(frozen=True, slots=True)
class QueueReading:
    """One integration's queue at the last refresh."""

    counts: QueueCounts
    read_at: float  # the clock's monotonic time of the answer


class QueueMonitor:
    """The counts of every queue source, refreshed by the proxy's telemetry loop."""

    def __init__(self, *, clock: Clock = SYSTEM_CLOCK, timeout_s: float = 5.0) -> None:
        self._clock = clock
        self._timeout_s = timeout_s
        self._readings: dict[str, QueueReading] = {}
        self._failing: dict[str, str] = {}
        self.failures = 0

    async def refresh(self, sources: Mapping[str, object]) -> None:
        """Asks each queue source (by integration) for its counts; forgets the others."""
        queues = {name: s for name, s in sources.items() if isinstance(s, CountsQueue)}
        for name in set(self._readings) - set(queues):
            del self._readings[name]
        await asyncio.gather(*(self._read(name, source) for name, source in queues.items()))

    async def _read(self, name: str, source: CountsQueue) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                counts = await source.stats()
        except (NemesisError, TimeoutError) as exc:
            # The last reading stays; said once per new error, not every round.
            self.failures += 1
            error = str(exc) or type(exc).__name__
            if self._failing.get(name) != error:
                log.warning("integration %s: counting its queue failed: %s", name, error)
            self._failing[name] = error
            return
        self._failing.pop(name, None)
        self._readings[name] = QueueReading(counts, self._clock.monotonic())

    def reading(self, integration: str) -> QueueReading | None:
        """The integration's last counts; None for a source that is not a counted queue."""
        return self._readings.get(integration)


def last_receive_at(source: object, clock: Clock) -> float | None:
    """When a queue source last received (on ``clock``'s monotonic time); None if never."""
    if not isinstance(source, CountsQueue):
        return None
    at = source.last_receive_at
    if at is None:
        return None
    return clock.monotonic() - max(time.monotonic() - at, 0.0)
