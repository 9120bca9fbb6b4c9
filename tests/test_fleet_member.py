"""Fleet members in one process on a real state store, driven tick by tick (no timing).

Two proxies (not running: placement and overrides need no delivery) share
one embedded broker file and one state store (each kind of
``tests/test_fleet_store.py``: a file, a PostgreSQL schema), each with its ``FleetMember``;
each ``tick()`` is one look at the store, as the member's loop makes every
``poll_s``.
"""

from __future__ import annotations

import dataclasses
import re
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import generate_latest

from nemesis import processes
from nemesis.admin import create_admin_app
from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config import overrides as live
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.errors import StateError
from nemesis.fleet.member import FleetMember, FleetOptions
from nemesis.fleet.port import MemberInfo, StateStore
from nemesis.fleet.sqlite import open_sqlite_state
from nemesis.metrics import Metrics
from nemesis.runtime.app import Proxy
from nemesis.testing.clock import FakeClock
from tests.operability import AUTH, TOKEN, integration, metric_names, run_promtool
from tests.test_fleet_store import STORES
from tests.test_processes import dead_pid

NAMES = sorted(f"team-{n}" for n in range(12))
OPTIONS = FleetOptions(lease_s=10, poll_s=1, handover_wait_s=60)
FLEET_DOCS = Path(__file__).parents[1] / "docs" / "fleet.md"


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


@pytest.fixture(params=sorted(STORES))
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[list[StateStore]]:
    opener = STORES[request.param](request)
    opened = [await opener(tmp_path) for _ in range(2)]
    yield opened
    for store in opened:
        await store.close()


def proxy(broker: EmbeddedBroker, clock: FakeClock, **sections: object) -> Proxy:
    configs = {name: integration(name, "http://127.0.0.1:9/", **sections) for name in NAMES}
    return Proxy(broker, configs, clock=clock)


async def test_two_members_split_the_integrations_and_a_leaving_one_hands_over(
    broker: EmbeddedBroker, stores: list[StateStore]
) -> None:
    clock = FakeClock()
    first, second = proxy(broker, clock), proxy(broker, clock)
    a = FleetMember(stores[0], first, options=OPTIONS, clock=clock, member_id="a", pid=1)
    b = FleetMember(stores[1], second, options=OPTIONS, clock=clock, member_id="b", pid=2)
    await a.join()
    assert a.statistics().running == NAMES  # alone, it runs everything
    await b.join()
    share = sorted(name for name in NAMES if b.owners_of(name) == ("b",))
    assert 5 <= len(share) <= 7
    assert b.statistics().waiting == share  # until a lets go of them
    assert b.statistics().running == []
    await a.tick()  # a sees b and hands them over
    assert a.statistics().running == sorted(set(NAMES) - set(share))
    await b.tick()
    assert b.statistics().running == share

    first.stop()  # a shuts down: draining, it hands over each integration once drained
    clock.advance(1)
    await a.tick()
    assert a.statistics().draining
    assert a.statistics().running == []  # nothing ran here, so nothing to drain
    await b.tick()
    assert b.statistics().running == NAMES
    await a.leave()
    assert [m.member_id for m in (await stores[1].view()).members] == ["b"]


async def test_a_new_owner_waits_for_a_live_old_owner_to_let_go(
    broker: EmbeddedBroker, stores: list[StateStore]
) -> None:
    clock = FakeClock()
    options = FleetOptions(lease_s=600, handover_wait_s=60)  # a stays alive, silent
    a = FleetMember(stores[0], proxy(broker, clock), options=options, clock=clock, member_id="a")
    b = FleetMember(stores[1], proxy(broker, clock), options=options, clock=clock, member_id="b")
    await a.join()
    await b.join()
    waiting = b.statistics().waiting
    assert waiting
    clock.advance(options.handover_wait_s - 1)
    await b.tick()  # a has not looked yet: b still waits
    assert b.statistics().waiting == waiting
    clock.advance(1)
    await b.tick()  # a never let go: b starts them anyway, the broker fences the overlap
    assert b.statistics().waiting == []
    assert set(waiting) <= set(b.statistics().running)


