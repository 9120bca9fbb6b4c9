"""Prometheus metrics (docs/design.md, section 8), prefix ``nemesis_``.

Families live on a ``Metrics`` object with its own registry (no module-level
singleton: tests make their own). Labels are bounded: integration, topic,
partition, stage, tier, outcome, status class, flow, the state store's
operation; never message ids, member ids or URLs.
Gauges that describe live state (lag, buffered, in flight, seconds since last
read) are computed at scrape time from the runners' ``statistics()``
snapshots, so a stuck runner cannot leave a stale value behind.
"""

from __future__ import annotations

import bisect
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    GCCollector,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from nemesis import __version__
from nemesis.stage_meter import STAGE_BUCKETS_S, StageMeter

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

# Rate-limiter waits: from a token's fraction of a millisecond to a replay queued for a minute.
RATE_LIMIT_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0)

# The age of a message when its handler took it: a millisecond on a quiet
# topic, up to a day for a backlog after an outage.
AGE_BUCKETS_S = (*LATENCY_BUCKETS_S[1:], 60.0, 300.0, 900.0, 3600.0, 21600.0, 86400.0)

# A handover waits for the old owner to drain: nothing, a poll, up to a shutdown grace and a lease.
HANDOVER_BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)

# The state store's operations a fleet member calls (``nemesis.fleet.port.StateStore``).
FLEET_STATE_OPERATIONS = (
    "generation",
    "heartbeat",
    "view",
    "forget",
    "assign",
    "unassign",
    "leave",
    "set_overrides",
    "clear_overrides",
    "drop_caught_up",
)


def status_class(status: int | None, protocol: str = "http") -> str:
    """Bounded label for a handler's answer: common HTTP codes, else their class; gRPC codes."""
    if status is None:
        return "none"
    if protocol == "grpc":
        return f"grpc_{status}"  # 17 codes at most
    if status in (200, 202, 204, 400, 404, 408, 409, 422, 429, 500, 502, 503, 504):
        return str(status)
    return f"{status // 100}xx"


class LoopCounter:
    """A counter child updated only from the event loop's thread: no lock, read at scrape time."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopHistogram:
    """A histogram child updated only from the event loop's thread (see ``LoopCounter``)."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # not cumulative; the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def observe_many(self, values: Sequence[float]) -> None:
        """Observes each value; values that share one bucket (a batch's, mostly) cost one update."""
        if not values:
            return
        bounds, counts = self.bounds, self.counts
        bucket = bisect.bisect_left(bounds, min(values))
        if bucket == bisect.bisect_left(bounds, max(values)):
            counts[bucket] += len(values)
        else:
            bisect_left = bisect.bisect_left
            for value in values:
                counts[bisect_left(bounds, value)] += 1
        self.sum += sum(values)


Child = TypeVar("Child", LoopCounter, LoopHistogram)


