"""The breaker and the failure policy together, over a model of an integration's flows.

The model is the runner's shape without its I/O: a main flow and one flow per
retry tier, each with its workers; a flow stops taking messages while the
breaker is open; a worker asks the real ``CircuitBreaker`` for a permit with
its message's attempt, "delivers" after a fixed latency, tells the breaker the
answer, and hands a failure to the real ``policy.decide`` with the health the
settlement reads (``Settlement.health``). Time is a ``FakeClock`` under
autojump: minutes of tiers and cooldowns run in milliseconds, and the bounds
below are fake seconds, not a measure of the host.

Properties:

- A handler that fails each message ``k`` times and takes attempt ``k + 1``
  (``k`` at most the tiers) gets every message through, each on exactly
  ``k + 1`` attempts, none dead-lettered, within a bound of a few cooldowns
  and tiers, with the default breaker: its retries close the breaker.
- An outage (every answer a failure for a while, any ``k`` besides)
  dead-letters nothing, and once it is over every message is delivered.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nemesis.config.models import BreakerConfig
from nemesis.delivery.port import FailureKind
from nemesis.resilience.breaker import BreakerState, CircuitBreaker
from nemesis.runtime.policy import Action, Failure, Health, RetryPolicy, decide
from nemesis.testing.clock import FakeClock

LATENCY_S = 0.01  # every answer, healthy or not
DEFAULT_BREAKER = BreakerConfig()


@dataclass
class Message:
    n: int
    attempt: int = 1
    failed_at: float | None = None  # monotonic, like Work.failed_at


@dataclass
class Flow:
    """One flow's queue: messages due now, and messages due later (a tier's delay)."""

    tier: int
    ready: asyncio.Queue[Message] = field(default_factory=asyncio.Queue)


@dataclass
class Model:
    clock: FakeClock
    breaker: CircuitBreaker
    policy: RetryPolicy
    flows: list[Flow]
    takes_attempt: int  # the handler answers attempt >= this one (a large number: never)
    outage_until: float  # and fails everything before this fake time
    attempts: dict[int, list[int]] = field(default_factory=dict)
    delivered: set[int] = field(default_factory=set)
    dead: set[int] = field(default_factory=set)
    _later: list[tuple[float, int, int, Message]] = field(default_factory=list)
    _order: itertools.count[int] = field(default_factory=itertools.count)

    def healthy(self, message: Message) -> bool:
        if self.clock.monotonic() < self.outage_until:
            return False
        return message.attempt >= self.takes_attempt

    def health(self, message: Message) -> Health:
        breaker = self.breaker
        healthy_at = breaker.last_healthy_at
        failed_at = message.failed_at
        answered = failed_at is not None and healthy_at is not None and healthy_at > failed_at
        return Health(breaker.state, breaker.recent_failure_rate, answered)

    def put_later(self, flow: int, message: Message, delay_s: float) -> None:
        due = self.clock.monotonic() + delay_s
        heapq.heappush(self._later, (due, next(self._order), flow, message))

    async def timers(self) -> None:
        while True:
            if not self._later:
                await self.clock.sleep(0.05)
                continue
            due, _, flow, message = self._later[0]
            wait_s = due - self.clock.monotonic()
            if wait_s > 0:
                await self.clock.sleep(min(wait_s, 0.05))
                continue
            heapq.heappop(self._later)
            self.flows[flow].ready.put_nowait(message)

    async def worker(self, flow_index: int) -> None:
        flow, breaker = self.flows[flow_index], self.breaker
        while True:
            if breaker.state is BreakerState.OPEN:
                await breaker.wait_until_not_open()  # the intake: nothing is read while open
            message = await flow.ready.get()
            permit = None
            if not breaker.closed:
                permit = breaker.try_acquire(message.attempt) or await breaker.acquire(
                    message.attempt
                )
            await self.clock.sleep(LATENCY_S)
            healthy = self.healthy(message)
            self.attempts.setdefault(message.n, []).append(message.attempt)
            if permit is not None:
                permit.record(healthy)
            else:
                breaker.record(healthy, message.attempt)
            if healthy:
                self.delivered.add(message.n)
                continue
            failure = Failure(FailureKind.SERVER_ERROR, status=503)
            decision = decide(
                failure, message.attempt, flow.tier, self.policy, self.health(message)
            )
            message.failed_at = self.clock.monotonic()
            message.attempt += 1
            if decision.action is Action.TO_TIER:
                self.put_later(decision.tier, message, decision.delay_s)
            elif decision.action is Action.RETRY_IN_PLACE:
                self.put_later(flow_index, message, decision.delay_s)
            else:
                assert decision.action is Action.DEAD_LETTER, decision
                self.dead.add(message.n)


async def run_model(
    *,
    count: int,
    tiers: tuple[float, ...],
    takes_attempt: int,
    workers: int,
    outage_s: float = 0.0,
    until_s: float,
    breaker: BreakerConfig = DEFAULT_BREAKER,
) -> Model:
    """Runs the model until every message is delivered or ``until_s`` fake seconds passed."""
    clock = FakeClock()
    model = Model(
        clock=clock,
        breaker=CircuitBreaker(breaker, clock=clock, name="model", retries=len(tiers)),
        policy=RetryPolicy(
            delays_s=tiers, open_above=breaker.open_above, cooldown_s=breaker.cooldown_s
        ),
        flows=[Flow(tier) for tier in range(len(tiers) + 1)],
        takes_attempt=takes_attempt,
        outage_until=outage_s,
    )
    for n in range(count):
        model.flows[0].ready.put_nowait(Message(n))
    async with clock.autojump(), asyncio.TaskGroup() as tasks:
        running = [tasks.create_task(model.timers())]
        for flow in range(len(model.flows)):
            running += [tasks.create_task(model.worker(flow)) for _ in range(workers)]
        while len(model.delivered) < count and clock.monotonic() < until_s:
            await clock.sleep(0.5)
        for task in running:
            task.cancel()
    return model


tier_delays = st.lists(st.sampled_from([0.2, 0.5, 1.0, 2.0, 3.0]), min_size=1, max_size=3)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tiers=tier_delays,
    data=st.data(),
    count=st.integers(20, 300),
    workers=st.integers(2, 16),
)
def test_a_handler_that_takes_a_later_attempt_gets_every_message_through(
    tiers: list[float], data: st.DataObject, count: int, workers: int
) -> None:
    failures = data.draw(st.integers(0, len(tiers)), label="failures per message")
    # A few rounds of cooldown and tiers: the breaker may open until the first messages
    # reach the attempt the handler takes (nothing tells it from an outage before).
    bound_s = (failures + 3) * (DEFAULT_BREAKER.cooldown_s + sum(tiers)) + (
        count * (failures + 1) * LATENCY_S / workers
    )
    model = asyncio.run(
        run_model(
            count=count,
            tiers=tuple(tiers),
            takes_attempt=failures + 1,
            workers=workers,
            until_s=bound_s,
        )
    )
    assert len(model.delivered) == count, (
        f"{len(model.delivered)} of {count} in {bound_s:.0f}s: {model.breaker.statistics()}"
    )
    assert not model.dead
    assert all(seen == list(range(1, failures + 2)) for seen in model.attempts.values())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tiers=tier_delays,
    data=st.data(),
    count=st.integers(20, 200),
    workers=st.integers(2, 16),
    outage_s=st.sampled_from([1.0, 5.0, 20.0, 60.0]),
)
def test_an_outage_dead_letters_nothing_whatever_the_handler_does_after(
    tiers: list[float], data: st.DataObject, count: int, workers: int, outage_s: float
) -> None:
    failures = data.draw(st.integers(0, len(tiers)), label="failures per message")
    bound_s = (
        outage_s
        + (failures + 3) * (DEFAULT_BREAKER.cooldown_s + sum(tiers))
        + (count * (failures + 1) * LATENCY_S / workers)
    )
    model = asyncio.run(
        run_model(
            count=count,
            tiers=tuple(tiers),
            takes_attempt=failures + 1,
            workers=workers,
            outage_s=outage_s,
            until_s=bound_s * 4,
        )
    )
    assert not model.dead
    assert len(model.delivered) == count, model.breaker.statistics()