async def test_an_override_set_on_one_member_applies_on_the_other_and_survives_a_restart(
    broker: EmbeddedBroker, stores: list[StateStore]
) -> None:
    clock = FakeClock()
    first, second = proxy(broker, clock), proxy(broker, clock)
    a = FleetMember(stores[0], first, options=OPTIONS, clock=clock, member_id="a", pid=1)
    b = FleetMember(stores[1], second, options=OPTIONS, clock=clock, member_id="b", pid=2)
    await a.join()
    await b.join()
    await a.set_overrides("team-1", {"delivery.workers": 64, "paused": True}, set_by="test")
    assert first.groups["team-1"].config.delivery.workers == 64  # here at once
    assert second.groups["team-1"].config.delivery.workers == 8
    await b.tick()
    assert second.groups["team-1"].overrides == {"delivery.workers": 64, "paused": True}
    assert second.groups["team-1"].config.paused

    restarted = proxy(broker, clock)
    again = FleetMember(stores[1], restarted, options=OPTIONS, clock=clock, member_id="c", pid=3)
    await again.join()
    assert restarted.groups["team-1"].config.delivery.workers == 64
    drift = [s.field for s in live.settings(restarted.groups["team-1"].yaml, {}) if s.drift]
    assert drift == []  # the YAML alone has none: the drift is the stored override's
    assert restarted.snapshot({"team-1"}).integrations[0].overrides == {
        "delivery.workers": 64,
        "paused": True,
    }

    await a.clear_overrides("team-1", ["paused"])
    await b.tick()
    assert second.groups["team-1"].overrides == {"delivery.workers": 64}


async def test_an_override_the_yaml_catches_up_with_leaves_the_store(
    broker: EmbeddedBroker, stores: list[StateStore]
) -> None:
    clock = FakeClock()
    first, second = proxy(broker, clock), proxy(broker, clock)
    a = FleetMember(stores[0], first, options=OPTIONS, clock=clock, member_id="a", pid=1)
    b = FleetMember(stores[1], second, options=OPTIONS, clock=clock, member_id="b", pid=2)
    await a.join()
    await b.join()
    await a.set_overrides("team-2", {"delivery.workers": 64}, set_by="test")
    await b.tick()
    changed = integration("team-2", "http://127.0.0.1:9/", delivery={"workers": 64, "buffer": 500})
    second.update_file_config(changed)  # b's YAML now says 64 (a reload)
    await b.tick()
    assert (await stores[0].view()).overrides == ()
    assert second.groups["team-2"].overrides == {}
    await a.tick()
    assert first.groups["team-2"].overrides == {}  # a's YAML says 8 again: back to it


async def test_an_override_that_does_not_fit_is_refused_before_it_is_stored(
    broker: EmbeddedBroker, stores: list[StateStore]
) -> None:
    from pydantic import ValidationError

    clock = FakeClock()
    a = FleetMember(stores[0], proxy(broker, clock), options=OPTIONS, clock=clock, pid=1)
    await a.join()
    with pytest.raises(ValidationError):
        await a.set_overrides("team-3", {"delivery.buffer": 0}, set_by="test")
    assert (await stores[0].view()).overrides == ()


async def test_shares_follow_the_members_running_an_integration(
    broker: EmbeddedBroker, stores: list[StateStore]
) -> None:
    clock = FakeClock()
    sections = {"replicas": "all", "rate_limits": {"main": 300}}
    first, second = proxy(broker, clock, **sections), proxy(broker, clock, **sections)
    a = FleetMember(stores[0], first, options=OPTIONS, clock=clock, member_id="a", pid=1)
    b = FleetMember(stores[1], second, options=OPTIONS, clock=clock, member_id="b", pid=2)
    await a.join()
    main = first.snapshot({"team-0"}).integrations[0].limits
    assert next(iter(main.values())).rate == 300
    await b.join()
    await a.tick()
    for member in (first, second):
        limits = member.snapshot({"team-0"}).integrations[0].limits
        assert {flow.value: s.rate for flow, s in limits.items()}["main"] == 150
    await b.leave()
    clock.advance(1)
    await a.tick()
    limits = first.snapshot({"team-0"}).integrations[0].limits
    assert {flow.value: s.rate for flow, s in limits.items()}["main"] == 300


