"""The circuit breaker of one integration's target: rate-based, with hysteresis.

The rule (docs/design.md, section 7)::

    closed ──(window error rate > open_above, with >= min_requests)──> open
    open ──(cooldown_s passed)──> half_open
    half_open ──(probe round error rate < close_below)──> closed
    half_open ──(probe round error rate > open_above)──> open (a new cooldown)
    half_open ──(in between)──> half_open: another probe round

Closed: every answer lands in a sliding window of ``window_s`` seconds kept
in at most 60 fixed buckets, so memory does not grow with traffic. Open:
nothing is let through; the runner stops pulling (``wait_until_not_open``)
so messages wait in the topic, not in retry tiers or the DLQ. Half-open:
probes go out in rounds of ``probes_per_round`` requests (default
``min_requests``, the same evidence the breaker needs to open), at most
``probe_concurrency`` at a time; a round's error rate decides, as soon as the
results still missing can no longer change the verdict. An error rate between
``close_below`` and ``open_above`` neither opens a closed breaker nor closes
or re-opens a half-open one: that band is the hysteresis that keeps a
flaky-but-alive handler from flapping. The price of the band is that such a
handler stays half-open, fed at the probe pace, until it gets better or worse.

What counts (``is_healthy``): only the failures whose kind says the handler
may be unwell (``FailureKind.unwell``, the definition the failure policy
shares: 5xx, timeouts, refused connections, 408/425/429, the misconfigured
401/403/404/405, a retry verdict). A message-level answer (a ``dead`` kind:
4xx contract violations, a dead verdict), a delivered and a dropped one
prove the handler is up and count as healthy. One request counts once,
whether it carried one event or a batch.

Retries prove a recovering handler (each answer carries the attempt of its
message, the smallest of a batch's):

- A retry delivered on attempt n counts as n healthy answers, in the window
  and in a probe round: it shows that the n - 1 failures before it were the
  message's, not an outage.
- The answers that settle a retried message are also kept in a window of
  their own that no state change clears: a delivered retry (weighed as
  above) and a failed last attempt (past the ``retries`` the tiers allow; any
  failed retry when the breaker is not told them). While it holds
  ``min_requests`` of them failing at no more than ``open_above``, the
  breaker does not open, and a half-open one closes at its next probe's
  answer: a handler that fails first attempts and takes the retries is up,
  however its first attempts go. In an outage retries are not delivered,
  and the breaker opens at most ``window_s`` later.
- Half-open, probe slots go to the waiting request with the most attempts
  first: due retries before new messages.

So a handler that fails every message twice and takes the third attempt
opens the breaker once (at first nothing tells it from an outage), closes
it with the first round of third attempts, and keeps it closed.

Which answers count: while closed, every answer received (fresh evidence,
whenever its request left); while half-open, only the answers to this
round's probes; while open, none. A late answer to a request sent before the
breaker opened therefore never decides a probe round.

In a runner::

    await breaker.wait_until_not_open()        # the reader, before each receive
    async with breaker.permit(attempt) as permit:     # a worker, around one request
        result = await transport.deliver(event)
        permit.record(is_healthy(result.failure))
    # leaving without record() (stale message, cancellation) gives a probe slot back
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Final

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import BreakerConfig
from nemesis.delivery.port import FailureKind
from nemesis.metrics import Metrics

log = logging.getLogger(__name__)

DEFAULT_PROBE_CONCURRENCY: Final = 5
_MIN_RECENT: Final = 10
_MAX_RECENT: Final = 1000
_MIN_BUCKETS: Final = 10
_MAX_BUCKETS: Final = 60
# Float sums of deadlines can land a hair short of the cooldown's end; that is the end.
_EPSILON_S: Final = 1e-9
_floor: Final = math.floor


def is_healthy(failure: FailureKind | None) -> bool:
    """Whether an answer (its failure kind; None: delivered or dropped) shows a healthy handler."""
    return failure is None or not failure.unwell


class BreakerState(enum.Enum):
    """Where a circuit breaker stands."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    @property
    def gauge(self) -> int:
        """The value of the ``nemesis_breaker_state`` gauge: 0 closed, 1 open, 2 half-open."""
        return _GAUGE[self]


