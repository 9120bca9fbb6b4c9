"""Signing in to the viewer: who can hold a user back, what a replica counts, where a form works.

Through httpx against the app, on real state stores: the throttle's counts
and spent sign-in forms are shared by two viewers over one SQLite file (and
one PostgreSQL schema), a browser the user signed in on passes someone
guessing from the same address, a sign-in form works once and only from
the viewer's own origin, and a sign-out made while the store refused writes
reaches the other replicas once it takes them again.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from dlq_viewer.auth import (
    DEVICE_COOKIE,
    FREE_FAILURES,
    LOGIN_COOKIE,
    SESSION_COOKIE,
    STORE_RETRY_S,
    SharedLoginStore,
    SharedSessionRevocations,
)
from dlq_viewer.testing import (
    STANDARD_ACCESS,
    ViewerEnv,
    eventually,
    integration,
    sign_in,
    viewer_env,
)
from nemesis.backends.postgres import PostgresStateConfig
from nemesis.fleet.postgres import open_postgres_state
from nemesis.fleet.sqlite import SqliteStateStore, open_sqlite_state
from nemesis.testing.clock import FakeClock
from tests.postgres_server import PostgresServer

ALICE, BOB, _ = STANDARD_ACCESS.people
INTEGRATIONS = {"orders-a": integration("orders-a", ["team-a"])}
_TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


def browser(env: ViewerEnv, peer: str = "192.0.2.7") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=env.app, client=(peer, 40000))
    return httpx.AsyncClient(transport=transport, base_url="http://viewer.test")


async def form_of(client: httpx.AsyncClient) -> str:
    found = _TOKEN.search((await client.get("/login")).text)
    assert found is not None
    return found.group(1)


async def post_login(
    client: httpx.AsyncClient,
    name: str,
    password: str,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    token = await form_of(client) if token is None else token
    return await client.post(
        "/login",
        data={"username": name, "password": password, "csrf_token": token},
        headers=headers or {},
    )


# --- a browser the user signed in on is not held back by a guesser at the same address -------


async def test_a_known_browser_signs_in_while_someone_at_its_address_guesses(
    tmp_path: Path,
) -> None:
    clock = FakeClock(wall_start=time.time())
    async with (
        viewer_env(tmp_path, integrations=INTEGRATIONS, clock=clock) as env,
        browser(env) as alice,
        browser(env) as guesser,  # the same address: a NAT, a VPN, an office proxy
    ):
        await sign_in(alice, ALICE)
        assert DEVICE_COOKIE in alice.cookies
        alice.cookies.delete(SESSION_COOKIE)  # signed out, or the session expired
        # The guesser sends one wrong password each time the wait ends, forever.
        for _ in range(FREE_FAILURES + 6):
            answer = await post_login(guesser, ALICE.name, "guess")
            if answer.status_code == 429:
                clock.advance(float(answer.headers["retry-after"]))
                answer = await post_login(guesser, ALICE.name, "guess")
            assert answer.status_code == 401
        assert (await post_login(guesser, ALICE.name, ALICE.password)).status_code == 429
        # Alice's browser counts its own failures only: she is not held back.
        assert (await post_login(alice, ALICE.name, ALICE.password)).status_code == 303
        # Her device cookie says nothing for another user name.
        alice.cookies.delete(SESSION_COOKIE)
        for _ in range(FREE_FAILURES + 1):
            assert (await post_login(guesser, BOB.name, "guess")).status_code == 401
        assert (await post_login(alice, BOB.name, BOB.password)).status_code == 429


async def test_a_known_browser_is_slowed_by_its_own_failures(tmp_path: Path) -> None:
    clock = FakeClock(wall_start=time.time())
    async with (
        viewer_env(tmp_path, integrations=INTEGRATIONS, clock=clock) as env,
        browser(env) as alice,
    ):
        await sign_in(alice, ALICE)
        alice.cookies.delete(SESSION_COOKIE)
        codes = [
            (await post_login(alice, ALICE.name, "typo")).status_code
            for _ in range(FREE_FAILURES + 2)
        ]
        assert codes == [401] * (FREE_FAILURES + 1) + [429]


# --- the sign-in form: once, and from the viewer's own origin only ---------------------------


async def test_sign_in_from_another_origin_is_refused(tmp_path: Path) -> None:
    async with (
        viewer_env(tmp_path, integrations=INTEGRATIONS) as env,
        browser(env) as client,
    ):
        refused = (
            {"sec-fetch-site": "same-site"},  # a page on another port of this host
            {"sec-fetch-site": "cross-site"},
            {"origin": "http://viewer.test:8081"},
            {"origin": "https://viewer.test"},
            {"origin": "http://viewer.test:8081", "sec-fetch-site": "same-site"},
        )
        for headers in refused:
            answer = await post_login(client, ALICE.name, ALICE.password, headers=headers)
            assert answer.status_code == 403, headers
            assert SESSION_COOKIE not in answer.cookies
        own = {"origin": "http://viewer.test", "sec-fetch-site": "same-origin"}
        signed_in = await post_login(client, ALICE.name, ALICE.password, headers=own)
        assert signed_in.status_code == 303


async def test_a_sign_in_form_works_once(tmp_path: Path) -> None:
    async with (
        viewer_env(tmp_path, integrations=INTEGRATIONS) as env,
        browser(env) as client,
    ):
        token = await form_of(client)
        nonce = client.cookies[LOGIN_COOKIE]
        assert (await post_login(client, ALICE.name, "guess", token=token)).status_code == 401
        # The attacker's own pair, planted in a victim's browser, does not sign in a second time.
        client.cookies.set(LOGIN_COOKIE, nonce, domain="viewer.test", path="/login")
        again = await post_login(client, BOB.name, BOB.password, token=token)
        assert again.status_code == 403
        assert SESSION_COOKIE not in again.cookies


# --- two replicas count one throttle and spend one set of forms -------------------------------

StateOpener = Callable[[], Awaitable[object]]


@pytest.fixture(params=["sqlite", "postgres"])
async def open_replica_state(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[Callable[[], Awaitable[SqliteStateStore | object]]]:
    """Opens the state store as one more replica would: one SQLite file, or one PG schema."""
    opened: list[object] = []
    if request.param == "sqlite":

        async def opener() -> object:
            store = await open_sqlite_state(tmp_path / "state.db")
            opened.append(store)
            return store

    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        config = PostgresStateConfig(dsn=server.dsn(), schema_name=f"s_{uuid.uuid4().hex[:12]}")

        async def opener() -> object:
            store = await open_postgres_state(config)
            opened.append(store)
            return store

    try:
        yield opener
    finally:
        for store in opened:
            await store.close()  # type: ignore[attr-defined]


async def test_two_replicas_share_the_throttle_and_the_spent_forms(
    tmp_path: Path, open_replica_state: Callable[[], Awaitable[object]]
) -> None:
    clock = FakeClock(wall_start=time.time())
    envs = []
    for name in ("a", "b"):
        state = await open_replica_state()
        envs.append(
            viewer_env(
                tmp_path / name,
                integrations=INTEGRATIONS,
                clock=clock,
                login_store=SharedLoginStore(state, clock),  # type: ignore[arg-type]
                session_revocations=SharedSessionRevocations(state, clock),  # type: ignore[arg-type]
            )
        )
    async with envs[0] as one, envs[1] as two, browser(one) as on_one, browser(two) as on_two:
        # Alternating, as a load balancer would send them.
        codes = [
            (await post_login((on_one, on_two)[n % 2], BOB.name, "guess")).status_code
            for n in range(FREE_FAILURES + 2)
        ]
        # One count for the fleet: the free guesses are granted once, not once per replica.
        assert codes == [401] * (FREE_FAILURES + 1) + [429]
        # A form spent on one replica is refused on the other.
        token = await form_of(on_one)
        assert (await post_login(on_one, ALICE.name, "guess", token=token)).status_code == 401
        on_two.cookies.set(LOGIN_COOKIE, on_one.cookies[LOGIN_COOKIE], domain="viewer.test")
        assert (await post_login(on_two, ALICE.name, ALICE.password, token=token)).status_code == (
            403
        )


# --- a sign-out the store did not take is retried until it does ---------------------------------


async def test_a_sign_out_made_while_the_store_refused_writes_reaches_the_others(
    tmp_path: Path,
) -> None:
    clock = FakeClock(wall_start=time.time())
    path = tmp_path / "state.db"
    await (await open_sqlite_state(path)).close()  # the tables exist
    # This replica gives up on a locked file quickly, so the outage shows soon.
    store_here = SqliteStateStore(path, timeout_s=0.3)
    await store_here.open()
    store_there = await open_sqlite_state(path)
    here = SharedSessionRevocations(store_here, clock)
    there = SharedSessionRevocations(store_there, clock)
    far = clock.time() + 3600
    lock = sqlite3.connect(path, isolation_level=None)
    try:
        lock.execute("BEGIN EXCLUSIVE")  # another process holds the file: no write gets in
        await here.revoke("signed-out-during-the-outage", far)
        assert await here.is_revoked("signed-out-during-the-outage")

        # The write the caller gave up on waits out its 0.3 s for the lock, and fails.
        await asyncio.sleep(1.0)
        assert not await there.is_revoked("signed-out-during-the-outage")
        lock.execute("ROLLBACK")
        # Nothing more happens on this replica (no request): its retry alone must share it.
        clock.advance(STORE_RETRY_S)
        await eventually(
            lambda: there.is_revoked("signed-out-during-the-outage"),
            timeout_s=30,
            what="the other replica refusing the session",
        )
        assert here.statistics().unshared == 0
        await here.aclose()
    finally:
        lock.close()
        await store_here.close()
        await store_there.close()
