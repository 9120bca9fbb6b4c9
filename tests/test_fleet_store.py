"""The fleet's state store, on a real file: members and leases, assignments, overrides, generation.

Written once against the port; each store kind is one entry of ``STORES``.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import closing
from pathlib import Path
from typing import cast

import pytest
import ydb
from ydb.aio.query.pool import QuerySessionPool

from nemesis.backends.postgres import PostgresStateConfig
from nemesis.errors import StateError
from nemesis.fleet.port import MemberInfo, StateStore
from nemesis.fleet.postgres import open_postgres_state
from nemesis.fleet.sqlite import open_sqlite_state
from nemesis.fleet.ydb import YdbStateStore
from tests.postgres_server import PostgresServer
from tests.ydb_fake import FAST_RETRY, FakePool, FakeTx, FakeYdb

Opener = Callable[[Path], Awaitable[StateStore]]


def _sqlite(request: pytest.FixtureRequest) -> Opener:
    async def opener(tmp: Path) -> StateStore:
        return await open_sqlite_state(tmp / "state.db")

    return opener


def _postgres(request: pytest.FixtureRequest) -> Opener:
    """A schema of the test's own on the session's server (tests/postgres_server.py)."""
    server: PostgresServer = request.getfixturevalue("postgres_server")
    config = PostgresStateConfig(dsn=server.dsn(), schema_name=f"fleet_{uuid.uuid4().hex[:12]}")

    async def opener(tmp: Path) -> StateStore:
        return await open_postgres_state(config)

    return opener


def _ydb_fake(request: pytest.FixtureRequest) -> Opener:
    """One fake YDB database per test (tests/ydb_fake.py)."""
    database = FakeYdb()

    async def opener(tmp: Path) -> StateStore:
        store = YdbStateStore(
            cast(QuerySessionPool, FakePool(database)),
            directory="nemesis/fleet",
            retry_settings=FAST_RETRY,
        )
        await store.open()
        return store

    return opener


# A kind's opener, given the test's request (for the fixtures only some kinds need).
STORES: dict[str, Callable[[pytest.FixtureRequest], Opener]] = {
    "sqlite": _sqlite,
    "postgres": _postgres,
    "ydb-fake": _ydb_fake,
}

A = MemberInfo("host-a-1-aaaaaa", "host-a", 1, started_at=1000.0)
B = MemberInfo("host-b-2-bbbbbb", "host-b", 2, started_at=1001.0)


@pytest.fixture(params=sorted(STORES))
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[list[StateStore]]:
    """Two connections to one store, as two replicas have."""
    opener = STORES[request.param](request)
    opened = [await opener(tmp_path), await opener(tmp_path)]
    try:
        yield opened
    finally:
        for store in opened:
            await store.close()


async def test_a_new_member_moves_the_generation_and_a_renewal_does_not(
    stores: list[StateStore],
) -> None:
    one, two = stores
    start = await one.generation()
    joined = await one.heartbeat(A, now=1000.0, lease_s=10)
    assert joined == start + 1
    assert await two.generation() == joined  # the other connection sees it
    assert await one.heartbeat(A, now=1003.0, lease_s=10) == joined
    [member] = (await two.view()).members
    assert (member.member_id, member.host, member.pid) == ("host-a-1-aaaaaa", "host-a", 1)
    assert (member.heartbeat_at, member.lease_until, member.draining) == (1003.0, 1013.0, False)


async def test_draining_is_news_to_the_others(stores: list[StateStore]) -> None:
    one, _ = stores
    joined = await one.heartbeat(A, now=1000.0, lease_s=10)
    draining = MemberInfo(A.member_id, A.host, A.pid, A.started_at, draining=True)
    assert await one.heartbeat(draining, now=1001.0, lease_s=10) == joined + 1
    assert (await one.view()).members[0].draining


async def test_an_expired_member_is_forgotten_with_its_assignments(
    stores: list[StateStore],
) -> None:
    one, two = stores
    await one.heartbeat(A, now=1000.0, lease_s=10)
    await one.assign("orders", A.member_id, now=1000.0)
    await two.heartbeat(B, now=1005.0, lease_s=10)
    assert {a.member_id for a in (await two.view()).assignments} == {A.member_id}
    before = await two.generation()
    # A's lease ran until 1010; B's heartbeat at 1011 finds it expired.
    after = await two.heartbeat(B, now=1011.0, lease_s=10)
    assert after == before + 1
    view = await one.view()
    assert [m.member_id for m in view.members] == [B.member_id]
    assert view.assignments == ()


async def test_assignments_are_idempotent_and_only_changes_move_the_generation(
    stores: list[StateStore],
) -> None:
    one, two = stores
    start = await one.generation()
    await one.assign("orders", A.member_id, now=1.0)
    await one.assign("orders", A.member_id, now=2.0)
    await two.assign("orders", B.member_id, now=3.0)
    assert await one.generation() == start + 2
    view = await two.view()
    assert [(a.integration, a.member_id, a.since) for a in view.assignments] == [
        ("orders", A.member_id, 1.0),
        ("orders", B.member_id, 3.0),
    ]
    await one.unassign("orders", A.member_id)
    await one.unassign("orders", A.member_id)
    assert await one.generation() == start + 3
    await two.leave(B.member_id)
    assert (await one.view()).assignments == ()


async def test_overrides_keep_their_json_value_version_and_author(
    stores: list[StateStore],
) -> None:
    one, two = stores
    values = {"delivery.workers": 64, "flags.disabled_types": ["a", "b"], "rate_limits.main": None}
    version = await one.set_overrides("orders", values, set_by="admin API on a", now=5.0)
    assert version == await two.generation()
    stored = (await two.view()).overrides_of("orders")
    assert {f: o.value for f, o in stored.items()} == values
    assert {(o.version, o.set_by, o.set_at) for o in stored.values()} == {
        (version, "admin API on a", 5.0)
    }
    later = await two.set_overrides(
        "orders", {"delivery.workers": 8}, cleared=["rate_limits.main"], set_by="b", now=6.0
    )
    stored = (await one.view()).overrides_of("orders")
    assert {f: (o.value, o.version) for f, o in stored.items()} == {
        "delivery.workers": (8, later),
        "flags.disabled_types": (["a", "b"], version),
    }
    await one.clear_overrides("orders", ["flags.disabled_types"])
    assert list((await two.view()).overrides_of("orders")) == ["delivery.workers"]
    await one.clear_overrides("orders")
    assert (await two.view()).overrides == ()


async def test_a_caught_up_override_is_dropped_only_at_the_version_seen(
    stores: list[StateStore],
) -> None:
    one, two = stores
    old = await one.set_overrides("orders", {"delivery.workers": 64}, set_by="a", now=1.0)
    new = await two.set_overrides("orders", {"delivery.workers": 8}, set_by="b", now=2.0)
    await one.drop_caught_up("orders", {"delivery.workers": old})  # a stale view: kept
    assert (await one.view()).overrides_of("orders")["delivery.workers"].value == 8
    await one.drop_caught_up("orders", {"delivery.workers": new})
    assert (await one.view()).overrides == ()


async def test_a_revoked_session_is_seen_through_every_connection_until_it_expires(
    stores: list[StateStore],
) -> None:
    one, two = stores
    start = await one.generation()
    assert await one.revoke_session("s-1", 1100.0, now=1000.0) == 0
    assert await two.session_revoked_until("s-1", now=1000.0) == 1100.0
    assert await two.session_revoked_until("s-2", now=1000.0) is None
    assert await two.revoke_session("s-1", 1100.0, now=1001.0) == 0  # twice: one row
    assert await one.generation() == start  # the members have nothing to re-read
    assert await two.session_revoked_until("s-1", now=1100.0) is None  # its cookie expired


async def test_expired_revocations_are_deleted_by_later_revokes(
    stores: list[StateStore],
) -> None:
    one, two = stores
    for n in range(3):
        await one.revoke_session(f"old-{n}", 1010.0 + n, now=1000.0)
    # The table holds 4 rows at most: the expired ones make room, no live one is pushed out.
    assert await two.revoke_session("new-1", 2000.0, now=1500.0, max_rows=4) == 0
    assert await two.revoke_session("new-2", 2000.0, now=1500.0, max_rows=4) == 0
    assert await two.revoke_session("new-3", 2000.0, now=1500.0, max_rows=4) == 0
    assert await two.revoke_session("new-4", 2000.0, now=1500.0, max_rows=4) == 0
    for n in range(1, 5):
        assert await one.session_revoked_until(f"new-{n}", now=1500.0) == 2000.0


async def test_a_full_table_keeps_the_newest_revocation_and_says_what_it_forgot(
    stores: list[StateStore],
) -> None:
    one, two = stores
    await one.revoke_session("late", 1300.0, now=1000.0, max_rows=2)
    await one.revoke_session("soon", 1100.0, now=1000.0, max_rows=2)
    # Full: the revocation whose cookie expires soonest goes, the new one is stored.
    assert await two.revoke_session("newest", 1050.0, now=1001.0, max_rows=2) == 1
    assert await one.session_revoked_until("soon", now=1001.0) is None
    assert await one.session_revoked_until("late", now=1001.0) == 1300.0
    assert await one.session_revoked_until("newest", now=1001.0) == 1050.0


async def test_a_closed_store_says_so(tmp_path: Path) -> None:
    store = await open_sqlite_state(tmp_path / "state.db")
    await store.close()
    with pytest.raises(StateError, match=r"state\.db"):
        await store.generation()


async def test_a_path_that_cannot_be_a_file_is_a_state_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StateError, match="file"):
        await open_sqlite_state(tmp_path / "file" / "state.db")


async def test_ydb_jobs_run_again_over_their_own_undetermined_commit() -> None:
    """Each commit happens and answers Undetermined: the SDK runs the job again on top of it."""
    database = FakeYdb()
    store = YdbStateStore(
        cast(QuerySessionPool, FakePool(database)),
        directory="nemesis/fleet",
        retry_settings=FAST_RETRY,
    )
    await store.open()
    try:
        database.undetermined_commits = 1
        joined = await store.heartbeat(A, now=1000.0, lease_s=10)
        database.undetermined_commits = 1
        await store.assign("orders", A.member_id, now=1000.0)
        database.undetermined_commits = 1
        version = await store.set_overrides("orders", {"delivery.workers": 8}, set_by="a", now=1.0)
        assert database.undetermined_commits == 0  # each was answered Undetermined
        view = await store.view()
        assert [m.member_id for m in view.members] == [A.member_id]
        assert [(a.member_id, a.since) for a in view.assignments] == [(A.member_id, 1000.0)]
        assert view.overrides_of("orders")["delivery.workers"].version == version
        assert view.generation == version > joined
    finally:
        await store.close()


async def test_ydb_reads_a_result_set_streamed_in_parts_as_one() -> None:
    """The query service streams a result set as parts sharing its index (one row a part here)."""
    database = FakeYdb(part_rows=1)
    store = YdbStateStore(
        cast(QuerySessionPool, FakePool(database)),
        directory="nemesis/fleet",
        retry_settings=FAST_RETRY,
    )
    await store.open()
    try:
        members = [MemberInfo(f"host-{n}-{n}-aaaaaa", f"host-{n}", n, 1000.0) for n in range(3)]
        for member in members:
            await store.heartbeat(member, now=1000.0, lease_s=10)
            await store.assign("orders", member.member_id, now=1000.0)
        view = await store.view()
        assert [m.member_id for m in view.members] == [m.member_id for m in members]
        assert len(view.assignments) == 3
    finally:
        await store.close()


async def test_the_fake_ydb_streams_a_result_set_in_parts_sharing_its_index() -> None:
    database = FakeYdb(part_rows=2)
    database.run(
        "CREATE TABLE IF NOT EXISTS `t` (\n`id` Int64 NOT NULL,\nPRIMARY KEY (`id`)\n)", None
    )
    for n in range(5):
        database.run(f"UPSERT INTO `t` (`id`) VALUES ({n});", None)

    async def callee(tx: FakeTx) -> list[tuple[int, int]]:
        stream = await tx.execute("SELECT id FROM `t`;\nSELECT id FROM `t` WHERE id > 9;")
        return [(part.index, len(part.rows)) async for part in stream]

    parts = await FakePool(database).retry_tx_async(callee)
    assert parts == [(0, 2), (0, 2), (0, 1), (1, 0)]


@pytest.mark.parametrize(
    ("statement", "refusal"),
    [
        ("UPDATE `t` SET id = 2 WHERE id = 1;", "Cannot update primary key column: id"),
        ("UPSERT INTO `t` (`id`) SELECT 1 AS id;", "Missing not null column in input: n"),
        ("UPSERT INTO `t` (`id`, `n`) SELECT 1 AS id, NULL AS n;", "NULL in a not null"),
    ],
)
def test_the_fake_ydb_refuses_what_a_server_refuses(statement: str, refusal: str) -> None:
    database = FakeYdb()
    database.run(
        "CREATE TABLE IF NOT EXISTS `t` (\n`id` Int64 NOT NULL,\n"
        "`n` Int64 NOT NULL,\nPRIMARY KEY (`id`)\n)",
        None,
    )
    with pytest.raises(ydb.issues.GenericError, match=refusal):
        database.run(statement, None)


async def test_ydb_refuses_a_server_whose_transactions_cannot_read_their_writes() -> None:
    store = YdbStateStore(
        cast(QuerySessionPool, FakePool(FakeYdb(immediate_effects=False))),
        directory="nemesis/fleet",
        retry_settings=FAST_RETRY,
    )
    with pytest.raises(StateError, match=r"read its own writes .*YDB 24\.1 or newer"):
        await store.open()
    await store.close()


# Opens a store, joins, lets the test's fault happen, then heartbeats on and says how it went.
_CHILD = textwrap.dedent(
    """
    import asyncio, shutil, sys
    from pathlib import Path
    from nemesis.errors import StateError
    from nemesis.fleet.port import MemberInfo
    from nemesis.fleet.sqlite import open_sqlite_state

    folder, fault = Path(sys.argv[1]), sys.argv[2]
    me = MemberInfo("host-a-1-aaaaaa", "host-a", 1, started_at=1000.0)

    async def main():
        store = await open_sqlite_state(folder / "state.db")
        for n in range(20):
            await store.heartbeat(me, now=1000.0 + n, lease_s=10)
        if fault == "cut":
            for path in folder.iterdir():  # the file and whatever lies beside it
                with open(path, "r+b") as f:
                    f.truncate(0)
        else:
            shutil.rmtree(folder)
        failed, last = 0, None
        for n in range(20, 60):
            try:
                await store.heartbeat(me, now=1000.0 + n, lease_s=10)
                await store.view()
            except StateError as exc:
                failed += 1
                last = exc
        print(f"failed {failed} of 40 rounds; the last error: {last}")
        await store.close()

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("fault", ["cut", "removed"])
def test_state_files_cut_or_removed_under_the_store_fail_its_calls_not_the_process(
    tmp_path: Path, fault: str
) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "fleet"), fault],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    # A memory-mapped WAL index (-shm) cut under the process would end it: SIGBUS (-7).
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr}"
    assert child.stdout.startswith("failed "), child.stdout
    assert "Traceback" not in child.stderr


