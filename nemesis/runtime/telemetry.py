"""What the proxy looks like right now: one snapshot for ``/metrics`` and the admin API.

``Proxy.snapshot()`` reads every runner's, breaker's and limiter's
``statistics()`` and the last lag refresh once; ``metric_families`` turns the
snapshot into the gauges of docs/design.md (section 8) that describe live state
(counters and histograms are kept where they are counted). Computed at scrape
time, a gauge cannot be left behind by a runner that stopped updating it:
that is what makes a stuck consumer visible. Collect on the event loop's
thread (the admin API's ``/metrics`` does): the statistics are read unlocked.

Labels stay bounded: integration, flow (main, retry-<n>, replay), topic,
partition, tier, state and the names of live fields.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from nemesis.config.models import IntegrationConfig
from nemesis.errors import ConfigProblem
from nemesis.resilience.breaker import BreakerStatistics
from nemesis.resilience.limits import Flow, LimiterStatistics
from nemesis.runtime.lag import LagStatistics, PartitionLag
from nemesis.runtime.queues import QueueCounts
from nemesis.runtime.runner import RunnerState, RunnerStats
from nemesis.runtime.sizing import LiveEstimate


@dataclass(frozen=True, slots=True)
class IntegrationSnapshot:
    """One integration at one moment."""

    name: str
    state: str  # starting | running | paused | stopping | failed
    config: IntegrationConfig  # running: the YAML with the live overrides
    file_config: IntegrationConfig  # as the YAML says
    overrides: Mapping[str, Any]
    file: Path | None
    flows: Sequence[RunnerStats]
    issues: Mapping[str, str]  # flow -> why it is not running (a missing topic, ...)
    breaker: BreakerStatistics
    limits: Mapping[Flow, LimiterStatistics]
    lags: Sequence[PartitionLag]
    sizing: LiveEstimate | None
    problems: Sequence[ConfigProblem]  # of its file at the last reload (it runs the last good)
    queue: QueueCounts | None = None  # a queue source's counts at the last refresh


@dataclass(frozen=True, slots=True)
class ProxySnapshot:
    """Every integration at one moment, with the clock readings it was taken at."""

    monotonic: float
    time: float
    running: bool
    stopping: bool
    integrations: Sequence[IntegrationSnapshot]
    lag: LagStatistics


def seconds_since_last_read(stats: RunnerStats, now: float) -> float:
    """Since messages last arrived, or since the runner started when none ever did."""
    since = stats.last_read_at if stats.last_read_at is not None else stats.started_at
    return max(now - since, 0.0)


def metric_families(snapshot: ProxySnapshot) -> Iterator[Metric]:
    """The live-state gauges (and the lag monitor's failure counter) of a snapshot."""
    yield from _runner_families(snapshot)
    yield from _lag_families(snapshot)
    yield from _queue_families(snapshot)
    yield from _integration_families(snapshot)


def _gauge(name: str, documentation: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, labels=labels)


def _runner_families(snapshot: ProxySnapshot) -> Iterator[Metric]:
    labels = ["integration", "flow"]
    now = snapshot.monotonic
    families = {
        "workers": _gauge(
            "nemesis_workers", "Delivery workers of a flow now (after live resizes).", labels
        ),
        "busy": _gauge(
            "nemesis_workers_busy", "Workers holding messages now (retiring ones included).", labels
        ),
        "buffered": _gauge(
            "nemesis_buffered_messages", "Messages read and not yet started by a worker.", labels
        ),
        "in_flight": _gauge(
            "nemesis_in_flight_messages", "Messages being delivered to the handler now.", labels
        ),
        "delayed": _gauge(
            "nemesis_delayed_messages", "Messages waiting for a retry in place.", labels
        ),
        "halted": _gauge(
            "nemesis_keys_halted",
            "Keys (or partitions) of an ordered flow halted now behind a message whose retries"
            " ran out (retry.on_exhausted: halt), until the handler accepts it.",
            labels,
        ),
        "dlq_waiting": _gauge(
            "nemesis_dlq_waiting_messages",
            "Dead messages waiting, unacknowledged, for the dead-letter store, which cannot"
            " write now; written as soon as it can.",
            labels,
        ),
        "unfinished": _gauge(
            "nemesis_unfinished_messages",
            "Messages read and not done: the fill of delivery.buffer.",
            labels,
        ),
        "uncommitted": _gauge(
            "nemesis_uncommitted_messages",
            "Messages read and not committed (done ones behind an unfinished one included).",
            labels,
        ),
        "paused_partitions": _gauge(
            "nemesis_paused_partitions",
            "Partitions paused at the reader: too much uncommitted behind a slow message.",
            labels,
        ),
        "assigned": _gauge(
            "nemesis_assigned_partitions", "Partition sessions this process holds.", labels
        ),
        "stalled": _gauge(
            "nemesis_stalled_partitions",
            "Partitions held and delivering nothing until an operator acts (a codec Nemesis"
            " cannot decode); the admin API's flow status says why.",
            labels,
        ),
        "since_read": _gauge(
            "nemesis_seconds_since_last_read",
            "Seconds since messages last arrived (since the flow started if none did yet);"
            " grows on a stuck consumer even when nothing is committed and lag looks flat.",
            labels,
        ),
        "since_commit": _gauge(
            "nemesis_seconds_since_last_commit",
            "Seconds since an offset was last committed (since the flow started if none was).",
            labels,
        ),
    }
    state = _gauge(
        "nemesis_runner_state",
        "1 for the state a flow is in: starting, running, paused, draining, stopped.",
        ["integration", "flow", "state"],
    )
    for integration in snapshot.integrations:
        for stats in integration.flows:
            values = [integration.name, stats.flow]
            committed = stats.last_commit_at
            readings = {
                "workers": stats.workers,
                "busy": stats.workers_busy,
                "buffered": stats.buffered,
                "in_flight": stats.in_flight,
                "delayed": stats.delayed,
                "halted": stats.halted,
                "dlq_waiting": stats.dlq_waiting.messages,
                "unfinished": stats.unfinished,
                "uncommitted": stats.outstanding,
                "paused_partitions": stats.paused_partitions,
                "assigned": stats.assigned_partitions,
                "stalled": len(stats.stalled),
                "since_read": seconds_since_last_read(stats, now),
                "since_commit": max(
                    now - (committed if committed is not None else stats.started_at), 0.0
                ),
            }
            for key, value in readings.items():
                families[key].add_metric(values, float(value))
            for runner_state in RunnerState:
                state.add_metric(
                    [*values, runner_state.value], 1.0 if runner_state is stats.state else 0.0
                )
    yield from families.values()
    yield state


def _lag_families(snapshot: ProxySnapshot) -> Iterator[Metric]:
    labels = ["integration", "flow", "topic", "partition"]
    messages = _gauge(
        "nemesis_commit_lag_messages",
        "Messages written to a partition and not committed by the flow's consumer"
        " (the broker's view, refreshed in the background).",
        labels,
    )
    seconds = _gauge(
        "nemesis_commit_lag_seconds",
        "Age of the oldest message of a partition the flow's consumer has not committed;"
        " 0 when nothing is behind.",
        labels,
    )
    retention = _gauge(
        "nemesis_topic_retention_seconds",
        "How long the broker keeps the messages of a flow's topic (absent: kept forever);"
        " commit lag in seconds approaching it means messages expire unread.",
        labels[:3],
    )
    for integration in snapshot.integrations:
        topics: set[tuple[str, str]] = set()
        for lag in integration.lags:
            values = [integration.name, lag.flow, lag.topic, str(lag.partition)]
            messages.add_metric(values, float(lag.messages))
            if lag.seconds is not None:
                seconds.add_metric(values, lag.seconds)
            if lag.retention_s is not None and (lag.flow, lag.topic) not in topics:
                topics.add((lag.flow, lag.topic))
                retention.add_metric([integration.name, lag.flow, lag.topic], lag.retention_s)
    yield messages
    yield seconds
    yield retention
    stats = snapshot.lag
    age = _gauge(
        "nemesis_lag_refresh_age_seconds",
        "Seconds since the broker last answered the describes commit lag is computed from.",
        [],
    )
    if stats.last_success_at is not None:
        age.add_metric([], max(snapshot.monotonic - stats.last_success_at, 0.0))
    yield age
    failures = CounterMetricFamily(
        "nemesis_lag_refresh_failures",
        "Topic describes for commit lag that failed or timed out.",
        labels=[],
    )
    failures.add_metric([], float(stats.failures))
    yield failures


def _queue_families(snapshot: ProxySnapshot) -> Iterator[Metric]:
    labels = ["integration", "queue"]
    visible = _gauge(
        "nemesis_queue_visible_messages",
        "Messages a queue source's queue holds ready to receive (SQS's approximate count).",
        labels,
    )
    in_flight = _gauge(
        "nemesis_queue_in_flight_messages",
        "Messages of a queue received by a reader (any replica) and not deleted yet.",
        labels,
    )
    delayed = _gauge(
        "nemesis_queue_delayed_messages",
        "Messages of a queue sent with a delay that has not run out yet.",
        labels,
    )
    for integration in snapshot.integrations:
        counts = integration.queue
        if counts is None:
            continue
        values = [integration.name, counts.queue]
        visible.add_metric(values, float(counts.visible))
        in_flight.add_metric(values, float(counts.in_flight))
        delayed.add_metric(values, float(counts.delayed))
    yield from (visible, in_flight, delayed)


def _integration_families(snapshot: ProxySnapshot) -> Iterator[Metric]:
    integration_label = ["integration"]
    # Info-style: 1 per integration, its team the first of `owners` (the team paged for
    # it). Alert rules join it on `integration` to route by team (deploy/prometheus).
    info = _gauge(
        "nemesis_integration_info",
        "1 for each integration this process runs; team is the first of its owners.",
        ["integration", "team"],
    )
    paused = _gauge(
        "nemesis_integration_paused", "1 while an integration is paused.", integration_label
    )
    configured = _gauge(
        "nemesis_workers_configured",
        "delivery.workers as running now (the YAML, or a live override); each flow runs as many.",
        integration_label,
    )
    recommended = _gauge(
        "nemesis_workers_recommended",
        "Workers the measured load needs: demand x mean delivery time x headroom / batch.",
        integration_label,
    )
    buffer = _gauge(
        "nemesis_buffer_capacity",
        "delivery.buffer as running now: messages a flow may hold read and not done.",
        integration_label,
    )
    breaker_seconds = _gauge(
        "nemesis_breaker_state_seconds",
        "Seconds the circuit breaker has been in its current state.",
        integration_label,
    )
    limit = _gauge(
        "nemesis_rate_limit_messages_per_second",
        "A flow's rate limit (absent when unlimited).",
        ["integration", "flow"],
    )
    waiting = _gauge(
        "nemesis_rate_limit_waiting",
        "Deliveries queued for a flow's rate limit now.",
        ["integration", "flow"],
    )
    overrides = _gauge(
        "nemesis_config_override",
        "1 for each live field set by the admin API and not (yet) in the YAML: drift.",
        ["integration", "field"],
    )
    tier_delay = _gauge(
        "nemesis_retry_tier_delay_seconds",
        "The delay of each retry tier (a tier's lag in seconds is at least this).",
        ["integration", "tier"],
    )
    for integration in snapshot.integrations:
        name, config = integration.name, integration.config
        info.add_metric([name, config.owners[0]], 1.0)
        paused.add_metric([name], 1.0 if config.paused else 0.0)
        configured.add_metric([name], float(config.delivery.workers))
        buffer.add_metric([name], float(config.delivery.buffer))
        if integration.sizing is not None:
            recommended.add_metric([name], float(integration.sizing.sizing.workers))
        breaker_seconds.add_metric([name], integration.breaker.time_in_state_s)
        for flow, stats in integration.limits.items():
            if stats.rate is not None and math.isfinite(stats.rate):
                limit.add_metric([name, flow.value], stats.rate)
            waiting.add_metric([name, flow.value], float(stats.waiting))
        for path in sorted(integration.overrides):
            overrides.add_metric([name, path], 1.0)
        for tier, delay_s in enumerate(config.retry.tiers, start=1):
            tier_delay.add_metric([name, str(tier)], delay_s)
    yield from (
        info,
        paused,
        configured,
        recommended,
        buffer,
        breaker_seconds,
        limit,
        waiting,
        overrides,
        tier_delay,
    )