_GAUGE: Final = {BreakerState.CLOSED: 0, BreakerState.OPEN: 1, BreakerState.HALF_OPEN: 2}
_CLOSED: Final = BreakerState.CLOSED


@dataclass(frozen=True, slots=True)
class BreakerTransition:
    """One state change, with the evidence that caused it."""

    name: str
    from_state: BreakerState
    to_state: BreakerState
    at: float  # monotonic
    requests: int  # answers in the sample that decided (0 for a cooldown's end)
    failures: int

    @property
    def error_rate(self) -> float | None:
        return self.failures / self.requests if self.requests else None


BreakerListener = Callable[[BreakerTransition], None]


@dataclass(frozen=True, slots=True)
class BreakerStatistics:
    """A snapshot of a breaker for metrics, logs and the admin API."""

    name: str
    state: BreakerState
    time_in_state_s: float
    cooldown_remaining_s: float  # 0 unless open
    window_requests: int  # closed: answers in the sliding window (a retry weighs its attempts)
    window_failures: int
    probes_in_flight: int  # half-open: probes sent and not answered
    round_requests: int  # half-open: answers in the current probe round
    round_failures: int
    probe_rounds: int  # half-open rounds that ended in the band, since the breaker was made
    ignored_answers: int  # answers to requests let through in an earlier state
    transitions: Mapping[tuple[BreakerState, BreakerState], int]
    retry_requests: int = 0  # answers to retries in their own window, in every state
    retry_failures: int = 0

    @property
    def error_rate(self) -> float | None:
        """The error rate the current state decides on, or None without answers yet."""
        if self.state is BreakerState.HALF_OPEN:
            requests, failures = self.round_requests, self.round_failures
        else:
            requests, failures = self.window_requests, self.window_failures
        return failures / requests if requests else None


class SlidingWindow:
    """Answer and failure counts over the last ``window_s`` seconds, in fixed buckets.

    The window holds the current bucket and the ones before it, so it spans
    between ``window_s - bucket_s`` and ``window_s``: old answers are
    forgotten a bucket at a time, never kept past ``window_s``.
    """

    __slots__ = ("_bucket_s", "_failures", "_head", "_requests", "_slot", "failures", "requests")

    def __init__(self, window_s: float) -> None:
        buckets = min(_MAX_BUCKETS, max(_MIN_BUCKETS, math.ceil(window_s)))
        self._bucket_s = window_s / buckets
        self._requests = [0] * buckets
        self._failures = [0] * buckets
        self._head: int | None = None  # bucket_of() the newest answer
        self._slot = 0  # where the head bucket sits in the lists
        self.requests = 0
        self.failures = 0

    @property
    def bucket_s(self) -> float:
        """The width of one bucket: the step in which old answers are forgotten."""
        return self._bucket_s

    @property
    def buckets(self) -> int:
        return len(self._requests)

    def bucket_of(self, now: float) -> int:
        """The absolute number of the bucket that ``now`` falls in."""
        return _floor(now / self._bucket_s)

    def add(self, now: float, failed: bool, count: int = 1) -> None:
        """Counts ``count`` answers at ``now``, all failed or all not."""
        # On the delivery path: the same-bucket case stays inline.
        index = _floor(now / self._bucket_s)
        if index != self._head:
            self._move_to(index)
        slot = self._slot
        self._requests[slot] += count
        self.requests += count
        if failed:
            self._failures[slot] += count
            self.failures += count

    def expire(self, now: float) -> None:
        """Forgets the buckets that have left the window by ``now``."""
        index = _floor(now / self._bucket_s)
        if index != self._head:
            self._move_to(index)

    def clear(self) -> None:
        """Forgets everything."""
        size = len(self._requests)
        self._requests = [0] * size
        self._failures = [0] * size
        self._head = None
        self.requests = self.failures = 0

    def _move_to(self, index: int) -> None:
        head, size = self._head, len(self._requests)
        if head is not None and index < head:
            return  # a clock that went back: count it in the newest bucket
        if head is None or index - head >= size:
            if self.requests:
                self.clear()
        else:
            for absolute in range(head + 1, index + 1):
                slot = absolute % size
                self.requests -= self._requests[slot]
                self.failures -= self._failures[slot]
                self._requests[slot] = self._failures[slot] = 0
        self._head = index
        self._slot = index % size


