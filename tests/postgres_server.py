"""A real PostgreSQL server for the tests: one per test session, a fresh database per test.

``postgres_server`` (session scope) runs ``initdb`` into a temporary folder
and starts ``postgres`` on 127.0.0.1 with a free port and its unix socket in
that folder, without fsync (a test's data need not survive a power cut),
and stops it when the session ends. It speaks TLS too, with a certificate
for 127.0.0.1 made for it (``ca_file``: that certificate, the CA to trust).
Under pytest-xdist each worker is a session of its own, so each starts its
own server. ``postgres_dsn`` creates a database for one test and drops it
afterwards.

PostgreSQL refuses to run as root, and CI runs the tests as root: then the
server runs as the ``postgres`` user (Debian's postgresql package creates
it), or ``nobody`` where there is none, and the folder is handed to that
user. The binaries come from Debian's packages
(``/usr/lib/postgresql/<version>/bin``) or ``PATH``; ``make system-packages``
installs them when missing.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import asyncpg
import pytest

SUPERUSER = "nemesis"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
# Settings for a throwaway server: no fsync, small memory, enough connections for a
# test's pools (asyncpg's default pool holds 10) and the fixture's own.
SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "shared_buffers": "32MB",
    "max_connections": "200",
    "log_min_messages": "warning",
}


@dataclass(frozen=True)
class PostgresServer:
    """A running server: TCP on 127.0.0.1 with a password, or trust on its unix socket."""

    host: str
    port: int
    user: str
    password: str
    socket_dir: Path
    log: Path
    ca_file: Path  # the server's self-signed certificate, for clients that verify it
    postmaster: Postmaster | None = field(default=None, compare=False, repr=False)

    def stop(self) -> None:
        """Stops the server (a fast shutdown: clients are cut off); ``start`` brings it back."""
        assert self.postmaster is not None
        self.postmaster.stop()

    def start(self) -> None:
        """Starts a stopped server again, on the same port and data."""
        assert self.postmaster is not None
        if not self.postmaster.start():
            pytest.fail("postgres did not start again:\n" + self.log.read_text(errors="replace"))

    def dsn(self, database: str = "postgres") -> str:
        """A libpq URL that signs in over TCP with the password."""
        return (
            f"postgresql://{quote(self.user)}:{quote(self.password, safe='')}"
            f"@{self.host}:{self.port}/{quote(database)}"
        )

    async def admin(self) -> asyncpg.Connection:
        """A superuser connection over the unix socket."""
        return await asyncpg.connect(
            host=str(self.socket_dir), port=self.port, user=self.user, database="postgres"
        )


def bin_dir() -> Path:
    """Where ``initdb`` and ``postgres`` are: the newest Debian version, else ``PATH``."""
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if versions:
        return versions[-1].parent
    initdb = shutil.which("initdb")
    if initdb is None:
        pytest.fail(
            "the PostgreSQL tests need a server's binaries (initdb, postgres): "
            "install Debian's postgresql package (make system-packages does)"
        )
    return Path(initdb).parent


def _runner() -> tuple[list[str], pwd.struct_passwd | None]:
    """The command prefix that drops root, and the user it becomes (None: stay as we are)."""
    if os.geteuid() != 0:
        return [], None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            user = pwd.getpwnam(name)
            break
    else:
        pytest.fail("the tests run as root and neither a postgres nor a nobody user exists")
    prefix = [
        "setpriv",
        f"--reuid={user.pw_uid}",
        f"--regid={user.pw_gid}",
        "--clear-groups",
        "--pdeathsig=SIGINT",  # a killed test run does not leave its server behind
        "--",
    ]
    return prefix, user


def make_certificate(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key: ``name``.crt, ``name``.key."""
    certificate, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "subjectAltName=IP:127.0.0.1",
            "-keyout", str(key), "-out", str(certificate),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    key.chmod(0o600)
    return certificate, key


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _ready(binaries: Path, socket_dir: Path, port: int) -> bool:
    check = subprocess.run(
        [binaries / "pg_isready", "-q", "-h", str(socket_dir), "-p", str(port), "-t", "1"],
        check=False,
    )
    return check.returncode == 0


