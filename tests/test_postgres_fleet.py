"""The fleet on PostgreSQL: replicas that share their state and their DLQ through one database.

The store's cases, written once for every kind, are in
``tests/test_fleet_store.py``; here are what only a shared server shows
(writers of two connections serialised, a job cancelled midway) and the
whole thing with real ``nemesis run`` processes (``tests/test_fleet_e2e.py``'s
``Fleet``, its state and DLQ moved to the PostgreSQL server of the session).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nemesis.backends.postgres import PostgresStateConfig
from nemesis.errors import StateError
from nemesis.fleet.port import MemberInfo, Tx
from nemesis.fleet.postgres import PostgresStateStore, numbered, open_postgres_state
from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, kill_hard, stop_gracefully
from tests.postgres_server import PostgresServer
from tests.test_fleet_e2e import LEASE_S, Fleet, eventually, publish

A = MemberInfo("host-a-1-aaaaaa", "host-a", 1, started_at=1000.0)


@pytest.fixture
async def two(postgres_server: PostgresServer) -> AsyncIterator[list[PostgresStateStore]]:
    """Two stores on one schema, as two replicas on two hosts have."""
    config = PostgresStateConfig(dsn=postgres_server.dsn(), schema_name=f"f_{uuid.uuid4().hex}")
    opened = [await open_postgres_state(config), await open_postgres_state(config)]
    try:
        yield opened
    finally:
        for store in opened:
            await store.close()


def test_placeholders_are_numbered_in_order() -> None:
    assert numbered("UPDATE t SET a = ?, b = ? WHERE c = ?") == (
        "UPDATE t SET a = $1, b = $2 WHERE c = $3"
    )
    assert numbered("SELECT 1") == "SELECT 1"


async def test_writers_of_two_replicas_take_turns(two: list[PostgresStateStore]) -> None:
    # Each set_overrides reads the generation it bumped: concurrent writers must never
    # hand out one version twice, nor lose a bump.
    one, other = two
    start = await one.generation()
    versions = await asyncio.gather(
        *(
            store.set_overrides("orders", {"delivery.workers": n}, set_by=f"s{n}", now=float(n))
            for n in range(20)
            for store in ((one, other)[n % 2],)
        )
    )
    assert sorted(versions) == list(range(start + 1, start + 21))
    assert await other.generation() == start + 20
    [stored] = (await one.view()).overrides
    assert stored.version == start + 20


async def test_a_heartbeat_sent_twice_at_once_is_one_member(
    two: list[PostgresStateStore],
) -> None:
    # A heartbeat retried (say after a timeout) while the first is still on its way: both
    # read "no such member"; the second must then find the first's row, not insert its own.
    start = await two[0].generation()
    for n in range(5):
        member = MemberInfo(f"host-{n}", "host", n, started_at=1000.0)
        await asyncio.gather(
            *(store.heartbeat(member, now=1000.0, lease_s=10) for store in two for _ in range(2))
        )
    view = await two[1].view()
    assert [m.member_id for m in view.members] == [f"host-{n}" for n in range(5)]
    assert view.generation == start + 5  # one "joined" each


async def test_text_with_a_nul_is_stored_with_a_replacement_character(
    two: list[PostgresStateStore],
) -> None:
    one, other = two
    await one.set_overrides("orders", {"flags.note": "a\x00b"}, set_by="ops\x00", now=1.0)
    [stored] = (await other.view()).overrides
    assert (stored.value, stored.set_by) == ("a\x00b", "ops\ufffd")  # the value is JSON


async def test_a_cancelled_job_leaves_nothing_behind_and_the_store_goes_on(
    two: list[PostgresStateStore],
) -> None:
    one, other = two
    start = await one.generation()
    inside = threading.Event()

    def job(tx: Tx) -> None:
        tx.execute(one.queries.bump)
        inside.set()
        tx.query("SELECT pg_sleep(0.5)")
        tx.execute(one.queries.bump)

    task = asyncio.ensure_future(one._transaction(job))
    await asyncio.to_thread(inside.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await other.generation() == start  # rolled back: neither bump happened
    assert await one.heartbeat(A, now=1000.0, lease_s=10) == start + 1


async def test_an_unreachable_database_is_a_state_error_naming_it() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = PostgresStateConfig(
        dsn=f"postgresql://app:pw-{port}@127.0.0.1:{port}/fleet", connect_timeout_s=5
    )
    with pytest.raises(StateError) as caught:
        await open_postgres_state(config)
    assert f"the PostgreSQL state store at 127.0.0.1:{port}/fleet: connect:" in str(caught.value)
    assert f"pw-{port}" not in str(caught.value)


async def test_a_closed_store_says_so(two: list[PostgresStateStore]) -> None:
    one, _ = two
    await one.close()
    with pytest.raises(StateError, match=r"PostgreSQL state store at 127\.0\.0\.1:\d+/"):
        await one.generation()


async def test_a_schema_from_before_revocations_gets_their_table(
    postgres_server: PostgresServer,
) -> None:
    config = PostgresStateConfig(dsn=postgres_server.dsn(), schema_name=f"f_{uuid.uuid4().hex}")
    store = await open_postgres_state(config)
    try:
        await store.revoke_session("gone", 2000.0, now=1000.0)
        admin = await postgres_server.admin()
        try:
            await admin.execute(f'DROP TABLE "{config.schema_name}".fleet_revoked_sessions')
        finally:
            await admin.close()
    finally:
        await store.close()
    # The four older tables are there: opening must still add the missing one.
    store = await open_postgres_state(config)
    try:
        assert await store.revoke_session("s-1", 2000.0, now=1000.0) == 0
        assert await store.session_revoked_until("s-1", now=1000.0) == 2000.0
    finally:
        await store.close()


# --- replicas as processes ------------------------------------------------------------------


class PostgresFleet(Fleet):
    """``Fleet``'s replicas with their state and DLQ in PostgreSQL (``NEMESIS_TEST_PG_DSN``)."""

    def config(self, n: int) -> str:
        name = super().config(n)
        path = self.workspace.root / name
        shared = "kind: postgres, dsn: '${NEMESIS_TEST_PG_DSN}'"
        text = path.read_text().replace("kind: sqlite, path: state.db", shared)
        assert shared in text, text
        path.write_text(text + f"dlq: {{{shared}}}\n")
        return name


