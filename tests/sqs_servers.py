"""Two SQS-API servers for the tests, on 127.0.0.1: moto's server mode and ElasticMQ.

Two implementations written apart from each other (moto in Python, from
PyPI; ElasticMQ in Scala, from Maven Central through ``tests/sqs/pom.xml``),
so that a test passing against both is not tuned to one's quirks.

- ``start_moto(directory)``: ``python -m moto.server`` on a free port. With
  ``authenticate=True`` it checks every request's signature against the IAM
  users it knows (none): any key is refused, as a real service refuses a
  wrong one.
- ``start_elasticmq(directory)``: ElasticMQ's server in one small JVM, its
  classpath resolved once and cached (``tests/maven.py``), its log in
  ``elasticmq.log``. It keeps SQS's limits (``sqs-limits = strict``) and
  checks no signatures.

The ``sqs_server`` fixture is one server per test module, parametrised over
both (a module's cases run against moto, then against ElasticMQ); each case
makes queues of its own (``queue_name``). Neither server needs credentials
that mean anything, but the client needs some: ``aws_env`` sets a test pair
in the environment, where the usual AWS chain finds it, and turns off the
instance-metadata lookup so that the chain never leaves the machine.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.kafka_broker import free_port
from tests.maven import maven_classpath

POM = Path(__file__).resolve().parent / "sqs" / "pom.xml"
REGION = "eu-central-1"  # moto knows only the regions of Amazon SQS

ELASTICMQ_CONF = """\
include classpath("application.conf")
node-address {{ protocol = http, host = "127.0.0.1", port = {port}, context-path = "" }}
rest-sqs {{ enabled = true, bind-port = {port}, bind-hostname = "127.0.0.1", sqs-limits = strict }}
rest-stats {{ enabled = false }}
aws {{ region = "{region}", accountId = "000000000000" }}
"""
ELASTICMQ_READY = b"started in"


@dataclass
class SqsServer:
    """One SQS-API server process; ``endpoint`` is its URL."""

    name: str
    endpoint: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def failure(self, what: str) -> RuntimeError:
        tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
        return RuntimeError(f"{self.name} {what} (see {self.log_path}):\n" + "\n".join(tail))


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def start_moto(directory: Path, *, authenticate: bool = False) -> SqsServer:
    """moto's server mode, ready to answer."""
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log_path = directory / "moto.log"
    env = dict(os.environ)
    if authenticate:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
    server = SqsServer("moto", f"http://127.0.0.1:{port}", process, log_path)
    _wait_ready(server, lambda: _accepts(port))
    return server


def start_elasticmq(directory: Path, *, heap_mb: int = 256) -> SqsServer:
    """ElasticMQ's server (one JVM), ready to answer."""
    classpath = maven_classpath(POM, "elasticmq", "ElasticMQ")
    directory.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = directory / "elasticmq.conf"
    conf.write_text(ELASTICMQ_CONF.format(port=port, region=REGION))
    log_path = directory / "elasticmq.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [
                "java",
                f"-Xmx{heap_mb}m",
                "-XX:+UseSerialGC",
                "-XX:TieredStopAtLevel=1",
                "-XX:+ExitOnOutOfMemoryError",
                "-XX:-UsePerfData",
                "-Djava.awt.headless=true",
                f"-Dconfig.file={conf}",
                "-cp",
                classpath,
                "org.elasticmq.server.Main",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    server = SqsServer("elasticmq", f"http://127.0.0.1:{port}", process, log_path)
    _wait_ready(server, lambda: ELASTICMQ_READY in log_path.read_bytes() and _accepts(port))
    return server


def _wait_ready(server: SqsServer, ready: Callable[[], bool], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if server.process.poll() is not None:
            raise server.failure("exited before it was ready")
        if time.monotonic() > deadline:
            server.stop()
            raise server.failure(f"was not ready in {timeout_s:.0f} s")
        time.sleep(0.1)


STARTERS: dict[str, Callable[[Path], SqsServer]] = {
    "moto": start_moto,
    "elasticmq": start_elasticmq,
}


@pytest.fixture(scope="module", params=sorted(STARTERS))
def sqs_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SqsServer]:
    """One SQS-API server per module and implementation: moto, then ElasticMQ."""
    name: str = request.param
    server = STARTERS[name](tmp_path_factory.mktemp(name))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Test credentials where the AWS chain looks first; nothing read from the user's files."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nemesis-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "nemesis-test-secret")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    # The chain's last resort asks an address outside the machine: never in a test.
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in (
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
    ):
        monkeypatch.delenv(name, raising=False)


def queue_name(prefix: str = "q", *, fifo: bool = False) -> str:
    """A queue name of the test's own (the servers are shared by a module's cases)."""
    name = f"{prefix}-{secrets.token_hex(4)}"
    return name + ".fifo" if fifo else name


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60.0
) -> None:
    """Polls ``check`` until it holds; fails naming ``what`` after a generous deadline."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s:.0f} s: {what}")
        await asyncio.sleep(0.1)
