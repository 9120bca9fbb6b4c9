"""What this replica tells the state store about the integrations it runs (the team console's).

Every ``every_s`` the reporter takes the proxy's snapshot and writes one
report per running integration (``nemesis.fleet.reports``): state, lag,
seconds since the last read, the breaker, retry backlog, dead messages
waiting for the store, and rates of delivered, filtered, retried and
dead-lettered messages over the last period (from the counters behind
``/metrics``, so the console and Grafana count the same things). The DLQ
viewer adds the reports of all replicas up; it never calls a replica.

A store that does not answer costs that period's reports (logged once per
outage), never a delivery: the reporter runs beside the proxy, on its loop,
and each write is one transaction of a few small rows.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Final

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.errors import StateError
from nemesis.fleet.port import StateStore
from nemesis.resilience.breaker import BreakerState

if TYPE_CHECKING:
    from nemesis.runtime.app import Proxy
    from nemesis.runtime.telemetry import IntegrationSnapshot

log = logging.getLogger(__name__)

REPORT_EVERY_S: Final = 5.0
_BREAKER: Final = {
    BreakerState.CLOSED: "closed",
    BreakerState.OPEN: "open",
    BreakerState.HALF_OPEN: "half_open",
}
COUNTED: Final = ("delivered", "filtered", "retried", "dead_lettered")


class StatusReporter:
    """Writes this member's reports every ``every_s`` until cancelled."""

    def __init__(
        self,
        proxy: Proxy,
        store: StateStore,
        member_id: str,
        *,
        every_s: float = REPORT_EVERY_S,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.proxy = proxy
        self.store = store
        self.member_id = member_id
        self.every_s = every_s
        self._clock = clock
        # The last counts and when they were taken (monotonic), per integration.
        self._last: dict[str, tuple[float, dict[str, float]]] = {}
        self._failing = False

    def reports(self) -> dict[str, dict[str, Any]]:
        """A report of each integration running here, rates since the previous call."""
        snapshot = self.proxy.snapshot()
        now = snapshot.monotonic
        found = {}
        for integration in snapshot.integrations:
            found[integration.name] = self._report(integration, now)
        for gone in set(self._last) - set(found):
            del self._last[gone]
        return found

    def _report(self, snapshot: IntegrationSnapshot, now: float) -> dict[str, Any]:
        counts = self.proxy.metrics.totals(snapshot.name)
        counts["filtered"] += sum(stats.skipped for stats in snapshot.flows)
        previous = self._last.get(snapshot.name)
        self._last[snapshot.name] = (now, counts)
        rates: dict[str, float] | None = None
        if previous is not None and now > previous[0]:
            elapsed = now - previous[0]
            rates = {
                key: max(counts[key] - previous[1].get(key, 0.0), 0.0) / elapsed for key in COUNTED
            }
        main = [lag for lag in snapshot.lags if lag.flow == "main"]
        ages = [lag.seconds for lag in main if lag.seconds is not None]
        reads = [stats for stats in snapshot.flows if stats.flow == "main"]
        since_read = None
        if reads:
            since = max(
                (s.last_read_at if s.last_read_at is not None else s.started_at) for s in reads
            )
            since_read = max(now - since, 0.0)
        retry_lag = sum(lag.messages for lag in snapshot.lags if lag.flow.startswith("retry-"))
        return {
            "state": snapshot.state,
            "paused": snapshot.config.paused,
            "lag_messages": sum(lag.messages for lag in main),
            "lag_seconds": max(ages) if ages else None,
            "since_last_read_s": since_read,
            "rates": rates,
            "breaker": _BREAKER[snapshot.breaker.state],
            "retry_backlog": retry_lag + sum(stats.delayed for stats in snapshot.flows),
            "waiting_for_dlq": sum(stats.dlq_waiting.messages for stats in snapshot.flows),
            "issues": dict(snapshot.issues),
            "every_s": self.every_s,
        }

    async def publish(self) -> None:
        """Writes the reports once; a store that does not answer is logged, once per outage."""
        reports = self.reports()
        try:
            await self.store.publish_reports(self.member_id, reports, now=self._clock.time())
        except StateError as exc:
            if not self._failing:
                log.warning("the console's status reports are not written: %s", exc)
            self._failing = True
            return
        if self._failing:
            log.info("the console's status reports are written again")
        self._failing = False

    async def run(self) -> None:
        """Publishes every ``every_s`` until cancelled."""
        while True:
            try:
                await self.publish()
            except Exception:
                # A bug here must not end the proxy beside it: the console goes stale instead.
                log.exception("the console's status report failed")
            await asyncio.sleep(self.every_s)
