"""The team console over real parts: the viewer, a SQLite state store, the DLQ store.

Who sees and changes what (every identity kind against every console route,
counting bypasses), CSRF on every change, the audit entries, bad input as a
4xx naming the field, and hostile text from the store rendered inert.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dlq_viewer.testing import (
    STANDARD_ACCESS,
    ViewerEnv,
    integration,
    sign_in,
    viewer_env,
)
from nemesis.dlq import Action
from nemesis.fleet.port import MemberInfo
from nemesis.fleet.sqlite import SqliteStateStore, open_sqlite_state

ALICE, BOB, ROOT = STANDARD_ACCESS.people
BOT_A, BOT_ROOT = STANDARD_ACCESS.clients
INTEGRATIONS = {
    "orders-a": integration("orders-a", ["team-a"]),
    "orders-b": integration("orders-b", ["team-b"]),
}
HOSTILE = "<script>window.__pwned = 1</script><img src=x onerror=alert(1)>\u202egpj.exe"


@pytest.fixture
async def state(tmp_path: Path) -> AsyncIterator[SqliteStateStore]:
    store = await open_sqlite_state(tmp_path / "state.db")
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture
async def env(tmp_path: Path, state: SqliteStateStore) -> AsyncIterator[ViewerEnv]:
    async with viewer_env(tmp_path, integrations=INTEGRATIONS, state=state) as built:
        yield built


def client_of(env: ViewerEnv, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=env.app),
        base_url="http://viewer.test",
        headers=headers or {},
    )


async def report(state: SqliteStateStore, member: str, bodies: dict[str, dict[str, Any]]) -> None:
    import time

    now = time.time()
    await state.heartbeat(MemberInfo(member, "host-1", 1, now), now=now, lease_s=600)
    await state.publish_reports(member, bodies, now=now)


def body(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "state": "running",
        "paused": False,
        "lag_messages": 12,
        "lag_seconds": 3.5,
        "since_last_read_s": 1.0,
        "rates": {"delivered": 40.0, "filtered": 2.0, "retried": 1.0, "dead_lettered": 0.5},
        "breaker": "closed",
        "retry_backlog": 4,
        "waiting_for_dlq": 0,
        "issues": {},
        "every_s": 5.0,
    }
    base.update(fields)
    return base


async def overrides(state: SqliteStateStore, name: str) -> dict[str, Any]:
    view = await state.view()
    return {path: o.value for path, o in view.overrides_of(name).items()}


# --- who sees what ------------------------------------------------------------------


async def test_owners_see_their_integrations_added_up_over_replicas(
    env: ViewerEnv, state: SqliteStateStore
) -> None:
    await report(state, "m1", {"orders-a": body(), "orders-b": body()})
    await report(state, "m2", {"orders-a": body(breaker="open", lag_messages=8, lag_seconds=9.0)})
    async with client_of(env) as client:
        await sign_in(client, ALICE)
        listed = await client.get("/console")
        detail = await client.get("/console/orders-a")
    assert listed.status_code == 200
    assert "orders-a" in listed.text
    assert "orders-b" not in listed.text
    assert detail.status_code == 200
    assert 'id="kpi-lag">20<' in detail.text  # 12 + 8 across the two replicas
    assert 'id="kpi-breaker">open<' in detail.text  # the worst of them
    assert "80.0" in detail.text  # delivered/s summed
    assert 'id="tune-form"' in detail.text
    assert 'id="pause"' in detail.text


async def test_a_replica_that_left_is_not_counted(env: ViewerEnv, state: SqliteStateStore) -> None:
    await report(state, "m1", {"orders-a": body()})
    await report(state, "m2", {"orders-a": body(lag_messages=1000)})
    await state.leave("m2")
    async with client_of(env) as client:
        await sign_in(client, ALICE)
        detail = await client.get("/console/orders-a")
    assert 'id="kpi-lag">12<' in detail.text


async def test_an_admin_sees_every_integration_read_only(
    env: ViewerEnv, state: SqliteStateStore
) -> None:
    async with client_of(env) as client:
        await sign_in(client, ROOT)
        listed = await client.get("/console")
        detail = await client.get("/console/orders-b")
    assert "orders-a" in listed.text
    assert "orders-b" in listed.text
    assert 'id="read-only"' in detail.text
    assert 'id="tune-form"' not in detail.text
    assert "/pause" not in detail.text


# --- the authorization matrix ---------------------------------------------------------

CHANGES = {
    "pause": {},
    "resume": {},
    "tune": {"delivery.workers": "7"},
    "flags": {"disabled_types": "order.test"},
    "reset": {},
}


async def _as(env: ViewerEnv, who: str) -> tuple[httpx.AsyncClient, str]:
    if who in ("alice", "bob", "root"):
        person = {"alice": ALICE, "bob": BOB, "root": ROOT}[who]
        client = client_of(env)
        csrf = await sign_in(client, person)
        return client, csrf
    if who == "bot-a":
        return client_of(env, {"authorization": f"Bearer {BOT_A.token}"}), ""
    if who == "bot-root":
        return client_of(env, {"authorization": f"Bearer {BOT_ROOT.token}"}), ""
    if who == "wrong-token":
        return client_of(env, {"authorization": "Bearer nmsv_not-a-token"}), ""
    return client_of(env), ""


# (identity, integration) -> what reads and changes answer.
READ = {
    ("alice", "orders-a"): 200,
    ("alice", "orders-b"): 404,
    ("bob", "orders-a"): 404,
    ("bob", "orders-b"): 200,
    ("root", "orders-a"): 200,
    ("root", "orders-b"): 200,
    ("bot-a", "orders-a"): 200,
    ("bot-a", "orders-b"): 404,
    ("bot-root", "orders-a"): 200,
    ("bot-root", "orders-b"): 200,
    ("anonymous", "orders-a"): 303,
    ("anonymous", "orders-b"): 303,
    ("wrong-token", "orders-a"): 303,
    ("wrong-token", "orders-b"): 303,
}
OWNERS = {("alice", "orders-a"), ("bob", "orders-b"), ("bot-a", "orders-a")}


def expected_change(who: str, name: str) -> int:
    if (who, name) in OWNERS:
        return 303
    read = READ[(who, name)]
    return 403 if read == 200 else read  # read-only: refused; unseen: 404; signed out: sign in


async def test_every_identity_against_every_console_route_has_no_bypass(
    env: ViewerEnv, state: SqliteStateStore
) -> None:
    requests = 0
    bypasses: list[str] = []
    for who in ("alice", "bob", "root", "bot-a", "bot-root", "anonymous", "wrong-token"):
        client, csrf = await _as(env, who)
        try:
            listed = await client.get("/console")
            requests += 1
            for name in INTEGRATIONS:
                shown = f'data-integration="{name}"' in listed.text
                if shown != (READ[(who, name)] == 200):
                    bypasses.append(f"{who} list shows {name}: {shown}")
                got = (await client.get(f"/console/{name}")).status_code
                requests += 1
                if got != READ[(who, name)]:
                    bypasses.append(f"{who} GET {name}: {got}")
                for route, fields in CHANGES.items():
                    before = await overrides(state, name)
                    answer = await client.post(
                        f"/console/{name}/{route}", data={"csrf_token": csrf, **fields}
                    )
                    requests += 1
                    want = expected_change(who, name)
                    after = await overrides(state, name)
                    changed = after != before
                    if answer.status_code != want:
                        bypasses.append(f"{who} {route} {name}: {answer.status_code} != {want}")
                    if want != 303 and changed:
                        bypasses.append(f"{who} {route} {name} changed {before} -> {after}")
        finally:
            await client.aclose()
    assert bypasses == []
    assert requests == 7 * (1 + 2 * 6)


async def test_a_change_without_the_csrf_token_is_refused(
    env: ViewerEnv, state: SqliteStateStore
) -> None:
    async with client_of(env) as client:
        csrf = await sign_in(client, ALICE)
        for route, fields in CHANGES.items():
            missing = await client.post(f"/console/orders-a/{route}", data=fields)
            wrong = await client.post(
                f"/console/orders-a/{route}", data={"csrf_token": csrf[:-2] + "xx", **fields}
            )
            cross = await client.post(
                f"/console/orders-a/{route}",
                data={"csrf_token": csrf, **fields},
                headers={"sec-fetch-site": "cross-site"},
            )
            assert (missing.status_code, wrong.status_code, cross.status_code) == (403, 403, 403)
    assert await overrides(state, "orders-a") == {}


# --- changes, drift and the audit log -------------------------------------------------


async def test_pause_tune_flags_and_reset_are_stored_for_the_fleet_and_audited(
    env: ViewerEnv, state: SqliteStateStore
) -> None:
    async with client_of(env) as client:
        csrf = await sign_in(client, ALICE)
        paused = await client.post("/console/orders-a/pause", data={"csrf_token": csrf})
        assert paused.status_code == 303
        tuned = await client.post(
            "/console/orders-a/tune",
            data={"csrf_token": csrf, "delivery.workers": "7", "rate_limits.main": "150"},
        )
        assert tuned.status_code == 303
        await client.post(
            "/console/orders-a/flags",
            data={"csrf_token": csrf, "disabled_types": "order.test\norder.test, order.dry-run"},
        )
        assert await overrides(state, "orders-a") == {
            "paused": True,
            "delivery.workers": 7,
            "rate_limits.main": 150.0,
            "flags.disabled_types": ["order.test", "order.dry-run"],
        }
        detail = await client.get("/console/orders-a")
        assert "4 live overrides differ from the file" in detail.text
        assert 'id="resume"' in detail.text
        view = await state.view()
        assert {o.set_by for o in view.overrides} == {"alice through the DLQ viewer"}
        await client.post("/console/orders-a/reset", data={"csrf_token": csrf})
        assert await overrides(state, "orders-a") == {}
    entries = (await env.store.actions()).rows
    assert [(e.who, e.action, list(e.integrations)) for e in entries] == [
        ("alice", Action.RESET, ["orders-a"]),
        ("alice", Action.TUNE, ["orders-a"]),
        ("alice", Action.TUNE, ["orders-a"]),
        ("alice", Action.PAUSE, ["orders-a"]),
    ]
    assert "delivery.workers=7" in entries[2].description
    assert "rate_limits.main=150.0" in entries[2].description


async def test_a_value_the_yaml_says_is_no_drift(env: ViewerEnv, state: SqliteStateStore) -> None:
    async with client_of(env) as client:
        csrf = await sign_in(client, ALICE)
        await client.post("/console/orders-a/pause", data={"csrf_token": csrf})
        await client.post("/console/orders-a/resume", data={"csrf_token": csrf})
    assert await overrides(state, "orders-a") == {}  # the YAML says not paused


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"delivery.workers": "many"}, "delivery.workers"),
        ({"delivery.workers": "0"}, "workers"),
        ({"delivery.workers": "99999"}, "workers"),
        ({"delivery.buffer": "1", "delivery.batch.size": "50"}, "buffer"),
        ({"rate_limits.main": "-3"}, "main"),
        ({"rate_limits.main": "nan"}, "rate_limits.main"),
        ({"delivery.batch.max_wait_ms": "1e400"}, "delivery.batch.max_wait_ms"),
    ],
)
async def test_a_value_that_does_not_fit_is_refused_naming_the_field(
    env: ViewerEnv, state: SqliteStateStore, fields: dict[str, str], names: str
) -> None:
    async with client_of(env) as client:
        csrf = await sign_in(client, ALICE)
        answer = await client.post(
            "/console/orders-a/tune", data={"csrf_token": csrf, **fields}, follow_redirects=True
        )
    assert answer.status_code == 200
    assert "Not changed" in answer.text
    assert names in answer.text
    assert await overrides(state, "orders-a") == {}


async def test_hostile_flags_are_refused_and_long_names_are_404(
    env: ViewerEnv, state: SqliteStateStore
) -> None:
    async with client_of(env) as client:
        csrf = await sign_in(client, ALICE)
        answer = await client.post(
            "/console/orders-a/flags",
            data={"csrf_token": csrf, "disabled_types": "x" * 500},
            follow_redirects=True,
        )
        assert "Not changed" in answer.text
        assert (await client.get("/console/" + "a" * 5000)).status_code == 404
        assert (await client.get("/console/%00")).status_code == 404
    assert await overrides(state, "orders-a") == {}


async def test_hostile_text_from_the_store_renders_escaped(
    env: ViewerEnv, state: SqliteStateStore
) -> None:
    await report(
        state,
        HOSTILE,
        {"orders-a": body(state=HOSTILE, issues={HOSTILE: HOSTILE}, breaker=HOSTILE)},
    )
    await state.set_overrides(
        "orders-a", {"flags.disabled_types": [HOSTILE]}, set_by=HOSTILE, now=1.0
    )
    async with client_of(env) as client:
        await sign_in(client, ROOT)
        pages = [await client.get("/console"), await client.get("/console/orders-a")]
    for page in pages:
        assert page.status_code == 200
        assert "<script>window" not in page.text
        assert "<img src=x" not in page.text
    assert "&lt;script&gt;" in pages[1].text


async def test_without_a_state_store_there_is_no_console(tmp_path: Path) -> None:
    async with viewer_env(tmp_path, integrations=INTEGRATIONS) as env, client_of(env) as client:
        await sign_in(client, ALICE)
        assert (await client.get("/console")).status_code == 404
