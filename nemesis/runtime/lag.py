"""Commit lag per partition, in messages and in seconds, refreshed in the background.

The broker is asked for every watched topic's end offsets and committed
offsets every ``interval_s`` (one describe per topic per round, however many
integrations read it), never while a scrape waits: ``/metrics`` and the
admin API read the last snapshot. A topic that does not exist yet (a retry
tier nobody failed into) is skipped quietly.

Lag in seconds is the age of the oldest message not committed. It is exact
where this process holds the partition and has read that message (the ack
tracker knows its ``written_at``). Elsewhere the oldest uncommitted message
was never read here, so its time is looked up in a table of (offset, written
at) points each partition collects from its describes (the time the end
offset's last message was written): interpolated between two points, or the
oldest point's time when the offset is older than the table, which
understates the lag rather than invent one (the approach of Kafka lag
exporters). Either way a lag of zero messages is zero seconds.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from nemesis.broker.port import Broker, DescribesMany, PartitionInfo, TopicDescription
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.errors import NemesisError, TopicNotFound

log = logging.getLogger(__name__)

# Points kept per partition; when full, every second one of the older half goes.
MAX_POINTS: Final = 64


@dataclass(frozen=True, slots=True)
class LagTarget:
    """One flow whose lag is watched: what it reads, as which consumer."""

    integration: str
    flow: str
    topic: str
    consumer: str


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """The commit lag of one flow on one partition."""

    integration: str
    flow: str
    topic: str
    partition: int
    end_offset: int
    committed_offset: int
    messages: int
    seconds: float | None  # None: no time known yet (no message was ever seen written)
    exact: bool  # from a message this process read, not from the offset table
    # How long the broker keeps the topic's messages; None: forever (or unknown).
    retention_s: float | None = None


@dataclass(frozen=True, slots=True)
class LagStatistics:
    """How fresh the lag data is."""

    rounds: int
    failures: int  # describes that failed or timed out (missing topics not counted)
    last_round_at: float | None  # monotonic
    last_success_at: float | None  # monotonic: the last round in which the broker answered
    last_error: str | None
    topics: int
    # Monotonic time since which every describe of every round failed; None: the broker answers.
    unreachable_since: float | None = None


class OffsetTimes:
    """(offset, written_at) points of one partition, to tell an offset's time without reading it."""

    __slots__ = ("_offsets", "_times")

    def __init__(self) -> None:
        self._offsets: list[int] = []
        self._times: list[float] = []

    def __len__(self) -> int:
        return len(self._offsets)

    def add(self, offset: int, written_at: float) -> None:
        """Records that the message at ``offset`` was written at ``written_at``."""
        if self._offsets and offset <= self._offsets[-1]:
            return  # nothing new was written (or the topic was recreated: keep what we know)
        self._offsets.append(offset)
        self._times.append(written_at)
        if len(self._offsets) > MAX_POINTS:
            half = MAX_POINTS // 2
            self._offsets[:half] = self._offsets[:half:2]
            self._times[:half] = self._times[:half:2]

    def time_of(self, offset: int) -> float | None:
        """When the message at ``offset`` was written, as well as the points tell; None if empty."""
        if not self._offsets:
            return None
        i = bisect.bisect_left(self._offsets, offset)
        if i == 0:
            # Older than anything seen: the oldest point is a lower bound on its age.
            return self._times[0]
        if i == len(self._offsets):
            return self._times[-1]
        if self._offsets[i] == offset:
            return self._times[i]
        low_offset, high_offset = self._offsets[i - 1], self._offsets[i]
        low_time, high_time = self._times[i - 1], self._times[i]
        share = (offset - low_offset) / (high_offset - low_offset)
        return low_time + share * (high_time - low_time)


# (integration, flow, topic, partition) -> written_at of the oldest message read and not done.
OldestUnfinished = Callable[[str, str, str, int], float | None]


