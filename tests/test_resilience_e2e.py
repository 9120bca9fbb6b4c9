"""Retry tiers, the DLQ, the breaker, rate limits and requeue, end to end in one process.

Real parts: the embedded log and the sqlite DLQ in files under tmp_path, the
aiohttp transport, a real handler server on 127.0.0.1. Time is a fake clock
that jumps whenever every task waits (``FakeClock.autojump``): tiers,
cooldowns, rate limits and the handler's arrival stamps all read it, so the
delays and rates asserted here are exact in fake time, however loaded the
machine is.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.config.models import EmbeddedBackendConfig, IntegrationConfig
from nemesis.dlq import DeadLetterFilter, Reason, SqliteDeadLetterStore, Status, open_sqlite_dlq
from nemesis.dlq.requeue import requeue
from nemesis.metrics import Metrics
from nemesis.resilience.breaker import BreakerState, BreakerTransition, CircuitBreaker
from nemesis.runtime.app import Proxy
from nemesis.runtime.runner import RunnerOptions
from nemesis.testing import HandlerServer, LedgerEntry
from nemesis.testing.clock import FakeClock
from nemesis.topology import META_TRACEPARENT, replay_topic, tier_topic
from nemesis.tracecontext import parse_traceparent

# Fake time jumps once the loop has been idle this long (real seconds): room for the
# requests on loopback to be answered first.
AUTOJUMP_S = 0.002
FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=2)


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def dlq(tmp_path: Path) -> AsyncIterator[SqliteDeadLetterStore]:
    store = await open_sqlite_dlq(tmp_path / "dlq.db")
    yield store
    await store.close()


def integration(name: str, url: str, **sections: Any) -> IntegrationConfig:
    document: dict[str, Any] = {
        "name": name,
        "owners": [f"team-{name}"],
        "source": {"topic": "orders", "consumer": name},
        "target": {"url": url, "timeout_s": 2},
        "delivery": {"workers": 16, "buffer": 500},
        "retry": {"tiers": ["200ms", "400ms", "800ms"]},
    }
    document.update(sections)
    return IntegrationConfig.model_validate(document)


async def publish(
    broker: EmbeddedBroker, count: int, consumers: tuple[str, ...] = ("it",), start: int = 0
) -> None:
    await broker.admin.create_topic(
        "orders", partitions=4, consumers=[ConsumerSpec(c) for c in consumers], exist_ok=True
    )
    writer = await broker.writer("orders")
    end = start + count
    for first in range(start, end, 1000):
        await writer.write(
            [
                OutgoingMessage(value=orjson.dumps({"n": n}), metadata={"type": "order.created"})
                for n in range(first, min(end, first + 1000))
            ]
        )
    await writer.close()


async def publish_every(
    broker: EmbeddedBroker, clock: FakeClock, every_s: float, *, key: str, start: int
) -> None:
    """Publishes one message with ``key`` every ``every_s`` (fake) seconds until cancelled."""
    writer = await broker.writer("orders")
    try:
        for n in itertools.count(start):
            await writer.write([OutgoingMessage(value=orjson.dumps({"n": n}), key=key)])
            await clock.sleep(every_s)
    finally:
        await writer.close()


def n_of(entry: LedgerEntry) -> int:
    return int(json.loads(entry.body)["n"])


async def end_offsets(broker: EmbeddedBroker, topic: str) -> int:
    description = await broker.admin.describe_topic(topic)
    return sum(p.end_offset - p.start_offset for p in description.partitions)


async def wait_for_state(
    breaker: CircuitBreaker, states: set[BreakerState], timeout_s: float = 10
) -> None:
    changed = asyncio.Event()

    def on_transition(_: BreakerTransition) -> None:
        changed.set()

    breaker.add_listener(on_transition)
    try:
        async with asyncio.timeout(timeout_s):
            while breaker.state not in states:
                changed.clear()
                await changed.wait()
    finally:
        breaker.remove_listener(on_transition)


async def test_failing_twice_goes_through_two_tiers_and_is_delivered(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock
) -> None:
    count = 200
    await publish(broker, count)
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        handler.fail_first(2, status=503)
        # Two failures in three attempts would open the breaker: that has its own test.
        config = integration("it", handler.url, breaker={"min_requests": 100_000})
        proxy = Proxy(broker, {"it": config}, dlq=dlq, clock=clock, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        await handler.ledger.wait_for(count, timeout_s=30)
        proxy.stop()
        await task
    # Each message: attempt 1 from the source, 2 from tier 1, 3 from tier 2.
    assert await end_offsets(broker, tier_topic("it", 1)) == count
    assert await end_offsets(broker, tier_topic("it", 2)) == count
    assert await end_offsets(broker, tier_topic("it", 3)) == 0
    assert await dlq.count(DeadLetterFilter()) == 0
    for event_id in handler.ledger.ids():
        arrivals = handler.ledger.by_id(event_id)
        assert [e.attempt for e in arrivals] == [1, 2, 3]
        # The handler sees the source coordinates and one ce-id on every attempt.
        assert {(e.topic, e.partition, e.offset) for e in arrivals} == {
            ("orders", arrivals[0].partition, arrivals[0].offset)
        }
        first, second, third = (e.received_wall for e in arrivals)
        assert second - first >= 0.2 - 1e-6  # tier 1: 200 ms (fake: float sums only)
        assert third - second >= 0.4 - 1e-6  # tier 2: 400 ms


async def test_a_handler_that_takes_the_third_attempt_closes_the_default_breaker(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock
) -> None:
    # Two of every three requests fail, and every first attempt does: at first nothing
    # tells this handler from an outage, so the breaker opens. Its third attempts must
    # close it again and keep it closed, or the messages trickle through cooldown by
    # cooldown (with probes made of first attempts, 245 of 2,000 in 400 s).
    count = 1000
    await publish(broker, count)
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        handler.fail_first(2, status=503)
        config = integration(
            "it", handler.url, retry={"tiers": ["1s", "2s"]}, delivery={"workers": 32}
        )
        proxy = Proxy(broker, {"it": config}, dlq=dlq, clock=clock, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        breaker = proxy.groups["it"].breaker
        # Fake time: a bound on cooldowns and tiers, not on how busy the host is.
        deadline = clock.monotonic() + 300
        while len(handler.ledger.done_ids()) < count and clock.monotonic() < deadline:
            await clock.sleep(1)
        done = len(handler.ledger.done_ids())
        proxy.stop()
        await task
    assert done == count, f"{done} of {count} delivered; breaker: {breaker.statistics()}"
    assert await dlq.count(DeadLetterFilter()) == 0
    assert set(handler.ledger.counts().values()) == {3}
    for event_id in handler.ledger.ids():
        first, second, third = (e.received_wall for e in handler.ledger.by_id(event_id))
        assert second - first >= 1 - 1e-6
        assert third - second >= 2 - 1e-6
    assert breaker.state is BreakerState.CLOSED


async def test_rejected_message_is_dead_lettered_at_once_and_nothing_stalls(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock
) -> None:
    count = 10_000
    await publish(broker, count)
    poison = "orders:2:777"
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        handler.fail_ids({poison}, status=422, body='{"error": "missing field city"}')
        config = integration("it", handler.url, delivery={"workers": 32, "buffer": 1000})
        proxy = Proxy(broker, {"it": config}, dlq=dlq, clock=clock, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        await handler.ledger.wait_for(count - 1, timeout_s=120)
        for _ in range(100):
            described = await broker.admin.describe_topic("orders")
            if all(p.committed.get("it") == p.end_offset for p in described.partitions):
                break
            await clock.sleep(0.05)
        proxy.stop()
        await task
    assert len(handler.ledger.by_id(poison)) == 1  # dead at once: no retry
    rows = (await dlq.query(DeadLetterFilter())).rows
    assert len(rows) == 1
    row = await dlq.get(rows[0].id)
    assert row is not None
    assert row.reason is Reason.HTTP_4XX
    assert row.http_status == 422
    assert "missing field city" in row.error
    assert (row.source_topic, row.source_partition, row.source_offset) == ("orders", 2, 777)
    # The producer's metadata, and the trace Nemesis started for the record (it had none).
    assert row.metadata.keys() == {"type", META_TRACEPARENT}
    assert row.metadata["type"] == "order.created"
    assert parse_traceparent(row.metadata[META_TRACEPARENT]) is not None
    assert json.loads(row.payload) == {"n": n_of(handler.ledger.by_id(poison)[0])}
    assert all(p.committed["it"] == p.end_offset for p in described.partitions)


async def test_outage_opens_the_breaker_and_dead_letters_nothing(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock
) -> None:
    count = 600
    await publish(broker, count)
    metrics = Metrics()
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        handler.behave(status=500)
        config = integration(
            "it",
            handler.url,
            retry={"tiers": ["100ms", "200ms"]},
            breaker={"window_s": 5, "min_requests": 20, "cooldown_s": 0.5},
            delivery={"workers": 8, "buffer": 200},
        )
        proxy = Proxy(
            broker, {"it": config}, dlq=dlq, metrics=metrics, clock=clock, runner_options=FAST
        )
        task = asyncio.create_task(proxy.run())
        breaker = proxy.groups["it"].breaker
        await wait_for_state(breaker, {BreakerState.OPEN, BreakerState.HALF_OPEN})
        requests_when_opened = handler.requests
        await handler.refuse_connections()  # the outage goes on, now as connection errors
        await clock.sleep(2.0)
        # While open, only probes reach the handler (none can while it refuses connections).
        assert handler.requests == requests_when_opened
        handler.behave(status=200)
        await handler.accept_connections()
        await handler.ledger.wait_for(count, timeout_s=60)
        await wait_for_state(breaker, {BreakerState.CLOSED})
        proxy.stop()
        await task
    assert await dlq.count(DeadLetterFilter()) == 0
    transitions = breaker.statistics().transitions
    assert transitions.get((BreakerState.CLOSED, BreakerState.OPEN), 0) >= 1
    assert transitions.get((BreakerState.HALF_OPEN, BreakerState.CLOSED), 0) == 1


async def test_a_handler_answering_retry_to_everything_is_waited_out_not_dead_lettered(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock
) -> None:
    # `nemesis-verdict: retry` counts against the breaker, as a 503 does (the handler
    # contract), and the failure policy reads the same definition: while the handler asks
    # every message to come back later, far longer than the tiers last, none is dead.
    count = 200
    await publish(broker, count)
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        handler.behave(status=200, headers={"nemesis-verdict": "retry"})
        config = integration(
            "it",
            handler.url,
            retry={"tiers": ["100ms", "200ms"]},
            breaker={"window_s": 5, "min_requests": 20, "cooldown_s": 0.5},
            delivery={"workers": 8, "buffer": 200},
        )
        proxy = Proxy(broker, {"it": config}, dlq=dlq, clock=clock, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        breaker = proxy.groups["it"].breaker
        await wait_for_state(breaker, {BreakerState.OPEN, BreakerState.HALF_OPEN})
        await clock.sleep(10.0)  # dozens of tier lengths and cooldowns
        assert await dlq.count(DeadLetterFilter()) == 0
        assert handler.requests > count  # the retries were answered "retry", not waiting
        handler.behave(status=200)
        await handler.ledger.wait_for(count, timeout_s=60)
        proxy.stop()
        await task
    assert await dlq.count(DeadLetterFilter()) == 0


@pytest.mark.slow
async def test_an_outage_with_tiers_shorter_than_the_breaker_needs_dead_letters_nothing(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock
) -> None:
    # The breaker weighs the 400 successes before the outage in its 30-second window, so
    # it opens only seconds into the outage; the tiers run out in 0.3 s. Every message the
    # outage fails must wait for the handler, in a topic or in place, and none be dead.
    before, during = 400, 400
    await publish(broker, before)
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        config = integration(
            "it",
            handler.url,
            retry={"tiers": ["100ms", "200ms"]},
            rate_limits={"main": 100},  # failures come at 100/s: the window turns slowly
            delivery={"workers": 8, "buffer": 200},
        )
        proxy = Proxy(broker, {"it": config}, dlq=dlq, clock=clock, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        await handler.ledger.wait_for(before, timeout_s=60)
        handler.behave(status=500)
        await publish(broker, during, start=before)
        await clock.sleep(10)  # the outage: 500s ...
        await handler.refuse_connections()
        await clock.sleep(10)  # ... then refused connections
        assert await dlq.count(DeadLetterFilter()) == 0
        handler.behave(status=200)
        await handler.accept_connections()
        await handler.ledger.wait_for(before + during, timeout_s=60)
        proxy.stop()
        await task
    assert await dlq.count(DeadLetterFilter()) == 0
    assert len(handler.ledger.done_ids()) == before + during


@pytest.mark.slow
async def test_in_an_outage_of_a_quiet_integration_a_lone_message_waits_for_the_handler(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock
) -> None:
    # The handler's last answers were successes, and only one message fails: nothing
    # but the message's own failures says the handler is down. It waits, it is not dead.
    await publish(broker, 30)
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        config = integration(
            "it", handler.url, retry={"tiers": ["100ms", "200ms"]}, breaker={"cooldown_s": 1}
        )
        proxy = Proxy(broker, {"it": config}, dlq=dlq, clock=clock, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        await handler.ledger.wait_for(30, timeout_s=30)
        await handler.refuse_connections()
        await publish(broker, 1, start=30)
        await clock.sleep(60)  # the tiers and dozens of cooldowns
        assert await dlq.count(DeadLetterFilter()) == 0
        await handler.accept_connections()
        await handler.ledger.wait_for(31, timeout_s=30)
        proxy.stop()
        await task
    assert await dlq.count(DeadLetterFilter()) == 0


async def test_dead_letters_and_retries_are_logged_at_the_default_level(
    broker: EmbeddedBroker,
    dlq: SqliteDeadLetterStore,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)  # what `nemesis run` sets unless told otherwise
    count = 40
    await publish(broker, count)
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        handler.fail_ids({"orders:1:3"}, status=422)
        handler.fail_first(1, status=503)
        config = integration("it", handler.url, breaker={"min_requests": 100_000})
        proxy = Proxy(broker, {"it": config}, dlq=dlq, clock=clock, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        await handler.ledger.wait_for(count - 1, timeout_s=30)
        proxy.stop()
        await task
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    dead = [r.getMessage() for r in warnings if "dead-lettered" in r.getMessage()]
    assert dead == [
        "integration it: orders/1@3 dead-lettered (http_4xx) after 1 attempts: rejected (http 422)"
    ]
    # Retries are summed up, not logged one by one: the first at once.
    retries = [r.getMessage() for r in warnings if "retries since" in r.getMessage()]
    assert retries
    assert retries[0].startswith("integration it, flow main: 1 retries since the last report")
    assert len(retries) < count
    # Never the payload.
    assert not any('"n"' in r.getMessage() for r in caplog.records)


async def test_retry_flow_stays_within_its_rate_limit(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock
) -> None:
    count, retry_rate = 300, 50.0
    await publish(broker, count)
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        handler.fail_first(1, status=503)  # every message goes to tier 1 once
        config = integration(
            "it",
            handler.url,
            retry={"tiers": ["300ms"]},
            rate_limits={"retry": retry_rate},
            breaker={"min_requests": 100_000},  # keep the breaker out of this test
        )
        proxy = Proxy(broker, {"it": config}, dlq=dlq, clock=clock, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        await handler.ledger.wait_for(count, timeout_s=60)
        proxy.stop()
        await task
    retried = sorted(e.received_monotonic for e in handler.ledger if e.attempt == 2)
    assert len(retried) == count
    # The token bucket's promise, exact in fake time: in any window of W seconds at
    # most burst + rate * W (the burst is 50 ms worth), over the whole flow and over 2 s.
    burst = max(1.0, retry_rate * 0.05)
    span = retried[-1] - retried[0]
    assert len(retried) <= burst + retry_rate * span + 1e-6
    for i, start in enumerate(retried):
        in_window = sum(1 for t in retried[i:] if t - start <= 2.0)
        assert in_window <= burst + retry_rate * 2.0 + 1e-6


async def test_requeue_goes_to_the_owning_integration_only(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock
) -> None:
    count, replay_rate = 60, 20.0
    await publish(broker, count, consumers=("owner", "bystander"))
    async with (
        HandlerServer(clock=clock) as owner,
        HandlerServer(clock=clock) as bystander,
        clock.autojump(AUTOJUMP_S),
    ):
        owner.when(lambda e: e.attempt is not None and n_of(e) % 3 == 0, status=422)
        configs = {
            "owner": integration("owner", owner.url, rate_limits={"replay": replay_rate}),
            "bystander": integration("bystander", bystander.url),
        }
        proxy = Proxy(broker, configs, dlq=dlq, clock=clock, runner_options=FAST)
        task = asyncio.create_task(proxy.run())
        await bystander.ledger.wait_for(count, timeout_s=30)
        await owner.ledger.wait_for(count - count // 3, timeout_s=30)
        for _ in range(100):
            if await dlq.count(DeadLetterFilter()) == count // 3:
                break
            await clock.sleep(0.05)
        dead = await dlq.select_ids(DeadLetterFilter(status=Status.DEAD), 1000)
        assert len(dead) == count // 3
        owner.reset()  # the fix is deployed
        bystander_before = len(bystander.ledger)
        result = await requeue(dlq, broker, dead, by="alice", description="test")
        assert result.count == count // 3
        await owner.ledger.wait_for(count, timeout_s=30)
        await clock.sleep(0.3)
        proxy.stop()
        await task
    assert len(bystander.ledger) == bystander_before  # the other integration got nothing
    replayed = sorted(e.received_monotonic for e in owner.ledger if e.done and n_of(e) % 3 == 0)
    assert len(replayed) == count // 3
    span = replayed[-1] - replayed[0]
    assert len(replayed) <= max(1.0, replay_rate * 0.05) + replay_rate * span + 1e-6
    assert await end_offsets(broker, replay_topic("owner")) == count // 3
    rows = [await dlq.get(i) for i in dead]
    assert all(r is not None and r.status is Status.REQUEUED for r in rows)
    assert all(r is not None and r.last_action_by == "alice" and r.requeue_count == 1 for r in rows)
    actions = await dlq.actions()
    assert [(a.who, a.count) for a in actions.rows] == [("alice", count // 3)]


@pytest.mark.parametrize("on_exhausted", ["dead_letter", "halt"])
async def test_ordered_integration_retries_in_place_then_dead_letters_or_halts(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock, on_exhausted: str
) -> None:
    await broker.admin.create_topic("orders", partitions=2, consumers=[ConsumerSpec("it")])
    writer = await broker.writer("orders")
    # Two keys; key "a" has a message the handler never accepts (a 503 each time).
    await writer.write(
        [
            OutgoingMessage(value=orjson.dumps({"n": n}), key="a" if n % 2 else "b")
            for n in range(40)
        ]
    )
    await writer.close()
    metrics = Metrics()
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        refusal = handler.when(lambda e: n_of(e) == 5, status=503)
        config = integration(
            "it",
            handler.url,
            delivery={"workers": 8, "buffer": 100, "ordering": "key"},
            retry={"tiers": ["50ms", "100ms"], "on_exhausted": on_exhausted},
            # A 503 that runs out of tiers waits one cooldown before the DLQ (or the halt).
            breaker={"min_requests": 100_000, "cooldown_s": 0.2},
        )
        proxy = Proxy(
            broker, {"it": config}, dlq=dlq, metrics=metrics, clock=clock, runner_options=FAST
        )
        task = asyncio.create_task(proxy.run())
        # Key "b" keeps flowing, whatever happens to key "a": the handler visibly answers
        # other messages, the evidence without which a 503 is waited out as an outage.
        trickle = asyncio.create_task(publish_every(broker, clock, 0.05, key="b", start=100))
        await handler.ledger.wait_until(
            lambda ledger: sum(1 for e in ledger if e.done and e.key == "b") >= 20, timeout_s=20
        )
        await clock.sleep(1.0)
        attempts_of_5 = [e.attempt for e in handler.ledger if n_of(e) == 5]
        after_5 = [n_of(e) for e in handler.ledger if e.key == "a" and e.done and n_of(e) > 5]
        main = {"integration": "it", "flow": "main"}
        halted_now = metrics.registry.get_sample_value("nemesis_keys_halted", main)
        if on_exhausted == "halt":
            # The handler is fixed: the halted message goes through, and the key after it.
            handler.remove(refusal)
            await handler.ledger.wait_until(
                lambda ledger: sum(1 for e in ledger if e.done and e.key == "a") == 20,
                timeout_s=20,
            )
            assert metrics.registry.get_sample_value("nemesis_keys_halted", main) == 0
        trickle.cancel()
        proxy.stop()
        await task
    # No retry tier topics for an ordered integration: retries happen in place.
    assert tier_topic("it", 1) not in await broker.admin.list_topics()
    if on_exhausted == "dead_letter":
        # The first try, one per tier, and one after a cooldown: a 503 may be an outage.
        assert attempts_of_5 == [1, 2, 3, 4]
        assert await dlq.count(DeadLetterFilter()) == 1
        row = (await dlq.query(DeadLetterFilter())).rows[0]
        assert row.reason is Reason.RETRIES_EXHAUSTED
        assert after_5 == list(range(7, 40, 2))  # the key went on, in order, after it
        assert halted_now == 0
    else:
        assert attempts_of_5[:4] == [1, 2, 3, 4]
        assert len(attempts_of_5) > 4  # still being retried at the last delay
        assert await dlq.count(DeadLetterFilter()) == 0
        assert after_5 == []  # the key is halted behind it
        halted = metrics.registry.get_sample_value(
            "nemesis_halted_keys_total", {"integration": "it"}
        )
        assert halted == 1
        assert halted_now == 1  # the gauge: one key held back now
        resumed = [n_of(e) for e in handler.ledger if e.key == "a" and e.done and n_of(e) >= 5]
        assert resumed == list(range(5, 40, 2))  # then, once accepted, the rest in order


async def test_a_key_held_by_a_message_waiting_for_the_handler_counts_as_halted(
    broker: EmbeddedBroker, dlq: SqliteDeadLetterStore, clock: FakeClock
) -> None:
    # Nothing else is sent once key "b" is done, so nothing shows the handler is up: the
    # 503s of message 5 may be an outage, and it waits. Its key is held all the same, and
    # with on_exhausted: halt the gauge and the alert say so.
    await broker.admin.create_topic("orders", partitions=2, consumers=[ConsumerSpec("it")])
    writer = await broker.writer("orders")
    await writer.write(
        [
            OutgoingMessage(value=orjson.dumps({"n": n}), key="a" if n % 2 else "b")
            for n in range(40)
        ]
    )
    await writer.close()
    metrics = Metrics()
    async with HandlerServer(clock=clock) as handler, clock.autojump(AUTOJUMP_S):
        handler.when(lambda e: n_of(e) == 5, status=503)
        config = integration(
            "it",
            handler.url,
            delivery={"workers": 8, "buffer": 100, "ordering": "key"},
            retry={"tiers": ["50ms", "100ms"], "on_exhausted": "halt"},
            breaker={"min_requests": 100_000, "cooldown_s": 0.2},
        )
        proxy = Proxy(
            broker, {"it": config}, dlq=dlq, metrics=metrics, clock=clock, runner_options=FAST
        )
        task = asyncio.create_task(proxy.run())
        await handler.ledger.wait_until(
            lambda ledger: sum(1 for e in ledger if e.done and e.key == "b") == 20, timeout_s=20
        )
        await clock.sleep(2.0)
        halted_now = metrics.registry.get_sample_value(
            "nemesis_keys_halted", {"integration": "it", "flow": "main"}
        )
        proxy.stop()
        await task
    assert len([e for e in handler.ledger if n_of(e) == 5]) > 4  # waiting, tried each cooldown
    assert await dlq.count(DeadLetterFilter()) == 0
    assert halted_now == 1
