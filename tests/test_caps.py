"""The platform's caps (``limits:``): ``nemesis validate``, ``nemesis run``, the admin API, ctl.

Through the real CLI in subprocesses (validate, run, ctl) and the admin API
over real HTTP on loopback, on the embedded broker.
"""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config.limits import Caps, within_caps
from nemesis.config.loader import load_process_config
from nemesis.config.models import EmbeddedBackendConfig, IntegrationConfig, LimitsConfig
from nemesis.dlq import open_sqlite_dlq
from nemesis.dlq.sqlite import SqliteDeadLetterStore
from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully
from tests.test_admin_access import PLATFORM_TOKEN, TOKENS, auth_config, team_proxy
from tests.test_cli_ctl import ctl

LIMITS = """\
limits:
  integration:
    workers: 64
    batch_size: 100
    rate_limits:
      main: 500
  team:
    workers: 100
"""
RATE = "rate_limits: {main: 100}\n"


def line_of(path: Path, text: str) -> int:
    """The line (from 1) of the first line of ``path`` holding ``text``."""
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def write(path: Path, name: str, owner: str, workers: int, rate: str = "100") -> None:
    path.write_text(
        f"name: {name}\n"
        f"owners: [{owner}]\n"
        f"source: {{topic: orders, consumer: {name}}}\n"
        "target: {url: 'http://127.0.0.1:9/hook'}\n"
        "delivery:\n"
        f"  workers: {workers}\n"
        "  buffer: 500\n" + (f"rate_limits:\n  main: {rate}\n" if rate != "unset" else "")
    )


def test_validate_names_the_integration_line_the_cap_and_where_it_is_set(tmp_path: Path) -> None:
    process = tmp_path / "nemesis.yaml"
    process.write_text(LIMITS)
    directory = tmp_path / "integrations"
    directory.mkdir()
    write(directory / "big.yaml", "big", "team-a", 65)
    write(directory / "fair.yaml", "fair", "team-b", 60)
    write(directory / "share.yaml", "share", "team-b", 50)
    write(directory / "open.yaml", "open", "team-c", 8, rate="unset")
    write(directory / "fine.yaml", "fine", "team-d", 64, rate="500")

    result = Workspace(tmp_path).cli("validate", "nemesis.yaml", "integrations")

    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    workers_cap = f"limits.integration.workers in nemesis.yaml:{line_of(process, 'workers: 64')}"
    team_cap = f"limits.team.workers in nemesis.yaml:{line_of(process, 'workers: 100')}"
    rate_cap = f"limits.integration.rate_limits.main in nemesis.yaml:{line_of(process, 'main:')}"
    assert lines == [
        "integrations/big.yaml:6: delivery.workers: 65 is over the platform's cap of 64"
        f" ({workers_cap})",
        "integrations/fair.yaml:6: delivery.workers: team-b's integrations would take 110"
        f" together (fair 60, share 50), over the team cap of 100 ({team_cap})",
        "integrations/open.yaml:1: rate_limits.main: no rate (unlimited), but the platform caps"
        f" it at 500/s ({rate_cap}): set rate_limits.main to at most 500",
        "integrations/share.yaml:6: delivery.workers: team-b's integrations would take 110"
        f" together (share 50, fair 60), over the team cap of 100 ({team_cap})",
    ], result.stdout

    # Without the process file there is no cap to check against.
    alone = Workspace(tmp_path).cli("validate", "integrations/fine.yaml")
    assert alone.returncode == 0, alone.stdout + alone.stderr


def test_run_keeps_what_runs_and_refuses_in_name_order() -> None:
    caps = Caps(LimitsConfig.model_validate({"team": {"workers": 100}}))

    def config(name: str, workers: int) -> IntegrationConfig:
        return IntegrationConfig.model_validate(
            {
                "name": name,
                "owners": ["team-a"],
                "source": {"topic": "orders", "consumer": name},
                "target": {"url": "http://127.0.0.1:9/"},
                "delivery": {"workers": workers},
            }
        )

    files: dict[str, Path | None] = {"a": None, "b": None, "c": None}
    admitted, problems = within_caps(caps, {"b": config("b", 60), "a": config("a", 30)}, files)
    assert sorted(admitted) == ["a", "b"]
    assert problems == []
    # c arrives while a and b run: refused, whatever its name's place.
    running = dict(admitted)
    candidates = {**running, "c": config("c", 20)}
    admitted, problems = within_caps(caps, candidates, files, running)
    assert sorted(admitted) == ["a", "b"]
    assert [(p.file, p.field) for p in problems] == [("integration c", "delivery.workers")]
    # A running one that grows past the team's total is refused; its running version stays.
    admitted, problems = within_caps(caps, {**running, "a": config("a", 50)}, files, running)
    assert sorted(admitted) == ["b"]
    assert "would take 110 together (a 50, b 60)" in problems[0].message