class LagMonitor:
    """End and committed offsets of the watched flows' topics, refreshed in the background."""

    def __init__(
        self,
        broker: Broker,
        targets: Callable[[], Iterable[LagTarget]],
        *,
        clock: Clock = SYSTEM_CLOCK,
        interval_s: float = 5.0,
        timeout_s: float = 5.0,
        concurrency: int = 4,
    ) -> None:
        self._broker = broker
        self._targets = targets
        self._clock = clock
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._concurrency = concurrency
        self._descriptions: dict[str, TopicDescription] = {}
        self._times: dict[tuple[str, int], OffsetTimes] = {}
        self._rounds = 0
        self._failures = 0
        self._last_round_at: float | None = None
        self._last_error: str | None = None
        self._round_failures = 0
        self._unreachable_since: float | None = None
        self._last_success_at: float | None = None

    async def run(self) -> None:
        """Refreshes every ``interval_s`` until cancelled."""
        while True:
            await self.refresh()
            await self._clock.sleep(self._interval_s)

    async def refresh(self) -> None:
        """One round: describes every watched topic once."""
        topics = sorted({target.topic for target in self._targets()})
        gate = asyncio.Semaphore(self._concurrency)

        async def describe(topic: str) -> None:
            async with gate:
                await self._describe(topic)

        self._round_failures = 0
        singles = topics
        admin = self._broker.admin
        if isinstance(admin, DescribesMany) and topics:
            # One trip for every topic: with hundreds of integrations, a describe per topic
            # was most of what an idle process did. Should it fail, each topic is asked alone.
            singles = []
            try:
                async with asyncio.timeout(self._timeout_s):
                    found = await admin.describe_topics(topics)
            except (NemesisError, TimeoutError):
                singles = topics
            else:
                for topic in topics:
                    description = found.get(topic)
                    if description is None:
                        self._forget(topic)
                    else:
                        self._take(topic, description)
        async with asyncio.TaskGroup() as tasks:
            for topic in singles:
                tasks.create_task(describe(topic), name=f"lag:{topic}")
        for topic in set(self._descriptions) - set(topics):
            self._forget(topic)
        now = self._clock.monotonic()
        if topics and self._round_failures == len(topics):
            if self._unreachable_since is None:
                self._unreachable_since = now
        else:
            self._unreachable_since = None
            self._last_success_at = now
        self._rounds += 1
        self._last_round_at = now

    def statistics(self) -> LagStatistics:
        """Rounds, failures and the time of the last round."""
        return LagStatistics(
            rounds=self._rounds,
            failures=self._failures,
            last_round_at=self._last_round_at,
            last_success_at=self._last_success_at,
            last_error=self._last_error,
            topics=len(self._descriptions),
            unreachable_since=self._unreachable_since,
        )

    def end_offsets(self, topic: str) -> int | None:
        """The sum of a topic's end offsets at the last refresh (None: not described)."""
        description = self._descriptions.get(topic)
        if description is None:
            return None
        return sum(p.end_offset for p in description.partitions)

    def lags(
        self, targets: Iterable[LagTarget], oldest_unfinished: OldestUnfinished | None = None
    ) -> list[PartitionLag]:
        """The lag of each target on each partition of its topic, as of now."""
        now = self._clock.time()
        lags: list[PartitionLag] = []
        for target in targets:
            description = self._descriptions.get(target.topic)
            if description is None:
                continue
            lags.extend(
                self._lag_of(target, info, now, oldest_unfinished, description.retention_s)
                for info in description.partitions
            )
        return lags

    def _lag_of(
        self,
        target: LagTarget,
        info: PartitionInfo,
        now: float,
        oldest_unfinished: OldestUnfinished | None,
        retention_s: float | None = None,
    ) -> PartitionLag:
        # Retention may have removed what was never committed: that is gone, not lag.
        committed = max(info.committed.get(target.consumer, info.start_offset), info.start_offset)
        messages = max(info.end_offset - committed, 0)
        seconds: float | None = 0.0
        exact = False
        if messages:
            written_at = None
            if oldest_unfinished is not None:
                written_at = oldest_unfinished(
                    target.integration, target.flow, target.topic, info.partition
                )
            exact = written_at is not None
            if written_at is None:
                times = self._times.get((target.topic, info.partition))
                written_at = None if times is None else times.time_of(committed)
            seconds = None if written_at is None else max(now - written_at, 0.0)
        return PartitionLag(
            integration=target.integration,
            flow=target.flow,
            topic=target.topic,
            partition=info.partition,
            end_offset=info.end_offset,
            committed_offset=committed,
            messages=messages,
            seconds=seconds,
            exact=exact,
            retention_s=retention_s or None,
        )

    async def _describe(self, topic: str) -> None:
        try:
            async with asyncio.timeout(self._timeout_s):
                description = await self._broker.admin.describe_topic(topic)
        except TopicNotFound:
            self._forget(topic)
            return
        except (NemesisError, TimeoutError) as exc:
            # The last snapshot stays; lag ages with it until the broker answers again.
            self._failures += 1
            self._round_failures += 1
            self._last_error = f"{topic}: {exc or type(exc).__name__}"
            log.warning("lag: describing topic %s failed: %s", topic, self._last_error)
            return
        self._take(topic, description)

    def _take(self, topic: str, description: TopicDescription) -> None:
        self._descriptions[topic] = description
        for info in description.partitions:
            if info.last_written_at is not None and info.end_offset > info.start_offset:
                times = self._times.get((topic, info.partition))
                if times is None:
                    times = self._times[(topic, info.partition)] = OffsetTimes()
                times.add(info.end_offset - 1, info.last_written_at)

    def _forget(self, topic: str) -> None:
        self._descriptions.pop(topic, None)
        for key in [key for key in self._times if key[0] == topic]:
            del self._times[key]


def oldest_unfinished_from(
    partitions: Mapping[tuple[str, str, str, int], float],
) -> OldestUnfinished:
    """An ``OldestUnfinished`` over a mapping built from runner statistics."""

    def lookup(integration: str, flow: str, topic: str, partition: int) -> float | None:
        return partitions.get((integration, flow, topic, partition))

    return lookup