async def test_the_state_file_has_no_memory_mapped_index(tmp_path: Path) -> None:
    store = await open_sqlite_state(tmp_path / "state.db")
    try:
        await store.heartbeat(A, now=1000.0, lease_s=10)
        assert not (tmp_path / "state.db-shm").exists()
        with closing(sqlite3.connect(tmp_path / "state.db")) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal"  # only WAL persists
    finally:
        await store.close()


async def test_a_state_file_another_process_holds_in_wal_stays_in_wal_until_opened_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "state.db"
    with closing(sqlite3.connect(path)) as earlier:  # a member of an earlier release
        assert earlier.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
        earlier.execute("CREATE TABLE kept (n INTEGER)")
        store = await open_sqlite_state(path)
        try:
            assert await store.heartbeat(A, now=1000.0, lease_s=10) >= 1
        finally:
            await store.close()
    assert "kept in journal mode WAL while another process has it open" in caplog.text
    store = await open_sqlite_state(path)  # alone on the file now
    try:
        [member] = (await store.view()).members
        assert member.member_id == A.member_id
    finally:
        await store.close()
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal"  # only WAL persists
    assert not (tmp_path / "state.db-shm").exists()


async def test_a_members_reports_replace_its_last_and_go_when_it_leaves(
    stores: list[StateStore],
) -> None:
    one, two = stores
    await one.heartbeat(A, now=1000.0, lease_s=10)
    await two.heartbeat(B, now=1000.0, lease_s=10)
    start = await one.generation()
    await one.publish_reports(
        A.member_id, {"orders": {"lag_messages": 3}, "refunds": {"state": "running"}}, now=1001.0
    )
    await two.publish_reports(B.member_id, {"orders": {"lag_messages": 4}}, now=1002.0)
    await one.publish_reports(A.member_id, {"orders": {"lag_messages": 5}}, now=1003.0)
    found = {(r.integration, r.member_id): (r.at, r.body) for r in await two.reports()}
    assert found == {
        ("orders", A.member_id): (1003.0, {"lag_messages": 5}),  # refunds no longer runs there
        ("orders", B.member_id): (1002.0, {"lag_messages": 4}),
    }
    assert await one.generation() == start  # reports are not news the members wait for
    await two.leave(B.member_id)
    assert [(r.integration, r.member_id) for r in await one.reports()] == [("orders", A.member_id)]