async def test_the_admin_api_stores_changes_for_the_fleet_and_answers_503_without_the_store(
    broker: EmbeddedBroker, stores: list[StateStore]
) -> None:
    clock = FakeClock()
    here = proxy(broker, clock)
    member = FleetMember(stores[0], here, options=OPTIONS, clock=clock, member_id="a")
    await member.join()
    app = create_admin_app(here, token=TOKEN, fleet=member)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://admin") as admin:
        patched = await admin.patch(
            "/integrations/team-1", json={"delivery": {"workers": 16}}, headers=AUTH
        )
        assert patched.status_code == 200, patched.text
        [stored] = (await stores[1].view()).overrides
        assert (stored.field, stored.value, stored.set_by) == (
            "delivery.workers",
            16,
            "platform (admin.token) through the admin API of a",  # who, and where
        )
        fleet = (await admin.get("/fleet")).json()
        assert [m["member_id"] for m in fleet["members"]] == ["a"]
        assert fleet["members"][0]["this"]
        assert {i["name"]: i["running"] for i in fleet["integrations"]}["team-1"] == ["a"]

        await stores[0].close()  # the store goes away
        refused = await admin.patch(
            "/integrations/team-1", json={"delivery": {"workers": 4}}, headers=AUTH
        )
        assert refused.status_code == 503
        assert "the change was not made" in refused.json()["detail"]
        cleared = await admin.delete("/integrations/team-1/overrides", headers=AUTH)
        assert cleared.status_code == 503
        last = (await admin.get("/fleet")).json()  # as last read, saying why
        assert [m["member_id"] for m in last["members"]] == ["a"]
        assert "closed" in last["last_error"]
    assert here.groups["team-1"].config.delivery.workers == 16  # nothing changed here either


async def test_a_change_of_replicas_places_the_integration_again_without_a_restart(
    broker: EmbeddedBroker, stores: list[StateStore]
) -> None:
    clock = FakeClock()
    first, second = proxy(broker, clock), proxy(broker, clock)
    a = FleetMember(stores[0], first, options=OPTIONS, clock=clock, member_id="a", pid=1)
    b = FleetMember(stores[1], second, options=OPTIONS, clock=clock, member_id="b", pid=2)
    await a.join()
    await b.join()
    await a.tick()
    name = next(n for n in NAMES if a.owners_of(n) == ("a",))
    everywhere = integration(name, "http://127.0.0.1:9/", replicas="all")
    assert live.needs_restart(first.groups[name].yaml, everywhere) == []
    for member in (first, second):
        member.update_file_config(everywhere)  # the reload of each replica
    await b.tick()
    assert sorted(b.owners_of(name)) == ["a", "b"]
    assert name in b.statistics().running


# --- what /metrics shows of the fleet -----------------------------------------------


@pytest.fixture
async def one_file(tmp_path: Path) -> AsyncIterator[list[StateStore]]:
    """Three connections to one SQLite state file, as three replicas of one host have."""
    opened: list[StateStore] = [await open_sqlite_state(tmp_path / "state.db") for _ in range(3)]
    yield opened
    for store in opened:
        await store.close()


def gauge(metrics: Metrics, name: str, **labels: str) -> float | None:
    """One sample as a scrape of the member's registry shows it."""
    return metrics.registry.get_sample_value(name, labels)


async def test_the_fleet_gauges_of_each_member_agree_with_the_placement(
    broker: EmbeddedBroker, one_file: list[StateStore]
) -> None:
    clock = FakeClock()
    proxies = [proxy(broker, clock) for _ in range(3)]
    registries = [Metrics() for _ in range(3)]
    members = [
        FleetMember(
            one_file[n],
            proxies[n],
            options=OPTIONS,
            clock=clock,
            member_id=m,
            pid=n + 1,
            metrics=registries[n],
        )
        for n, m in enumerate("abc")
    ]
    for member in members:
        await member.join()
    for _ in range(2):  # the old owners let go, the new ones start, everyone sees it
        for member in members:
            await member.tick()
    generation = await one_file[0].generation()
    for member, metrics in zip(members, registries, strict=True):
        placed = [name for name in NAMES if member.member_id in member.owners_of(name)]
        assert member.statistics().running == placed
        assert gauge(metrics, "nemesis_fleet_members", state="active") == 3
        assert gauge(metrics, "nemesis_fleet_members", state="draining") == 0
        assert gauge(metrics, "nemesis_fleet_integrations", state="placed") == len(placed)
        assert gauge(metrics, "nemesis_fleet_integrations", state="running") == len(placed)
        assert gauge(metrics, "nemesis_fleet_integrations", state="waiting") == 0
        assert gauge(metrics, "nemesis_fleet_unplaced_integrations") == 0
        assert gauge(metrics, "nemesis_fleet_underplaced_integrations") == 0
        assert gauge(metrics, "nemesis_fleet_generation") == generation
        assert gauge(metrics, "nemesis_fleet_last_sync_timestamp_seconds") == clock.time()
        assert gauge(metrics, "nemesis_fleet_lease_expiry_timestamp_seconds") == (
            clock.time() + OPTIONS.lease_s  # renewed at the join, the clock has not moved
        )
    running = [gauge(m, "nemesis_fleet_integrations", state="running") for m in registries]
    assert sum(r or 0 for r in running) == len(NAMES)

    proxies[2].stop()  # c shuts down: draining, it lets go of its integrations
    clock.advance(1)
    await members[2].tick()
    a = registries[0]
    assert gauge(a, "nemesis_fleet_members", state="active") == 3  # a has not looked yet
    c_ran = len(NAMES) - sum(r or 0 for r in running[:2])
    assert gauge(a, "nemesis_fleet_unplaced_integrations") == 0  # as a last read the store
    await members[0].tick()
    assert gauge(a, "nemesis_fleet_members", state="active") == 2
    assert gauge(a, "nemesis_fleet_members", state="draining") == 1
    # a started its part of c's; b's part runs nowhere until b looks.
    b_takes = [n for n in NAMES if members[0].owners_of(n) == ("b",)]
    unplaced = [n for n in b_takes if n not in members[1].statistics().running]
    assert 0 < len(unplaced) < c_ran
    assert gauge(a, "nemesis_fleet_unplaced_integrations") == len(unplaced)
    assert gauge(a, "nemesis_fleet_underplaced_integrations") == len(unplaced)
    await members[1].tick()
    await members[0].tick()
    assert gauge(a, "nemesis_fleet_unplaced_integrations") == 0


