"""End to end through the real CLI in subprocesses, against a real handler on loopback."""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import orjson
import pytest

from nemesis.testing import HandlerServer, Ledger, LedgerEntry
from tests.conftest import Workspace, integration_yaml, kill_hard, stop_gracefully

pytestmark = pytest.mark.slow


def write_orders(path: Path, count: int, start: int = 0) -> set[str]:
    ids = set()
    with path.open("wb") as out:
        for n in range(start, start + count):
            order_id = f"order-{n}"
            ids.add(order_id)
            out.write(orjson.dumps({"id": order_id, "city": "msk", "amount": n % 500}) + b"\n")
    return ids


def order_id(entry: LedgerEntry) -> str:
    return str(json.loads(entry.body)["id"])


def publish(workspace: Workspace, topic: str, count: int, partitions: int = 4) -> set[str]:
    created = workspace.cli("topics", "create", topic, "--partitions", str(partitions))
    assert created.returncode == 0, created.stderr
    ids = write_orders(workspace.root / "orders.jsonl", count)
    published = workspace.cli(
        "publish", topic, "--file", "orders.jsonl", "--lines", "--key-field", "id", timeout=120
    )
    assert published.returncode == 0, published.stderr
    assert f"written {count} message(s)" in published.stdout
    return ids


def describe(workspace: Workspace, topic: str) -> dict[str, object]:
    described = workspace.cli("topics", "describe", topic, "--json")
    assert described.returncode == 0, described.stderr
    document: dict[str, object] = json.loads(described.stdout)
    return document


async def test_run_delivers_every_published_message(workspace: Workspace) -> None:
    ids = publish(workspace, "orders", 10_000)
    async with HandlerServer() as handler:
        workspace.write_integration("loyalty", integration_yaml("loyalty", handler.url, workers=32))
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(10_000, timeout_s=120)
        assert await stop_gracefully(proxy) == 0, workspace.logs()
        delivered = {order_id(e) for e in handler.ledger if e.done}
    assert delivered == ids
    partitions = describe(workspace, "orders")["partitions"]
    assert isinstance(partitions, list)
    assert sum(p["end_offset"] for p in partitions) == 10_000
    for p in partitions:
        assert p["committed"]["loyalty"] == p["end_offset"], p


async def test_commit_never_passes_an_unfinished_message(workspace: Workspace) -> None:
    """Handler answers in random order; at every look, all offsets below the commit arrived."""
    publish(workspace, "orders", 3000)
    async with HandlerServer(seed=3) as handler:
        handler.delay(0.0, 0.03)
        workspace.write_integration("loyalty", integration_yaml("loyalty", handler.url, workers=32))
        proxy = await workspace.start("run")
        broker = await workspace.open_broker()
        looks = 0
        widest_gap = 0
        try:
            while len(handler.ledger.done_ids()) < 3000:
                await asyncio.sleep(0.05)
                description = await broker.admin.describe_topic("orders")
                arrived = {(e.partition, e.offset) for e in handler.ledger if e.done}
                for partition in description.partitions:
                    committed = partition.committed.get("loyalty", 0)
                    missing = [
                        o for o in range(committed) if (partition.partition, o) not in arrived
                    ]
                    assert not missing, f"{partition.partition}: {committed} before {missing[:5]}"
                    here = [o for p, o in arrived if p == partition.partition and o is not None]
                    if here:
                        widest_gap = max(widest_gap, max(here) + 1 - committed)
                looks += 1
        finally:
            await broker.close()
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    assert looks > 5
    # Commits really ran behind deliveries in flight (else this test proves nothing).
    assert widest_gap > 1