class LoopFamily(Generic[Child]):
    """Counters or histograms by label values, for hot paths on the event loop.

    prometheus_client's children take a lock per update (1-2 us each, measured
    as a fifth of the runner's own cost per message); these are plain numbers
    that the registry reads when scraped. Same ``labels(...).inc()/observe()`` API.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: list[str],
        make: Callable[[], Child],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._make: Callable[[], Child] = make
        self._children: dict[tuple[str, ...], Child] = {}

    def labels(self, *values: str) -> Child:
        """The child for these label values, created on first use."""
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}")
            child = self._children[values] = self._make()
        return child

    def forget(self, first_label: str) -> None:
        """Drops the children whose first label value is ``first_label`` (a removed integration)."""
        for values in [values for values in self._children if values[0] == first_label]:
            del self._children[values]

    def collect(self) -> Metric:
        counters = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        histograms = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        # A copy: a scrape may run on another thread.
        for values, child in list(self._children.items()):
            _add_sample(counters, histograms, list(values), child)
        return counters if self._make is LoopCounter else histograms


def _add_sample(
    counters: CounterMetricFamily,
    histograms: HistogramMetricFamily,
    values: list[str],
    child: LoopCounter | LoopHistogram,
) -> None:
    if isinstance(child, LoopCounter):
        counters.add_metric(values, child.value)
        return
    cumulative, buckets = 0, []
    for bound, count in zip((*child.bounds, float("inf")), child.counts, strict=True):
        cumulative += count
        buckets.append((_bound_label(bound), cumulative))
    histograms.add_metric(values, buckets, child.sum)


class Metrics:
    """Every metric family the proxy exports, on one registry.

    With ``process=True`` the registry also carries the process, platform and
    garbage-collector families of prometheus_client (``process_*``,
    ``python_*``): what ``nemesis run`` exports; tests leave them out.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = False) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._loop_families: list[LoopFamily[Any]] = []
        if process:
            ProcessCollector(registry=r)
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        Info("nemesis_build", "The Nemesis version this process runs.", registry=r).info(
            {"version": __version__}
        )
        self.messages_read = self._loop_counter(
            "nemesis_messages_read",
            "Messages read from source topics.",
            ["integration", "topic"],
        )
        self.deliveries = self._loop_counter(
            "nemesis_deliveries",
            "Delivery attempts by outcome and handler status (a batch counts once per message).",
            ["integration", "outcome", "status"],
        )
        self.delivery_duration = self._loop_histogram(
            "nemesis_delivery_duration_seconds",
            "Time of one delivery request to the handler (single event or batch), by its"
            " outcome: a timeout's seconds do not hide in the accepted requests' latency.",
            ["integration", "outcome"],
            buckets=LATENCY_BUCKETS_S,
        )
        self.delivery_age = self._loop_histogram(
            "nemesis_delivery_age_seconds",
            "Time from a message's write to the topic its flow reads until its handler"
            " accepted it: retries in place included; on a retry tier, the tier's delay too.",
            ["integration", "flow"],
            buckets=AGE_BUCKETS_S,
        )
        self.delivery_batch_size = self._loop_histogram(
            "nemesis_delivery_batch_size",
            "Events per delivery request.",
            ["integration"],
            buckets=(1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0),
        )
        self.retries_in_place = self._loop_counter(
            "nemesis_retries_in_place",
            "Messages scheduled for another attempt without leaving their partition.",
            ["integration"],
        )
        self.commits = self._loop_counter(
            "nemesis_commits",
            "Offset commits sent to the broker.",
            ["integration", "topic"],
        )
        self.committed_messages = self._loop_counter(
            "nemesis_committed_messages",
            "Messages whose offsets were committed.",
            ["integration", "topic"],
        )
        self.commit_failures = self._loop_counter(
            "nemesis_commit_failures",
            "Offset commits the broker refused or timed out.",
            ["integration", "topic"],
        )
        self.stale_dropped = self._loop_counter(
            "nemesis_stale_messages_dropped",
            "Messages dropped because their partition was revoked (its new owner reads them).",
            ["integration"],
        )
        self.retry_publishes = self._loop_counter(
            "nemesis_retry_publishes",
            "Messages sent to a retry tier, by tier (1-based): written to its topic,"
            " or released to the queue for its delay.",
            ["integration", "tier"],
        )
        self.dlq_writes = self._loop_counter(
            "nemesis_dlq_writes",
            "Messages written to the dead-letter store, by reason.",
            ["integration", "reason"],
        )
        self.halted_keys = self._loop_counter(
            "nemesis_halted_keys",
            "Keys or partitions of ordered integrations halted after their retries ran out.",
            ["integration"],
        )
        self.breaker_state = Gauge(
            "nemesis_breaker_state",
            "Circuit breaker state of an integration's target: 0 closed, 1 open, 2 half-open.",
            ["integration"],
            registry=r,
        )
        self.breaker_transitions = self._loop_counter(
            "nemesis_breaker_transitions",
            "Circuit breaker state changes, by the state left and the state entered.",
            ["integration", "from_state", "to_state"],
        )
        self.rate_limit_wait = self._loop_histogram(
            "nemesis_rate_limit_wait_seconds",
            "Time an acquisition waited for its flow's rate limit (only those that waited;"
            " the sum is the time lost to the limit).",
            ["integration", "flow"],
            buckets=RATE_LIMIT_WAIT_BUCKETS_S,
        )
        self.flow_restarts = self._loop_counter(
            "nemesis_flow_restarts",
            "Restarts of a flow after it failed or could not start (a broker that refused it,"
            " a record that crashed its reader); a flow waiting for its topic is not counted.",
            ["integration", "flow"],
        )
        self.disabled_type_skips = self._loop_counter(
            "nemesis_disabled_type_skips",
            "Messages acknowledged without delivery because their type was in"
            " flags.disabled_types.",
            ["integration", "type"],
        )
        # The fleet member's counts (``nemesis.fleet.member``); its gauges are computed at
        # scrape time from its statistics(). Labels: the store's operation, nothing per member.
        self.fleet_state_errors = self._loop_counter(
            "nemesis_fleet_state_errors",
            "Calls of the fleet's state store that failed, by operation (heartbeat, view, ...).",
            ["operation"],
        )
        self.fleet_handovers = self._loop_counter(
            "nemesis_fleet_handovers",
            "Integrations this member started that another member ran or was placed on.",
            [],
        )
        self.fleet_handover_duration = self._loop_histogram(
            "nemesis_fleet_handover_duration_seconds",
            "Time from this member's decision to run an integration another member ran until"
            " it started it here: the wait for the old owner to drain included.",
            [],
            buckets=HANDOVER_BUCKETS_S,
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

    def forget_integration(self, integration: str) -> None:
        """Drops every series of an integration that was removed from the configuration."""
        for family in self._loop_families:
            if family.labelnames and family.labelnames[0] == "integration":
                family.forget(integration)
        self.forget_stages(integration)
        # Gauge.remove raises KeyError for label values it never saw.
        with contextlib.suppress(KeyError):
            self.breaker_state.remove(integration)

    def totals(self, integration: str) -> dict[str, float]:
        """Counts since start of one integration's messages: delivered, filtered, retried, dead.

        Filtered counts the pipelines' filters (messages of a disabled type are
        the runner's, see ``RunnerStats.skipped``); retried counts retries in
        place and writes to a retry tier.
        """

        def total(family: LoopFamily[LoopCounter], **match: str) -> float:
            where = [(family.labelnames.index(label), value) for label, value in match.items()]
            return sum(
                child.value
                for values, child in list(family._children.items())
                if values[0] == integration and all(values[i] == v for i, v in where)
            )

        filtered = sum(
            meter.filtered
            for (name, _), meter in list(self._stage_meters.items())
            if name == integration
        )
        return {
            "delivered": total(self.deliveries, outcome="delivered"),
            "filtered": float(filtered),
            "retried": total(self.retries_in_place) + total(self.retry_publishes),
            "dead_lettered": total(self.dlq_writes),
        }

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
            filtered, failed = meter.filtered, meter.failed  # read once: passed derives from them
            cumulative, buckets = 0, []
            for bound, count in zip((*STAGE_BUCKETS_S, float("inf")), meter.buckets, strict=True):
                cumulative += count
                buckets.append((_bound_label(bound), cumulative))
            duration.add_metric([integration, stage], buckets, meter.seconds)
            passed = max(cumulative - filtered - failed, 0)
            messages.add_metric([integration, stage, "passed"], passed)
            messages.add_metric([integration, stage, "filtered"], filtered)
            messages.add_metric([integration, stage, "failed"], failed)
        yield messages
        yield duration

    def _loop_counter(
        self, name: str, documentation: str, labelnames: list[str]
    ) -> LoopFamily[LoopCounter]:
        family = LoopFamily(name, documentation, labelnames, LoopCounter)
        self.registry.register(_CallbackCollector(lambda: [family.collect()]))
        self._loop_families.append(family)
        return family

    def _loop_histogram(
        self, name: str, documentation: str, labelnames: list[str], *, buckets: tuple[float, ...]
    ) -> LoopFamily[LoopHistogram]:
        family = LoopFamily(name, documentation, labelnames, lambda: LoopHistogram(buckets))
        self.registry.register(_CallbackCollector(lambda: [family.collect()]))
        self._loop_families.append(family)
        return family

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
