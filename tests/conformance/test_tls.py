"""The transports over TLS to real servers: verification, custom CA, host name, SNI, mutual TLS.

Everything is signed by a CA made for the module. nginx serves two
certificates on one port: ``localhost``'s for requests that name it by SNI,
and ``default.invalid``'s for the others; a delivery to ``https://localhost``
succeeds only if the transport sent SNI, trusted the CA and checked the name.
A second nginx port asks for a client certificate from that CA
(``ssl_verify_client on``); its requests under ``/logged/`` are written to
``access.log`` with the client certificate's subject, so a test sees which
certificate a proxy presented. Two grpcio servers (the sync server, which
belongs to no event loop, so one serves the tests of both loops) do the same
for ``grpcs://``: one with ``localhost``'s certificate, one that also
requires a client certificate.

``target.tls`` is tried with no ``SSL_CERT_FILE`` in the environment: its
``ca_file`` alone makes the test CA trusted. Its files are checked when the
transport is made, and when ``nemesis run`` builds an integration. The last
tests run integrations from a folder of YAML files as ``nemesis run`` does
(``load_integrations``, ``Proxy``, ``ConfigReloader`` watching it), each
with a path of its own under ``/logged/`` (every test runs once per event
loop against the one nginx). Certificates renewed on disk (a Secret's
folder swapped, a key rewritten in place) are picked up by the reload's
watch.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.broker.port import Message
from nemesis.config.loader import load_integrations
from nemesis.config.models import EmbeddedBackendConfig, IntegrationConfig, TargetConfig
from nemesis.delivery.grpc import GrpcTransport
from nemesis.delivery.h1 import H1Transport
from nemesis.delivery.http import HttpTransport
from nemesis.delivery.port import DeliveryResult, Event, Outcome, Transport
from nemesis.errors import ConfigError, ConfigProblem
from nemesis.proto import SERVICE
from nemesis.proto.nemesis.v1 import handler_pb2 as pb
from nemesis.runtime.app import Proxy
from nemesis.runtime.reload import ConfigReloader
from tests.conformance.conftest import free_port, nginx
from tests.operability import (
    AUTH,
    FAST,
    admin_client,
    committed,
    publish,
    reloading,
    running,
    wait_until_true,
    watch_sees,
)

TRANSPORTS: dict[str, type[H1Transport | HttpTransport | GrpcTransport]] = {
    "h1": H1Transport,
    "aiohttp": HttpTransport,
    "grpc": GrpcTransport,
}


@dataclass(frozen=True, slots=True)
class TlsServers:
    directory: Path  # the CA, the certificates and keys
    port: int  # nginx: localhost's certificate by SNI, default.invalid's otherwise
    mtls_port: int  # nginx: localhost's certificate; a client certificate required
    grpc_port: int  # grpcio: localhost's certificate
    grpc_mtls_port: int  # grpcio: localhost's certificate; a client certificate required

    def file(self, name: str) -> str:
        return str(self.directory / name)

    def clients(self, path: str) -> list[str]:
        """The client certificate's subject of each request to ``/logged/<path>``, in order."""
        log = self.directory / "access.log"
        lines = log.read_text().splitlines() if log.exists() else []
        return [
            subject
            for uri, subject, _ in (line.split(" ") for line in lines)
            if uri == f"/logged/{path}"
        ]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(directory: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip


def _certificate(directory: Path, name: str, usage: str = "serverAuth") -> None:
    """``name.pem`` and ``name.key``, for DNS name ``name``, signed by ``ca.pem``."""
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.ext").write_text(
        f"subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\n"
        f"keyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
        "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
        cwd=directory,
    )  # fmt: skip