async def test_run_refuses_an_integration_over_the_caps_and_runs_the_others(
    workspace: Workspace,
) -> None:
    config = workspace.write_config(LIMITS)
    created = workspace.cli("topics", "create", "orders", "--partitions", "2")
    assert created.returncode == 0, created.stderr
    async with HandlerServer() as handler:
        ok = integration_yaml("ok", handler.url, workers=8, extra=RATE)
        workspace.write_integration("ok", ok)
        big = workspace.write_integration(
            "big", integration_yaml("big", handler.url, workers=80, extra=RATE)
        )
        proxy = await workspace.start("run")
        cap = f"limits.integration.workers in nemesis.yaml:{line_of(config, 'workers: 64')}"
        await workspace.wait_for_log(
            proxy,
            f"integrations/big.yaml:{line_of(big, 'workers')}: delivery.workers: 80 is over the"
            f" platform's cap of 64 ({cap}) (integration not started)",
        )
        published = workspace.cli("publish", "orders", '{"n": 1}')
        assert published.returncode == 0, published.stderr
        await handler.ledger.wait_for(1, timeout_s=60)

        # A reload that raises a running one over the cap: refused, the running one goes on.
        ok = integration_yaml("ok", handler.url, workers=70, extra=RATE)
        workspace.write_integration("ok", ok)
        assert proxy.returncode is None
        proxy.send_signal(signal.SIGHUP)
        await workspace.wait_for_log(
            proxy,
            "delivery.workers: 70 is over the platform's cap of 64"
            f" ({cap}) (ignored; the running configuration stays)",
        )
        published = workspace.cli("publish", "orders", '{"n": 2}')
        assert published.returncode == 0, published.stderr
        await handler.ledger.wait_for(2, timeout_s=60)
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    assert "integration big: added" not in workspace.logs()


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


async def test_live_changes_over_a_cap_are_refused_by_the_api_and_ctl(
    broker: EmbeddedBroker, tmp_path: Path, audit_store: SqliteDeadLetterStore
) -> None:
    process = tmp_path / "nemesis.yaml"
    process.write_text("limits:\n  integration:\n    workers: 16\n  team:\n    workers: 20\n")
    caps = Caps.of(load_process_config(process), process)
    options = {"token": PLATFORM_TOKEN, "auth": auth_config(), "caps": caps}
    alpha = {"Authorization": f"Bearer {TOKENS['alpha']}"}
    async with (
        team_proxy(broker, tmp_path, audit_store, **options) as (proxy, url),
        httpx.AsyncClient(base_url=url, headers=alpha) as client,
    ):
        answer = await client.patch("/integrations/alpha", json={"delivery": {"workers": 17}})
        assert answer.status_code == 422, answer.text
        assert answer.json()["detail"] == [
            {
                "loc": ["body", "delivery", "workers"],
                "msg": "17 is over the platform's cap of 16"
                f" (limits.integration.workers in {process}:3)",
                "type": "over_cap",
            }
        ]
        assert proxy.integrations["alpha"].delivery.workers == 8

        answer = await client.patch("/integrations/alpha", json={"delivery": {"workers": 16}})
        assert answer.status_code == 200, answer.text
        assert proxy.integrations["alpha"].delivery.workers == 16

        # The same through ctl, as a team's engineer runs it; and the platform's token is
        # held to the caps too.
        code, _, err = await ctl(
            url, TOKENS["alpha"], "set", "alpha", "delivery.workers=40", cwd=tmp_path
        )
        assert code == 1
        assert (
            f"422 delivery.workers: 40 is over the platform's cap of 16"
            f" (limits.integration.workers in {process}:3)" in err
        )
        code, _, err = await ctl(
            url, PLATFORM_TOKEN, "set", "alpha", "delivery.workers=12", cwd=tmp_path
        )
        assert code == 0, err
        assert proxy.integrations["alpha"].delivery.workers == 12
        # Turning down, or tuning what no cap bounds, is never refused.
        code, _, err = await ctl(
            url, TOKENS["alpha"], "set", "alpha", "delivery.buffer=400", cwd=tmp_path
        )
        assert code == 0, err


