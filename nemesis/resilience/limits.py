"""Rate limits per flow (``main``, ``retry``, ``replay``) in messages per second.

Each flow has its own token bucket, so recovering retries and DLQ replays
never exceed their own budget nor take fresh traffic's. A bucket refills at
``rate`` tokens per second up to ``burst``: ``rate * burst_s`` tokens (at
least one), 50 ms worth by default. The burst is that small on purpose: after
an outage the bucket is full, and whatever it holds goes out at once on top of
the rate, so over any window of W seconds at most ``burst + rate * W``
messages pass: within +5% of the rate for every window of a second or more
(at 20 messages/s and up; below that the one-message minimum burst is more
than 5% of a second's worth). Waiters are served first come, first served;
only the head of the queue sleeps, until its tokens are there. A batch of n
messages takes n tokens at once, so a batch larger than the burst waits
until n tokens have built up and goes out as one burst of n.

``set_rate`` takes effect at once for everyone who asks after it; the head of
the queue, asleep with a deadline computed at the old rate, looks again
within ``MAX_NAP_S``. Tokens built up at the old rate carry over, cut to the
new burst, so a lower rate never starts with a burst of the old size.
``None`` is unlimited: ``acquire`` returns at once, counting nothing.

In a runner, after the breaker's permit and right before the request::

    await limits.acquire(Flow.RETRY, len(batch))
"""

from __future__ import annotations

import asyncio
import collections
import enum
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import RateLimitsConfig
from nemesis.metrics import Metrics

DEFAULT_BURST_S: Final = 0.05
# The longest the head waiter sleeps before it looks at the rate again.
MAX_NAP_S: Final = 0.25
# Float refills can land a hair short of a whole token; that is the token.
_EPSILON_TOKENS: Final = 1e-9


class Flow(enum.StrEnum):
    """The delivery flows of an integration, each with its own rate limit."""

    MAIN = "main"  # fresh messages from the source topic
    RETRY = "retry"  # messages back from the retry tiers
    REPLAY = "replay"  # messages requeued from the DLQ


@dataclass(frozen=True, slots=True)
class LimiterStatistics:
    """A snapshot of one rate limiter."""

    rate: float | None  # messages per second; None: unlimited
    burst: float  # tokens the bucket holds at most (0 when unlimited)
    tokens: float  # tokens available now
    waiting: int  # acquisitions queued
    acquired: int  # messages let through while limited
    waits: int  # acquisitions that had to wait
    waited_s: float  # seconds spent waiting, summed over acquisitions


class _Waiter:
    __slots__ = ("n", "turn")

    def __init__(self, n: int, turn: asyncio.Future[None] | None) -> None:
        self.n = n
        self.turn = turn  # resolved when this waiter reaches the head of the queue


