"""Faults of the embedded log's files under a process that has them open.

The embedded log keeps WAL, whose index (``-shm``) SQLite maps into memory
whatever ``mmap_size`` says: other processes read the log while one appends,
which a rollback journal would serialize (see nemesis/sqlite_thread.py). So:

- the ``-shm`` removed, or the whole folder removed, under a process that
  writes and reads: the process goes on (the open files outlive their names);
- the ``-shm`` cut to nothing: SQLite's next look at the mapped index is a
  SIGBUS, which no setting of SQLite turns into an error. ``nemesis run`` then
  ends with the stack of every thread on stderr (faulthandler), and the next
  start delivers every message: the WAL on disk is whole.

The writer and reader run in a child process, so that a signal shows as its
exit code instead of ending the test run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully

# Appends and reads with commits, lets the test's fault happen, then goes on and says how.
_CHILD = textwrap.dedent(
    """
    import asyncio, shutil, sys
    from pathlib import Path
    from nemesis.broker.embedded import open_embedded
    from nemesis.broker.port import ConsumerSpec, OutgoingMessage
    from nemesis.config.models import EmbeddedBackendConfig
    from nemesis.errors import BrokerError

    folder, fault = Path(sys.argv[1]), sys.argv[2]
    path = folder / "log.db"

    async def turn(writer, reader):
        await writer.write([OutgoingMessage(value=b"x" * 500) for _ in range(50)])
        got = await reader.receive(1000, 0.5)
        if got:
            await reader.commit(got)
        return len(got)

    async def main():
        broker = await open_embedded(EmbeddedBackendConfig(path=str(path)))
        await broker.admin.create_topic("orders", partitions=1, consumers=[ConsumerSpec("c")])
        writer = await broker.writer("orders")
        reader = await broker.reader("orders", "c")
        read = 0
        for _ in range(20):
            read += await turn(writer, reader)
        if fault == "shm-removed":
            Path(f"{path}-shm").unlink()
        else:
            shutil.rmtree(folder)
        failed = after = 0
        for _ in range(40):
            try:
                after += await turn(writer, reader)
            except BrokerError as exc:
                failed += 1
        print(f"read {read} before, {after} after; {failed} of 40 turns failed")
        await reader.close()
        await writer.close()
        await broker.close()

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("fault", ["shm-removed", "folder-removed"])
def test_the_log_files_removed_under_a_process_leave_it_running(tmp_path: Path, fault: str) -> None:
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "log"), fault],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert child.returncode == 0, f"exit {child.returncode}\n{child.stderr}"
    assert child.stdout.startswith("read 1000 before, "), child.stdout
    assert "Traceback" not in child.stderr, child.stderr


async def publish(workspace: Workspace, count: int) -> None:
    broker = await workspace.open_broker()
    try:
        await broker.admin.create_topic(
            "orders", partitions=2, consumers=[ConsumerSpec("loyalty")], exist_ok=True
        )
        writer = await broker.writer("orders")
        await writer.write([OutgoingMessage(value=b'{"order": %d}' % n) for n in range(count)])
        await writer.close()
    finally:
        await broker.close()


async def test_a_wal_index_cut_under_the_proxy_ends_it_with_a_report_and_loses_nothing(
    workspace: Workspace,
) -> None:
    count = 200
    await publish(workspace, count)
    async with HandlerServer() as handler:
        workspace.write_integration("loyalty", integration_yaml("loyalty", handler.url))
        proxy = await workspace.start("run")
        await handler.ledger.wait_for(count, timeout_s=60)
        # This process must not open the log while the proxy maps the cut index: it
        # would meet the same signal. The proxy's own lease heartbeats touch it.
        os.truncate(f"{workspace.db_path}-shm", 0)
        async with asyncio.timeout(60):
            code = await proxy.wait()
        logs = workspace.logs()
        assert code == -signal.SIGBUS, f"exit {code}\n{logs}"
        assert "Fatal Python error: Bus error" in logs, logs
        assert "sqlite_thread.py" in logs, logs  # the stack says where: SQLite's threads

        # The next start rebuilds the index from the WAL: every message is still there.
        await publish(workspace, 100)
        proxy = await workspace.start("run")
        await handler.ledger.wait_until(lambda ledger: len(ledger.done_ids()) >= 300, 60)
        assert await stop_gracefully(proxy) == 0, workspace.logs()
