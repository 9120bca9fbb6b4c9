"""Real HTTP servers for the conformance suite, each started once per module.

nginx (Debian's package, started as an unprivileged configuration in a
temporary directory), uvicorn, aiohttp.web and Node's ``http`` module serve the
same routes (``servers/``):

- ``/ok``: 204;
- ``/status/N``: status N with the body ``answered N``;
- ``/chunked``: a 503 whose body ``answered in chunks`` comes in chunks
  (nginx, which cannot, answers ``/chunked`` with a plain 503 of that body);
- ``/close``: 204 with ``Connection: close``.

Each keeps idle connections open ``KEEPALIVE_S``, far shorter than the
transport's own keep-alive, so that the tests can watch a server close them.

Every test runs twice: on asyncio's own event loop and on uvloop (what
``nemesis run`` uses when the ``speed`` extra is installed).
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvloop

SERVERS_DIR = Path(__file__).parent / "servers"
KEEPALIVE_S = 1.0
_START_S = 15.0


@dataclass(frozen=True, slots=True)
class RealServer:
    """A running server: its name and where it listens."""

    name: str
    port: int

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    """asyncio's loop, then uvloop's, for every test of the suite."""
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def free_port() -> int:
    """A port on 127.0.0.1 where nothing listens (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def nginx_binary() -> str:
    """Debian installs nginx in /usr/sbin, which an unprivileged PATH may lack."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        pytest.fail("nginx is not installed (.ci/system-packages installs it)")
    return found


def wait_listening(process: subprocess.Popen[bytes], port: int) -> None:
    """Until ``port`` accepts connections; fails with the server's output if it exits."""
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            output = process.stdout.read().decode(errors="replace") if process.stdout else ""
            pytest.fail(f"the server exited with {process.returncode}: {output}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    process.kill()
    pytest.fail(f"nothing listens on port {port} after {_START_S}s")


def run(command: list[str], port: int, cwd: Path | None = None) -> Iterator[None]:
    """Starts ``command``, waits until it listens on ``port``, and stops it afterwards."""
    process = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
    )
    try:
        wait_listening(process, port)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


NGINX_CONF = """
worker_processes 1;
pid {prefix}/nginx.pid;
error_log stderr error;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_timeout {keepalive_ms}ms;
    server {{
        listen 127.0.0.1:{port};
        {tls_listen}
        location = /ok {{ return 204; }}
        location = /status/422 {{ return 422 "answered 422"; }}
        location = /status/503 {{ return 503 "answered 503"; }}
        location = /chunked {{ return 503 "answered in chunks"; }}
        location = /close {{ keepalive_timeout 0; return 204; }}
    }}
    {tls_servers}
}}
"""


def nginx(
    directory: Path, port: int, *, tls_listen: str = "", tls_servers: str = ""
) -> Iterator[None]:
    """nginx serving the routes on ``port``, configured and run from ``directory``."""
    conf = directory / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            prefix=directory,
            port=port,
            keepalive_ms=int(KEEPALIVE_S * 1000),
            tls_listen=tls_listen,
            tls_servers=tls_servers,
        )
    )
    command = [nginx_binary(), "-p", str(directory), "-c", str(conf), "-e", "stderr"]
    return run([*command, "-g", "daemon off;"], port)


def _serve(name: str, directory: Path) -> Iterator[RealServer]:
    port = free_port()
    if name == "nginx":
        started = nginx(directory, port)
    elif name == "uvicorn":
        started = run(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "asgi_app:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--timeout-keep-alive",
                str(int(KEEPALIVE_S)),
                "--no-access-log",
                "--log-level",
                "warning",
                "--http",
                "httptools",
                "--loop",
                "asyncio",
            ],
            port,
            cwd=SERVERS_DIR,
        )
    elif name == "aiohttp":
        started = run(
            [sys.executable, str(SERVERS_DIR / "aiohttp_app.py"), str(port), str(KEEPALIVE_S)],
            port,
        )
    else:
        node = shutil.which("node")
        if node is None:
            pytest.fail("node is not installed (.ci/system-packages installs it)")
        started = run(
            [node, str(SERVERS_DIR / "node_app.js"), str(port), str(int(KEEPALIVE_S * 1000))],
            port,
        )
    for _ in started:
        yield RealServer(name, port)


@pytest.fixture(scope="module", params=["nginx", "uvicorn", "aiohttp", "node"])
def real_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RealServer]:
    """Each real server in turn, started once for the module."""
    yield from _serve(request.param, tmp_path_factory.mktemp(request.param))
