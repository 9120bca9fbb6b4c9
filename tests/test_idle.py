"""An idle integration costs (almost) nothing: no flow polls, internal topics share a reader.

Counted, not timed: the cases count reads, receives and heartbeat rounds over
an interval in which nothing is written, on the embedded backend with its real
file, and a real handler server on 127.0.0.1 (which receives nothing).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemesis.broker.embedded import EmbeddedBroker, EmbeddedReader, Wakeups, log, open_embedded
from nemesis.broker.embedded.multi import EmbeddedMultiReader
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.config.models import EmbeddedBackendConfig, IntegrationConfig
from nemesis.dlq.sqlite import open_sqlite_dlq
from nemesis.runtime.app import Proxy
from nemesis.runtime.internal import FlowReader
from nemesis.runtime.lag import LagMonitor, LagTarget
from nemesis.runtime.runner import RunnerState
from nemesis.testing import HandlerServer
from nemesis.testing.clock import FakeClock
from nemesis.topology import replay_topic, tier_topic

pytestmark = pytest.mark.timeout(120)

NAMES = ("alpha", "beta", "gamma")
# Readers poll the file at first (every few ms, doubling); these start slow, so that
# any read in the counted interval is one the runner asked for.
QUIET = Wakeups(poll_min_s=30.0, poll_max_s=30.0, belled_poll_max_s=30.0)


def integration(name: str, url: str) -> IntegrationConfig:
    return IntegrationConfig.model_validate(
        {
            "name": name,
            "owners": [f"team-{name}"],
            "source": {"topic": f"src-{name}", "consumer": name},
            "target": {"url": url, "timeout_s": 2},
            "retry": {"tiers": ["1s", "2s", "3s"]},
        }
    )


class Counts:
    """Calls of the embedded readers' receive, reads and waits, by method."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: Counter[str] = Counter()
        self.readers: list[Any] = []
        for cls, method in (
            (EmbeddedReader, "receive"),
            (EmbeddedReader, "try_receive"),
            (EmbeddedReader, "_read"),
            (EmbeddedReader, "_wait"),
            (EmbeddedMultiReader, "receive"),
            (EmbeddedMultiReader, "_wait"),
        ):
            self._count(monkeypatch, cls, method)

    def _count(self, monkeypatch: pytest.MonkeyPatch, cls: type, method: str) -> None:
        original = getattr(cls, method)
        label = f"{cls.__name__}.{method}"
        calls = self.calls

        async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls[label] += 1
            return await original(self, *args, **kwargs)

        monkeypatch.setattr(cls, method, counted)


@contextlib.asynccontextmanager
async def running_proxy(
    tmp_path: Path, url: str, broker: EmbeddedBroker
) -> AsyncIterator[tuple[Proxy, list[Any]]]:
    dlq = await open_sqlite_dlq(tmp_path / "dlq.db")
    for name in NAMES:
        await broker.admin.create_topic(f"src-{name}", partitions=2, consumers=[ConsumerSpec(name)])
    opened: list[Any] = []
    open_reader = broker.reader

    async def recording_reader(topic: str | Sequence[str], consumer: str, **options: Any) -> Any:
        opened.append(topic if isinstance(topic, str) else tuple(topic))
        return await open_reader(topic, consumer, **options)

    broker.reader = recording_reader  # type: ignore[method-assign]
    proxy = Proxy(broker, {name: integration(name, url) for name in NAMES}, dlq=dlq)
    task = asyncio.create_task(proxy.run())
    try:
        for _ in range(600):
            flows = [r for g in proxy.groups.values() for r in g.runners.values()]
            if len(flows) == 5 * len(NAMES) and all(
                r.state is RunnerState.RUNNING and r.statistics().assigned_partitions > 0
                for r in flows
            ):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the flows did not start")
        yield proxy, opened
    finally:
        proxy.stop()
        await task
        await dlq.close()


async def test_an_idle_proxy_neither_receives_nor_reads_nor_wakes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = Counts(monkeypatch)
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "n.db")), wakeups=QUIET)
    try:
        async with HandlerServer() as handler:
            async with running_proxy(tmp_path, handler.url, broker):
                await asyncio.sleep(0.2)  # the first reads after the start
                before = Counter(counts.calls)
                await asyncio.sleep(1.0)
                # Each flow waits in one receive (30 s); nothing polls, nothing reads.
                assert counts.calls == before, counts.calls - before
            assert len(handler.ledger) == 0
    finally:
        await broker.close()