class Permit:
    """Leave to send one request: report its answer with ``record``, or ``release`` it unused."""

    __slots__ = ("_breaker", "_epoch", "_open", "attempt", "probe")

    def __init__(self, breaker: CircuitBreaker, epoch: int, probe: bool, attempt: int = 1) -> None:
        self._breaker = breaker
        self._epoch = epoch
        self._open = True
        self.probe = probe  # a half-open probe, one of the round's slots
        self.attempt = attempt  # of the message it carries (1: a first attempt)

    def record(self, healthy: bool) -> None:
        """Reports the request's answer: ``healthy`` unless it was a handler-health failure."""
        if not self._open:
            raise RuntimeError("this permit's answer was already reported")
        self._open = False
        self._breaker._record(self._epoch, self.probe, healthy, self.attempt)

    def release(self) -> None:
        """Gives the permit back without an answer (nothing was sent); no-op after ``record``."""
        if self._open:
            self._open = False
            self._breaker._release(self._epoch, self.probe)


class CircuitBreaker:
    """A rate-based circuit breaker with hysteresis for one integration's target."""

    def __init__(
        self,
        config: BreakerConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        name: str = "",
        probes_per_round: int | None = None,
        probe_concurrency: int = DEFAULT_PROBE_CONCURRENCY,
        retries: int | None = None,
    ) -> None:
        if probes_per_round is not None and probes_per_round < 1:
            raise ValueError("probes_per_round must be at least 1")
        if probe_concurrency < 1:
            raise ValueError("probe_concurrency must be at least 1")
        self.config = config
        self.name = name
        self._clock = clock
        # Read on every answer: plain attributes, not the config model's.
        self._min_requests = config.min_requests
        self._open_above = config.open_above
        self._round_size = probes_per_round or config.min_requests
        self._probe_concurrency = min(probe_concurrency, self._round_size)
        self._state = BreakerState.CLOSED
        self._epoch = 0  # bumped on every transition: tells which state a permit belongs to
        self._entered_at = clock.monotonic()
        self._window = SlidingWindow(config.window_s)
        # The answers to retries, kept through every state change: the evidence that a
        # handler failing first attempts is up (see the module docstring).
        self._retry_window = SlidingWindow(config.window_s)
        # A failed attempt from here on is a message's last (None: the tiers are not known).
        self._last_attempt = 2 if retries is None else retries + 1
        # The last answers, however old, in every state: the failure policy's view of
        # whether the handler is down, which neither the window's successes from before
        # an outage nor a long pause in traffic can hide.
        self._recent = bytearray(min(_MAX_RECENT, max(_MIN_RECENT, config.min_requests)))
        self._recent_at = 0
        self._recent_seen = 0
        self._recent_failures = 0
        self._last_healthy_at: float | None = None
        self._round_issued = 0  # probes of this round handed out and not given back
        self._round_answered = 0  # of those, answered
        self._round_requests = 0  # the answers' weight (a retry weighs its attempts)
        self._round_failures = 0
        self._probe_rounds = 0
        self._ignored = 0
        self._transitions: dict[tuple[BreakerState, BreakerState], int] = {}
        self._listeners: list[BreakerListener] = []
        self._waiters: list[asyncio.Future[None]] = []
        # Acquirers waiting for a permit, by attempt: half-open, the most attempts go first.
        self._waiting: dict[int, int] = {}

    # --- reading --------------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        """The current state (an open breaker whose cooldown has passed turns half-open)."""
        self._tick()
        return self._state

    def statistics(self) -> BreakerStatistics:
        """A snapshot of the state, the evidence and the transitions so far."""
        self._tick()
        now = self._clock.monotonic()
        self._window.expire(now)
        self._retry_window.expire(now)
        return BreakerStatistics(
            name=self.name,
            state=self._state,
            time_in_state_s=now - self._entered_at,
            cooldown_remaining_s=self._cooldown_remaining(now),
            window_requests=self._window.requests,
            window_failures=self._window.failures,
            probes_in_flight=self._round_issued - self._round_answered,
            round_requests=self._round_requests,
            round_failures=self._round_failures,
            probe_rounds=self._probe_rounds,
            ignored_answers=self._ignored,
            transitions=dict(self._transitions),
            retry_requests=self._retry_window.requests,
            retry_failures=self._retry_window.failures,
        )

    @property
    def recent_failure_rate(self) -> float | None:
        """The handler-health failures among its last answers (``min_requests`` of them, at
        least 10 and at most 1000), whatever the state; None before its first answer."""
        seen = self._recent_seen
        return self._recent_failures / seen if seen else None

    @property
    def last_healthy_at(self) -> float | None:
        """When (monotonic) the handler last answered without a health failure, in any state."""
        return self._last_healthy_at

    def add_listener(self, listener: BreakerListener) -> None:
        """Calls ``listener`` after every state change (for metrics and logs)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: BreakerListener) -> None:
        self._listeners.remove(listener)

    # --- letting requests through ---------------------------------------------

    @property
    def closed(self) -> bool:
        """Closed: requests go without a permit, their answers are given to ``record``."""
        return self._state is _CLOSED

    def record(self, healthy: bool, attempt: int = 1) -> None:
        """Reports the answer to a request sent while closed (what a non-probe permit reports).

        ``attempt`` is the attempt of the request's message (of a batch: the smallest).
        """
        self._record(self._epoch, False, healthy, attempt)

    def record_healthy(self, count: int) -> None:
        """Reports ``count`` healthy answers at once, as ``count`` calls of ``record(True)``."""
        if count < 1:
            return
        if self._state is not _CLOSED:
            for _ in range(count):
                self._record(self._epoch, False, True)
            return
        now = self._clock.monotonic()
        self._last_healthy_at = now
        recent = self._recent
        if self._recent_failures or self._recent_seen < len(recent):
            for _ in range(min(count, len(recent))):
                self._note_recent(0)
        # else: the last answers were all healthy, and these change nothing there.
        window = self._window
        window.expire(now)
        # Healthy answers can still bring the window to min_requests with a failure rate
        # above the threshold; one by one, the breaker would open at the first answer that
        # does (the rate only falls after it) and take the rest as answers while open.
        first = max(1, min(count, self._min_requests - window.requests))
        window.add(now, False, first)
        requests = window.requests
        if (
            requests >= self._min_requests
            and window.failures / requests > self._open_above
            and not self._retries_vouch(now)
        ):
            self._transition(BreakerState.OPEN, now, requests, window.failures)
            self._ignored += count - first
        elif count > first:
            window.add(now, False, count - first)

    def try_acquire(self, attempt: int = 1) -> Permit | None:
        """A permit to send one request now, or None while open or with no probe slot free.

        Half-open, a request of a message on ``attempt`` gets no slot while one with more
        attempts waits in ``acquire``.
        """
        if self._state is _CLOSED:
            return Permit(self, self._epoch, False, attempt)
        self._tick()
        if (
            self._state is BreakerState.HALF_OPEN
            and self._probe_slot_free()
            and not self._outranked(attempt)
        ):
            self._round_issued += 1
            return Permit(self, self._epoch, True, attempt)
        return None

    async def acquire(self, attempt: int = 1) -> Permit:
        """Waits for a permit: through the cooldown while open, for a probe slot while half-open
        (the waiters with the most attempts first)."""
        waiting = self._waiting
        waiting[attempt] = waiting.get(attempt, 0) + 1
        try:
            while True:
                permit = self.try_acquire(attempt)
                if permit is not None:
                    return permit
                if self._state is BreakerState.OPEN:
                    await self._clock.sleep(self._cooldown_remaining(self._clock.monotonic()))
                else:
                    await self._changed()
        finally:
            left = waiting[attempt] - 1
            if left:
                waiting[attempt] = left
            else:
                del waiting[attempt]
                # Waiters with fewer attempts may take a slot now.
                self._notify()

    @contextlib.asynccontextmanager
    async def permit(self, attempt: int = 1) -> AsyncIterator[Permit]:
        """``acquire()`` as a context: a permit left unreported at exit is released."""
        permit = await self.acquire(attempt)
        try:
            yield permit
        finally:
            permit.release()

    async def wait_until_not_open(self) -> None:
        """Returns once the breaker is closed or half-open: where a reader may pull again."""
        while True:
            self._tick()
            if self._state is not BreakerState.OPEN:
                return
            await self._clock.sleep(self._cooldown_remaining(self._clock.monotonic()))

    # --- answers --------------------------------------------------------------

    def _note_recent(self, failed: int) -> None:
        recent, at = self._recent, self._recent_at
        self._recent_failures += failed - recent[at]
        recent[at] = failed
        self._recent_at = at + 1 if at + 1 < len(recent) else 0
        if self._recent_seen < len(recent):
            self._recent_seen += 1

    def _record(self, epoch: int, probe: bool, healthy: bool, attempt: int = 1) -> None:
        now = self._clock.monotonic()
        failed = 0 if healthy else 1
        self._note_recent(failed)
        # A retry delivered on attempt n vouches for the n - 1 failures before it.
        weight = attempt if healthy and attempt > 1 else 1
        if healthy:
            self._last_healthy_at = now
        if attempt > 1 and (healthy or attempt >= self._last_attempt):
            self._retry_window.add(now, not healthy, weight)
        if self._state is _CLOSED:
            # Whenever it was sent, an answer received while closed is fresh evidence.
            window = self._window
            window.add(now, not healthy, weight)
            requests = window.requests
            if (
                requests >= self._min_requests
                and window.failures / requests > self._open_above
                and not self._retries_vouch(now)
            ):
                self._transition(BreakerState.OPEN, now, requests, window.failures)
            return
        self._tick()
        if self._state is BreakerState.HALF_OPEN and probe and epoch == self._epoch:
            self._round_answered += 1
            self._round_requests += weight
            self._round_failures += not healthy
            if self._retries_vouch(now):
                # The retries show the handler up, as they would keep a closed breaker closed.
                self._transition(
                    BreakerState.CLOSED, now, self._round_requests, self._round_failures
                )
            else:
                self._judge_round(now)
            self._notify()
        else:
            self._ignored += 1

    def _retries_vouch(self, now: float) -> bool:
        """Whether the retries' answers show the handler up: enough of them, mostly taken."""
        retries = self._retry_window
        retries.expire(now)
        requests = retries.requests
        return requests >= self._min_requests and retries.failures / requests <= self._open_above

    def _outranked(self, attempt: int) -> bool:
        """Whether an acquirer with more attempts than ``attempt`` waits for a permit."""
        return any(waiting > attempt for waiting in self._waiting)

    def _release(self, epoch: int, probe: bool) -> None:
        if probe and epoch == self._epoch and self._state is BreakerState.HALF_OPEN:
            self._round_issued -= 1
            self._notify()

    def _judge_round(self, now: float) -> None:
        size, requests, failures = self._round_size, self._round_requests, self._round_failures
        # The verdict is the round's error rate once its answers weigh ``size``; take it
        # as soon as the answers still missing (each weighing one) can no longer change
        # it. Without retries every answer weighs one and the round is ``size`` probes.
        whole = max(size, requests)
        if failures / whole > self.config.open_above:
            self._transition(BreakerState.OPEN, now, requests, failures)
        elif (failures + whole - requests) / whole < self.config.close_below:
            self._transition(BreakerState.CLOSED, now, requests, failures)
        elif requests >= size:
            # In the band: stay half-open and probe another round. Weighed answers can
            # fill a round before all its probes answered: those belong to the next one.
            in_flight = self._round_issued - self._round_answered
            self._probe_rounds += 1
            self._start_round()
            self._round_issued = in_flight

    # --- states ---------------------------------------------------------------

    def _tick(self) -> None:
        if self._state is BreakerState.OPEN:
            now = self._clock.monotonic()
            if self._cooldown_remaining(now) <= _EPSILON_S:
                self._transition(BreakerState.HALF_OPEN, now, 0, 0)

    def _cooldown_remaining(self, now: float) -> float:
        if self._state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._entered_at + self.config.cooldown_s - now)

    def _probe_slot_free(self) -> bool:
        in_flight = self._round_issued - self._round_answered
        return self._round_issued < self._round_size and in_flight < self._probe_concurrency

    def _start_round(self) -> None:
        self._round_issued = self._round_answered = 0
        self._round_requests = self._round_failures = 0

    def _transition(self, to: BreakerState, now: float, requests: int, failures: int) -> None:
        change = BreakerTransition(self.name, self._state, to, now, requests, failures)
        self._state = to
        self._epoch += 1
        self._entered_at = now
        # Each state starts from fresh evidence: closing must not inherit the
        # failures that opened the breaker, nor a new round the last one's answers.
        self._window.clear()
        self._start_round()
        key = (change.from_state, to)
        self._transitions[key] = self._transitions.get(key, 0) + 1
        _log_transition(change)
        self._notify()
        for listener in list(self._listeners):
            try:
                listener(change)
            except Exception:
                # A broken metrics or log hook must not stop deliveries; the state has changed.
                log.exception("circuit breaker %s: a state-change listener failed", self.name)

    async def _changed(self) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        await future

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)