def _team_config(name: str, workers: int, replicas: int | str = 1) -> IntegrationConfig:
    return IntegrationConfig.model_validate(
        {
            "name": name,
            "owners": ["team-a"],
            "source": {"topic": "orders", "consumer": name},
            "target": {"url": "http://127.0.0.1:9/"},
            "delivery": {"workers": workers, "buffer": 100},
            "replicas": replicas,
        }
    )


def test_team_totals_count_workers_and_buffers_once_per_replica() -> None:
    caps = Caps(LimitsConfig.model_validate({"team": {"workers": 100, "buffer": 350}}))
    spread = _team_config("spread", 30, replicas=3)
    small = _team_config("small", 20)
    # 30 workers on each of 3 replicas and 20 on one: 110, over 100 (not 50, as per replica).
    workers, buffer = caps.check(small, {"spread": spread})
    assert workers.field == "delivery.workers"
    assert "would take 110 together (small 20, spread 30x3)" in workers.message
    # Buffers too: 100 x 3 + 100.
    assert buffer.field == "delivery.buffer"
    assert "would take 400 together (small 100, spread 100x3)" in buffer.message
    # On one replica each, the same two fit.
    assert caps.check(small, {"spread": _team_config("spread", 30)}) == []

    everywhere = _team_config("everywhere", 30, replicas="all")
    unknown = caps.check(everywhere, {})
    assert [b.field for b in unknown] == ["delivery.workers", "delivery.buffer"]
    assert "set replicas to a number, or limits.team.all_replicas" in unknown[0].message
    sized = Caps(
        LimitsConfig.model_validate({"team": {"workers": 100, "all_replicas": 4}}),
    )
    [counted] = sized.check(everywhere, {})
    assert "would take 120 together (everywhere 30x4)" in counted.message
    assert sized.check(_team_config("everywhere", 25, replicas="all"), {}) == []


async def test_a_stored_fleet_override_over_this_replicas_caps_is_not_applied(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """A live value another replica stored (an older one, without these caps) is checked here."""
    from nemesis.fleet.member import FleetMember, FleetOptions
    from nemesis.fleet.sqlite import open_sqlite_state
    from nemesis.runtime.app import Proxy
    from nemesis.testing.clock import FakeClock
    from tests.operability import integration

    clock = FakeClock()
    options = FleetOptions(lease_s=10, poll_s=1, handover_wait_s=60)
    caps = Caps(LimitsConfig.model_validate({"integration": {"workers": 32}}))
    stores = [await open_sqlite_state(tmp_path / "state.db") for _ in range(2)]
    try:
        proxies = [
            Proxy(broker, {"it": integration("it", "http://127.0.0.1:9/")}, clock=clock)
            for _ in range(2)
        ]
        old = FleetMember(stores[0], proxies[0], options=options, clock=clock, member_id="a")
        capped = FleetMember(
            stores[1], proxies[1], options=options, clock=clock, member_id="b", caps=caps
        )
        await old.join()
        await capped.join()
        await old.set_overrides("it", {"delivery.workers": 64}, set_by="test")
        await capped.tick()
        assert proxies[1].groups["it"].config.delivery.workers == 8  # the YAML's, not 64
        assert proxies[1].groups["it"].overrides == {}
        # Within the caps (a lower value, or a field no cap bounds), it applies.
        await old.set_overrides("it", {"delivery.workers": 16, "paused": True}, set_by="test")
        await capped.tick()
        assert proxies[1].groups["it"].config.delivery.workers == 16
        assert proxies[1].groups["it"].config.paused
    finally:
        for store in stores:
            await store.close()
