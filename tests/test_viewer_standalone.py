"""The viewer apart from the proxy: what it imports, where owners come from, how it requeues.

It reads owners from the configuration's integrations directory (every
integration, not only those one process runs), reads and writes dead
letters through the state store, requeues through ``nemesis.dlq.requeue``
with the replay topic as the broker describes it, and starts on its own
with ``python -m dlq_viewer -c nemesis.yaml``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import yaml

from dlq_viewer.actions import replay_requeuer
from dlq_viewer.app import create_app
from dlq_viewer.owners import ConfiguredIntegrations
from dlq_viewer.passwords import hash_token
from dlq_viewer.testing import (
    STANDARD_ACCESS,
    TEST_SECRET,
    letter,
    sign_in,
)
from nemesis.admin.server import plugin_services, serve_beside
from nemesis.backends import open_backend, open_dlq, open_state
from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config.loader import load_integrations, load_process_config
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.dlq import DeadLetterFilter, Status, open_sqlite_dlq
from nemesis.dlq.requeue import requeue
from nemesis.runtime.app import Proxy
from nemesis.testing.clock import FakeClock
from nemesis.topology import internal_consumer, replay_topic

ALICE, BOB, ROOT = STANDARD_ACCESS.people
ROOT_TOKEN = "nmsv_standalone-root-token-0123456789"
TEAM_B_TOKEN = "nmsv_standalone-team-b-token-0123456"
# The nemesis modules `import dlq_viewer` may load: the store, the broker port and the
# embedded log the SQLite store shares its thread with, the configuration (with the
# registry's module of each backend kind: models only, no client library), the topology.
MAX_NEMESIS_MODULES = 35


def integration_file(directory: Path, name: str, owners: list[str]) -> None:
    document = {
        "name": name,
        "owners": owners,
        "source": {"topic": "orders", "consumer": name},
        "target": {"url": "http://127.0.0.1:9/", "timeout_s": 2},
    }
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(document))


def test_importing_the_viewer_loads_nothing_of_the_runtime() -> None:
    script = (
        "import json, sys, dlq_viewer, dlq_viewer.__main__\n"
        "names = sorted(n for n in sys.modules if n == 'nemesis' or n.startswith('nemesis.'))\n"
        "print(json.dumps(names))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = json.loads(done.stdout)
    assert [name for name in loaded if name.startswith("nemesis.runtime")] == []
    assert [
        name for name in loaded if name.startswith(("nemesis.resilience", "nemesis.delivery"))
    ] == []
    assert "nemesis.dlq.requeue" in loaded
    assert len(loaded) <= MAX_NEMESIS_MODULES, loaded


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    try:
        yield opened
    finally:
        await opened.close()


async def test_a_missing_replay_topic_gets_as_many_partitions_as_the_source(
    tmp_path: Path, broker: EmbeddedBroker
) -> None:
    await broker.admin.create_topic("orders", partitions=3)
    store = await open_sqlite_dlq(tmp_path / "dlq.db")
    try:
        await store.put([letter("orders-a", n) for n in range(5)])
        ids = await store.select_ids(DeadLetterFilter(), 10)
        result = await requeue(store, broker, ids, by="test")
    finally:
        await store.close()
    assert result.count == 5
    described = await broker.admin.describe_topic(replay_topic("orders-a"))
    assert len(described.partitions) == 3
    assert list(described.consumers) == [internal_consumer("orders-a")]
    assert sum(p.end_offset for p in described.partitions) == 5


async def test_an_existing_replay_topic_is_used_as_the_broker_describes_it(
    tmp_path: Path, broker: EmbeddedBroker
) -> None:
    await broker.admin.create_topic("orders", partitions=3)
    await broker.admin.create_topic(replay_topic("orders-a"), partitions=2)  # no consumer yet
    store = await open_sqlite_dlq(tmp_path / "dlq.db")
    try:
        await store.put([letter("orders-a", n) for n in range(4)])
        result = await requeue(
            store, broker, await store.select_ids(DeadLetterFilter(), 10), by="t"
        )
    finally:
        await store.close()
    assert result.count == 4
    described = await broker.admin.describe_topic(replay_topic("orders-a"))
    assert len(described.partitions) == 2
    # The replay flow's consumer is added.
    assert list(described.consumers) == [internal_consumer("orders-a")]


async def test_owners_come_from_the_integrations_directory_and_follow_its_edits(
    tmp_path: Path, broker: EmbeddedBroker
) -> None:
    directory = tmp_path / "integrations"
    directory.mkdir()
    integration_file(directory, "orders-a", ["team-a"])
    integration_file(directory, "orders-b", ["team-b"])
    clock = FakeClock(wall_start=time.time())
    configured = ConfiguredIntegrations(directory, clock=clock, refresh_s=1.0)
    store = await open_sqlite_dlq(tmp_path / "dlq.db", clock=clock)
    try:
        await store.put([letter("orders-a", 1), letter("orders-b", 1)])
        app = create_app(
            store,
            integrations=configured,
            auth=STANDARD_ACCESS.config(),
            requeue=replay_requeuer(store, broker, clock=clock),
            clock=clock,
        )
        transport = httpx.ASGITransport(app=app)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=transport, base_url="http://viewer.test") as client,
        ):
            await sign_in(client, BOB)
            assert (await client.get("/api/me")).json()["integrations"] == ["orders-b"]
            integration_file(directory, "orders-a", ["team-a", "team-b"])
            (directory / "broken.yaml").write_text("name: [\n")
            clock.advance(1.0)
            me = (await client.get("/api/me")).json()
            assert me["integrations"] == ["orders-a", "orders-b"]
            rows = (await client.get("/api/messages", params={"status": "dead"})).json()["rows"]
            assert sorted(row["integration"] for row in rows) == ["orders-a", "orders-b"]
            # A file that stops validating keeps its last good owners.
            (directory / "orders-a.yaml").write_text("name: orders-a\nowners: 7\n")
            clock.advance(1.0)
            assert (await client.get("/api/me")).json()["integrations"] == [
                "orders-a",
                "orders-b",
            ]
    finally:
        await store.close()


def _config_dir(root: Path) -> Path:
    integrations = root / "integrations"
    integrations.mkdir(parents=True)
    integration_file(integrations, "orders-a", ["team-a"])
    integration_file(integrations, "orders-b", ["team-b"])
    config = {
        "data_dir": str(root / "data"),
        "integrations_dir": "integrations",
        "backend": {"kind": "embedded", "path": "log.db"},
        "dlq": {"kind": "sqlite", "path": "dlq.db"},
        "admin": {"enabled": False},
        "viewer": {"host": "127.0.0.1", "port": 0},
        "auth": {
            "session_secret": TEST_SECRET,
            "tokens": [
                {"name": "ops", "token_hash": hash_token(ROOT_TOKEN), "admin": True},
                {"name": "b-bot", "token_hash": hash_token(TEAM_B_TOKEN), "teams": ["team-b"]},
            ],
        },
    }
    (root / "data").mkdir()
    (root / "nemesis.yaml").write_text(yaml.safe_dump(config))
    return root / "nemesis.yaml"


async def _viewer_url(process: asyncio.subprocess.Process) -> str:
    assert process.stderr is not None
    seen = []
    async with asyncio.timeout(60):
        while line := (await process.stderr.readline()).decode():
            seen.append(line)
            if "DLQ viewer on http://" in line:
                return line.rsplit(" ", 1)[-1].strip()
    raise AssertionError(f"the viewer did not start: {''.join(seen)}")


async def test_python_m_dlq_viewer_serves_a_configuration_on_its_own(tmp_path: Path) -> None:
    path = _config_dir(tmp_path)
    data = tmp_path / "data"
    broker = await open_embedded(EmbeddedBackendConfig(path=str(data / "log.db")))
    try:
        await broker.admin.create_topic("orders", partitions=3)
    finally:
        await broker.close()
    store = await open_sqlite_dlq(data / "dlq.db")
    try:
        await store.put([letter("orders-a", n) for n in range(3)] + [letter("orders-b", 1)])
        a_ids = list(
            await store.select_ids(DeadLetterFilter(integrations=frozenset({"orders-a"})), 10)
        )
    finally:
        await store.close()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dlq_viewer",
        "-c",
        str(path),
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        url = await _viewer_url(process)
        auth = {"authorization": f"Bearer {ROOT_TOKEN}"}
        async with httpx.AsyncClient(base_url=url, headers=auth, timeout=30) as client:
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/api/me")).json()["name"] == "ops"
            listed = (await client.get("/api/messages")).json()["rows"]
            assert len(listed) == 4
            moved = await client.post("/api/requeue", json={"ids": a_ids})
            assert moved.json()["count"] == 3
    finally:
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            code = await process.wait()
    assert code == 0
    broker = await open_embedded(EmbeddedBackendConfig(path=str(data / "log.db")))
    try:
        described = await broker.admin.describe_topic(replay_topic("orders-a"))
    finally:
        await broker.close()
    assert len(described.partitions) == 3  # as the source topic, not a default
    assert sum(p.end_offset for p in described.partitions) == 3
    store = await open_sqlite_dlq(data / "dlq.db")
    try:
        rows = await store.get_many(a_ids)
    finally:
        await store.close()
    assert {row.status for row in rows} == {Status.REQUEUED}


def test_a_bad_configuration_is_refused_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "nemesis.yaml"
    path.write_text("viewer:\n  trusted_proxies: [not-a-network]\n")
    done = subprocess.run(
        [sys.executable, "-m", "dlq_viewer", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "viewer.trusted_proxies" in done.stderr


async def test_inside_nemesis_run_the_viewer_shows_every_configured_integration(
    tmp_path: Path,
) -> None:
    config = load_process_config(_config_dir(tmp_path))
    broker = await open_backend(config)
    dlq = await open_dlq(config, broker=broker)
    state = await open_state(config)
    try:
        await dlq.put([letter("orders-a", 1), letter("orders-b", 1)])
        # This process runs orders-a only (as one replica of a fleet would).
        only_a = {"orders-a": load_integrations(Path(config.integrations_dir))[0]["orders-a"]}
        proxy = Proxy(broker, only_a, dlq=dlq)
        services = plugin_services(config, proxy, dlq, broker, state)
        assert [service.name for service in services] == ["DLQ viewer"]
        seen: dict[str, object] = {}

        async def browse() -> None:
            # Team b's integration runs elsewhere; its owners still see its dead letters here.
            auth = {"authorization": f"Bearer {TEAM_B_TOKEN}"}
            async with httpx.AsyncClient(base_url=services[0].url, headers=auth) as client:
                seen["rows"] = (await client.get("/api/messages")).json()["rows"]

        await serve_beside(browse(), services)
    finally:
        await state.close()
        await dlq.close()
        await broker.close()
    rows = seen["rows"]
    assert isinstance(rows, list)
    assert [row["integration"] for row in rows] == ["orders-b"]


class _ConnectsWhenNamed(logging.Handler):
    """On the line naming the viewer's URL, connects at once, with the viewer's loop held."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[str] = []
        self.stop: Callable[[], None] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "DLQ viewer on http://" not in message:
            return
        host, port = message.rsplit("/", 1)[-1].rsplit(":", 1)
        try:
            # Blocking, inside the loop: the viewer cannot accept meanwhile, so only a
            # socket already listening (its backlog) completes the handshake.
            with socket.create_connection((host, int(port)), timeout=30):
                self.answers.append("connected")
        except OSError as exc:
            self.answers.append(f"refused: {exc}")
        if self.stop is not None:
            self.stop()


async def test_the_viewer_listens_before_it_names_its_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlq_viewer import __main__ as standalone
    from dlq_viewer import server as viewer_server_module

    config = load_process_config(_config_dir(tmp_path))
    handler = _ConnectsWhenNamed()
    built = viewer_server_module.viewer_server

    def keeping_stop(*args: object, **kwargs: object) -> viewer_server_module.ViewerServer:
        server = built(*args, **kwargs)  # type: ignore[arg-type]
        handler.stop = server.stop
        return server

    monkeypatch.setattr(standalone, "viewer_server", keeping_stop)
    standalone.log.addHandler(handler)
    standalone.log.setLevel(logging.INFO)
    try:
        async with asyncio.timeout(60):
            await standalone._serve(config)
    finally:
        standalone.log.removeHandler(handler)
    assert handler.answers == ["connected"]