def _log_transition(change: BreakerTransition) -> None:
    name, to = change.name, change.to_state
    # A breaker is an integration's (its name), not one event's: no event id to name.
    where = {"integration": name, "outcome": to.value}
    if to is BreakerState.OPEN:
        log.warning(
            "circuit breaker %s: %s -> open: %d of %d answers were handler failures",
            name,
            change.from_state.value,
            change.failures,
            change.requests,
            extra=where,
        )
    elif to is BreakerState.HALF_OPEN:
        log.info("circuit breaker %s: cooldown over, half-open: probing", name, extra=where)
    else:
        log.info(
            "circuit breaker %s: closed: %d of %d probes failed",
            name,
            change.failures,
            change.requests,
            extra=where,
        )


def bind_breaker_metrics(breaker: CircuitBreaker, metrics: Metrics) -> BreakerListener:
    """Feeds ``nemesis_breaker_state`` and ``nemesis_breaker_transitions`` for this breaker.

    The breaker's name is the ``integration`` label. Returns the listener, for
    ``remove_listener`` when the integration goes away.
    """
    gauge = metrics.breaker_state.labels(breaker.name)
    gauge.set(breaker.state.gauge)

    def on_transition(change: BreakerTransition) -> None:
        gauge.set(change.to_state.gauge)
        metrics.breaker_transitions.labels(
            breaker.name, change.from_state.value, change.to_state.value
        ).inc()

    breaker.add_listener(on_transition)
    return on_transition