def _grpc_server(directory: Path, *, client_ca: bytes | None) -> tuple[grpc.Server, int]:
    """A ``HandlerService`` answering OK over TLS; with ``client_ca``, mutual TLS."""

    def ok(request: Any, context: grpc.ServicerContext) -> pb.DeliverResponse:
        return pb.DeliverResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.unary_unary_rpc_method_handler(
        ok,
        request_deserializer=pb.DeliverRequest.FromString,
        response_serializer=pb.DeliverResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Deliver": handler}),)
    )
    credentials = grpc.ssl_server_credentials(
        [((directory / "localhost.key").read_bytes(), (directory / "localhost.pem").read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )
    port = server.add_secure_port("localhost:0", credentials)
    server.start()
    return server, port


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServers]:
    directory = tmp_path_factory.mktemp("tls")
    _ca(directory, "ca")
    _ca(directory, "other-ca")
    for name in ("localhost", "default.invalid"):
        _certificate(directory, name)
    for client in ("client", "client-renewed"):
        _certificate(directory, client, usage="clientAuth")
    _openssl(
        "pkey", "-in", "client.key", "-aes256", "-passout", "pass:secret",
        "-out", "client-encrypted.key",
        cwd=directory,
    )  # fmt: skip
    port, tls_port, mtls_port = free_port(), free_port(), free_port()
    tls_listen = (
        f"listen 127.0.0.1:{tls_port} ssl default_server;\n"
        f"ssl_certificate {directory}/default.invalid.pem;\n"
        f"ssl_certificate_key {directory}/default.invalid.key;"
    )
    named = (
        "log_format clients '$request_uri $ssl_client_s_dn $status';\n"
        "server {\n"
        f"    listen 127.0.0.1:{tls_port} ssl;\n"
        "    server_name localhost;\n"
        f"    ssl_certificate {directory}/localhost.pem;\n"
        f"    ssl_certificate_key {directory}/localhost.key;\n"
        "    location = /ok { return 204; }\n"
        "}\n"
        "server {\n"
        f"    listen 127.0.0.1:{mtls_port} ssl;\n"
        f"    ssl_certificate {directory}/localhost.pem;\n"
        f"    ssl_certificate_key {directory}/localhost.key;\n"
        f"    ssl_client_certificate {directory}/ca.pem;\n"
        "    ssl_verify_client on;\n"
        "    location = /ok { return 204; }\n"
        f"    location /logged/ {{ access_log {directory}/access.log clients; return 204; }}\n"
        "}"
    )
    grpc_server, grpc_port = _grpc_server(directory, client_ca=None)
    grpc_mtls_server, grpc_mtls_port = _grpc_server(
        directory, client_ca=(directory / "ca.pem").read_bytes()
    )
    try:
        for _ in nginx(directory, port, tls_listen=tls_listen, tls_servers=named):
            yield TlsServers(directory, tls_port, mtls_port, grpc_port, grpc_mtls_port)
    finally:
        grpc_server.stop(None)
        grpc_mtls_server.stop(None)


@pytest.fixture
def no_ssl_cert_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only target.tls names the test CA."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)


def event() -> Event:
    return Event(message=Message("orders", 0, 1, b"{}"), id="orders/0/1", type="order.created")


def target(url: str, **tls: str) -> TargetConfig:
    settings: dict[str, Any] = {"url": url, "timeout_s": 5}
    if tls:
        settings["tls"] = tls
    return TargetConfig.model_validate(settings)


async def deliver(url: str, *, transport: str = "h1", **tls: str) -> DeliveryResult:
    """Two deliveries (a new connection, then a reused one, or the same channel): one result."""
    made: Transport = TRANSPORTS[transport](
        target(url, **tls), integration="tls", max_connections=2
    )
    try:
        first = await made.deliver(event())
        second = await made.deliver(event())
        assert (first.outcome, first.error) == (second.outcome, second.error)
        return first
    finally:
        await made.close()


# --- the system's CAs, or SSL_CERT_FILE for the process ------------------------------


async def test_a_certificate_from_a_trusted_ca_for_the_name_is_accepted(
    servers: TlsServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", servers.file("ca.pem"))

    result = await deliver(f"https://localhost:{servers.port}/ok")

    assert (result.outcome, result.status) == (Outcome.DELIVERED, 204)


async def test_a_certificate_from_an_unknown_ca_is_refused(
    servers: TlsServers, no_ssl_cert_file: None
) -> None:
    result = await deliver(f"https://localhost:{servers.port}/ok")

    assert result.outcome is Outcome.RETRY
    assert result.error is not None
    assert result.error.startswith("TLS error: ")
    assert "unable to get local issuer certificate" in result.error


async def test_a_certificate_for_another_name_is_refused(
    servers: TlsServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", servers.file("ca.pem"))

    # By address: no SNI, so nginx shows default.invalid's certificate.
    result = await deliver(f"https://127.0.0.1:{servers.port}/ok")

    assert result.outcome is Outcome.RETRY
    assert result.error is not None
    assert "TLS error: " in result.error
    assert "mismatch" in result.error, result.error


# --- target.tls ----------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["h1", "aiohttp"])
async def test_tls_ca_file_makes_its_ca_trusted(
    servers: TlsServers, no_ssl_cert_file: None, transport: str
) -> None:
    result = await deliver(
        f"https://localhost:{servers.port}/ok", transport=transport, ca_file=servers.file("ca.pem")
    )

    assert (result.outcome, result.status) == (Outcome.DELIVERED, 204)


async def test_tls_ca_file_makes_its_ca_trusted_over_grpc(
    servers: TlsServers, no_ssl_cert_file: None
) -> None:
    result = await deliver(
        f"grpcs://localhost:{servers.grpc_port}", transport="grpc", ca_file=servers.file("ca.pem")
    )

    assert (result.outcome, result.status, result.error) == (Outcome.DELIVERED, 0, None)


@pytest.mark.parametrize("transport", ["h1", "aiohttp"])
async def test_tls_ca_file_replaces_the_system_cas(
    servers: TlsServers, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", servers.file("ca.pem"))

    result = await deliver(
        f"https://localhost:{servers.port}/ok",
        transport=transport,
        ca_file=servers.file("other-ca.pem"),
    )

    assert result.outcome is Outcome.RETRY
    assert result.error is not None
    assert "unable to get local issuer certificate" in result.error, result.error


@pytest.mark.parametrize("transport", ["h1", "aiohttp"])
async def test_tls_server_name_is_checked_and_sent_for_an_address(
    servers: TlsServers, no_ssl_cert_file: None, transport: str
) -> None:
    # Without server_name this URL gets default.invalid's certificate (the test above).
    result = await deliver(
        f"https://127.0.0.1:{servers.port}/ok",
        transport=transport,
        ca_file=servers.file("ca.pem"),
        server_name="localhost",
    )

    assert (result.outcome, result.status) == (Outcome.DELIVERED, 204)


async def test_tls_server_name_over_grpc(servers: TlsServers, no_ssl_cert_file: None) -> None:
    result = await deliver(
        f"grpcs://127.0.0.1:{servers.grpc_port}",
        transport="grpc",
        ca_file=servers.file("ca.pem"),
        server_name="localhost",
    )

    assert (result.outcome, result.status, result.error) == (Outcome.DELIVERED, 0, None)


@pytest.mark.parametrize("transport", ["h1", "aiohttp"])
async def test_mutual_tls_with_the_client_certificate_delivers(
    servers: TlsServers, no_ssl_cert_file: None, transport: str
) -> None:
    result = await deliver(
        f"https://localhost:{servers.mtls_port}/ok",
        transport=transport,
        ca_file=servers.file("ca.pem"),
        cert_file=servers.file("client.pem"),
        key_file=servers.file("client.key"),
    )

    assert (result.outcome, result.status) == (Outcome.DELIVERED, 204)


@pytest.mark.parametrize("transport", ["h1", "aiohttp"])
async def test_mutual_tls_without_a_client_certificate_is_nginx_s_400(
    servers: TlsServers, no_ssl_cert_file: None, transport: str
) -> None:
    # nginx completes the handshake and answers 400 "No required SSL certificate was
    # sent": an answer, so the contract's table decides (400: dead-lettered at once).
    result = await deliver(
        f"https://localhost:{servers.mtls_port}/ok",
        transport=transport,
        ca_file=servers.file("ca.pem"),
    )

    assert (result.outcome, result.status) == (Outcome.DEAD, 400)
    assert result.error is not None
    assert "No required SSL certificate was sent" in result.error, result.error


async def test_mutual_tls_over_grpc(servers: TlsServers, no_ssl_cert_file: None) -> None:
    url = f"grpcs://localhost:{servers.grpc_mtls_port}"
    client = {"cert_file": servers.file("client.pem"), "key_file": servers.file("client.key")}

    with_certificate = await deliver(
        url, transport="grpc", ca_file=servers.file("ca.pem"), **client
    )
    without = await deliver(url, transport="grpc", ca_file=servers.file("ca.pem"))

    assert with_certificate.outcome is Outcome.DELIVERED
    # grpcio's server refuses the handshake itself: no answer, a retry.
    assert (without.outcome, without.status) == (
        Outcome.RETRY,
        grpc.StatusCode.UNAVAILABLE.value[0],
    )


# --- files that do not load ----------------------------------------------------------


NO_FILE = "No such file or directory"


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize(
    ("files", "field", "words"),
    [
        pytest.param(
            {"ca_file": "missing.pem"},
            "ca_file",
            f"cannot read {{ca_file}}: {NO_FILE}",
            id="ca_file missing",
        ),
        pytest.param(
            {"ca_file": "client.key"},
            "ca_file",
            "{ca_file} holds no PEM certificate",
            id="ca_file holds a key",
        ),
        pytest.param(
            {"ca_file": "."}, "ca_file", "cannot read {ca_file}: Is a directory", id="ca_file a dir"
        ),
        pytest.param(
            {"cert_file": "missing.pem", "key_file": "client.key"},
            "cert_file",
            f"cannot read {{cert_file}}: {NO_FILE}",
            id="cert_file missing",
        ),
        pytest.param(
            {"cert_file": "client.key", "key_file": "client.key"},
            "cert_file",
            "{cert_file} holds no PEM certificate",
            id="cert_file holds a key",
        ),
        pytest.param(
            {"cert_file": "client.pem", "key_file": "missing.key"},
            "key_file",
            f"cannot read {{key_file}}: {NO_FILE}",
            id="key_file missing",
        ),
        pytest.param(
            {"cert_file": "client.pem", "key_file": "ca.pem"},
            "key_file",
            "{key_file} holds no PEM private key",
            id="key_file holds a certificate",
        ),
        pytest.param(
            {"cert_file": "client.pem", "key_file": "localhost.key"},
            "key_file",
            "{key_file} is not the private key of the certificate in {cert_file}",
            id="key_file of another certificate",
        ),
        pytest.param(
            {"cert_file": "client.pem", "key_file": "client-encrypted.key"},
            "key_file",
            "{key_file} is encrypted",
            id="key_file encrypted",
        ),
    ],
)
def test_a_tls_file_that_does_not_load_is_refused_when_the_transport_is_made(
    servers: TlsServers, transport: str, files: dict[str, str], field: str, words: str
) -> None:
    settings = {key: servers.file(name) for key, name in files.items()}
    url = "grpcs://localhost:1" if transport == "grpc" else "https://localhost:1/"

    with pytest.raises(ConfigError) as refused:
        TRANSPORTS[transport](target(url, **settings), integration="tls", max_connections=1)

    [problem] = refused.value.problems
    assert (problem.file, problem.field) == ("integration tls", f"target.tls.{field}")
    assert problem.message.startswith(words.format(**settings)), problem.message


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


def integration(name: str, url: str, tls: dict[str, str]) -> IntegrationConfig:
    return IntegrationConfig.model_validate(
        {
            "name": name,
            "owners": ["team-tls"],
            "source": {"topic": "orders", "consumer": name},
            "target": {"url": url, "tls": tls},
        }
    )


async def test_nemesis_run_refuses_an_integration_whose_tls_files_do_not_load(
    servers: TlsServers, broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """At start the integration is not started; on reload the running one stays."""
    url = f"https://localhost:{servers.port}/ok"
    good = {"ca_file": servers.file("ca.pem")}
    mismatched = {
        "cert_file": servers.file("client.pem"),
        "key_file": servers.file("localhost.key"),
    }
    files = {name: tmp_path / f"{name}.yaml" for name in ("alpha", "beta")}

    proxy = Proxy(
        broker,
        {"alpha": integration("alpha", url, good), "beta": integration("beta", url, mismatched)},
        pipelines_dir=tmp_path / "pipelines",
        integration_files=files,
    )
    assert sorted(proxy.groups) == ["alpha"]

    alpha = proxy.groups["alpha"]
    with pytest.raises(ConfigError) as refused:
        await proxy.replace_integration(integration("alpha", url, mismatched), files["alpha"])

    assert proxy.groups["alpha"] is alpha
    message = (
        f"{mismatched['key_file']} is not the private key of the certificate in"
        f" {mismatched['cert_file']}"
    )
    assert refused.value.problems == [
        ConfigProblem(str(files["alpha"]), None, "target.tls.key_file", message)
    ]


async def test_a_tls_file_gone_when_the_integration_starts_stops_that_integration_alone(
    servers: TlsServers, broker: EmbeddedBroker, tmp_path: Path
) -> None:
    ca_file = tmp_path / "ca.pem"
    shutil.copy(servers.file("ca.pem"), ca_file)
    url = f"https://localhost:{servers.port}/ok"
    proxy = Proxy(
        broker,
        {"alpha": integration("alpha", url, {"ca_file": str(ca_file)})},
        pipelines_dir=tmp_path / "pipelines",
    )
    ca_file.unlink()  # after the integration was built, before it starts (a fleet member's wait)

    async with running(proxy):
        await wait_until_true(lambda: "main" in proxy.groups["alpha"].issues)

        assert proxy.running
        assert proxy.groups["alpha"].issues["main"] == (
            f"cannot start: integration alpha: target.tls.ca_file: cannot read {ca_file}:"
            " No such file or directory"
        )


# --- integrations run from a directory ----------------------------------------------


def client_tls(
    folder: Path, *, cert: str = "client.pem", key: str = "client.key"
) -> dict[str, str]:
    """``target.tls`` trusting the test CA and presenting a client certificate, from ``folder``."""
    return {
        "ca_file": str(folder / "ca.pem"),
        "cert_file": str(folder / cert),
        "key_file": str(folder / key),
    }


def write_integration(
    directory: Path,
    name: str,
    url: str,
    tls: dict[str, str],
    *,
    headers: dict[str, str] | None = None,
) -> None:
    document = {
        "name": name,
        "owners": ["team-tls"],
        "source": {"topic": "orders", "consumer": name},
        "target": {"url": url, "timeout_s": 5, "headers": headers or {}, "tls": tls},
        "delivery": {"workers": 4, "buffer": 100},
    }
    (directory / f"{name}.yaml").write_text(json.dumps(document))  # JSON is YAML


def proxy_from(
    broker: EmbeddedBroker, directory: Path, env: dict[str, str] | None = None
) -> tuple[Proxy, ConfigReloader]:
    """A proxy started from ``directory`` as ``nemesis run`` starts it, and its reloader."""
    integrations, problems = load_integrations(directory, env)
    assert problems == []
    proxy = Proxy(
        broker,
        integrations,
        pipelines_dir=directory.parent / "pipelines",
        integration_files={name: directory / f"{name}.yaml" for name in integrations},
        runner_options=FAST,
    )
    return proxy, ConfigReloader(proxy, directory, env=env, watch=True, debounce_ms=50)


# --- a target the transport refuses ---------------------------------------------------


async def test_a_header_value_the_transport_refuses_stops_that_integration_alone(
    servers: TlsServers, broker: EmbeddedBroker, tmp_path: Path, no_ssl_cert_file: None
) -> None:
    """A CR/LF that reaches a header value from the environment: alpha waits, beta delivers."""
    await publish(broker, 10, consumers=["alpha", "beta"])
    directory = tmp_path / "integrations"
    directory.mkdir()
    url = f"https://localhost:{servers.mtls_port}/logged/{tmp_path.name}"
    for name in ("alpha", "beta"):
        headers = {"x-token": "${TOKEN}"} if name == "alpha" else {}
        write_integration(directory, name, url, client_tls(servers.directory), headers=headers)
    proxy, reloader = proxy_from(broker, directory, env={"TOKEN": "t0ken\r\nx-admin: yes"})

    async with running(proxy), admin_client(proxy, reloader=reloader) as admin:
        await wait_until_true(lambda: len(servers.clients(tmp_path.name)) == 10)
        await wait_until_true(lambda: "main" in proxy.groups["alpha"].issues)

        assert proxy.running
        assert proxy.groups["beta"].issues == {}
        answer = await admin.get("/integrations/alpha", headers=AUTH)
        assert answer.status_code == 200
        assert answer.json()["issues"] == {
            "main": "cannot start: integration alpha: target.headers.x-token:"
            " control characters in the value"
        }
    assert "alpha" not in proxy.runners
    assert await committed(broker, "alpha") == 0
    assert await committed(broker, "beta") == 10


async def test_a_reload_to_a_header_value_the_transport_refuses_keeps_the_running_version(
    servers: TlsServers, broker: EmbeddedBroker, tmp_path: Path, no_ssl_cert_file: None
) -> None:
    """A new header whose secret ends in a newline: refused before the running one drains."""
    await publish(broker, 10, consumers=["alpha"])
    directory = tmp_path / "integrations"
    directory.mkdir()
    url = f"https://localhost:{servers.mtls_port}/logged/{tmp_path.name}"
    tls = client_tls(servers.directory)
    write_integration(directory, "alpha", url, tls)
    proxy, reloader = proxy_from(broker, directory, env={"TOKEN": "t0ken\n"})

    async with running(proxy):
        await wait_until_true(lambda: len(servers.clients(tmp_path.name)) == 10)
        running_version = proxy.groups["alpha"]

        write_integration(directory, "alpha", url, tls, headers={"x-token": "${TOKEN}"})
        report = await reloader.reload("api")

        assert (report.restarted, report.kept) == ({}, ["alpha"])
        assert report.problems == [
            ConfigProblem(
                str(directory / "alpha.yaml"),
                None,
                "target.headers.x-token",
                "control characters in the value",
            )
        ]
        assert proxy.groups["alpha"] is running_version
        assert running_version.issues == {}
        await publish(broker, 10, start=10)
        await wait_until_true(lambda: len(servers.clients(tmp_path.name)) == 20)


# --- certificates renewed on disk while running ---------------------------------------


def copy_tls(servers: TlsServers, folder: Path, names: tuple[str, ...]) -> Path:
    folder.mkdir()
    for name in names:
        shutil.copy(servers.file(name), folder / name)
    return folder


def mount_secret(servers: TlsServers, secret: Path, version: str, client: str) -> None:
    """Lays out ``secret`` as Kubernetes mounts a Secret, or swaps in a new version of it.

    The names (``ca.pem``, ``tls.crt``, ``tls.key``) link through ``..data``
    to a folder of the version; a new version is written beside the old one,
    then ``..data`` is swapped to it by one rename, and the old one removed.
    """
    secret.mkdir(exist_ok=True)
    data = secret / "..data"
    old = data.resolve() if data.is_symlink() else None
    files = secret / f"..{version}"
    files.mkdir()
    shutil.copy(servers.file("ca.pem"), files / "ca.pem")
    shutil.copy(servers.file(f"{client}.pem"), files / "tls.crt")
    shutil.copy(servers.file(f"{client}.key"), files / "tls.key")
    (secret / "..data_tmp").symlink_to(files.name)
    (secret / "..data_tmp").rename(data)
    for name in ("ca.pem", "tls.crt", "tls.key"):
        if not (secret / name).is_symlink():
            (secret / name).symlink_to(f"..data/{name}")
    if old is not None:
        shutil.rmtree(old)


async def test_a_client_certificate_renewed_on_disk_restarts_the_integration_with_it(
    servers: TlsServers,
    broker: EmbeddedBroker,
    tmp_path: Path,
    no_ssl_cert_file: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    await publish(broker, 20, consumers=["alpha"])
    secret = tmp_path / "secret"
    mount_secret(servers, secret, "v1", "client")
    directory = tmp_path / "integrations"
    directory.mkdir()
    url = f"https://localhost:{servers.mtls_port}/logged/{tmp_path.name}"
    write_integration(directory, "alpha", url, client_tls(secret, cert="tls.crt", key="tls.key"))
    proxy, reloader = proxy_from(broker, directory)

    with caplog.at_level(logging.INFO, logger="nemesis.runtime.reload"):
        async with running(proxy), reloading(reloader, watched=directory):
            await wait_until_true(lambda: len(servers.clients(tmp_path.name)) == 20)
            running_version = proxy.groups["alpha"]
            await wait_until_true(
                lambda: running_version.runners["main"].statistics().unfinished == 0
            )

            # The watch sees the secret's folder: the renewal alone restarts alpha.
            mount_secret(servers, secret, "v2", "client-renewed")
            await wait_until_true(lambda: proxy.groups["alpha"] is not running_version)
            await publish(broker, 20, start=20)
            await wait_until_true(lambda: len(servers.clients(tmp_path.name)) >= 40)

            assert proxy.groups["alpha"].problems == []
    assert servers.clients(tmp_path.name) == ["CN=client"] * 20 + ["CN=client-renewed"] * 20
    assert "configuration reload (watch): restarted alpha" in caplog.messages
    assert await committed(broker, "alpha") == 40


async def test_a_certificate_renewed_before_its_key_keeps_the_running_version_until_it_loads(
    servers: TlsServers, broker: EmbeddedBroker, tmp_path: Path, no_ssl_cert_file: None
) -> None:
    """Files rewritten in place one by one: in between, the pair does not load and is reported."""
    await publish(broker, 10, consumers=["alpha"])
    folder = copy_tls(servers, tmp_path / "tls", ("ca.pem", "client.pem", "client.key"))
    directory = tmp_path / "integrations"
    directory.mkdir()
    url = f"https://localhost:{servers.mtls_port}/logged/{tmp_path.name}"
    write_integration(directory, "alpha", url, client_tls(folder))
    proxy, reloader = proxy_from(broker, directory)

    async with (
        running(proxy),
        reloading(reloader, watched=directory),
        admin_client(proxy, reloader=reloader) as admin,
    ):
        await wait_until_true(lambda: len(servers.clients(tmp_path.name)) == 10)
        running_version = proxy.groups["alpha"]

        # The renewed certificate first (the same file, truncated and written), its key later.
        shutil.copyfile(servers.file("client-renewed.pem"), folder / "client.pem")
        problem = ConfigProblem(
            str(directory / "alpha.yaml"),
            None,
            "target.tls.key_file",
            f"{folder / 'client.key'} is not the private key of the certificate in"
            f" {folder / 'client.pem'}",
        )
        await wait_until_true(lambda: running_version.problems == [problem])

        assert proxy.groups["alpha"] is running_version
        status = (await admin.get("/config", headers=AUTH)).json()
        assert status["last_reload"]["kept"] == ["alpha"]
        assert status["last_reload"]["problems"] == [
            {"file": problem.file, "line": None, "field": problem.field, "message": problem.message}
        ]
        # The running version delivers on, with the certificate it loaded.
        await publish(broker, 10, start=10)
        await wait_until_true(lambda: len(servers.clients(tmp_path.name)) == 20)

        # The key arrives: alpha restarts on the pair, the problem is gone.
        shutil.copyfile(servers.file("client-renewed.key"), folder / "client.key")
        await wait_until_true(lambda: proxy.groups["alpha"] is not running_version)
        assert proxy.groups["alpha"].problems == []
        await publish(broker, 10, start=20)
        await wait_until_true(lambda: len(servers.clients(tmp_path.name)) == 30)
    assert servers.clients(tmp_path.name) == ["CN=client"] * 20 + ["CN=client-renewed"] * 10


async def test_an_integration_whose_key_is_written_after_the_start_starts_then(
    servers: TlsServers, broker: EmbeddedBroker, tmp_path: Path, no_ssl_cert_file: None
) -> None:
    """An agent beside the proxy writes the key late: nothing but the watch is needed."""
    await publish(broker, 10, consumers=["alpha"])
    folder = copy_tls(servers, tmp_path / "tls", ("ca.pem", "client.pem"))
    directory = tmp_path / "integrations"
    directory.mkdir()
    url = f"https://localhost:{servers.mtls_port}/logged/{tmp_path.name}"
    write_integration(directory, "alpha", url, client_tls(folder))
    proxy, reloader = proxy_from(broker, directory)
    assert "alpha" not in proxy.groups  # its key is not there

    async with running(proxy), reloading(reloader, watched=directory):
        shutil.copy(servers.file("client.key"), folder / ".client.key.tmp")
        (folder / ".client.key.tmp").rename(folder / "client.key")

        await wait_until_true(lambda: len(servers.clients(tmp_path.name)) == 10)
        assert proxy.groups["alpha"].problems == []
    assert servers.clients(tmp_path.name) == ["CN=client"] * 10


async def test_the_watch_follows_the_tls_files_to_the_folder_a_changed_file_names(
    servers: TlsServers, broker: EmbeddedBroker, tmp_path: Path, no_ssl_cert_file: None
) -> None:
    names = ("ca.pem", "client.pem", "client.key")
    before, after = (copy_tls(servers, tmp_path / name, names) for name in ("before", "after"))
    directory = tmp_path / "integrations"
    directory.mkdir()
    url = f"https://localhost:{servers.mtls_port}/logged/{tmp_path.name}"
    write_integration(directory, "alpha", url, client_tls(before))
    proxy, reloader = proxy_from(broker, directory)

    async with running(proxy), reloading(reloader, watched=directory):
        first = proxy.groups["alpha"]
        write_integration(directory, "alpha", url, client_tls(after))
        await wait_until_true(lambda: proxy.groups["alpha"] is not first)
        second = proxy.groups["alpha"]
        await watch_sees(reloader, after)

        shutil.copyfile(servers.file("localhost.key"), after / "client.key")
        await wait_until_true(lambda: bool(second.problems))

        [problem] = second.problems
        assert (problem.field, problem.message) == (
            "target.tls.key_file",
            f"{after / 'client.key'} is not the private key of the certificate in"
            f" {after / 'client.pem'}",
        )
        assert proxy.groups["alpha"] is second