async def test_a_failing_state_store_is_counted_and_the_sync_time_stops(
    broker: EmbeddedBroker, one_file: list[StateStore]
) -> None:
    clock = FakeClock()
    metrics = Metrics()
    member = FleetMember(
        one_file[0], proxy(broker, clock), options=OPTIONS, clock=clock, metrics=metrics
    )
    await member.join()
    clock.advance(1)
    await member.tick()
    synced = clock.time()
    assert gauge(metrics, "nemesis_fleet_last_sync_timestamp_seconds") == synced
    assert gauge(metrics, "nemesis_fleet_state_errors_total", operation="generation") == 0
    assert gauge(metrics, "nemesis_fleet_state_errors_total", operation="heartbeat") == 0

    await one_file[0].close()  # the store goes away
    clock.advance(1)
    with pytest.raises(StateError):
        await member.tick()  # the generation poll
    clock.advance(OPTIONS.lease_s / 3)
    with pytest.raises(StateError):
        await member.tick()  # the lease renewal
    with pytest.raises(StateError):
        await member.set_overrides("team-1", {"delivery.workers": 4}, set_by="test")
    assert gauge(metrics, "nemesis_fleet_state_errors_total", operation="generation") == 1
    assert gauge(metrics, "nemesis_fleet_state_errors_total", operation="heartbeat") == 1
    assert gauge(metrics, "nemesis_fleet_state_errors_total", operation="set_overrides") == 1
    assert gauge(metrics, "nemesis_fleet_state_errors_total", operation="view") == 0
    assert gauge(metrics, "nemesis_fleet_last_sync_timestamp_seconds") == synced
    # Renewed at the join (time 0): the lease is at risk, and the gauge says so.
    lease = gauge(metrics, "nemesis_fleet_lease_expiry_timestamp_seconds")
    assert lease is not None
    assert lease - clock.time() < OPTIONS.lease_s / 3 * 2
    assert gauge(metrics, "nemesis_fleet_integrations", state="running") == len(NAMES)


