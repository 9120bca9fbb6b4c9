"""A fleet of real ``nemesis run`` processes sharing an embedded broker and a state file.

Each replica is a subprocess with its own admin port; the handler is a real
``HandlerServer``. Waits are for conditions, with generous timeouts; how
fast things happen is measured by ``tests/bench/fleet.py``, not asserted.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, kill_hard, stop_gracefully
from tests.operability import samples, value_of

pytestmark = pytest.mark.slow

TOKEN = "fleet-test-token-0123456789"
# Long enough that a replica starting 60 integrations on a loaded machine keeps its lease.
LEASE_S = 5.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class Fleet:
    """Replicas of one configuration in one workspace: each its own admin port."""

    def __init__(self, workspace: Workspace) -> None:
        self.workspace = workspace
        self.ports: list[int] = []
        self.processes: list[asyncio.subprocess.Process] = []

    def config(self, n: int) -> str:
        while len(self.ports) <= n:
            self.ports.append(free_port())
        path = self.workspace.root / f"replica-{n}.yaml"
        path.write_text(
            "backend:\n"
            "  kind: embedded\n"
            f"  path: {self.workspace.db_path}\n"
            f"  lease_s: {LEASE_S}\n"
            f"state: {{kind: sqlite, path: state.db, lease_s: {LEASE_S}, poll_s: 0.5}}\n"
            "data_dir: .\n"
            "integrations_dir: integrations\n"
            "shutdown_grace_s: 5\n"
            f"admin: {{port: {self.ports[n]}, token: {TOKEN}}}\n"
            "viewer: {enabled: false}\n"
            "reload: {watch: false}\n"
        )
        return path.name

    async def start(self, n: int) -> asyncio.subprocess.Process:
        process = await self.workspace.start("run", "-c", self.config(n))
        if n < len(self.processes):
            self.processes[n] = process
        else:
            self.processes.append(process)
        return process

    def url(self, n: int, path: str) -> str:
        return f"http://127.0.0.1:{self.ports[n]}{path}"

    async def get(self, n: int, path: str) -> Any:
        """A GET on replica n's admin API; None while it does not answer."""
        try:
            async with httpx.AsyncClient(timeout=5) as client:
                response = await client.get(self.url(n, path))
        except httpx.TransportError:
            return None
        return response.json() if response.status_code == 200 else None

    async def patch(self, n: int, name: str, body: dict[str, Any]) -> httpx.Response:
        async with httpx.AsyncClient(timeout=10) as client:
            return await client.patch(
                self.url(n, f"/integrations/{name}"),
                json=body,
                headers={"Authorization": f"Bearer {TOKEN}"},
            )

    async def settled(self, n: int, members: int) -> dict[str, Any] | None:
        """Replica n's ``/fleet`` once it shows ``members`` members, each integration placed."""
        fleet = await self.get(n, "/fleet")
        if fleet is None or len(fleet["members"]) != members:
            return None
        live = {m["member_id"] for m in fleet["members"]}
        for integration in fleet["integrations"]:
            running = set(integration["running"])
            if not running or running != set(integration["assigned"]) or running - live:
                return None
        placed: dict[str, Any] = fleet
        return placed


