"""From the proxy's snapshot to the admin API's status bodies."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Literal

from nemesis.admin import schemas
from nemesis.config import overrides as live
from nemesis.errors import ConfigProblem
from nemesis.resilience.breaker import BreakerState
from nemesis.resilience.limits import Flow
from nemesis.runtime.reload import ReloadReport
from nemesis.runtime.runner import IntegrationRunner, RunnerStats
from nemesis.runtime.sizing import DEFAULT_HEADROOM
from nemesis.runtime.telemetry import IntegrationSnapshot, seconds_since_last_read
from nemesis.runtime.waiting import WaitingStatistics

_BREAKER_STATES: Final[dict[BreakerState, Literal["closed", "open", "half_open"]]] = {
    BreakerState.CLOSED: "closed",
    BreakerState.OPEN: "open",
    BreakerState.HALF_OPEN: "half_open",
}
_FLOWS: Final[dict[Flow, Literal["main", "retry", "replay"]]] = {
    Flow.MAIN: "main",
    Flow.RETRY: "retry",
    Flow.REPLAY: "replay",
}


def integration_status(
    snapshot: IntegrationSnapshot, *, now: float, topics: Mapping[str, str]
) -> schemas.IntegrationStatus:
    """One integration's status; ``topics`` maps its flows to the topics they read."""
    config = snapshot.config
    flows = [
        schemas.FlowStatus(
            flow=stats.flow,
            topic=topics.get(stats.flow, ""),
            state=stats.state.value,
            workers=stats.workers,
            workers_busy=stats.workers_busy,
            workers_retiring=stats.workers_retiring,
            buffered=stats.buffered,
            in_flight=stats.in_flight,
            delayed=stats.delayed,
            halted=stats.halted,
            dlq_waiting=stats.dlq_waiting.messages,
            unfinished=stats.unfinished,
            uncommitted=stats.outstanding,
            paused_partitions=stats.paused_partitions,
            assigned_partitions=stats.assigned_partitions,
            messages_read=stats.messages_read,
            seconds_since_last_read=seconds_since_last_read(stats, now),
            seconds_since_last_commit=None
            if stats.last_commit_at is None
            else max(now - stats.last_commit_at, 0.0),
            stalled_partitions=[
                schemas.StalledPartition(topic=topic, partition=partition, reason=reason)
                for (topic, partition), reason in sorted(stats.stalled.items())
            ],
        )
        for stats in snapshot.flows
    ]
    partitions = [
        schemas.PartitionLagStatus(
            flow=lag.flow,
            topic=lag.topic,
            partition=lag.partition,
            end_offset=lag.end_offset,
            committed_offset=lag.committed_offset,
            messages=lag.messages,
            seconds=lag.seconds,
            exact=lag.exact,
        )
        for lag in snapshot.lags
    ]
    ages = [lag.seconds for lag in snapshot.lags if lag.seconds is not None]
    breaker = snapshot.breaker
    settings = [
        schemas.Setting(
            field=setting.field,
            value=setting.value,
            source=setting.source.value,
            yaml=setting.yaml,
            drift=setting.drift,
        )
        for setting in live.settings(snapshot.file_config, snapshot.overrides)
    ]
    estimate = snapshot.sizing
    rates = None
    if estimate is not None:
        rates = schemas.Rates(
            window_s=estimate.window_s,
            delivered_per_s=estimate.delivered_rps,
            produced_per_s=estimate.produced_rps,
            latency_ms=estimate.sizing.latency_s * 1000,
            batch_size=estimate.sizing.batch_size,
        )
    return schemas.IntegrationStatus(
        name=snapshot.name,
        state=snapshot.state,
        paused=config.paused,
        file=None if snapshot.file is None else str(snapshot.file),
        flows=flows,
        issues=_with_stalled(snapshot.issues, snapshot.flows),
        breaker=schemas.BreakerStatus(
            state=_BREAKER_STATES[breaker.state],
            time_in_state_s=breaker.time_in_state_s,
            cooldown_remaining_s=breaker.cooldown_remaining_s,
            error_rate=breaker.error_rate,
            window_requests=breaker.window_requests,
            window_failures=breaker.window_failures,
        ),
        lag=schemas.LagStatus(
            messages=sum(lag.messages for lag in snapshot.lags),
            seconds=max(ages) if ages else None,
            partitions=partitions,
        ),
        rates=rates,
        rate_limits=[
            schemas.RateLimitStatus(
                flow=_FLOWS[flow],
                limit=stats.rate,
                waiting=stats.waiting,
                waits=stats.waits,
                waited_s=stats.waited_s,
            )
            for flow, stats in snapshot.limits.items()
        ],
        settings=settings,
        drift=[setting for setting in settings if setting.drift],
        sizing=schemas.SizingStatus(
            configured_workers=config.delivery.workers,
            configured_buffer=config.delivery.buffer,
            recommended_workers=None if estimate is None else estimate.sizing.workers,
            recommended_buffer=None if estimate is None else estimate.sizing.buffer,
            headroom=DEFAULT_HEADROOM if estimate is None else estimate.sizing.headroom,
            capped=False if estimate is None else estimate.sizing.capped,
        ),
        problems=problems(snapshot.problems),
    )