@pytest.mark.slow
async def test_two_replicas_meet_in_postgres_and_a_killed_one_hands_over(
    workspace: Workspace, postgres_dsn: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("NEMESIS_TEST_PG_DSN", postgres_dsn)
    workspace.lease_s = LEASE_S
    workspace.write_config()
    fleet = PostgresFleet(workspace)
    names = [f"team-{n}" for n in range(6)]
    async with HandlerServer() as handler:
        for name in names:
            workspace.write_integration(
                name, integration_yaml(name, f"{handler.url}{name}", workers=4, tiers=())
            )
        publish(workspace, "orders", range(10))
        for n in range(2):
            await fleet.start(n)
        placed = await eventually(
            lambda: fleet.settled(0, 2), timeout_s=90, what="2 members", logs=workspace.logs
        )
        running = [m["running"] for m in placed["members"]]
        assert sum(running) == 6
        assert min(running) > 0, running  # each runs a share
        shown = workspace.cli("fleet", "status", "-c", "replica-0.yaml", "--json")
        assert shown.returncode == 0, shown.stderr
        assert len(json.loads(shown.stdout)["members"]) == 2

        kill_hard(fleet.processes[1])
        await fleet.processes[1].wait()
        publish(workspace, "orders", range(10, 20))
        after = await eventually(
            lambda: fleet.settled(0, 1), timeout_s=60, what="1 member", logs=workspace.logs
        )
        assert [m["running"] for m in after["members"]] == [6]
        expected = {(f"/{name}", f"order-{n}") for name in names for n in range(20)}

        def delivered() -> set[tuple[str, str]]:
            return {(e.path, json.loads(e.body)["id"]) for e in handler.ledger if e.done}

        async def everything() -> bool:
            return delivered() >= expected

        await eventually(everything, timeout_s=90, what="every message", logs=workspace.logs)
        assert await stop_gracefully(fleet.processes[0]) == 0, workspace.logs()[-4000:]
    assert delivered() == expected
    left = workspace.cli("fleet", "status", "-c", "replica-0.yaml", "--json")
    assert left.returncode == 0, left.stderr
    assert json.loads(left.stdout)["members"] == []