async def test_the_internal_flows_of_an_integration_share_one_reader(tmp_path: Path) -> None:
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "n.db")))
    try:
        async with (
            HandlerServer() as handler,
            running_proxy(tmp_path, handler.url, broker) as (proxy, opened),
        ):
            for name in NAMES:
                internal = (*(tier_topic(name, n) for n in (1, 2, 3)), replay_topic(name))
                assert opened.count(f"src-{name}") == 1
                assert opened.count(internal) == 1
                runners = proxy.groups[name].runners
                views = [runners[flow]._source for flow in ("retry-1", "retry-2", "replay")]
                assert all(isinstance(view, FlowReader) for view in views)
            assert len(opened) == 2 * len(NAMES)
    finally:
        await broker.close()


async def test_a_multi_topic_reader_reads_commits_and_can_be_interrupted(tmp_path: Path) -> None:
    path = EmbeddedBackendConfig(path=str(tmp_path / "n.db"))
    broker = await open_embedded(path)
    try:
        for topic in ("a", "b"):
            await broker.admin.create_topic(topic, partitions=2, consumers=[ConsumerSpec("c")])
            writer = await broker.writer(topic)
            await writer.write([OutgoingMessage(orjson.dumps({"n": n})) for n in range(10)])
        reader = await broker.reader(["a", "b"], "c")
        assert isinstance(reader, EmbeddedMultiReader)
        assert {(s.topic, s.partition) for s in reader.sessions()} == {
            ("a", 0),
            ("a", 1),
            ("b", 0),
            ("b", 1),
        }
        got: list[Any] = []
        while len(got) < 20:
            batch = await reader.receive(100, 5.0)
            assert batch
            # A read is runs of one partition session each; committed run by run.
            start = 0
            for index in range(1, len(batch) + 1):
                if index == len(batch) or batch[index].session is not batch[start].session:
                    await reader.commit(batch[start:index])
                    start = index
            got.extend(batch)
        assert Counter(m.topic for m in got) == {"a": 10, "b": 10}

        waiting = asyncio.create_task(reader.receive(100, 60.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        reader.interrupt()
        assert await asyncio.wait_for(waiting, 10) == ()
        await reader.close()

        again = await broker.reader(["a", "b"], "c")
        assert await again.receive(100, 0.3) == ()  # every message was committed
        await again.close()
    finally:
        await broker.close()


async def test_one_heartbeat_round_renews_every_reader_of_the_process(tmp_path: Path) -> None:
    clock = FakeClock()
    broker = await open_embedded(
        EmbeddedBackendConfig(path=str(tmp_path / "n.db"), lease_s=9), clock=clock
    )
    try:
        readers = []
        for n in range(12):
            await broker.admin.create_topic(f"t{n}", partitions=1, consumers=[ConsumerSpec("c")])
            readers.append(await broker.reader(f"t{n}", "c"))
            clock.advance(0.1)  # started at different times
        await asyncio.sleep(0.05)
        before = broker.beats.statistics()
        for _ in range(3):
            clock.advance(3.0)  # the interval: lease_s / 3
            for _ in range(100):
                await asyncio.sleep(0.01)
                if broker.beats.statistics().beats - before.beats >= 12:
                    break
        after = broker.beats.statistics()
        # Each reader was renewed (its leases run on), in far fewer rounds than readers.
        assert after.beats - before.beats >= 12
        assert after.rounds - before.rounds <= 3
        assert all(len(reader.sessions()) == 1 for reader in readers)
        assert all(s.expires_at > clock.time() for r in readers for s in r._sessions.values())
    finally:
        await broker.close()


async def test_retention_rounds_look_up_a_partitions_oldest_message_once(tmp_path: Path) -> None:
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "n.db")))
    try:
        for topic in ("a", "b", "c"):
            await broker.admin.create_topic(topic, partitions=2, retention_s=3600)
            writer = await broker.writer(topic)
            await writer.write([OutgoingMessage(b"x", partition=p) for p in (0, 1)])
        known: log.OldestKnown = {}
        statements: list[str] = []

        def rounds(conn: sqlite3.Connection) -> list[int]:
            looked_up = []
            conn.set_trace_callback(statements.append)
            try:
                for _ in range(3):
                    statements.clear()
                    log.expiry_candidates(conn, time.time(), known)
                    looked_up.append(sum("FROM messages" in s for s in statements))
            finally:
                conn.set_trace_callback(None)
            return looked_up

        # The first round looks up each of the six partitions; the next ones, none.
        assert await broker.db.maintenance.run(rounds, timeout_s=10) == [6, 0, 0]
        # Expired (an hour later): found from what is known, without a look-up.
        later = await broker.db.maintenance.run(
            lambda conn: log.expiry_candidates(conn, time.time() + 7200, known), timeout_s=10
        )
        assert len(later) == 6
    finally:
        await broker.close()


