"""The DLQ viewer's defences through httpx: sign-in, sessions, CSRF, team scopes, hostile input.

A browser runs the same payloads in tests/browser/ (no script may run);
here every refusal is checked at the HTTP level: the status, and that
nothing changed in the store.
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from dlq_viewer.auth import (
    FIRST_DELAY_S,
    FREE_FAILURES,
    MAX_DELAY_S,
    SESSION_COOKIE,
    MemorySessionRevocations,
    client_address,
)
from dlq_viewer.testing import (
    STANDARD_ACCESS,
    Access,
    Person,
    ViewerEnv,
    eventually,
    integration,
    letter,
    sign_in,
    viewer_env,
)
from nemesis.dlq import DeadLetterFilter, Status
from nemesis.testing.clock import FakeClock

ALICE, BOB, ROOT = STANDARD_ACCESS.people
BOT_A, BOT_ROOT = STANDARD_ACCESS.clients
INTEGRATIONS = {
    "orders-a": integration("orders-a", ["team-a"]),
    "orders-b": integration("orders-b", ["team-b"]),
}
CSP_MUST_HAVE = ("default-src 'none'", "script-src 'self'", "frame-ancestors 'none'")


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[ViewerEnv]:
    async with viewer_env(tmp_path, integrations=INTEGRATIONS) as opened:
        await opened.store.put(
            [letter("orders-a", n, error=f"422 order {n} for team a") for n in range(6)]
            + [letter("orders-b", n, error=f"422 order {n} for team b") for n in range(6)]
        )
        yield opened


def new_client(
    env: ViewerEnv, peer: str = "127.0.0.1", base_url: str = "http://viewer.test"
) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=env.app, client=(peer, 40000))
    return httpx.AsyncClient(transport=transport, base_url=base_url)


@pytest.fixture
async def client(env: ViewerEnv) -> AsyncIterator[httpx.AsyncClient]:
    async with new_client(env) as opened:
        yield opened


async def ids_of(env: ViewerEnv, integration_name: str) -> list[str]:
    where = DeadLetterFilter(integrations=frozenset({integration_name}))
    return list(await env.store.select_ids(where, 100))


async def statuses(env: ViewerEnv) -> dict[str, Status]:
    rows = (await env.store.query(DeadLetterFilter())).rows
    return {row.id: row.status for row in rows}


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


# --- sign-in and sessions --------------------------------------------------------------------


async def test_pages_without_a_session_redirect_to_sign_in(client: httpx.AsyncClient) -> None:
    for path in (
        "/",
        "/messages?q=x",
        "/groups",
        "/audit",
        "/messages/" + "a" * 32,
        "/jobs/" + "0" * 16,
        "/actions/confirm?action=requeue",
    ):
        answer = await client.get(path)
        assert answer.status_code == 303, path
        assert answer.headers["location"].startswith("/login"), path
    deep = await client.get("/messages?reason=http_4xx")
    assert deep.headers["location"] == "/login?next=%2Fmessages%3Freason%3Dhttp_4xx"


async def test_api_without_credentials_is_401(client: httpx.AsyncClient) -> None:
    for method, path in (
        ("GET", "/api/me"),
        ("GET", "/api/messages"),
        ("GET", "/api/audit"),
        ("POST", "/api/requeue"),
        ("POST", "/api/jobs"),
    ):
        answer = await client.request(method, path, json={"ids": ["a" * 32]})
        assert answer.status_code == 401, path
        assert answer.headers["www-authenticate"] == "Bearer"
        assert answer.json() == {"detail": "sign in, or send a bearer token"}


async def test_a_wrong_token_is_refused_even_beside_a_valid_session(
    client: httpx.AsyncClient,
) -> None:
    await sign_in(client, ALICE)
    assert (await client.get("/api/me")).status_code == 200
    assert (await client.get("/api/me", headers=bearer("nmsv_forged"))).status_code == 401
    assert (await client.get("/api/me", headers={"authorization": "Basic eDp5"})).status_code == 401


async def test_wrong_password_and_unknown_user_answer_alike(client: httpx.AsyncClient) -> None:
    answers = []
    for name, password in (("alice", "not-her-password"), ("mallory", "anything")):
        form = await client.get("/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
        assert token is not None
        answer = await client.post(
            "/login", data={"username": name, "password": password, "csrf_token": token.group(1)}
        )
        answers.append((answer.status_code, "Wrong user name or password." in answer.text))
        assert SESSION_COOKIE not in answer.cookies
    assert answers == [(401, True), (401, True)]


async def try_password(
    client: httpx.AsyncClient, name: str, password: str, *, forwarded_for: str | None = None
) -> httpx.Response:
    headers = {} if forwarded_for is None else {"x-forwarded-for": forwarded_for}
    form = await client.get("/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
    assert token is not None
    return await client.post(
        "/login",
        data={"username": name, "password": password, "csrf_token": token.group(1)},
        headers=headers,
    )


async def test_sign_in_is_throttled_after_repeated_failures(tmp_path: Path) -> None:
    clock = FakeClock(wall_start=time.time())
    async with (
        viewer_env(tmp_path, integrations=INTEGRATIONS, clock=clock) as env,
        new_client(env) as client,
    ):
        tries = FREE_FAILURES + 2
        codes = [(await try_password(client, "alice", "guess")).status_code for _ in range(tries)]
        assert codes == [401] * (FREE_FAILURES + 1) + [429]
        refused = await try_password(client, "alice", ALICE.password)
        assert refused.status_code == 429  # refused unchecked while the delay runs
        assert refused.headers["retry-after"] == str(int(FIRST_DELAY_S))


async def test_the_right_password_waits_a_bounded_delay_not_a_lockout(tmp_path: Path) -> None:
    clock = FakeClock(wall_start=time.time())
    async with (
        viewer_env(tmp_path, integrations=INTEGRATIONS, clock=clock) as env,
        new_client(env, peer="192.0.2.7") as guesser,
        new_client(env, peer="198.51.100.9") as elsewhere,
    ):
        for _ in range(12):  # guesses, waiting each delay out: every one is checked and fails
            answer = await try_password(guesser, "alice", "guess")
            if answer.status_code == 429:
                clock.advance(float(answer.headers["retry-after"]))
                answer = await try_password(guesser, "alice", "guess")
            assert answer.status_code == 401
        # Alice from her own address is not slowed by someone guessing elsewhere...
        assert (await try_password(elsewhere, "alice", ALICE.password)).status_code == 303
        # ...and from the guesser's address waits at most MAX_DELAY_S, never minutes.
        answer = await try_password(guesser, "alice", ALICE.password)
        assert answer.status_code == 429
        assert int(answer.headers["retry-after"]) <= MAX_DELAY_S
        clock.advance(MAX_DELAY_S)
        assert (await try_password(guesser, "alice", ALICE.password)).status_code == 303


async def test_forwarded_addresses_count_only_from_trusted_proxies(tmp_path: Path) -> None:
    clock = FakeClock(wall_start=time.time())
    async with (
        viewer_env(
            tmp_path,
            integrations=INTEGRATIONS,
            clock=clock,
            trusted_proxies=[ipaddress.ip_network("10.0.0.0/8")],
        ) as env,
        new_client(env, peer="10.1.2.3") as proxy,
        new_client(env, peer="203.0.113.5") as direct,
    ):
        for _ in range(FREE_FAILURES + 1):
            answer = await try_password(proxy, "alice", "guess", forwarded_for="192.0.2.1")
            assert answer.status_code == 401
        assert (
            await try_password(proxy, "alice", "guess", forwarded_for="192.0.2.1")
        ).status_code == 429
        # Another person behind the same proxy is another client: not slowed.
        answer = await try_password(proxy, "alice", ALICE.password, forwarded_for="192.0.2.2")
        assert answer.status_code == 303
        # A client that is not a proxy cannot pick its address: its header is ignored.
        for n in range(FREE_FAILURES + 1):
            answer = await try_password(direct, "bob", "guess", forwarded_for=f"192.0.2.{n + 10}")
            assert answer.status_code == 401
        answer = await try_password(direct, "bob", BOB.password, forwarded_for="192.0.2.99")
        assert answer.status_code == 429


def test_client_address_walks_past_trusted_hops_only() -> None:
    trusted = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("fd00::/8")]
    xff = {"x-forwarded-for": "198.51.100.1, 192.0.2.1, 10.0.0.2"}
    assert client_address("10.0.0.1", xff, trusted) == "192.0.2.1"
    assert client_address("203.0.113.1", xff, trusted) == "203.0.113.1"
    assert client_address("10.0.0.1", xff, []) == "10.0.0.1"
    forwarded = {"forwarded": 'for=192.0.2.60;proto=https, for="[2001:db8::1]:4711"'}
    assert client_address("fd00::1", forwarded, trusted) == "2001:db8::1"
    assert client_address("10.0.0.1", {"forwarded": "for=unknown"}, trusted) == "10.0.0.1"
    assert client_address("10.0.0.1", {}, trusted) == "10.0.0.1"


async def test_sign_in_form_needs_its_own_token(client: httpx.AsyncClient) -> None:
    await client.get("/login")
    answer = await client.post(
        "/login", data={"username": "alice", "password": "alice-password", "csrf_token": "forged"}
    )
    assert answer.status_code == 403
    assert SESSION_COOKIE not in answer.cookies


async def test_session_cookie_is_httponly_and_strict(client: httpx.AsyncClient) -> None:
    form = await client.get("/login")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
    assert token is not None
    answer = await client.post(
        "/login",
        data={"username": "alice", "password": "alice-password", "csrf_token": token.group(1)},
    )
    cookie = next(
        v for k, v in answer.headers.multi_items() if k == "set-cookie" and "session" in v
    )
    assert "HttpOnly" in cookie
    assert "SameSite=strict" in cookie
    assert "Path=/" in cookie
    assert "Secure" not in cookie  # this test app serves plain HTTP (secure_cookies: false)


async def test_secure_cookies_by_default(tmp_path: Path) -> None:
    person = Person("carol", "carol-password", ("team-a",))
    auth = Access([person]).config().model_copy(update={"secure_cookies": True})
    # Secure cookies come back over HTTPS only, as from a browser.
    async with (
        viewer_env(tmp_path, integrations=INTEGRATIONS, auth=auth) as env,
        new_client(env, base_url="https://viewer.test") as client,
    ):
        form = await client.get("/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
        assert token is not None
        answer = await client.post(
            "/login",
            data={
                "username": "carol",
                "password": "carol-password",
                "csrf_token": token.group(1),
            },
        )
    cookie = next(
        v for k, v in answer.headers.multi_items() if k == "set-cookie" and "session" in v
    )
    assert "Secure" in cookie
    assert answer.headers["strict-transport-security"].startswith("max-age=")


async def test_forged_and_tampered_sessions_are_refused(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await sign_in(client, ALICE)
    cookie = client.cookies[SESSION_COOKIE]
    data, signature = cookie.split(".")
    payload = json.loads(base64.urlsafe_b64decode(data + "=" * (-len(data) % 4)))
    payload["u"] = "root"  # become the admin...
    forged = base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode()
    for value in (f"{forged}.{signature}", "garbage", "a.b", "." * 3, "x" * 5000):
        async with new_client(env) as stranger:
            stranger.cookies.set(SESSION_COOKIE, value)
            assert (await stranger.get("/")).status_code == 303
            assert (await stranger.get("/api/me")).status_code == 401


async def test_a_password_change_ends_existing_sessions(tmp_path: Path) -> None:
    before = Access([Person("dave", "old-password", ("team-a",))])
    async with (
        viewer_env(tmp_path / "1", integrations=INTEGRATIONS, access=before) as env,
        new_client(env) as client,
    ):
        await sign_in(client, before.people[0])
        cookie = client.cookies[SESSION_COOKIE]
        assert (await client.get("/")).status_code == 200
    after = Access([Person("dave", "new-password", ("team-a",))])
    async with (
        viewer_env(tmp_path / "2", integrations=INTEGRATIONS, access=after) as env,
        new_client(env) as client,
    ):
        client.cookies.set(SESSION_COOKIE, cookie)
        assert (await client.get("/")).status_code == 303


async def test_sessions_expire(tmp_path: Path) -> None:
    clock = FakeClock(wall_start=time.time())
    person = Person("erin", "erin-password", ("team-a",))
    short = Access([person], extra={"session_ttl_s": "1h"})
    async with (
        viewer_env(tmp_path, integrations=INTEGRATIONS, access=short, clock=clock) as env,
        new_client(env) as client,
    ):
        await sign_in(client, person)
        clock.advance(3599)
        assert (await client.get("/")).status_code == 200
        clock.advance(2)
        assert (await client.get("/")).status_code == 303


async def test_sign_in_never_redirects_off_site(client: httpx.AsyncClient) -> None:
    for target in ("//evil.example/", "https://evil.example/", "/\\evil.example", "javascript:x"):
        form = await client.get("/login", params={"next": target})
        token = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
        assert token is not None
        answer = await client.post(
            "/login",
            data={
                "username": "alice",
                "password": "alice-password",
                "csrf_token": token.group(1),
                "next": target,
            },
        )
        assert answer.status_code == 303, target
        assert answer.headers["location"] == "/", target
        client.cookies.clear()


async def test_sign_out_needs_the_csrf_token_and_ends_the_session(
    client: httpx.AsyncClient,
) -> None:
    csrf = await sign_in(client, ALICE)
    assert (await client.post("/logout", data={})).status_code == 403
    answer = await client.post("/logout", data={"csrf_token": csrf})
    assert answer.status_code == 303
    assert SESSION_COOKIE not in client.cookies
    assert (await client.get("/")).status_code == 303


async def test_a_copy_of_a_signed_out_cookie_is_refused(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    csrf = await sign_in(client, ALICE)
    copied = client.cookies[SESSION_COOKIE]
    a_id = (await ids_of(env, "orders-a"))[0]
    assert (await client.post("/logout", data={"csrf_token": csrf})).status_code == 303
    async with new_client(env) as thief:
        thief.cookies.set(SESSION_COOKIE, copied)
        assert (await thief.get("/api/me")).status_code == 401
        assert (await thief.get("/")).status_code == 303
        answer = await thief.post(
            "/api/requeue", json={"ids": [a_id]}, headers={"x-csrf-token": csrf}
        )
        assert answer.status_code == 401
    assert (await statuses(env))[a_id] is Status.DEAD
    # Signing in again starts a new session, which works.
    await sign_in(client, ALICE)
    assert (await client.get("/api/me")).status_code == 200


async def test_revocations_are_forgotten_once_the_cookie_would_expire() -> None:
    clock = FakeClock(wall_start=1_000_000.0)
    revoked = MemorySessionRevocations(clock, max_entries=2)
    await revoked.revoke("a", 1_000_010.0)
    await revoked.revoke("b", 1_000_020.0)
    assert await revoked.is_revoked("a")
    clock.advance(10)
    assert not await revoked.is_revoked("a")  # its cookie is expired anyway
    assert await revoked.is_revoked("b")
    await revoked.revoke("c", 1_000_030.0)
    await revoked.revoke("d", 1_000_040.0)  # full: the soonest to expire goes first
    assert len(revoked) == 2
    assert not await revoked.is_revoked("b")
    assert await revoked.is_revoked("c")
    assert await revoked.is_revoked("d")


# --- CSRF -------------------------------------------------------------------------------------


async def test_state_changes_without_the_csrf_token_are_refused(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    csrf = await sign_in(client, ALICE)
    (target, *_) = await ids_of(env, "orders-a")
    before = await statuses(env)
    attempts = [
        client.post(f"/messages/{target}/requeue", data={}),
        client.post(f"/messages/{target}/discard", data={"csrf_token": "forged"}),
        client.post("/actions/selected", data={"action": "discard", "ids": [target]}),
        client.post("/actions/bulk", data={"action": "discard", "integration": "orders-a"}),
        client.post("/api/requeue", json={"ids": [target]}),
        client.post("/api/discard", json={"ids": [target]}, headers={"x-csrf-token": "forged"}),
        client.post("/api/jobs", json={"action": "discard"}),
        # The right token, sent from another site: browsers say so and cannot be made to lie.
        client.post(
            f"/messages/{target}/discard",
            data={"csrf_token": csrf},
            headers={"sec-fetch-site": "cross-site"},
        ),
    ]
    for attempt in attempts:
        answer = await attempt
        assert answer.status_code == 403
    assert await statuses(env) == before
    assert (await env.store.actions()).rows == []
    # With the token it works, from a form and from a script.
    ok = await client.post(f"/messages/{target}/discard", data={"csrf_token": csrf})
    assert ok.status_code == 303
    (other, *_) = [i for i in await ids_of(env, "orders-a") if i != target]
    api = await client.post("/api/requeue", json={"ids": [other]}, headers={"x-csrf-token": csrf})
    assert api.json()["count"] == 1


async def test_one_users_csrf_token_does_not_work_for_another(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    alice_csrf = await sign_in(client, ALICE)
    async with new_client(env) as other:
        await sign_in(other, ROOT)
        (target, *_) = await ids_of(env, "orders-a")
        answer = await other.post(f"/messages/{target}/discard", data={"csrf_token": alice_csrf})
    assert answer.status_code == 403


async def test_api_tokens_need_no_csrf_token(env: ViewerEnv, client: httpx.AsyncClient) -> None:
    (target, *_) = await ids_of(env, "orders-a")
    answer = await client.post("/api/discard", json={"ids": [target]}, headers=bearer(BOT_A.token))
    assert answer.json() == {"action": "discard", "count": 1, "by_integration": {"orders-a": 1}}


# --- team scopes ------------------------------------------------------------------------------


async def test_a_team_sees_only_its_integrations_in_the_ui(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await sign_in(client, ALICE)
    foreign = await ids_of(env, "orders-b")
    listed = (await client.get("/messages?status=any")).text
    assert "team a" in listed
    assert "team b" not in listed
    assert "orders-b" not in listed
    asked = (await client.get("/messages?integration=orders-b")).text
    assert "team b" not in asked
    assert 'id="match-count">0<' in asked
    assert "for team b" not in (await client.get("/messages?q=team+b")).text
    overview = (await client.get("/")).text
    assert "orders-b" not in overview
    assert "orders-b" not in (await client.get("/groups")).text
    for path in (f"/messages/{foreign[0]}", f"/messages/{foreign[0]}/payload"):
        answer = await client.get(path)
        assert answer.status_code == 404
        assert "team b" not in answer.text
    confirm = (await client.get("/actions/confirm?action=requeue&integration=orders-b")).text
    assert "Requeue 0 messages?" in confirm


async def test_a_team_cannot_act_on_another_teams_messages_in_the_ui(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    csrf = await sign_in(client, ALICE)
    foreign = await ids_of(env, "orders-b")
    before = await statuses(env)
    for verb in ("requeue", "discard"):
        answer = await client.post(f"/messages/{foreign[0]}/{verb}", data={"csrf_token": csrf})
        assert answer.status_code == 404
    selected = await client.post(
        "/actions/selected",
        data={"csrf_token": csrf, "action": "requeue", "ids": foreign, "return_to": "/messages"},
    )
    assert selected.status_code == 303
    bulk = await client.post(
        "/actions/bulk",
        data={"csrf_token": csrf, "action": "discard", "integration": "orders-b", "expected": "6"},
    )
    job_path = bulk.headers["location"]
    for _ in range(200):
        job = (await client.get("/api" + job_path)).json()
        if job["finished"]:
            break
        await _pause()
    assert job["done"] == 0
    assert await statuses(env) == before


async def _pause() -> None:
    await asyncio.sleep(0.02)


async def test_a_team_cannot_see_or_act_on_another_teams_messages_by_api(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    headers = bearer(BOT_A.token)
    foreign = await ids_of(env, "orders-b")
    before = await statuses(env)
    rows = (await client.get("/api/messages?integration=orders-b", headers=headers)).json()
    assert rows == {"rows": [], "next_cursor": None}
    everything = (await client.get("/api/messages?status=dead", headers=headers)).json()
    assert {row["integration"] for row in everything["rows"]} == {"orders-a"}
    assert (await client.get(f"/api/messages/{foreign[0]}", headers=headers)).status_code == 404
    assert (
        await client.get(f"/api/messages/{foreign[0]}/payload", headers=headers)
    ).status_code == 404
    assert (await client.get("/api/groups?integration=orders-b", headers=headers)).json() == []
    stats = (await client.get("/api/stats", headers=headers)).json()
    assert [item["integration"] for item in stats["by_integration"]] == ["orders-a"]
    for path in ("/api/requeue", "/api/discard"):
        moved = await client.post(path, json={"ids": foreign}, headers=headers)
        assert moved.json()["count"] == 0
    job = await client.post(
        "/api/jobs",
        json={"action": "discard", "filter": {"integrations": ["orders-b"]}},
        headers=headers,
    )
    assert job.json()["expected"] == 0
    assert await statuses(env) == before
    # The admin's token sees both.
    admin = (await client.get("/api/messages?status=dead", headers=bearer(BOT_ROOT.token))).json()
    assert {row["integration"] for row in admin["rows"]} == {"orders-a", "orders-b"}


async def test_the_audit_log_shows_a_team_only_its_entries(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    b_ids = await ids_of(env, "orders-b")
    await client.post("/api/discard", json={"ids": b_ids[:2]}, headers=bearer(BOT_ROOT.token))
    await sign_in(client, ALICE)
    assert "orders-b" not in (await client.get("/audit")).text
    assert (await client.get("/api/audit")).json()["rows"] == []
    async with new_client(env) as bob:
        await sign_in(bob, BOB)
        assert "orders-b" in (await bob.get("/audit")).text


async def test_an_admins_bulk_job_shows_a_team_none_of_the_other_teams_details(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    spec = {
        "action": "discard",
        "filter": {"integrations": ["orders-a", "orders-b"], "text": "for team"},
    }
    started = await client.post("/api/jobs", json=spec, headers=bearer(BOT_ROOT.token))
    assert started.status_code == 202
    job = started.json()["id"]

    async def finished() -> bool:
        answer = await client.get(f"/api/jobs/{job}", headers=bearer(BOT_ROOT.token))
        return bool(answer.json()["state"] == "done")

    await eventually(finished, what="the bulk job")
    admin_view = (await client.get("/api/audit", headers=bearer(BOT_ROOT.token))).json()["rows"]
    assert "orders-b" in admin_view[0]["description"]  # the admin sees everything
    await sign_in(client, ALICE)
    rows = (await client.get("/api/audit")).json()["rows"]
    assert rows
    for row in rows:
        assert row["integrations"] == ["orders-a"]
        assert "orders-b" not in row["description"]
        assert "for team" not in row["description"]
    page = (await client.get("/audit")).text
    assert "orders-a" in page
    assert "orders-b" not in page
    assert "for team" not in page


async def test_an_admins_action_over_two_teams_shows_each_team_its_own_count(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    a_ids, b_ids = await ids_of(env, "orders-a"), await ids_of(env, "orders-b")
    chosen = a_ids[:2] + b_ids[:5]
    moved = await client.post("/api/discard", json={"ids": chosen}, headers=bearer(BOT_ROOT.token))
    assert moved.json()["count"] == 7
    admin_rows = (await client.get("/api/audit", headers=bearer(BOT_ROOT.token))).json()["rows"]
    assert [row["count"] for row in admin_rows] == [7]
    await sign_in(client, ALICE)
    assert [row["count"] for row in (await client.get("/api/audit")).json()["rows"]] == [2]
    count_cells = re.findall(r'<td class="num">([^<]*)</td>', (await client.get("/audit")).text)
    assert count_cells == ["2"]
    async with new_client(env) as bob:
        await sign_in(bob, BOB)
        assert [row["count"] for row in (await bob.get("/api/audit")).json()["rows"]] == [5]


async def test_jobs_are_visible_to_their_starter_and_admins_only(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    started = await client.post(
        "/api/jobs", json={"action": "requeue"}, headers=bearer(BOT_A.token)
    )
    job_id = started.json()["id"]
    assert (await client.get(f"/api/jobs/{job_id}", headers=bearer(BOT_A.token))).status_code == 200
    assert (
        await client.get(f"/api/jobs/{job_id}", headers=bearer(BOT_ROOT.token))
    ).status_code == 200
    await sign_in(client, BOB)
    assert (await client.get(f"/jobs/{job_id}")).status_code == 404
    assert (await client.get(f"/api/jobs/{job_id}")).status_code == 404
    assert (await client.get("/api/jobs")).json() == []


# --- trusted SSO header -------------------------------------------------------------------------


async def test_a_trusted_proxy_signs_people_in_with_a_header(tmp_path: Path) -> None:
    access = Access(
        [Person("frank", "frank-password", ("team-b",))],
        extra={
            "trusted_header": {"trusted_proxies": ["10.0.0.0/8"]},
            "admin_teams": ["platform"],
        },
    )
    async with viewer_env(tmp_path, integrations=INTEGRATIONS, access=access) as env:
        await env.store.put([letter("orders-a", 1), letter("orders-b", 1)])
        sso = {"x-forwarded-user": "grace", "x-forwarded-groups": "team-a, other"}
        async with new_client(env, peer="10.1.2.3") as proxied:
            me = (await proxied.get("/api/me", headers=sso)).json()
            assert (me["name"], me["method"], me["integrations"]) == ("grace", "sso", ["orders-a"])
            platform = {"x-forwarded-user": "heidi", "x-forwarded-groups": "platform"}
            assert (await proxied.get("/api/me", headers=platform)).json()["admin"] is True
            # A configured user of that name adds their teams.
            frank = {"x-forwarded-user": "frank"}
            assert (await proxied.get("/api/me", headers=frank)).json()["integrations"] == [
                "orders-b"
            ]
            page = await proxied.get("/messages", headers=sso)
            assert page.status_code == 200
            token = re.search(r'<meta name="csrf-token" content="([^"]+)">', page.text)
            assert token is not None
            (row_id,) = re.findall(r'name="ids" value="([0-9a-f]{32})"', page.text)
            # Headers arrive with every request: state changes still need the CSRF token.
            refused = await proxied.post(f"/messages/{row_id}/discard", headers=sso, data={})
            assert refused.status_code == 403
            done = await proxied.post(
                f"/messages/{row_id}/discard", headers=sso, data={"csrf_token": token.group(1)}
            )
            assert done.status_code == 303
        async with new_client(env, peer="192.168.1.9") as direct:
            assert (await direct.get("/api/me", headers=sso)).status_code == 401
            assert (await direct.get("/", headers=sso)).status_code == 303


# --- headers ---------------------------------------------------------------------------------


async def test_every_answer_carries_strict_security_headers(client: httpx.AsyncClient) -> None:
    await sign_in(client, ALICE)
    for path in (
        "/",
        "/messages",
        "/login",
        "/api/me",
        "/api/openapi.json",
        "/nope",
        "/static/viewer.js",
    ):
        headers = (await client.get(path)).headers
        policy = headers["content-security-policy"]
        assert all(part in policy for part in CSP_MUST_HAVE), path
        assert "unsafe-inline" not in policy
        assert "unsafe-eval" not in policy
        assert headers["x-content-type-options"] == "nosniff"
        assert headers["x-frame-options"] == "DENY"
        assert headers["referrer-policy"] == "no-referrer"
        if not path.startswith("/static/"):
            assert headers["cache-control"] == "no-store"


async def test_pages_contain_no_inline_script_or_style(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await sign_in(client, ROOT)
    (row_id, *_) = await ids_of(env, "orders-a")
    for path in ("/", "/messages", "/groups", "/audit", f"/messages/{row_id}", "/login"):
        text = (await client.get(path)).text
        assert re.findall(r"<script(?![^>]*\bsrc=)[^>]*>", text) == [], path
        assert " style=" not in text, path
        assert "<style" not in text, path
        assert not re.search(r"\son[a-z]+=", text), path


async def test_oversized_bodies_are_refused_before_parsing(client: httpx.AsyncClient) -> None:
    csrf = await sign_in(client, ALICE)
    answer = await client.post(
        "/api/requeue", content=b"x" * (2 * 1024 * 1024), headers={"x-csrf-token": csrf}
    )
    assert answer.status_code == 413


# --- hostile input ------------------------------------------------------------------------------

BAD_LIST_QUERIES = [
    "q=' OR 1=1 --",
    "q=%25",
    "q=z_z",
    "q=%5C",
    "q=" + "x" * 201,
    "q=" + "x" * 20_000,
    "q=%00",
    "q=%F0%9F%92%A9%E2%80%AE",
    "integration=orders-a'; DROP TABLE dlq_letters; --",
    "integration=" + "a" * 300,
    "integration=ORDERS-A",
    "reason=nope",
    "reason=http_4xx' OR '1'='1",
    "status=all",
    "http_status=abc",
    "http_status=99",
    "http_status=1e3",
    "http_status=-1",
    "group=zzzz",
    "group=0123456789abcdef' --",
    "range=1y",
    "range=custom&since=yesterday",
    "range=custom&since=2026-13-45T99:99",
    "range=custom&since=99999999999999999999",
    "range=custom&since=nan",
    "range=custom&since=2026-01-02&until=2026-01-01",
    "cursor=forged",
    "cursor=" + base64.urlsafe_b64encode(b'["dlq-audit",1]').decode(),
    "cursor=" + base64.urlsafe_b64encode(b'["dlq",1e308,"x"]').decode(),
    "cursor=" + base64.urlsafe_b64encode(b'["dlq",99999999999999999999999,1]').decode(),
    "cursor=" + "A" * 5000,
    "limit=0",
    "limit=100000",
    "limit=-5",
]


async def test_hostile_list_input_is_a_4xx_or_an_empty_list(client: httpx.AsyncClient) -> None:
    await sign_in(client, ROOT)
    for query in BAD_LIST_QUERIES:
        page = await client.get(f"/messages?{query}")
        api = await client.get(f"/api/messages?{query}")
        for answer in (page, api):
            assert answer.status_code < 500, (query, answer.text[:300])
            assert "Traceback" not in answer.text
            if answer.status_code == 200 and query.startswith(("q=", "integration=")):
                assert "order 1 for team" not in answer.text, query  # nothing matched the trick
        if page.status_code == 400:
            assert 'id="filter-error"' in page.text, query  # said next to the form
        for groups in (f"/groups?{query}", f"/api/groups?{query}", f"/api/stats?{query}"):
            assert (await client.get(groups)).status_code < 500, (groups, query)


HOSTILE_PATHS = [
    "/messages/" + "0" * 32,
    "/messages/not-an-id",
    "/messages/" + "A" * 32,
    "/messages/..%2f..%2fetc%2fpasswd",
    "/messages/" + "a" * 5000,
    "/jobs/unknown",
    "/jobs/" + "f" * 16,
    "/api/messages/" + "0" * 32,
    "/api/messages/%27%20OR%201%3D1",
    "/api/jobs/" + "f" * 16,
    "/api/groups?limit=0",
    "/api/stats?buckets=100000",
    "/api/stats?bucket_s=0",
    "/api/audit?cursor=forged",
    "/api/audit?cursor=" + base64.urlsafe_b64encode(b'["dlq",1,2]').decode(),
    "/api/messages?since=2026-01-02&until=2026-01-01",
    "/?range=forever",
    "/actions/confirm?action=explode",
    "/actions/confirm?action=requeue&http_status=abc",
    "/audit?cursor=forged",
]


async def test_unknown_and_malformed_ids_and_params_are_4xx(client: httpx.AsyncClient) -> None:
    await sign_in(client, ROOT)
    for path in HOSTILE_PATHS:
        answer = await client.get(path)
        assert 400 <= answer.status_code < 500, (path, answer.status_code, answer.text[:300])
        assert "Traceback" not in answer.text


async def test_malformed_action_bodies_are_422(client: httpx.AsyncClient) -> None:
    bodies: tuple[object, ...] = (
        {"ids": []},
        {"ids": ["x"]},
        {"ids": ["' OR 1=1 --"]},
        {"ids": ["a" * 32] * 1001},
        {"ids": "a" * 32},
        {"ids": ["a" * 32], "extra": 1},
        [],
        None,
    )
    for body in bodies:
        answer = await client.post("/api/requeue", json=body, headers=bearer(BOT_ROOT.token))
        assert answer.status_code == 422, body
        assert "' OR 1=1" not in answer.text  # the input is not echoed back


async def test_malformed_bulk_filters_are_4xx(env: ViewerEnv, client: httpx.AsyncClient) -> None:
    before = await statuses(env)
    for spec in (
        {"action": "explode"},
        {"action": "requeue", "filter": {"text": "x" * 201}},
        {"action": "requeue", "filter": {"text": "a\u0000"}},
        {"action": "requeue", "filter": {"group": "nope"}},
        {"action": "requeue", "filter": {"http_status": 1000}},
        {"action": "requeue", "filter": {"integrations": ["Bad Name"]}},
        {"action": "requeue", "filter": {"since": 10.0, "until": 5.0}},
        {"action": "requeue", "filter": {"since": "inf"}},
        {"action": "requeue", "filter": {"unknown": 1}},
    ):
        answer = await client.post("/api/jobs", json=spec, headers=bearer(BOT_ROOT.token))
        assert answer.status_code in (400, 422), (spec, answer.text[:300])
    assert await statuses(env) == before


async def test_times_beyond_any_date_are_400_naming_the_field_on_every_path(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    before = await statuses(env)
    auth = bearer(BOT_ROOT.token)
    for field in ("since", "until"):
        for value in (-1e20, 1e20, 1e300, -1.0):
            job = {"action": "requeue", "filter": {field: value}}
            answer = await client.post("/api/jobs", json=job, headers=auth)
            assert answer.status_code == 400, (job, answer.text[:300])
            assert answer.json()["detail"].startswith(f"filter.{field}:"), answer.text
            for path in ("/api/messages", "/api/messages/count", "/api/groups"):
                listed = await client.get(path, params={field: repr(value)}, headers=auth)
                assert listed.status_code == 400, (path, field, value, listed.text[:300])
                assert listed.json()["detail"].startswith(f"{field}:"), listed.text
        raw = b'{"action": "requeue", "filter": {"%s": 1e400}}' % field.encode()
        answer = await client.post(
            "/api/jobs", content=raw, headers={**auth, "content-type": "application/json"}
        )
        assert answer.status_code in (400, 422), answer.text[:300]
    assert await statuses(env) == before


async def test_hostile_selection_forms_are_4xx(env: ViewerEnv, client: httpx.AsyncClient) -> None:
    csrf = await sign_in(client, ROOT)
    for data in (
        {"action": "requeue"},
        {"action": "explode", "ids": ["a" * 32]},
        {"action": "requeue", "ids": ["' OR 1=1 --"]},
        {"action": "requeue", "ids": ["a" * 32] * 501},
    ):
        answer = await client.post("/actions/selected", data={"csrf_token": csrf, **data})
        assert 400 <= answer.status_code < 500, data
    answer = await client.post(
        "/actions/bulk", data={"csrf_token": csrf, "action": "discard", "q": "x" * 500}
    )
    assert answer.status_code == 400
    assert await env.store.count(DeadLetterFilter(status=Status.DISCARDED)) == 0
