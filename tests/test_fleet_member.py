"""Fleet members in one process on a real state store, driven tick by tick (no timing).

Two proxies (not running: placement and overrides need no delivery) share
one embedded broker file and one state store (each kind of
``tests/test_fleet_store.py``: a file, a PostgreSQL schema), each with its ``FleetMember``;
each ``tick()`` is one look at the store, as the member's loop makes every
``poll_s``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from nemesis.admin import create_admin_app
from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.fleet.member import FleetMember, FleetOptions
from nemesis.fleet.port import StateStore
from nemesis.runtime import overrides as live
from nemesis.runtime.app import Proxy
from nemesis.testing.clock import FakeClock
from tests.operability import AUTH, TOKEN, integration
from tests.test_fleet_store import STORES

NAMES = sorted(f"team-{n}" for n in range(12))
OPTIONS = FleetOptions(lease_s=10, poll_s=1, handover_wait_s=60)


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
            "admin API of a",
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
