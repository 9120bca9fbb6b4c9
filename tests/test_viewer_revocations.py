"""Signing out of the viewer ends the session on every replica, through the fleet's state store.

Two viewers of one configuration: ``python -m dlq_viewer`` in a process of
its own, and the viewer ``nemesis run`` serves (its plugin service) in this
one; they share the state store of the configuration (a SQLite file). Then
what a viewer does while the store does not answer, on a real PostgreSQL
whose table another session holds locked. The store's own cases (expiry,
the bound) run on every kind in ``tests/test_fleet_store.py``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml

from dlq_viewer.auth import SESSION_COOKIE, STORE_RETRY_S, SharedSessionRevocations
from dlq_viewer.passwords import hash_password
from dlq_viewer.testing import STANDARD_ACCESS, TEST_SCRYPT_N, TEST_SECRET, Person, sign_in
from nemesis.admin.server import plugin_services, serve_beside
from nemesis.backends import open_backend, open_dlq, open_state
from nemesis.backends.postgres import PostgresStateConfig
from nemesis.config.loader import load_integrations, load_process_config
from nemesis.fleet.postgres import PostgresStateStore, open_postgres_state
from nemesis.runtime.app import Proxy
from nemesis.testing.clock import FakeClock
from tests.postgres_server import PostgresServer
from tests.test_viewer_standalone import _viewer_url, integration_file

ALICE, BOB, _ = STANDARD_ACCESS.people


def _config(root: Path, people: tuple[Person, ...]) -> Path:
    """A configuration with password users; its state store is the default SQLite file."""
    integrations = root / "integrations"
    integrations.mkdir(parents=True)
    integration_file(integrations, "orders-a", ["team-a"])
    integration_file(integrations, "orders-b", ["team-b"])
    config = {
        "data_dir": str(root / "data"),
        "integrations_dir": "integrations",
        "backend": {"kind": "embedded", "path": "log.db"},
        "admin": {"enabled": False},
        "viewer": {"host": "127.0.0.1", "port": 0},
        "auth": {
            "session_secret": TEST_SECRET,
            "secure_cookies": False,
            "users": [
                {
                    "name": person.name,
                    "password_hash": hash_password(person.password, n=TEST_SCRYPT_N),
                    "teams": list(person.teams),
                }
                for person in people
            ],
        },
    }
    (root / "data").mkdir()
    (root / "nemesis.yaml").write_text(yaml.safe_dump(config))
    return root / "nemesis.yaml"


async def _signed_out_elsewhere(signs_out: str, checks: str, person: Person) -> tuple[int, int]:
    """Signs ``person`` in and out on one viewer; what the other answers to the cookie, before
    and after the sign-out."""
    async with httpx.AsyncClient(base_url=signs_out) as browser:
        csrf = await sign_in(browser, person)
        cookie = browser.cookies[SESSION_COOKIE]
        async with httpx.AsyncClient(base_url=checks, cookies={SESSION_COOKIE: cookie}) as copy:
            before = (await copy.get("/api/me")).status_code
            assert (await browser.post("/logout", data={"csrf_token": csrf})).status_code == 303
            after = (await copy.get("/api/me")).status_code
    return before, after


async def test_a_sign_out_on_one_replica_ends_the_session_on_the_others(tmp_path: Path) -> None:
    path = _config(tmp_path, (ALICE, BOB))
    config = load_process_config(path)
    standalone = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dlq_viewer",
        "-c",
        str(path),
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    answers: dict[str, tuple[int, int]] = {}
    try:
        alone = await _viewer_url(standalone)
        broker = await open_backend(config)
        dlq = await open_dlq(config, broker=broker)
        state = await open_state(config)
        try:
            only_a = {"orders-a": load_integrations(Path(config.integrations_dir))[0]["orders-a"]}
            proxy = Proxy(broker, only_a, dlq=dlq)
            [served] = plugin_services(config, proxy, dlq, broker, state)

            async def browse() -> None:
                answers["alone to served"] = await _signed_out_elsewhere(alone, served.url, ALICE)
                answers["served to alone"] = await _signed_out_elsewhere(served.url, alone, BOB)

            await serve_beside(browse(), [served])
        finally:
            await state.close()
            await dlq.close()
            await broker.close()
    finally:
        standalone.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            assert await standalone.wait() == 0
    # One session secret: the cookie works on both until it is signed out on either.
    assert answers == {"alone to served": (200, 401), "served to alone": (200, 401)}


@pytest.fixture
async def postgres_config(postgres_server: PostgresServer) -> PostgresStateConfig:
    # Statements give up quickly, so that a locked table is an outage the test sees soon.
    return PostgresStateConfig(
        dsn=postgres_server.dsn(),
        schema_name=f"f_{uuid.uuid4().hex[:12]}",
        statement_timeout_s=0.5,
    )


@pytest.fixture
async def replicas(postgres_config: PostgresStateConfig) -> AsyncIterator[list[PostgresStateStore]]:
    """The state store as two replicas open it."""
    opened = [
        await open_postgres_state(postgres_config),
        await open_postgres_state(postgres_config),
    ]
    try:
        yield opened
    finally:
        for store in opened:
            await store.close()


async def test_while_the_store_does_not_answer_sign_outs_hold_here_and_are_shared_later(
    replicas: list[PostgresStateStore],
    postgres_server: PostgresServer,
    postgres_config: PostgresStateConfig,
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock(wall_start=time.time())
    here, there = (
        SharedSessionRevocations(replicas[0], clock),
        SharedSessionRevocations(replicas[1]),
    )
    far = 4_000_000_000.0  # the cookies' expiry: long after the test
    await there.revoke("signed-out-there", far)
    assert await here.is_revoked("signed-out-there")  # read from the store
    await there.revoke("also-signed-out-there", far)
    outage = await postgres_server.admin()
    try:
        await outage.execute("BEGIN")
        await outage.execute(
            f'LOCK TABLE "{postgres_config.schema_name}".fleet_revoked_sessions'
            " IN ACCESS EXCLUSIVE MODE"
        )
        with caplog.at_level(logging.WARNING, logger="dlq_viewer.auth"):
            # Known here: still refused. Not known here: accepted, not every session refused.
            assert await here.is_revoked("signed-out-there")
            assert not await here.is_revoked("also-signed-out-there")
            assert not await here.is_revoked("never-signed-out")
            await here.revoke("signed-out-during-the-outage", far)
            assert await here.is_revoked("signed-out-during-the-outage")
            assert here.statistics().unshared == 1  # waits for the store
            assert not here.statistics().store_answering
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert sum(w.startswith("the state store does not answer") for w in warnings) == 1, warnings
        assert any("other replicas accept its cookie" in w for w in warnings), warnings
        await outage.execute("ROLLBACK")
    finally:
        await outage.close()
    # The store answers again; this replica asks it again once STORE_RETRY_S has passed.
    assert not await here.is_revoked("never-signed-out")
    assert here.statistics().unshared == 1
    clock.advance(STORE_RETRY_S)
    # The next call shares what waited, and reads the store again.
    assert not await here.is_revoked("never-signed-out")
    assert here.statistics().unshared == 0
    assert here.statistics().store_answering
    assert await there.is_revoked("signed-out-during-the-outage")
    assert await here.is_revoked("also-signed-out-there")