async def test_handovers_are_counted_and_timed_on_the_new_owner(
    broker: EmbeddedBroker, one_file: list[StateStore]
) -> None:
    clock = FakeClock()
    first, second = proxy(broker, clock), proxy(broker, clock)
    at_a, at_b = Metrics(), Metrics()
    options = dataclasses.replace(OPTIONS, lease_s=600)  # renewals are not what this is about
    a = FleetMember(
        one_file[0], first, options=options, clock=clock, member_id="a", pid=1, metrics=at_a
    )
    b = FleetMember(
        one_file[1], second, options=options, clock=clock, member_id="b", pid=2, metrics=at_b
    )
    await a.join()  # alone: it starts everything, which is no handover
    assert gauge(at_a, "nemesis_fleet_handovers_total") == 0
    assert gauge(at_a, "nemesis_fleet_handover_duration_seconds_count") == 0

    await b.join()  # b decides to take its share and waits for a to let go
    share = b.statistics().waiting
    assert gauge(at_b, "nemesis_fleet_integrations", state="waiting") == len(share)
    assert gauge(at_b, "nemesis_fleet_underplaced_integrations") == len(share)
    assert gauge(at_b, "nemesis_fleet_unplaced_integrations") == 0  # a runs them still
    clock.advance(3)
    await a.tick()
    await b.tick()
    assert b.statistics().running == share
    assert gauge(at_b, "nemesis_fleet_handovers_total") == len(share)
    duration = "nemesis_fleet_handover_duration_seconds"
    assert gauge(at_b, f"{duration}_count") == len(share)
    assert gauge(at_b, f"{duration}_sum") == 3 * len(share)
    assert gauge(at_b, f"{duration}_bucket", le="2.5") == 0
    assert gauge(at_b, f"{duration}_bucket", le="5.0") == len(share)

    first.stop()  # a leaves: b takes the rest at once (nothing ran there to drain)
    clock.advance(1)
    await a.tick()
    await a.leave()
    await b.tick()
    assert b.statistics().running == NAMES
    assert gauge(at_b, "nemesis_fleet_handovers_total") == len(NAMES)
    assert gauge(at_b, f"{duration}_count") == len(NAMES)
    assert gauge(at_b, f"{duration}_sum") == 3 * len(share)
    assert gauge(at_a, "nemesis_fleet_handovers_total") == 0


async def test_the_fleet_docs_name_exported_metrics_in_valid_alert_rules(
    broker: EmbeddedBroker, one_file: list[StateStore], tmp_path: Path
) -> None:
    metrics = Metrics()
    configs = {name: integration(name, "http://127.0.0.1:9/") for name in NAMES}
    here = Proxy(broker, configs, clock=FakeClock(), metrics=metrics)
    await FleetMember(one_file[0], here, options=OPTIONS, metrics=metrics).join()
    exported = metric_names(generate_latest(metrics.registry).decode())
    docs = FLEET_DOCS.read_text()
    assert set(re.findall(r"\bnemesis_fleet_[a-z_]+\b", docs)) <= exported
    [rules] = re.findall(r"```yaml\n(groups:.*?)```", docs, re.DOTALL)
    assert set(re.findall(r"\bnemesis_[a-z_]+\b", rules)) <= exported
    (tmp_path / "rules.yaml").write_text(rules)
    checked = run_promtool("check", "rules", str(tmp_path / "rules.yaml"))
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def test_a_reload_that_removes_an_awaited_integration_ends_the_wait(
    broker: EmbeddedBroker, one_file: list[StateStore]
) -> None:
    clock = FakeClock()
    second = proxy(broker, clock)
    metrics = Metrics()
    a = FleetMember(one_file[0], proxy(broker, clock), options=OPTIONS, clock=clock, member_id="a")
    b = FleetMember(
        one_file[1], second, options=OPTIONS, clock=clock, member_id="b", metrics=metrics
    )
    await a.join()
    await b.join()
    [removed, *_] = b.statistics().waiting  # a runs it still
    await second.remove_integration(removed)  # b's reload no longer has it
    clock.advance(1)
    await b.tick()
    assert removed not in b.statistics().waiting
    assert gauge(metrics, "nemesis_fleet_integrations", state="waiting") == len(
        b.statistics().waiting
    )


@pytest.mark.parametrize(
    ("node", "forgotten"),
    [
        (processes.node(), True),  # this host, this node, its pid gone: killed
        ("0badc0de", False),  # a container with the host's name: its pids are not ours
    ],
)
async def test_a_dead_neighbour_is_forgotten_at_join_and_a_container_row_is_not(
    broker: EmbeddedBroker, tmp_path: Path, node: str, forgotten: bool
) -> None:
    """A restart after kill -9 skips the lease wait; a live member elsewhere is never forgotten."""
    clock = FakeClock()
    store = await open_sqlite_state(tmp_path / "state.db")
    try:
        host, pid = socket.gethostname(), dead_pid()
        other = MemberInfo(f"{host}-{pid}-abcdef-{node}", host, pid, started_at=clock.time())
        await store.heartbeat(other, now=clock.time(), lease_s=600)
        await store.assign("team-1", other.member_id, now=clock.time())
        member = FleetMember(store, proxy(broker, clock), options=OPTIONS, clock=clock)
        assert member.member_id.endswith(f"-{processes.node()}")  # its id says where it runs
        await member.join()
        ids = {m.member_id for m in (await store.view()).members}
        assert (other.member_id not in ids) is forgotten
        assert ("team-1" in member.statistics().running) is forgotten  # no wait for the other
    finally:
        await store.close()
