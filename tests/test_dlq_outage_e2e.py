"""A DLQ that cannot write, end to end: ``nemesis run`` in a subprocess rides it out.

Real parts: the CLI in a subprocess on the embedded log, a handler server on
127.0.0.1 that rejects the messages marked poison (422: dead at once), the
sqlite DLQ in a folder whose files the test cuts under the process, or on a
small tmpfs mounted for the test and filled up (root can mount one, as in CI;
where mounting is refused the test says so and skips).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully
from tests.kafka_broker import free_port
from tests.operability import wait_until_true


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
    # (the flow's failure is logged with its traceback until dead messages can wait)