async def eventually(
    check: Callable[[], Awaitable[Any]], *, timeout_s: float, what: str, logs: Callable[[], str]
) -> Any:
    """Polls ``check`` until it returns something truthy (other processes change it)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not (found := await check()):  # noqa: ASYNC110 - other processes change it
                await asyncio.sleep(0.25)
    except TimeoutError:
        pytest.fail(f"not within {timeout_s}s: {what}\n{logs()[-6000:]}")
    return found


def publish(workspace: Workspace, topic: str, ids: range, partitions: int = 4) -> None:
    created = workspace.cli(
        "topics", "create", topic, "--partitions", str(partitions), "--exist-ok"
    )
    assert created.returncode == 0, created.stderr
    lines = workspace.root / f"{topic}-{ids.start}.jsonl"
    lines.write_text("".join(json.dumps({"id": f"order-{n}"}) + "\n" for n in ids))
    published = workspace.cli(
        "publish", topic, "--file", lines.name, "--lines", "--key-field", "id"
    )
    assert published.returncode == 0, published.stderr


@pytest.fixture
def fleet(workspace: Workspace) -> Fleet:
    workspace.lease_s = LEASE_S
    workspace.write_config()
    return Fleet(workspace)


async def test_three_replicas_share_sixty_integrations_and_a_killed_one_hands_over(
    fleet: Fleet, workspace: Workspace
) -> None:
    names = [f"team-{n:02d}" for n in range(60)]
    async with HandlerServer() as handler:
        for name in names:
            workspace.write_integration(
                name,
                integration_yaml(name, f"{handler.url}{name}", workers=4, buffer=100, tiers=()),
            )
        publish(workspace, "orders", range(20))
        for n in range(3):
            await fleet.start(n)
        placed = await eventually(
            lambda: fleet.settled(0, 3),
            timeout_s=120,
            what="3 members place 60",
            logs=workspace.logs,
        )
        counts = {m["member_id"]: m["running"] for m in placed["members"]}
        assert all(16 <= count <= 24 for count in counts.values()), counts
        assert sum(counts.values()) == 60

        victim = next(m for m in placed["members"] if m["pid"] == fleet.processes[2].pid)
        kill_hard(fleet.processes[2])
        await fleet.processes[2].wait()
        publish(workspace, "orders", range(20, 40))
        after = await eventually(
            lambda: fleet.settled(0, 2),
            timeout_s=60,
            what="2 members take over",
            logs=workspace.logs,
        )
        assert victim["member_id"] not in {m["member_id"] for m in after["members"]}
        assert sum(m["running"] for m in after["members"]) == 60

        expected = {(f"/{name}", f"order-{n}") for name in names for n in range(40)}

        def delivered() -> set[tuple[str, str]]:
            return {(e.path, json.loads(e.body)["id"]) for e in handler.ledger if e.done}

        async def everything() -> bool:
            return delivered() >= expected

        def missing() -> str:
            lost = sorted(expected - delivered())
            paths = sorted({path for path, _ in lost})
            return workspace.logs() + f"\n{len(lost)} missing, of {paths}"

        await eventually(everything, timeout_s=120, what="every message delivered", logs=missing)
        for process in fleet.processes[:2]:
            assert await stop_gracefully(process) == 0, workspace.logs()[-4000:]
    assert delivered() == expected  # nothing lost, nothing from elsewhere


async def test_two_replicas_of_one_integration_hold_its_rate_limit_together(
    fleet: Fleet, workspace: Workspace
) -> None:
    async with HandlerServer() as handler:
        workspace.write_integration(
            "heavy",
            integration_yaml(
                "heavy",
                handler.url,
                workers=16,
                extra="replicas: all\nrate_limits: {main: 200}\n",
            ),
        )
        workspace.cli("topics", "create", "orders", "--partitions", "4")
        for n in range(2):
            await fleet.start(n)

        async def both_run_it() -> Any:
            placed = await fleet.settled(0, 2)
            status = await fleet.get(1, "/integrations/heavy")
            if placed is None or status is None:
                return None
            assigned = [f["assigned_partitions"] for f in status["flows"] if f["flow"] == "main"]
            return len(placed["integrations"][0]["running"]) == 2 and assigned[0] > 0

        await eventually(both_run_it, timeout_s=60, what="both run it", logs=workspace.logs)

        async def halved() -> bool:
            # Each replica takes its share once its next poll sees the other run it too.
            limits = await fleet.get(0, "/integrations/heavy")
            return (
                limits is not None
                and {r["flow"]: r["limit"] for r in limits["rate_limits"]}["main"] == 100
            )

        await eventually(halved, timeout_s=30, what="each runner's share", logs=workspace.logs)
        published_at = time.monotonic()
        publish(workspace, "orders", range(2400))

        async def all_arrived() -> bool:
            return len({e.id for e in handler.ledger if e.done}) >= 2400

        await eventually(all_arrived, timeout_s=120, what="2400 delivered", logs=workspace.logs)
        for process in fleet.processes:
            assert await stop_gracefully(process) == 0
        last_arrival = max(e.received_monotonic for e in handler.ledger)
    # Each runner's bucket holds 50 ms of its share (nemesis.resilience.limits), so the
    # two sending their shares of 200/s need at least (2400 - 2 * 5) / 200 s; a replica
    # that took the whole limit for itself would finish in half that. A loaded host only
    # makes the run longer: this bounds the rate from above without timing the handler.
    assert last_arrival - published_at >= (2400 - 2 * 5) / 200 * 0.95


async def test_a_patch_on_one_replica_holds_on_the_other_and_after_a_restart(
    fleet: Fleet, workspace: Workspace
) -> None:
    async with HandlerServer() as handler:
        workspace.write_integration(
            "loyalty", integration_yaml("loyalty", handler.url, workers=4, extra="replicas: all\n")
        )
        workspace.cli("topics", "create", "orders", "--partitions", "2")
        for n in range(2):
            await fleet.start(n)
        await eventually(
            lambda: fleet.settled(0, 2), timeout_s=60, what="2 members", logs=workspace.logs
        )
        patched = await fleet.patch(0, "loyalty", {"delivery": {"workers": 7}})
        assert patched.status_code == 200, patched.text

        async def workers_on(n: int) -> Any:
            status = await fleet.get(n, "/integrations/loyalty")
            if status is None:
                return None
            drift = {s["field"]: s["value"] for s in status["drift"]}
            return drift.get("delivery.workers") == 7 and status

        seen = await eventually(
            lambda: workers_on(1), timeout_s=30, what="the PATCH on replica 1", logs=workspace.logs
        )
        main = next(f for f in seen["flows"] if f["flow"] == "main")
        assert main["workers"] == 7

        assert await stop_gracefully(fleet.processes[1]) == 0
        await fleet.start(1)
        await eventually(
            lambda: workers_on(1),
            timeout_s=60,
            what="the PATCH after a restart",
            logs=workspace.logs,
        )
        stored = await fleet.get(1, "/fleet")
        [override] = stored["overrides"]
        assert (override["integration"], override["field"], override["value"]) == (
            "loyalty",
            "delivery.workers",
            7,
        )
        for process in fleet.processes:
            assert await stop_gracefully(process) == 0


async def test_fleet_status_shows_members_and_assignments(
    fleet: Fleet, workspace: Workspace, tmp_path: Path
) -> None:
    async with HandlerServer() as handler:
        for name in ("alpha", "beta"):
            workspace.write_integration(name, integration_yaml(name, handler.url))
        workspace.cli("topics", "create", "orders", "--partitions", "2")
        process = await fleet.start(0)
        await eventually(
            lambda: fleet.settled(0, 1), timeout_s=60, what="1 member", logs=workspace.logs
        )
        shown = workspace.cli("fleet", "status", "-c", "replica-0.yaml", "--json")
        assert shown.returncode == 0, shown.stderr
        status = json.loads(shown.stdout)
        [member] = status["members"]
        assert (member["pid"], member["running"]) == (process.pid, 2)
        assert [(i["name"], i["running"]) for i in status["integrations"]] == [
            ("alpha", [member["member_id"]]),
            ("beta", [member["member_id"]]),
        ]
        text = workspace.cli("fleet", "status", "-c", "replica-0.yaml")
        assert f"pid {process.pid}  runs 2" in text.stdout

        async with httpx.AsyncClient(timeout=5) as client:
            scrape = samples((await client.get(fleet.url(0, "/metrics"))).text)
        assert value_of(scrape, "nemesis_fleet_members", state="active") == 1
        assert value_of(scrape, "nemesis_fleet_integrations", state="running") == 2
        assert value_of(scrape, "nemesis_fleet_integrations", state="placed") == 2
        assert value_of(scrape, "nemesis_fleet_unplaced_integrations") == 0
        assert value_of(scrape, "nemesis_fleet_generation") == status["generation"]
        errors = {labels["operation"] for labels, _ in scrape["nemesis_fleet_state_errors_total"]}
        assert {"heartbeat", "generation", "view"} <= errors
        assert value_of(scrape, "nemesis_fleet_handovers_total") == 0  # nothing moved
        assert value_of(scrape, "nemesis_fleet_handover_duration_seconds_count") == 0
        synced = value_of(scrape, "nemesis_fleet_last_sync_timestamp_seconds")
        assert member["started_at"] <= synced
        lease = value_of(scrape, "nemesis_fleet_lease_expiry_timestamp_seconds")
        assert 0 < lease - synced <= LEASE_S
        assert await stop_gracefully(process) == 0
        left = json.loads(workspace.cli("fleet", "status", "-c", "replica-0.yaml", "--json").stdout)
        assert left["members"] == []  # a replica that stops leaves the fleet
