"""Dead messages that wait for the dead-letter store: a DLQ that cannot write fails alone.

When a put fails (a full disk, a store that is down or times out), the
message the failure policy dead-lettered is not acknowledged: it waits here,
unfinished, and is written again and again until the store takes it, while
the flow delivers the rest of its messages. While messages wait, a new dead
message joins them without a put of its own (the store is known to be down:
a worker must not hang on it). Written, each is logged and finished as if
its first put had worked; a message whose partition session ended meanwhile
is let go (its next reader delivers it again).

Bounded by what bounds every unfinished message: a waiting one holds its
place in ``delivery.buffer`` (and, on an ordered flow, its key), and its
partition's commits stop behind it (a partition with ``delivery.buffer``
uncommitted pauses). When the whole buffer waits, the flow stops reading until
the store writes again; nothing is dropped and nothing is committed past a
waiting message, so a crash meanwhile delivers them again.

Retries: ``RETRY_FIRST_S`` after the failure, doubling to ``RETRY_MAX_S``; a
round writes up to ``ROUND`` messages at once (concurrent puts share a commit
on the sqlite store) and stops at the first part that fails. Logs: one error
when the store first fails, with its cause; one a minute while it stays
down; one warning when it writes again, with how many waited and how long.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from nemesis.clock import Clock
from nemesis.dlq import DeadLetter, DeadLetterStore
from nemesis.errors import DlqError
from nemesis.runtime.scheduler import Work

log = logging.getLogger(__name__)

RETRY_FIRST_S: Final = 0.5
RETRY_MAX_S: Final = 10.0
ROUND: Final = 64  # messages written at once in a retry
LOG_INTERVAL_S: Final = 60.0


@dataclass(frozen=True, slots=True)
class WaitingStatistics:
    """Dead messages waiting for the store now, and since when it fails."""

    messages: int
    since: float | None  # monotonic time of the first failure of this outage
    last_error: str | None


NOT_WAITING: Final = WaitingStatistics(0, None, None)


class WaitingDeadLetters:
    """A flow's dead messages that the store could not take yet; ``run`` writes them."""

    def __init__(
        self,
        integration: str,
        flow: str,
        dlq: DeadLetterStore,
        *,
        clock: Clock,
        written: Callable[[Work, DeadLetter, str], None],
        let_go: Callable[[Work], None],
    ) -> None:
        self._integration = integration
        self._flow = flow
        self._dlq = dlq
        self._clock = clock
        self._written = written
        self._let_go = let_go
        self._waiting: dict[Work, tuple[DeadLetter, str]] = {}  # the letter, its failure
        self._added = asyncio.Event()
        self._since: float | None = None
        self._last_error: str | None = None
        self._logged_at = 0.0

    @property
    def outage(self) -> bool:
        """Whether the store failed and has not written since."""
        return self._since is not None

    def statistics(self) -> WaitingStatistics:
        return WaitingStatistics(len(self._waiting), self._since, self._last_error)

    def add(
        self, work: Work, letter: DeadLetter, summary: str, error: DlqError | None = None
    ) -> None:
        """Keeps a dead message until the store takes it (``error``: why its put failed)."""
        self._waiting[work] = (letter, summary)
        if error is not None:
            self._failed(error)
        elif self._since is None:  # only during an outage is a message added untried
            self._since = self._clock.monotonic()
        self._added.set()

    async def run(self) -> None:
        """Writes the waiting messages as soon as the store takes them, until cancelled."""
        delay_s = RETRY_FIRST_S
        while True:
            if not self._waiting:
                self._added.clear()
                await self._added.wait()
                delay_s = RETRY_FIRST_S
            await self._clock.sleep(delay_s)
            written = await self._retry()
            delay_s = RETRY_FIRST_S if written else min(delay_s * 2, RETRY_MAX_S)

    async def _retry(self) -> bool:
        """One round; whether the store took everything that waited."""
        for work in [w for w in self._waiting if not w.message.alive]:
            del self._waiting[work]
            self._let_go(work)
        written = 0
        while self._waiting:
            chunk = list(self._waiting.items())[:ROUND]
            async with asyncio.TaskGroup() as tasks:
                puts = [tasks.create_task(self._put(work, *waiting)) for work, waiting in chunk]
            if not all(put.result() for put in puts):
                return False
            written += len(puts)
        if self._since is not None and written:
            log.warning(
                "integration %s, flow %s: the dead-letter store writes again after %.0fs;"
                " the dead messages that waited for it are written",
                self._integration,
                self._flow,
                self._clock.monotonic() - self._since,
                extra={"integration": self._integration, "flow": self._flow},
            )
        self._since = self._last_error = None
        return True

    async def _put(self, work: Work, letter: DeadLetter, summary: str) -> bool:
        try:
            await self._dlq.put([letter])
        except DlqError as exc:
            self._failed(exc)
            return False
        if self._waiting.pop(work, None) is not None:
            self._written(work, letter, summary)
        return True

    def _failed(self, error: DlqError) -> None:
        now = self._clock.monotonic()
        self._last_error = str(error)
        if self._since is None:
            self._since = now
            how_long = ""
        elif now - self._logged_at < LOG_INTERVAL_S:
            return
        else:
            how_long = f" for {now - self._since:.0f}s"
        self._logged_at = now
        log.error(
            "integration %s, flow %s: the dead-letter store cannot write%s: %s; %d dead"
            " messages wait for it unacknowledged (within delivery.buffer), the rest flows",
            self._integration,
            self._flow,
            how_long,
            error,
            len(self._waiting),
            extra={"integration": self._integration, "flow": self._flow},
        )
