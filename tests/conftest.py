"""Shared fixtures: real SQLite files under tmp_path, real servers on 127.0.0.1, the real CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config.models import EmbeddedBackendConfig
from tests.kafka_broker import kafka
from tests.postgres_server import postgres_dsn, postgres_server

__all__ = [
    "kafka",
    "postgres_dsn",
    "postgres_server",
]  # fixtures: Kafka, PostgreSQL, a database per test

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Workspace:
    """A folder with nemesis.yaml and integrations/, as a user would have it."""

    root: Path
    lease_s: float = 10.0
    processes: list[asyncio.subprocess.Process] = field(default_factory=list)
    log_files: list[IO[bytes]] = field(default_factory=list)

    @property
    def db_path(self) -> Path:
        return self.root / "nemesis.db"

    def write_config(self, extra: str = "") -> Path:
        # Any free port for the admin API and the viewer unless ``extra`` sets them: a
        # taken admin port stops `nemesis run`, and tests share the machine.
        listeners = "".join(
            f"{name}: {{port: 0}}\n" for name in ("admin", "viewer") if f"{name}:" not in extra
        )
        path = self.root / "nemesis.yaml"
        path.write_text(
            "backend:\n"
            "  kind: embedded\n"
            f"  path: {self.db_path}\n"
            f"  lease_s: {self.lease_s}\n"
            "data_dir: .\n"
            "integrations_dir: integrations\n" + listeners + extra
        )
        (self.root / "integrations").mkdir(exist_ok=True)
        return path

    def write_integration(self, name: str, text: str) -> Path:
        path = self.root / "integrations" / f"{name}.yaml"
        path.write_text(text)
        return path

    def cli(
        self, *args: str, input: bytes | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Runs the real CLI in a subprocess and waits for it."""
        return subprocess.run(
            [sys.executable, "-m", "nemesis", *args],
            cwd=self.root,
            input=None if input is None else input.decode(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    async def start(self, *args: str) -> asyncio.subprocess.Process:
        """Starts a long-running CLI command (``run``) in a subprocess."""
        log_file = (self.root / f"stderr-{len(self.processes)}.log").open("wb")
        self.log_files.append(log_file)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "nemesis",
            *args,
            cwd=self.root,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log_file,
        )
        self.processes.append(process)
        return process

    async def open_broker(self) -> EmbeddedBroker:
        return await open_embedded(
            EmbeddedBackendConfig(path=str(self.db_path), lease_s=self.lease_s)
        )

    async def wait_for_log(
        self, process: asyncio.subprocess.Process, text: str, timeout_s: float = 60
    ) -> None:
        """Waits until the process started by ``start`` has logged ``text``."""
        log_file = self.log_files[self.processes.index(process)]
        path = Path(log_file.name)
        async with asyncio.timeout(timeout_s):
            while text not in await asyncio.to_thread(path.read_text, errors="replace"):
                assert process.returncode is None, f"exited {process.returncode}:\n{self.logs()}"
                await asyncio.sleep(0.05)

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace") for p in sorted(self.root.glob("stderr-*.log"))
        )


@pytest.fixture
async def workspace(tmp_path: Path) -> AsyncIterator[Workspace]:
    space = Workspace(tmp_path)
    space.write_config()
    yield space
    for process in space.processes:
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
            await process.wait()
    for log_file in space.log_files:
        log_file.close()


async def stop_gracefully(process: asyncio.subprocess.Process, timeout_s: float = 30) -> int:
    """SIGTERM, then the exit code (SIGKILL and a failure if it does not stop in time)."""
    process.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(timeout_s):
            return await process.wait()
    except TimeoutError:
        process.send_signal(signal.SIGKILL)
        await process.wait()
        pytest.fail(f"process {process.pid} did not stop within {timeout_s}s of SIGTERM")


def kill_hard(process: asyncio.subprocess.Process) -> None:
    os.kill(process.pid, signal.SIGKILL)


def integration_yaml(
    name: str,
    url: str,
    *,
    topic: str = "orders",
    workers: int = 32,
    buffer: int = 1000,
    tiers: Sequence[str] = ("100ms", "200ms", "500ms"),
    headers: dict[str, str] | None = None,
    extra: str = "",
) -> str:
    header_yaml = ", ".join(f"{k}: {v}" for k, v in (headers or {}).items())
    return (
        f"name: {name}\n"
        "owners: [team-test]\n"
        f"source: {{topic: {topic}, consumer: {name}}}\n"
        f"target: {{url: '{url}', timeout_s: 5, headers: {{{header_yaml}}}}}\n"
        f"delivery: {{workers: {workers}, buffer: {buffer}}}\n"
        f"retry: {{tiers: [{', '.join(tiers)}]}}\n" + extra
    )


def order_descriptor_set(directory: Path) -> Path:
    """``directory/orders.pb``: a descriptor set of ``shop.v1.Order`` (city, amount_kop, paid)."""
    descriptor_pb2: Any = pytest.importorskip("google.protobuf.descriptor_pb2")
    files = descriptor_pb2.FileDescriptorSet()
    proto = files.file.add(name="shop/order.proto", package="shop.v1", syntax="proto3")
    order = proto.message_type.add(name="Order")
    kinds = descriptor_pb2.FieldDescriptorProto
    for number, (name, kind) in enumerate(
        [("city", kinds.TYPE_STRING), ("amount_kop", kinds.TYPE_INT64), ("paid", kinds.TYPE_BOOL)],
        start=1,
    ):
        order.field.add(name=name, number=number, type=kind, label=kinds.LABEL_OPTIONAL)
    path = directory / "orders.pb"
    path.write_bytes(files.SerializeToString())
    return path