class RateLimiter:
    """A token bucket in messages per second on an injected clock; ``None`` is unlimited."""

    def __init__(
        self,
        rate: float | None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        burst_s: float = DEFAULT_BURST_S,
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        _check_rate(rate)
        if burst_s <= 0:
            raise ValueError("burst_s must be positive")
        self._clock = clock
        self._burst_s = burst_s
        self._on_wait = on_wait
        self._rate = rate
        self._burst = _burst_of(rate, burst_s)
        self._tokens = self._burst
        self._updated = clock.monotonic()
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._acquired = 0
        self._waits = 0
        self._waited_s = 0.0

    @property
    def rate(self) -> float | None:
        """Messages per second, or None for unlimited."""
        return self._rate

    @property
    def burst(self) -> float:
        """Tokens the bucket holds at most."""
        return self._burst

    def set_rate(self, rate: float | None) -> None:
        """Changes the rate now, keeping the tokens built up so far (up to the new burst)."""
        _check_rate(rate)
        now = self._clock.monotonic()
        self._refill(now, self._cap())
        was_unlimited = self._rate is None
        self._rate = rate
        self._burst = _burst_of(rate, self._burst_s)
        self._updated = now
        if rate is None:
            self._tokens = 0.0
        elif was_unlimited:
            # Nothing was metered while unlimited; start as a fresh limiter would.
            self._tokens = self._burst
        else:
            self._tokens = min(self._tokens, self._cap())

    def try_acquire(self, n: int = 1) -> bool:
        """Takes ``n`` messages' leave if it is there now, without waiting; else takes nothing."""
        if n < 0:
            raise ValueError("cannot acquire a negative number of messages")
        if self._rate is None or n == 0:
            return True
        if not self._queue and self._take(n):
            self._acquired += n
            return True
        return False

    async def acquire(self, n: int = 1) -> float:
        """Waits until ``n`` messages may go; returns the seconds waited."""
        if n < 0:
            raise ValueError("cannot acquire a negative number of messages")
        if self._rate is None or n == 0:
            return 0.0
        if not self._queue and self._take(n):
            self._acquired += n
            return 0.0
        return await self._wait(n)

    def statistics(self) -> LimiterStatistics:
        """A snapshot of the rate, the bucket and the waits so far."""
        self._refill(self._clock.monotonic(), self._cap())
        return LimiterStatistics(
            rate=self._rate,
            burst=self.burst,
            tokens=self._tokens,
            waiting=len(self._queue),
            acquired=self._acquired,
            waits=self._waits,
            waited_s=self._waited_s,
        )

    async def _wait(self, n: int) -> float:
        start = self._clock.monotonic()
        turn = asyncio.get_running_loop().create_future() if self._queue else None
        waiter = _Waiter(n, turn)
        self._queue.append(waiter)
        try:
            if turn is not None:
                await turn
            while self._rate is not None and not self._take(n):
                missing = n - self._tokens
                await self._clock.sleep(min(missing / self._rate, MAX_NAP_S))
        finally:
            self._leave(waiter)
        waited = self._clock.monotonic() - start
        self._acquired += n
        self._waits += 1
        self._waited_s += waited
        if self._on_wait is not None and waited > 0:
            self._on_wait(waited)
        return waited

    def _leave(self, waiter: _Waiter) -> None:
        if self._queue[0] is not waiter:
            self._queue.remove(waiter)  # cancelled before its turn came
            return
        self._queue.popleft()
        # A large batch may have let tokens build up past the burst; nobody else may use them.
        self._tokens = min(self._tokens, self._burst)
        if self._queue:
            turn = self._queue[0].turn
            if turn is not None and not turn.done():
                turn.set_result(None)

    def _take(self, n: int) -> bool:
        self._refill(self._clock.monotonic(), self._cap(n))
        tokens = self._tokens
        if tokens + _EPSILON_TOKENS < n:
            return False
        self._tokens = tokens - n if tokens > n else 0.0
        return True

    def _cap(self, n: int = 0) -> float:
        # The head of the queue may save up for a batch larger than the burst.
        cap = self._burst
        if self._queue and self._queue[0].n > cap:
            cap = self._queue[0].n
        return n if n > cap else cap

    def _refill(self, now: float, cap: float) -> None:
        elapsed = now - self._updated
        if self._rate is not None and elapsed > 0:
            tokens = self._tokens + elapsed * self._rate
            self._tokens = tokens if tokens < cap else cap
            self._updated = now


def _burst_of(rate: float | None, burst_s: float) -> float:
    return 0.0 if rate is None else max(1.0, rate * burst_s)


def _check_rate(rate: float | None) -> None:
    if rate is not None and not rate > 0:
        raise ValueError(f"a rate limit must be positive messages per second, not {rate!r}")


class FlowLimits:
    """The three rate limiters of one integration, set from ``rate_limits``.

    In a fleet the limits hold for the integration as a whole: each of the
    ``runners`` members running it takes ``rate / runners`` (``set_runners``,
    called again whenever the membership changes).
    """

    def __init__(
        self,
        config: RateLimitsConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        burst_s: float = DEFAULT_BURST_S,
        on_wait: Callable[[Flow, float], None] | None = None,
        runners: int = 1,
    ) -> None:
        _check_runners(runners)
        self._config = config
        self._runners = runners
        self._limiters = {
            flow: RateLimiter(
                _rate_of(config, flow, runners),
                clock=clock,
                burst_s=burst_s,
                on_wait=None if on_wait is None else functools.partial(on_wait, flow),
            )
            for flow in Flow
        }

    def __getitem__(self, flow: Flow) -> RateLimiter:
        return self._limiters[flow]

    def try_acquire(self, flow: Flow, n: int = 1) -> bool:
        """Whether ``n`` messages of ``flow`` may go now (their leave is then taken)."""
        return self._limiters[flow].try_acquire(n)

    async def acquire(self, flow: Flow, n: int = 1) -> float:
        """Waits until ``n`` messages of ``flow`` may go; returns the seconds waited."""
        return await self._limiters[flow].acquire(n)

    @property
    def runners(self) -> int:
        """How many members share the limits (1 outside a fleet)."""
        return self._runners

    def apply(self, config: RateLimitsConfig) -> None:
        """Takes new limits while running (admin API, file reload); unchanged flows are kept."""
        self._config = config
        self._set_rates()

    def set_runners(self, runners: int) -> None:
        """Takes this member's share of limits that ``runners`` members hold together."""
        _check_runners(runners)
        self._runners = runners
        self._set_rates()

    def _set_rates(self) -> None:
        for flow, limiter in self._limiters.items():
            rate = _rate_of(self._config, flow, self._runners)
            if rate != limiter.rate:
                limiter.set_rate(rate)

    def statistics(self) -> Mapping[Flow, LimiterStatistics]:
        """A snapshot of every flow's limiter."""
        return {flow: limiter.statistics() for flow, limiter in self._limiters.items()}


def _rate_of(config: RateLimitsConfig, flow: Flow, runners: int = 1) -> float | None:
    rate: float | None = getattr(config, flow.value)
    return None if rate is None else rate / runners


def _check_runners(runners: int) -> None:
    if runners < 1:
        raise ValueError(f"limits are shared by one member or more, not {runners!r}")


def wait_recorder(metrics: Metrics, integration: str) -> Callable[[Flow, float], None]:
    """An ``on_wait`` for ``FlowLimits`` that feeds ``nemesis_rate_limit_wait_seconds``."""
    children = {flow: metrics.rate_limit_wait.labels(integration, flow.value) for flow in Flow}

    def record(flow: Flow, waited_s: float) -> None:
        children[flow].observe(waited_s)

    return record
