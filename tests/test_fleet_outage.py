"""Three fleet members on a real PostgreSQL server that stops for longer than the lease.

The members are ``FleetMember``s in this process, each with a store of its own
(its own connection pool, as three replicas have) on a server started for
this test alone, so that it can be stopped and started again. Their proxy
keeps a ledger of runner starts and stops: two runners of one integration
at any moment is seen as it happens, not sampled. Time is a ``FakeClock``
that jumps to the next deadline whenever every task waits and no call of a
store is under way (a slow answer on a busy host must not age the leases),
so the members poll, lose their leases and recover in fake seconds; the
server's stop and start are real.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from nemesis.backends.postgres import PostgresStateConfig
from nemesis.config.models import IntegrationConfig
from nemesis.fleet.member import FleetMember, FleetOptions
from nemesis.fleet.port import StateStore
from nemesis.fleet.postgres import PostgresStateStore, open_postgres_state
from nemesis.testing.clock import FakeClock
from tests.operability import integration
from tests.postgres_server import running_postgres

NAMES = sorted(f"team-{n:02}" for n in range(30))
OPTIONS = FleetOptions(lease_s=10, poll_s=1, handover_wait_s=60)
OUTAGE_S = 30.0  # three leases


@dataclass
class Ledger:
    """Who runs what, at every start and stop; every moment with two runners of one."""

    runners: dict[str, set[str]] = field(default_factory=dict)
    overlaps: list[tuple[str, frozenset[str]]] = field(default_factory=list)
    starts: int = 0

    def started(self, name: str, member: str) -> None:
        running = self.runners.setdefault(name, set())
        running.add(member)
        self.starts += 1
        if len(running) > 1:
            self.overlaps.append((name, frozenset(running)))

    def stopped(self, name: str, member: str) -> None:
        self.runners.get(name, set()).discard(member)


@dataclass
class Group:
    yaml: IntegrationConfig
    overrides: dict[str, Any] = field(default_factory=dict)


class RecordingProxy:
    """A proxy that runs nothing and writes each start and stop of a runner to the ledger."""

    def __init__(self, ledger: Ledger) -> None:
        self.groups = {name: Group(integration(name, "http://127.0.0.1:9/")) for name in NAMES}
        self.stopping = False
        self.member = ""
        self._ledger = ledger

    def set_placement(self, runs_here: Any) -> None:
        pass

    def start_integration(self, name: str) -> None:
        self._ledger.started(name, self.member)

    async def release_integration(self, name: str) -> None:
        self._ledger.stopped(name, self.member)

    def set_runners(self, name: str, runners: int) -> None:
        pass

    def replace_overrides(self, name: str, overrides: Mapping[str, Any]) -> None:
        self.groups[name].overrides = dict(overrides)

    def set_overrides(self, name: str, changes: Mapping[str, Any]) -> None:
        self.groups[name].overrides.update(changes)

    def clear_overrides(self, name: str, fields: Collection[str] | None = None) -> None:
        self.groups[name].overrides = {}


class Counted:
    """A state store whose calls under way are counted."""

    def __init__(self, store: PostgresStateStore) -> None:
        self.store = store
        self.under_way = 0

    def __getattr__(self, name: str) -> Any:
        found = getattr(self.store, name)
        if not inspect.iscoroutinefunction(found):
            return found

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.under_way += 1
            try:
                return await found(*args, **kwargs)
            finally:
                self.under_way -= 1

        return counted


async def drive(clock: FakeClock, stores: list[Counted]) -> None:
    """Moves fake time to the next deadline once every task waits and no store call is out."""
    while True:
        await clock.wait_all_tasks_blocked()
        deadline = clock.next_deadline
        if deadline is None or any(store.under_way for store in stores):
            await asyncio.sleep(0.005)
            continue
        clock.advance_to(deadline)


def settled(members: list[FleetMember]) -> bool:
    """Every member sees all three, and they run every integration once between them."""
    stats = [m.statistics() for m in members]
    running = [name for s in stats for name in s.running]
    return (
        all(s.members_active == len(members) and not s.waiting and not s.releasing for s in stats)
        and sorted(running) == NAMES
    )


async def until(clock: FakeClock, check: Any, timeout_s: float, what: str) -> None:
    """Polls ``check()`` every fake second; fails after ``timeout_s`` fake seconds."""
    deadline = clock.monotonic() + timeout_s
    while not check():
        if clock.monotonic() >= deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} fake seconds")
        await clock.sleep(1)


@pytest.mark.parametrize("one_dies", [False, True], ids=["all-live", "one-dies-meanwhile"])
async def test_a_store_outage_longer_than_the_lease_never_doubles_a_runner(
    caplog: pytest.LogCaptureFixture, one_dies: bool
) -> None:
    caplog.set_level(logging.INFO)
    ledger = Ledger()
    clock = FakeClock(wall_start=1_800_000_000.0)
    with running_postgres() as server:
        config = PostgresStateConfig(
            dsn=server.dsn(),
            schema_name=f"f_{uuid.uuid4().hex}",
            connect_timeout_s=2,
            statement_timeout_s=2,
        )
        stores = [Counted(await open_postgres_state(config)) for _ in range(3)]
        members: list[FleetMember] = []
        for n, store in enumerate(stores):
            proxy = RecordingProxy(ledger)
            proxy.member = f"m{n}"
            members.append(
                FleetMember(
                    cast(StateStore, store),
                    proxy,
                    options=OPTIONS,
                    clock=clock,
                    member_id=f"m{n}",
                    host=f"h{n}",
                )
            )
        try:
            async with asyncio.TaskGroup() as tasks:
                driver = tasks.create_task(drive(clock, stores))
                runs = []
                for member in members:
                    # Apart, as replicas are: after the outage one of them looks first.
                    await member.join()
                    runs.append(tasks.create_task(member.run()))
                    await clock.sleep(OPTIONS.poll_s / len(members))
                await until(clock, lambda: settled(members), 120, "three members settle")
                assert ledger.overlaps == []  # a cold start hands over drained: none yet
                before = {m.member_id: m.statistics().running for m in members}
                starts_before = ledger.starts
                caplog.clear()

                server.stop()
                await clock.sleep(OUTAGE_S / 2)
                live = members
                if one_dies:
                    # Its process ends: its runners with it, its row stays in the store.
                    runs[2].cancel()
                    await asyncio.wait([runs[2]])
                    for name in before["m2"]:
                        ledger.stopped(name, "m2")
                    live = members[:2]
                await clock.sleep(OUTAGE_S / 2)
                server.start()

                await until(clock, lambda: settled(live), 120, "the members settle again")
                # A few more polls: a late double start would show in the ledger.
                await clock.sleep(3 * OPTIONS.lease_s)
                after = {m.member_id: m.statistics().running for m in live}
                records = list(caplog.records)
                for run in runs:
                    run.cancel()
                await asyncio.wait(runs[: len(live)])
                driver.cancel()
        finally:
            for store in stores:
                await store.store.close()
    assert ledger.overlaps == [], ledger.overlaps[:5]
    if one_dies:
        # Forgotten once the others had settled: its integrations moved, each started once.
        assert sorted(after["m0"] + after["m1"]) == NAMES
        assert ledger.starts == starts_before + len(before["m2"])
    else:
        # Nobody died: the placement is the one from before, and nothing started again.
        assert after == before
        assert ledger.starts == starts_before
    assert all(r.exc_info is None for r in records), [r.getMessage() for r in records]
    failed = [r for r in records if "cannot reach the state store" in r.getMessage()]
    recovered = [r for r in records if "reaches the state store again" in r.getMessage()]
    assert len(failed) == 3, [r.getMessage() for r in records]  # one per member
    assert len(recovered) == len(live), [r.getMessage() for r in records]
    assert all(r.levelno == logging.ERROR for r in failed)