async def test_kill_9_loses_nothing_and_bounds_duplicates(workspace: Workspace) -> None:
    count, kills, buffer, partitions = 20_000, 4, 500, 4
    ids = publish(workspace, "orders", count, partitions)
    rng = random.Random(11)
    async with HandlerServer(seed=5) as handler:
        # Slow enough (about 2,000 msg/s) that every kill lands mid-run, however fast the
        # proxy: each proxy is killed within a second of its first delivery.
        handler.delay(0.002, 0.006)
        workspace.write_integration(
            "loyalty", integration_yaml("loyalty", handler.url, workers=8, buffer=buffer)
        )
        for _ in range(kills):
            proxy = await workspace.start("run")
            # Kill at a random moment once it is delivering (not while it is still starting).
            before = len(handler.ledger)

            def delivering(ledger: Ledger, before: int = before) -> bool:
                return len(ledger) > before

            await handler.ledger.wait_until(delivering, timeout_s=60)
            await asyncio.sleep(rng.uniform(0.1, 1.0))
            kill_hard(proxy)
            await proxy.wait()
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(count, timeout_s=180)
        # Earlier proxies may have delivered every message already: the last one is
        # stopped once it runs (a SIGTERM at interpreter start-up is Python's own).
        await workspace.wait_for_log(proxy, "admin API listening")
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    delivered = Counter(order_id(e) for e in handler.ledger if e.done)
    assert set(delivered) == ids, f"lost {len(ids - set(delivered))}"
    duplicates = sum(n - 1 for n in delivered.values())
    # A kill can only redeliver what was read and not committed: at most `buffer` per partition.
    assert duplicates <= kills * partitions * buffer, duplicates
    print(f"kill -9 x{kills}: {duplicates} duplicate deliveries of {count}")


async def test_second_process_takes_over_a_killed_ones_partitions(tmp_path: Path) -> None:
    count = 4000
    a, b = Workspace(tmp_path / "a", lease_s=1.5), Workspace(tmp_path / "b", lease_s=1.5)
    for space in (a, b):
        space.root.mkdir()
        space.write_config()
    # Both proxies use one log file and one consumer name.
    b.root.joinpath("nemesis.yaml").write_text(a.root.joinpath("nemesis.yaml").read_text())
    ids = publish(a, "orders", count)
    try:
        async with HandlerServer(seed=9) as handler:
            handler.delay(0.01)
            for name, space in (("a", a), ("b", b)):
                space.write_integration(
                    "shared",
                    integration_yaml(
                        "shared", handler.url, workers=2, buffer=20, headers={"x-proxy": name}
                    ),
                )
            proxy_a = await a.start("run")
            proxy_b = await b.start("run")

            def by(name: str) -> set[int]:
                return {
                    e.partition
                    for e in handler.ledger
                    if e.headers.get("x-proxy") == name and e.partition is not None
                }

            await handler.ledger.wait_until(
                lambda _: len(by("a")) >= 1 and len(by("b")) >= 1, timeout_s=30
            )
            owned_by_a = by("a")
            assert owned_by_a.isdisjoint(by("b")) or len(owned_by_a | by("b")) == 4
            kill_hard(proxy_a)
            await proxy_a.wait()
            # Lease 1.5 s: the survivor takes the dead one's partitions once it expires.
            await handler.ledger.wait_until(lambda _: by("b") >= owned_by_a, timeout_s=15)
            await handler.ledger.wait_for(count, timeout_s=120)
            assert await stop_gracefully(proxy_b) == 0, b.logs()
        delivered = {order_id(e) for e in handler.ledger if e.done}
        assert delivered == ids
    finally:
        for space in (a, b):
            for process in space.processes:
                if process.returncode is None:
                    kill_hard(process)
                    await process.wait()
            for log_file in space.log_files:
                log_file.close()


