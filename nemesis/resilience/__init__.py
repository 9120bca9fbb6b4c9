"""Keeping handlers alive: the circuit breaker and the per-flow rate limits of an integration."""

from __future__ import annotations

from nemesis.resilience.breaker import (
    BreakerState,
    BreakerStatistics,
    BreakerTransition,
    CircuitBreaker,
    Permit,
    bind_breaker_metrics,
    is_healthy,
)
from nemesis.resilience.limits import (
    Flow,
    FlowLimits,
    LimiterStatistics,
    RateLimiter,
    wait_recorder,
)

__all__ = [
    "BreakerState",
    "BreakerStatistics",
    "BreakerTransition",
    "CircuitBreaker",
    "Flow",
    "FlowLimits",
    "LimiterStatistics",
    "Permit",
    "RateLimiter",
    "bind_breaker_metrics",
    "is_healthy",
    "wait_recorder",
]
