"""Prometheus metrics (DESIGN.md section 8), prefix ``nemesis_``.

Families live on a ``Metrics`` object with its own registry (no module-level
singleton: tests make their own). Labels are bounded: integration, topic,
partition, stage, tier, outcome, status class, flow; never message ids or URLs.
Gauges that describe live state (lag, buffered, in flight, seconds since last
read) are computed at scrape time from the runners' ``statistics()``
snapshots, so a stuck runner cannot leave a stale value behind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)

# Pipeline stages take microseconds, not the milliseconds of a delivery.
STAGE_BUCKETS_S = (
    0.000001,
    0.0000025,
    0.000005,
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.005,
    0.025,
    0.1,
)


class StageMeter:
    """Counts and times one pipeline stage of one integration with plain numbers.

    The pipeline's hot path updates these attributes directly: a
    prometheus_client child costs about 1 us per ``inc`` and 2 us per
    ``observe`` (a lock each), more than a compiled filter takes. The
    ``nemesis_stage_*`` families are built from meters at scrape time.
    ``buckets[i]`` counts durations up to ``STAGE_BUCKETS_S[i]`` (the last
    one: above every bound); they are not cumulative.
    """

    __slots__ = ("buckets", "failed", "filtered", "passed", "seconds")

    def __init__(self) -> None:
        self.passed = 0
        self.filtered = 0
        self.failed = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(STAGE_BUCKETS_S) + 1)

    @property
    def processed(self) -> int:
        return self.passed + self.filtered + self.failed


def status_class(status: int | None) -> str:
    """Bounded label for an HTTP status: the code for common ones, else its class."""
    if status is None:
        return "none"
    if status in (200, 202, 204, 400, 404, 408, 409, 422, 429, 500, 502, 503, 504):
        return str(status)
    return f"{status // 100}xx"


class Metrics:
    """Every metric family the proxy exports, on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.messages_read = Counter(
            "nemesis_messages_read",
            "Messages read from source topics.",
            ["integration", "topic"],
            registry=r,
        )
        self.deliveries = Counter(
            "nemesis_deliveries",
            "Delivery attempts by outcome and handler status (a batch counts once per message).",
            ["integration", "outcome", "status"],
            registry=r,
        )
        self.delivery_duration = Histogram(
            "nemesis_delivery_duration_seconds",
            "Time of one delivery request to the handler (single event or batch).",
            ["integration"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.delivery_batch_size = Histogram(
            "nemesis_delivery_batch_size",
            "Events per delivery request.",
            ["integration"],
            buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000),
            registry=r,
        )
        self.retries_in_place = Counter(
            "nemesis_retries_in_place",
            "Messages scheduled for another attempt without leaving their partition.",
            ["integration"],
            registry=r,
        )
        self.commits = Counter(
            "nemesis_commits",
            "Offset commits sent to the broker.",
            ["integration", "topic"],
            registry=r,
        )
        self.committed_messages = Counter(
            "nemesis_committed_messages",
            "Messages whose offsets were committed.",
            ["integration", "topic"],
            registry=r,
        )
        self.commit_failures = Counter(
            "nemesis_commit_failures",
            "Offset commits the broker refused or timed out.",
            ["integration", "topic"],
            registry=r,
        )
        self.stale_dropped = Counter(
            "nemesis_stale_messages_dropped",
            "Messages dropped because their partition was revoked (the new owner reads them again).",
            ["integration"],
            registry=r,
        )
        # (integration, stage) -> meter; kept across pipeline reloads so counters stay monotonic.
        self._stage_meters: dict[tuple[str, str], StageMeter] = {}
        r.register(_CallbackCollector(self._collect_stages))

    def stage_meter(self, integration: str, stage: str) -> StageMeter:
        """The meter of one pipeline stage, created on first use and shared afterwards."""
        key = (integration, stage)
        meter = self._stage_meters.get(key)
        if meter is None:
            meter = self._stage_meters[key] = StageMeter()
        return meter

    def forget_stages(self, integration: str) -> None:
        """Drops the stage meters of an integration that was removed."""
        for key in [key for key in self._stage_meters if key[0] == integration]:
            del self._stage_meters[key]

    def _collect_stages(self) -> Iterator[Metric]:
        messages = CounterMetricFamily(
            "nemesis_stage_messages",
            "Messages leaving a pipeline stage, by outcome: passed on, filtered out, or failed"
            " (dead-lettered).",
            labels=["integration", "stage", "outcome"],
        )
        duration = HistogramMetricFamily(
            "nemesis_stage_duration_seconds",
            "Time one message spends in one pipeline stage.",
            labels=["integration", "stage"],
        )
        # A copy: a scrape from another thread must not see the dict change size.
        for (integration, stage), meter in list(self._stage_meters.items()):
            messages.add_metric([integration, stage, "passed"], meter.passed)
            messages.add_metric([integration, stage, "filtered"], meter.filtered)
            messages.add_metric([integration, stage, "failed"], meter.failed)
            cumulative, buckets = 0, []
            for bound, count in zip((*STAGE_BUCKETS_S, float("inf")), meter.buckets, strict=True):
                cumulative += count
                buckets.append((_bound_label(bound), cumulative))
            duration.add_metric([integration, stage], buckets, meter.seconds)
        yield messages
        yield duration

    def add_live_collector(self, collect: Callable[[], Iterable[Metric]]) -> None:
        """Registers gauges computed at scrape time."""
        self.registry.register(_CallbackCollector(collect))


class _CallbackCollector(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterator[Metric]:
        yield from self._collect()


def _bound_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