def test_validate_reports_every_broken_file_without_traceback(workspace: Workspace) -> None:
    integrations = workspace.root / "integrations"
    (integrations / "unknown-key.yaml").write_text(
        integration_yaml("unknown-key", "http://127.0.0.1:1/").replace("timeout_s", "timout_s")
    )
    (integrations / "wrong-type.yaml").write_text(
        integration_yaml("wrong-type", "http://127.0.0.1:1/").replace(
            "workers: 32", "workers: many"
        )
    )
    (integrations / "missing.yaml").write_text(
        "name: missing\nowners: [a]\nsource: {topic: t, consumer: c}\n"
    )
    (integrations / "broken.yaml").write_text("name: broken\nowners: [a\n")
    (integrations / "dup.yaml").write_text(integration_yaml("unknown-key", "http://127.0.0.1:1/"))
    result = workspace.cli("validate", "integrations")
    assert result.returncode == 1
    assert "Traceback" not in result.stdout + result.stderr
    out = result.stdout
    assert "integrations/unknown-key.yaml:4: target.timout_s" in out
    assert "integrations/wrong-type.yaml:5: delivery.workers" in out
    assert "integrations/missing.yaml:1: target" in out
    assert "integrations/broken.yaml:3: invalid YAML: while parsing a flow sequence (line 2)" in out
    assert "integrations/dup.yaml:1: name" in out