def problems(items: Iterable[ConfigProblem]) -> list[schemas.Problem]:
    """Configuration problems as the API shows them."""
    return [
        schemas.Problem(file=p.file, line=p.line, field=p.field, message=p.message) for p in items
    ]


def reload_result(report: ReloadReport) -> schemas.ReloadResult:
    """A reload report as the API shows it."""
    return schemas.ReloadResult(
        trigger=report.trigger,
        at=report.at,
        ok=report.ok,
        added=list(report.added),
        applied={name: list(fields) for name, fields in report.applied.items()},
        restarted={name: list(fields) for name, fields in report.restarted.items()},
        removed=list(report.removed),
        kept=list(report.kept),
        problems=problems(report.problems),
    )


def _with_stalled(issues: Mapping[str, str], flows: Sequence[RunnerStats]) -> dict[str, str]:
    """The integration's issues, and for a flow without one, its stalled partitions.

    Dead messages waiting for the dead-letter store come first: nothing is
    dead-lettered while they wait.
    """
    issues = dict(issues)
    for stats in flows:
        if stats.flow in issues:
            continue
        if stats.dlq_waiting.messages:
            issues[stats.flow] = _waiting_issue(stats.dlq_waiting)
        elif stats.stalled:
            reasons = sorted(stats.stalled.values())
            more = f" (and {len(reasons) - 1} more partitions)" if len(reasons) > 1 else ""
            issues[stats.flow] = reasons[0] + more
    return issues


def _waiting_issue(waiting: WaitingStatistics) -> str:
    return (
        f"{DLQ_UNAVAILABLE}: {waiting.messages} dead messages wait for the dead-letter store:"
        f" {waiting.last_error or 'it has not written yet'}"
    )


# The readiness reason (and flow issue) while dead messages wait for the store.
DLQ_UNAVAILABLE: Final = "dlq_unavailable"


def dlq_unavailable(runners: Iterable[IntegrationRunner]) -> str | None:
    """Why the proxy is not ready while dead messages wait for the store; None if none do."""
    waiting = [(runner.name, runner.dlq_waiting) for runner in runners]
    waiting = [(name, stats) for name, stats in waiting if stats.messages]
    if not waiting:
        return None
    names = sorted({name for name, _ in waiting})
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    messages = sum(stats.messages for _, stats in waiting)
    last = next((s.last_error for _, s in waiting if s.last_error), "it has not written yet")
    return (
        f"{DLQ_UNAVAILABLE}: the dead-letter store cannot write; {messages} dead messages"
        f" of {shown} wait for it (deliveries go on): {last}"
    )
