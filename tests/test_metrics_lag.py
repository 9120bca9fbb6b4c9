"""Commit lag from describes: messages, and seconds from the offset-time table or the tracker."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from nemesis.broker.port import PartitionInfo, TopicDescription
from nemesis.errors import BrokerTimeout, TopicNotFound
from nemesis.runtime.lag import MAX_POINTS, LagMonitor, LagTarget, OffsetTimes
from nemesis.testing.clock import FakeClock


def test_offset_times_interpolate_and_stay_bounded() -> None:
    times = OffsetTimes()
    assert times.time_of(5) is None
    times.add(99, 1000.0)
    times.add(199, 1100.0)
    assert times.time_of(99) == 1000.0
    assert times.time_of(149) == pytest.approx(1050.0)
    assert times.time_of(10) == 1000.0  # older than the table: the oldest point, a lower bound
    assert times.time_of(500) == 1100.0
    times.add(150, 2000.0)  # not past the last point: ignored
    assert times.time_of(199) == 1100.0
    for n in range(1, 500):
        times.add(199 + n, 1100.0 + n)
    assert len(times) <= MAX_POINTS
    assert times.time_of(198 + 499) == pytest.approx(1100.0 + 498, abs=20)


class _Admin:
    """A topic admin whose describes the test scripts."""

    def __init__(self) -> None:
        self.descriptions: dict[str, TopicDescription] = {}
        self.failing = False
        self.calls = 0

    async def describe_topic(self, name: str) -> TopicDescription:
        self.calls += 1
        if self.failing:
            raise BrokerTimeout("no answer")
        if name not in self.descriptions:
            raise TopicNotFound(name)
        return self.descriptions[name]


class _Broker:
    def __init__(self) -> None:
        self.admin = _Admin()


def describe(end: int, committed: int, written_at: float, start: int = 0) -> TopicDescription:
    return TopicDescription(
        "orders",
        [PartitionInfo(0, start, end, written_at, {"loyalty": committed})],
        ["loyalty"],
        None,
    )


def lags_of(monitor: LagMonitor, targets: Sequence[LagTarget]) -> list[tuple[int, float | None]]:
    return [(lag.messages, lag.seconds) for lag in monitor.lags(targets)]


async def test_lag_in_messages_and_seconds_from_describes() -> None:
    clock = FakeClock(wall_start=10_000.0)
    broker = _Broker()
    target = LagTarget("loyalty", "main", "orders", "loyalty")
    monitor = LagMonitor(broker, lambda: [target], clock=clock)  # type: ignore[arg-type]
    # Nothing committed yet: 100 behind, the oldest written when the first describe saw 100.
    broker.admin.descriptions["orders"] = describe(100, 0, written_at=10_000.0)
    await monitor.refresh()
    clock.advance(30)
    broker.admin.descriptions["orders"] = describe(200, 0, written_at=10_030.0)
    await monitor.refresh()
    assert lags_of(monitor, [target]) == [(200, 30.0)]
    # Half committed: offset 100's time is interpolated between the two points.
    broker.admin.descriptions["orders"] = describe(200, 100, written_at=10_030.0)
    await monitor.refresh()
    [(messages, seconds)] = lags_of(monitor, [target])
    assert messages == 100
    assert seconds == pytest.approx(29.7)
    # The tracker's oldest unfinished message wins: it is exact.
    [exact] = monitor.lags([target], lambda *_: 10_025.0)
    assert (exact.seconds, exact.exact) == (5.0, True)
    # Caught up: zero seconds, whatever the table says.
    broker.admin.descriptions["orders"] = describe(200, 200, written_at=10_030.0)
    await monitor.refresh()
    assert lags_of(monitor, [target]) == [(0, 0.0)]
    # Retention removed what was never committed: that is gone, not lag.
    broker.admin.descriptions["orders"] = describe(300, 50, written_at=10_030.0, start=250)
    await monitor.refresh()
    assert lags_of(monitor, [target])[0][0] == 50


async def test_a_broker_that_does_not_answer_keeps_the_last_figures_and_is_reported() -> None:
    clock = FakeClock()
    broker = _Broker()
    target = LagTarget("loyalty", "main", "orders", "loyalty")
    monitor = LagMonitor(broker, lambda: [target], clock=clock)  # type: ignore[arg-type]
    broker.admin.descriptions["orders"] = describe(10, 5, written_at=clock.time())
    await monitor.refresh()
    broker.admin.failing = True
    clock.advance(40)
    await monitor.refresh()
    clock.advance(40)
    await monitor.refresh()
    stats = monitor.statistics()
    assert stats.failures == 2
    assert stats.unreachable_since == 40
    assert stats.last_success_at == 0
    assert lags_of(monitor, [target])[0][0] == 5  # the last snapshot stays
    broker.admin.failing = False
    await monitor.refresh()
    assert monitor.statistics().unreachable_since is None
    # A topic that does not exist (a retry tier nobody failed into) is quietly skipped.
    missing = LagTarget("loyalty", "retry-1", "nemesis.retry.loyalty.1", "loyalty")
    assert monitor.lags([missing]) == []