def test_validate_accepts_the_shipped_examples() -> None:
    from tests.conftest import REPO

    result = Workspace(REPO).cli("validate", "integrations", "nemesis.example.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_pipeline_commands(workspace: Workspace) -> None:
    from tests.conftest import REPO

    shipped = Workspace(REPO).cli("test-pipelines", "pipelines")
    assert shipped.returncode == 0, shipped.stdout + shipped.stderr
    assert "cases passed" in shipped.stdout
    sample = workspace.root / "sample.jsonl"
    sample.write_text(
        "\n".join(
            json.dumps({"order": {"city": city, "amount": amount}})
            for city in ("msk", "spb", "kzn", "nsk")
            for amount in (500, 1500)
        )
    )
    dry = workspace.cli(
        "test-pipelines",
        "--sample",
        str(sample),
        "--pipeline",
        str(REPO / "pipelines/city-filter.yaml"),
    )
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "75" in dry.stdout  # three quarters of the sample filtered
    pipelines = workspace.root / "pipelines"
    pipelines.mkdir()
    (pipelines / "bad.yaml").write_text(
        "stages:\n  - filter:\n      match:\n        order.amount: {gtt: 5}\n  - nosuchstage: {}\n"
    )
    broken = workspace.cli("validate", "pipelines")
    assert broken.returncode == 1
    assert "Traceback" not in broken.stdout + broken.stderr
    assert "pipelines/bad.yaml:4: stages[0].filter.match.order.amount.gtt" in broken.stdout
    assert "pipelines/bad.yaml:5: stages[1]" in broken.stdout


def test_demo_runs_and_delivers(workspace: Workspace) -> None:
    result = workspace.cli(
        "demo",
        "--duration",
        "7",
        "--rate",
        "200",
        "--dir",
        "demo",
        "--viewer-port",
        "0",
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("produced")]
    assert lines, result.stdout
    counts = {
        name.strip(): int(value) for name, value in re.findall(r"([a-z -]+?) +(\d+)", lines[-1])
    }
    produced, filtered, delivered, dead = (
        counts[name] for name in ("produced", "filtered", "delivered", "dead-lettered")
    )
    assert produced > 500
    assert 0 < delivered < produced
    assert filtered > delivered  # most orders are filtered inside the proxy
    assert dead > 0  # orders above 480 are rejected by the sample handler
    assert (workspace.root / "demo" / "integrations" / "demo-orders.yaml").exists()
    # The viewer's user and this run's password, as the README says.
    [viewer] = [line for line in result.stdout.splitlines() if "DLQ viewer:" in line]
    assert re.search(r"http://127\.0\.0\.1:\d+/ \(demo / \S+\)$", viewer), viewer

    # The demo's parting hint runs as printed, with .venv/bin on PATH (the README's step).
    hint = re.search(r"look at them: (nemesis dlq list -c \S+)$", result.stdout, re.MULTILINE)
    assert hint, result.stdout
    bin_dir = Path(sys.executable).parent
    hinted = subprocess.run(
        ["bash", "-c", f'export PATH="{bin_dir}:$PATH"; {hint.group(1)}'],
        cwd=workspace.root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert hinted.returncode == 0, hinted.stderr
    assert "http_4xx" in hinted.stdout

    # The DLQ from a terminal, on what the demo left behind.
    config = str(workspace.root / "demo" / "nemesis.yaml")
    listed = workspace.cli("dlq", "list", "-c", config, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert len(rows) >= dead
    assert {r["reason"] for r in rows} == {"http_4xx"}
    assert all(r["http_status"] == 422 and json.loads(r["payload"])["amount"] > 480 for r in rows)
    shown = workspace.cli("dlq", "show", rows[0]["id"], "-c", config)
    assert shown.returncode == 0, shown.stderr
    assert "amount above the loyalty limit" in shown.stdout
    unconfirmed = workspace.cli("dlq", "discard", rows[0]["id"], "-c", config)
    assert unconfirmed.returncode == 1
    assert "--yes" in unconfirmed.stderr
    discarded = workspace.cli("dlq", "discard", rows[0]["id"], "--yes", "--by", "bob", "-c", config)
    assert discarded.returncode == 0, discarded.stderr
    assert "discarded 1 dead letter(s)" in discarded.stdout
    requeued = workspace.cli("dlq", "requeue", "--all-matching", "--yes", "-c", config)
    assert requeued.returncode == 0, requeued.stderr
    assert f"requeued {len(rows) - 1} dead letter(s)" in requeued.stdout
    after = workspace.cli("dlq", "list", "-c", config, "--json")
    statuses = sorted(json.loads(line)["status"] for line in after.stdout.splitlines())
    assert statuses == ["discarded"] + ["requeued"] * (len(rows) - 1)
    bad = workspace.cli("dlq", "list", "-c", config, "--text", "x" * 5000)
    assert bad.returncode == 1
    assert "Traceback" not in bad.stderr


def test_init_creates_what_the_configuration_needs_idempotently(workspace: Workspace) -> None:
    workspace.write_integration("loyalty", integration_yaml("loyalty", "http://127.0.0.1:1/"))
    missing = workspace.cli("init")
    assert missing.returncode == 1
    assert "topic orders: missing" in missing.stdout
    first = workspace.cli("init", "--create-sources")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "topic nemesis.retry.loyalty.1: created" in first.stdout
    assert "topic nemesis.replay.loyalty: created" in first.stdout
    again = workspace.cli("init", "--create-sources")
    assert again.returncode == 0
    assert "created" not in again.stdout
    assert "added" not in again.stdout
    topics = workspace.cli("topics", "list").stdout.split()
    assert {"orders", "nemesis.replay.loyalty", "nemesis.retry.loyalty.3"} <= set(topics)


async def test_a_restart_after_kill_9_takes_its_own_leases_back_at_once(tmp_path: Path) -> None:
    """With 60 s leases, the restarted proxy delivers long before its dead one's would expire.

    It recognises its predecessor (this host, a pid that is gone) and takes the
    partitions over at its first heartbeat instead of waiting out the lease.
    """
    workspace = Workspace(tmp_path, lease_s=60)
    workspace.write_config()
    publish(workspace, "orders", 8)
    try:
        async with HandlerServer() as handler:
            workspace.write_integration("loyalty", integration_yaml("loyalty", handler.url))
            first = await workspace.start("run")
            await handler.ledger.wait_for(8, timeout_s=60)
            kill_hard(first)
            await first.wait()
            more = workspace.root / "more.jsonl"
            write_orders(more, 8, start=100)
            published = workspace.cli("publish", "orders", "--file", str(more), "--lines")
            assert published.returncode == 0, published.stderr
            await workspace.start("run")
            # Well inside the 60 s the dead process's leases would still run.
            await handler.ledger.wait_until(
                lambda ledger: (
                    {f"order-{n}" for n in range(100, 108)}
                    <= {order_id(e) for e in ledger if e.done}
                ),
                timeout_s=30,
            )
    finally:
        for process in workspace.processes:
            if process.returncode is None:
                kill_hard(process)
                await process.wait()
        for log_file in workspace.log_files:
            log_file.close()
