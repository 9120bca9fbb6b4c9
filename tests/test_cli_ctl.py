"""``nemesis ctl``: a team pauses, re-tunes and flags its own integration through the real CLI.

The proxy and its admin API run here (two integrations, two teams, the
admin API on loopback); the CLI runs in a subprocess with the team's token
in ``$NEMESIS_TOKEN``, as a team's engineer runs it during an incident.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.cli_ctl import SETTABLE, parse_assignment, patch_body
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.config.overrides import LIVE_FIELDS
from nemesis.dlq import open_sqlite_dlq
from nemesis.dlq.sqlite import SqliteDeadLetterStore
from nemesis.errors import NemesisError
from nemesis.runtime.app import Proxy
from tests.test_admin_access import PLATFORM_TOKEN, TOKENS, auth_config, team_proxy


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


@pytest.fixture
async def audit_store(tmp_path: Path) -> AsyncIterator[SqliteDeadLetterStore]:
    store = await open_sqlite_dlq(tmp_path / "dlq.db")
    yield store
    await store.close()


def paused(proxy: Proxy, name: str) -> bool:
    """The running configuration's ``paused`` (read anew: a call changes it)."""
    return proxy.integrations[name].paused


async def ctl(url: str, token: str | None, *args: str, cwd: Path) -> tuple[int, str, str]:
    """``nemesis ctl ARGS`` in a subprocess; the event loop keeps serving the admin API."""
    env = {k: v for k, v in os.environ.items() if k not in ("NEMESIS_TOKEN", "NEMESIS_ADMIN_URL")}
    if token is not None:
        env["NEMESIS_TOKEN"] = token
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "nemesis",
        "ctl",
        *args,
        "--url",
        url,
        cwd=cwd,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_a_team_pauses_retunes_and_flags_its_own_integration_only(
    broker: EmbeddedBroker, tmp_path: Path, audit_store: SqliteDeadLetterStore
) -> None:
    options = {"token": PLATFORM_TOKEN, "auth": auth_config()}
    alpha = TOKENS["alpha"]
    async with team_proxy(broker, tmp_path, audit_store, **options) as (proxy, url):
        code, out, err = await ctl(url, alpha, "pause", "alpha", cwd=tmp_path)
        assert code == 0, err
        assert out.startswith("alpha: ")
        assert "paused" in out
        assert paused(proxy, "alpha")

        # While paused, the team moves its own offsets; the skip is audited.
        code, out, err = await ctl(url, alpha, "offsets", "alpha", cwd=tmp_path)
        assert code == 0, err
        assert "flow main: topic orders, consumer alpha" in out
        code, out, err = await ctl(url, alpha, "skip", "alpha", "--count", "1", cwd=tmp_path)
        assert code == 0, err
        assert "partition 0:" in out
        code, _, err = await ctl(url, alpha, "skip", "beta", "--count", "1", cwd=tmp_path)
        assert code == 1
        assert "404" in err

        code, out, err = await ctl(
            url, alpha, "set", "alpha", "delivery.workers=5", "rate_limits.main=100", cwd=tmp_path
        )
        assert code == 0, err
        assert proxy.integrations["alpha"].delivery.workers == 5
        assert proxy.integrations["alpha"].rate_limits.main == 100
        assert "delivery.workers=5 (override)" in out

        code, out, err = await ctl(
            url, alpha, "flag", "alpha", "--disable", "order.test", cwd=tmp_path
        )
        assert code == 0, err
        assert proxy.integrations["alpha"].flags.disabled_types == ["order.test"]

        code, out, err = await ctl(url, alpha, "status", cwd=tmp_path)
        assert code == 0, err
        assert [line.split(":")[0] for line in out.splitlines()] == ["alpha"]  # not beta

        # Another team's integration: as if it did not exist, and nothing changes.
        code, out, err = await ctl(url, alpha, "pause", "beta", cwd=tmp_path)
        assert code == 1
        assert "404 no integration 'beta'" in err
        assert not paused(proxy, "beta")
        code, _, err = await ctl(url, None, "pause", "alpha", cwd=tmp_path)
        assert code == 1
        assert "401" in err
        assert "NEMESIS_TOKEN" in err
        code, _, err = await ctl(url, alpha, "set", "alpha", "delivery.workers=0", cwd=tmp_path)
        assert code == 1
        assert "422 delivery.workers:" in err

        code, out, err = await ctl(url, alpha, "reset", "alpha", "delivery.workers", cwd=tmp_path)
        assert code == 0, err
        assert proxy.integrations["alpha"].delivery.workers == 8
        code, out, err = await ctl(url, alpha, "resume", "alpha", cwd=tmp_path)
        assert code == 0, err
        assert not paused(proxy, "alpha")

        code, out, err = await ctl(url, alpha, "audit", cwd=tmp_path)
        assert code == 0, err
        actions = [line.split(" (API token) ")[1].split()[0] for line in out.splitlines()]
        assert actions == ["resume", "reset", "tune", "tune", "skip", "pause"]
        code, _, err = await ctl(url, alpha, "skip", "alpha", "--count", "1", cwd=tmp_path)
        assert code == 1
        assert "409" in err
        assert "not paused" in err
        assert all(" ci-alpha (API token) " in line for line in out.splitlines())
        # Beta's team sees none of it.
        code, out, err = await ctl(url, TOKENS["beta"], "audit", cwd=tmp_path)
        assert (code, out) == (0, ""), err


def test_assignments_become_the_patch_body() -> None:
    assignments = [
        parse_assignment(text)
        for text in (
            "delivery.workers=16",
            "delivery.batch.size=10",
            "rate_limits.retry=null",
            "flags.disabled_types=a.b, c.d",
            "paused=true",
        )
    ]
    assert patch_body(assignments) == {
        "delivery": {"workers": 16, "batch": {"size": 10}},
        "rate_limits": {"retry": None},
        "flags": {"disabled_types": ["a.b", "c.d"]},
        "paused": True,
    }
    for bad in ("workers=3", "delivery.workers", "delivery.workers=many"):
        with pytest.raises(NemesisError, match=bad.split("=")[0]):
            parse_assignment(bad)


def test_ctl_set_takes_exactly_the_live_fields() -> None:
    assert SETTABLE == LIVE_FIELDS