class Postmaster:
    """The server's process: started with one command line, stopped and started again."""

    def __init__(
        self, command: list[str | Path], log: Path, cwd: Path, ready: Callable[[], bool]
    ) -> None:
        self._command = command
        self._log = log
        self._cwd = cwd
        self._ready = ready
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> bool:
        """Starts it and waits until it answers; False when it exited (its port taken)."""
        with self._log.open("ab") as log_file:
            process = self.process = subprocess.Popen(
                self._command, stdout=log_file, stderr=subprocess.STDOUT, cwd=self._cwd
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            if self._ready():
                return True
            time.sleep(0.1)
        if process.poll() is None:
            pytest.fail(
                f"postgres did not start within {START_TIMEOUT_S:g}s:\n"
                + self._log.read_text(errors="replace")
            )
        return False

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)


@contextlib.contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """Initialises and starts a server in a temporary folder; stops it and removes the folder."""
    binaries = bin_dir()
    prefix, user = _runner()
    # Not under pytest's tmp_path (its parents are private to root, and the server's user
    # must reach the folder) nor a long TMPDIR (a unix socket's path is short): /tmp.
    root = Path(
        tempfile.mkdtemp(prefix="nemesis-pg-", dir="/tmp" if Path("/tmp").is_dir() else None)
    )
    try:
        data, sockets, log = root / "data", root / "sockets", root / "server.log"
        sockets.mkdir()
        password = secrets.token_urlsafe(16)
        (root / "password").write_text(password)
        log.touch()
        certificate, key = make_certificate(root, "server")
        if user is not None:
            for path in (root, sockets, root / "password", log, certificate, key):
                os.chown(path, user.pw_uid, user.pw_gid)
        subprocess.run(
            [
                *prefix,
                binaries / "initdb",
                "-D",
                data,
                "-U",
                SUPERUSER,
                f"--pwfile={root / 'password'}",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
                "--encoding=UTF8",
                "--no-locale",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            cwd=root,
        )
        for _attempt in range(3):  # another process may take the free port first
            port = _free_port()
            settings = {
                **SETTINGS,
                "port": str(port),
                "unix_socket_directories": str(sockets),
                "ssl": "on",
                "ssl_cert_file": str(certificate),
                "ssl_key_file": str(key),
            }
            options = [f"--{name}={value}" for name, value in settings.items()]
            postmaster = Postmaster(
                [*prefix, binaries / "postgres", "-D", data, *options],
                log,
                root,
                lambda port=port: _ready(binaries, sockets, port),  # type: ignore[misc]
            )
            try:
                if not postmaster.start():
                    continue  # it exited: try another port
                yield PostgresServer(
                    "127.0.0.1", port, SUPERUSER, password, sockets, log, certificate, postmaster
                )
                return
            finally:
                postmaster.stop()
        pytest.fail("postgres did not start:\n" + log.read_text(errors="replace"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """A fast shutdown (SIGINT: disconnect clients, stop), then SIGKILL if it hangs."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.asynccontextmanager
async def fresh_database(server: PostgresServer) -> AsyncIterator[str]:
    """A new, empty database for one test; its DSN. Dropped (clients cut off) afterwards."""
    name = f"test_{secrets.token_hex(6)}"
    admin = await server.admin()
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield server.dsn(name)
    finally:
        admin = await server.admin()
        try:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        finally:
            await admin.close()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One PostgreSQL server for the session (for each xdist worker)."""
    with running_postgres() as server:
        yield server


@pytest.fixture
async def postgres_dsn(postgres_server: PostgresServer) -> AsyncIterator[str]:
    """The DSN of a database of this test's own, on the session's server."""
    async with fresh_database(postgres_server) as dsn:
        yield dsn
