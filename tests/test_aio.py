"""The shared asyncio helpers, and the background tasks of the embedded broker they own."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from nemesis.aio import TaskScope, first_of
from nemesis.broker.embedded import open_embedded
from nemesis.broker.embedded.broker import CHECKPOINT_INTERVAL_S
from nemesis.broker.embedded.db import Checkpoint
from nemesis.broker.port import ConsumerSpec
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.errors import BrokerError
from nemesis.testing.clock import FakeClock


async def test_first_of_returns_with_the_first_and_cancels_the_rest() -> None:
    clock = FakeClock()
    event = asyncio.Event()
    slow = asyncio.ensure_future(clock.sleep(60))
    waiting = asyncio.ensure_future(first_of(slow, event.wait()))
    await asyncio.sleep(0)
    assert not waiting.done()
    event.set()
    await waiting
    assert slow.cancelled()
    assert clock.sleepers == 0


async def test_first_of_raises_what_the_first_raised() -> None:
    async def broken() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        await first_of(broken(), asyncio.Event().wait())


async def test_first_of_stops_at_its_timeout() -> None:
    await first_of(asyncio.Event().wait(), timeout_s=0.01)


async def test_a_scope_hands_the_first_failure_over_and_cancels_the_other_tasks() -> None:
    failures: list[BaseException] = []
    scope = TaskScope("test", failures.append)
    fail = asyncio.Event()

    async def fails_when_told() -> None:
        await fail.wait()
        raise RuntimeError("bug")

    other = scope.start(asyncio.Event().wait(), name="other")  # type: ignore[arg-type]
    scope.start(fails_when_told(), name="failing")
    await asyncio.sleep(0)
    fail.set()
    await asyncio.wait([other])
    assert other.cancelled()
    assert [str(f) for f in failures] == ["bug"]
    assert str(scope.failure) == "bug"
    await scope.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        scope.start(asyncio.sleep(0), name="late")


async def test_close_cancels_and_awaits_every_task_of_a_scope() -> None:
    scope = TaskScope("test", lambda error: None)
    task = scope.start(asyncio.Event().wait(), name="waits")  # type: ignore[arg-type]
    await scope.aclose()
    assert task.cancelled()


async def test_a_bug_in_the_brokers_housekeeping_is_logged_and_the_loop_starts_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock()
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "n.db")), clock=clock)
    rounds: list[str] = []

    async def checkpoint() -> Checkpoint:
        rounds.append("checkpoint")
        if len(rounds) == 1:
            raise RuntimeError("a bug")
        return Checkpoint(wal_frames=0, copied=0)

    broker.checkpoint = checkpoint  # type: ignore[method-assign]  # the fault to inject
    try:
        for _ in range(3):
            await clock.wait_all_tasks_blocked()
            clock.advance(CHECKPOINT_INTERVAL_S)
        await clock.wait_all_tasks_blocked()
    finally:
        await broker.close()
    assert rounds == ["checkpoint"] * 3  # the loop went on after the bug
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "housekeeping" in errors[0].getMessage()
    assert errors[0].exc_info is not None


async def test_a_bug_in_the_lease_heartbeat_ends_the_readers_sessions_at_once(
    tmp_path: Path,
) -> None:
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "n.db")))
    try:
        await broker.admin.create_topic("orders", partitions=2, consumers=[ConsumerSpec("c")])
        reader = await broker.reader("orders", "c")
        sessions = reader.sessions()
        assert sessions

        async def heartbeat(timeout_s: float | None = None) -> None:
            raise RuntimeError("a bug")

        reader.heartbeat = heartbeat  # type: ignore[method-assign]  # the fault to inject
        reader.poke()
        for _ in range(10):
            await asyncio.sleep(0)
        # Not at the next receive, nor when the leases run out: now.
        assert not any(session.alive for session in sessions)
        with pytest.raises(BrokerError, match="heartbeat"):
            await reader.receive(10, 0.01)
    finally:
        await broker.close()
