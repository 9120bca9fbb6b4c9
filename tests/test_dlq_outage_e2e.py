"""A DLQ that cannot write, end to end: ``nemesis run`` in a subprocess rides it out.

Real parts: the CLI in a subprocess on the embedded log, a handler server on
127.0.0.1 that rejects the messages marked poison (422: dead at once), the
sqlite DLQ in a folder whose files the test cuts under the process, or on a
small tmpfs mounted for the test and filled up (root can mount one, as in CI;
where mounting is refused the test says so and skips).
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully
from tests.kafka_broker import free_port
from tests.operability import samples, wait_until_true
from tests.test_disk_errors import fill, small_disk

__all__ = ["small_disk"]  # a fixture of this module too


def configure(workspace: Workspace, dlq: Path) -> str:
    """nemesis.yaml with the DLQ at ``dlq`` and the admin API on a port of its own."""
    port = free_port()
    workspace.write_config(
        f"dlq: {{kind: sqlite, path: {dlq}}}\nadmin: {{port: {port}}}\nviewer: {{enabled: false}}\n"
    )
    return f"http://127.0.0.1:{port}"


async def publish(workspace: Workspace, bodies: list[bytes]) -> None:
    broker = await workspace.open_broker()
    try:
        await broker.admin.create_topic(
            "orders", partitions=2, consumers=[ConsumerSpec("loyalty")], exist_ok=True
        )
        writer = await broker.writer("orders")
        await writer.write([OutgoingMessage(value=body) for body in bodies])
        await writer.close()
    finally:
        await broker.close()


def orders(first: int, count: int, *, poison_every: int = 0) -> list[bytes]:
    return [
        (b'{"poison": %d}' if poison_every and n % poison_every == 0 else b'{"order": %d}') % n
        for n in range(first, first + count)
    ]


def dead_letters(path: Path) -> int:
    """Rows in the DLQ file, read as another process reads it (0 while it cannot be read)."""
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5) as conn:
            return int(conn.execute("SELECT count(*) FROM dlq_letters").fetchone()[0])
    except sqlite3.Error:
        return 0


async def wait_for_rows(path: Path, count: int, timeout_s: float = 60) -> None:
    await wait_until_true(lambda: dead_letters(path) >= count, timeout_s, step_s=0.1)


def healthy(bodies: list[bytes]) -> list[bytes]:
    return [body for body in bodies if b"poison" not in body]


def delivered(handler: HandlerServer, bodies: list[bytes]) -> bool:
    done = {entry.body for entry in handler.ledger if entry.done}
    return all(body in done for body in healthy(bodies))


async def test_dlq_files_cut_under_a_running_proxy_leave_it_running(
    workspace: Workspace, tmp_path: Path
) -> None:
    dlq = tmp_path / "dlq" / "dlq.db"
    configure(workspace, dlq)
    first = orders(0, 40, poison_every=10)
    await publish(workspace, first)
    async with HandlerServer() as handler:
        handler.when(lambda entry: b"poison" in entry.body, status=422)
        workspace.write_integration("loyalty", integration_yaml("loyalty", handler.url))
        proxy = await workspace.start("run")
        await wait_for_rows(dlq, 4)
        # The DLQ's file and whatever lies beside it (WAL's memory-mapped -shm) cut to nothing.
        for path in dlq.parent.iterdir():
            os.truncate(path, 0)
        second = orders(100, 40, poison_every=10)
        await publish(workspace, second)
        await handler.ledger.wait_until(lambda _: delivered(handler, second), timeout_s=60)
        await workspace.wait_for_log(proxy, str(dlq))
        assert proxy.returncode is None, workspace.logs()
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    logs = workspace.logs()
    assert "the dead-letter store cannot write" in logs
    assert "Traceback" not in logs


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 60) -> None:
    """Asks ``check`` until it says yes (each answer is a request to the proxy)."""
    # Polling on purpose: the proxy is another process, with no event to wait on.
    async with asyncio.timeout(timeout_s):
        while not await check():  # noqa: ASYNC110
            await asyncio.sleep(0.1)


class Admin:
    """The proxy's admin API, as an operator and Prometheus see it."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def ready(self) -> tuple[int, list[str]]:
        answer = await self.client.get("/readyz")
        return answer.status_code, answer.json()["reasons"]

    async def is_ready(self) -> bool:
        return await self.ready() == (200, [])

    async def metric(self, name: str, **labels: str) -> float | None:
        found = samples((await self.client.get("/metrics")).text).get(name, [])
        values = [value for got, value in found if labels.items() <= got.items()]
        return sum(values) if values else None

    async def flow(self) -> tuple[dict[str, object], dict[str, str]]:
        status = (await self.client.get("/integrations/loyalty")).json()
        (main,) = [flow for flow in status["flows"] if flow["flow"] == "main"]
        return main, status["issues"]


async def test_a_full_dlq_disk_holds_back_the_dead_messages_alone(
    workspace: Workspace, small_disk: Path
) -> None:
    dlq = small_disk / "dlq" / "dlq.db"
    admin_url = configure(workspace, dlq)
    await publish(workspace, orders(0, 20, poison_every=10))
    async with HandlerServer() as handler, httpx.AsyncClient(base_url=admin_url) as client:
        admin = Admin(client)
        handler.when(lambda entry: b"poison" in entry.body, status=422)
        workspace.write_integration("loyalty", integration_yaml("loyalty", handler.url))
        proxy = await workspace.start("run")
        await wait_for_rows(dlq, 2)
        await eventually(admin.is_ready)

        filler = small_disk / "filler"
        fill(filler)
        second = orders(100, 200, poison_every=20)  # 10 poison among them
        await publish(workspace, second)
        # The healthy messages flow: each delivered, not one flow restart.
        await handler.ledger.wait_until(lambda _: delivered(handler, second), timeout_s=60)
        main = {"integration": "loyalty", "flow": "main"}

        async def all_dead_wait() -> bool:
            return await admin.metric("nemesis_dlq_waiting_messages", **main) == 10

        await eventually(all_dead_wait)
        assert await admin.metric("nemesis_flow_restarts_total", **main) == 0
        code, reasons = await admin.ready()
        assert code == 503
        [reason] = reasons
        assert reason.startswith("dlq_unavailable: ")
        assert "10 dead messages of loyalty wait" in reason
        assert "the disk is full" in reason
        flow, issues = await admin.flow()
        assert flow["dlq_waiting"] == 10
        assert issues["main"].startswith("dlq_unavailable: 10 dead messages")
        assert dead_letters(dlq) == 2
        assert proxy.returncode is None

        # Room again: the waiting messages are written without a restart or a hand.
        filler.unlink()
        await wait_for_rows(dlq, 12)
        await eventually(admin.is_ready)
        assert await admin.metric("nemesis_dlq_waiting_messages", **main) == 0
        assert await admin.metric("nemesis_flow_restarts_total", **main) == 0
        assert await stop_gracefully(proxy) == 0, workspace.logs()
    # Each poison message reached the handler once: it waited, it was not delivered again.
    poison = [entry for entry in handler.ledger if b"poison" in entry.body]
    assert len(poison) == 12
    logs = workspace.logs()
    assert logs.count("the dead-letter store cannot write") == 1, logs
    assert "the dead-letter store writes again" in logs
    assert "Traceback" not in logs