async def test_a_member_joining_from_another_process_is_seen_by_the_shared_renewal(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    config = EmbeddedBackendConfig(path=str(tmp_path / "n.db"), lease_s=9)
    first = await open_embedded(config, clock=clock, member_id="host:1:a")
    second = await open_embedded(config, clock=clock, member_id="host:2:b")

    async def rounds(count: int) -> None:
        for _ in range(count):
            clock.advance(3.0)  # the interval: lease_s / 3
            for _ in range(50):
                await asyncio.sleep(0.01)

    try:
        await first.admin.create_topic("t", partitions=4, consumers=[ConsumerSpec("c")])
        mine = await first.reader("t", "c")
        await rounds(2)
        quiet = first.beats.statistics()
        assert len(mine.sessions()) == 4
        # Alone and settled: renewed with the whole process, no full protocol.
        assert quiet.beats > 0
        assert quiet.full == 0

        theirs = await second.reader("t", "c")  # joins; waits for the first to let go
        await rounds(3)
        # The renewal saw the new member and ran the full protocol: the share moved.
        assert first.beats.statistics().full > quiet.full
        assert len(mine.sessions()) == len(theirs.sessions()) == 2
    finally:
        await second.close()
        await first.close()


async def test_a_retried_message_waits_its_tier_and_comes_through_the_shared_reader(
    tmp_path: Path,
) -> None:
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "n.db")))
    dlq = await open_sqlite_dlq(tmp_path / "dlq.db")
    try:
        await broker.admin.create_topic("orders", partitions=2, consumers=[ConsumerSpec("it")])
        writer = await broker.writer("orders")
        await writer.write([OutgoingMessage(orjson.dumps({"n": n})) for n in range(5)])
        async with HandlerServer() as handler:
            handler.fail_first(1, status=503)
            config = IntegrationConfig.model_validate(
                {
                    "name": "it",
                    "owners": ["team-it"],
                    "source": {"topic": "orders", "consumer": "it"},
                    "target": {"url": handler.url, "timeout_s": 2},
                    "retry": {"tiers": ["300ms", "1s"]},
                    "breaker": {"min_requests": 100_000},
                }
            )
            proxy = Proxy(broker, {"it": config}, dlq=dlq)
            task = asyncio.create_task(proxy.run())
            try:
                await handler.ledger.wait_for(5, timeout_s=60)
                tier = proxy.groups["it"].runners["retry-1"]
                shared = tier._source
                assert isinstance(shared, FlowReader)
                assert tier.statistics().messages_read == 5
            finally:
                proxy.stop()
                await task
        for event_id in handler.ledger.ids():
            first, second = handler.ledger.by_id(event_id)
            assert (first.attempt, second.attempt) == (1, 2)
            assert second.received_wall - first.received_wall >= 0.3 - 0.01
    finally:
        await dlq.close()
        await broker.close()


async def test_a_lag_round_describes_every_topic_in_one_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "n.db")))
    try:
        for n in range(10):
            await broker.admin.create_topic(f"t{n}", partitions=2, consumers=[ConsumerSpec("c")])
        calls: Counter[str] = Counter()
        admin = type(broker.admin)
        for method in ("describe_topic", "describe_topics"):
            original = getattr(admin, method)

            async def counted(self: Any, *args: Any, _o: Any = original, _m: str = method) -> Any:
                calls[_m] += 1
                return await _o(self, *args)

            monkeypatch.setattr(admin, method, counted)
        targets = [LagTarget("it", "main", f"t{n}", "c") for n in range(10)] + [
            LagTarget("it", "retry-1", "missing", "c")
        ]
        monitor = LagMonitor(broker, lambda: targets)
        await monitor.refresh()
        assert calls == {"describe_topics": 1}
        assert len(monitor.lags(targets)) == 20  # ten topics of two partitions; none missing
    finally:
        await broker.close()
