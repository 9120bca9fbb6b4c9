"""Nemesis' HTTP/1.1 transport over TLS to nginx: verification, custom CA, host name, SNI.

nginx serves two certificates on one port, both signed by a CA made for the
module: ``localhost``'s for requests that name it by SNI, and
``default.invalid``'s for the others. A delivery to ``https://localhost``
succeeds only if the transport sent SNI, trusted the CA (``SSL_CERT_FILE``)
and checked the name.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nemesis.broker.port import Message
from nemesis.config.models import TargetConfig
from nemesis.delivery.h1 import H1Transport
from nemesis.delivery.port import DeliveryResult, Event, Outcome
from tests.conformance.conftest import free_port, nginx


@dataclass(frozen=True, slots=True)
class TlsServer:
    port: int
    ca_file: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificate(directory: Path, name: str) -> None:
    """``name.pem`` and ``name.key``, for DNS name ``name``, signed by ``ca.pem``."""
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.ext").write_text(
        f"subjectAltName=DNS:{name}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
        cwd=directory,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    directory = tmp_path_factory.mktemp("tls")
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=Nemesis test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=directory,
    )  # fmt: skip
    for name in ("localhost", "default.invalid"):
        _certificate(directory, name)
    port, tls_port = free_port(), free_port()
    tls_listen = (
        f"listen 127.0.0.1:{tls_port} ssl default_server;\n"
        f"ssl_certificate {directory}/default.invalid.pem;\n"
        f"ssl_certificate_key {directory}/default.invalid.key;"
    )
    named = (
        "server {\n"
        f"    listen 127.0.0.1:{tls_port} ssl;\n"
        "    server_name localhost;\n"
        f"    ssl_certificate {directory}/localhost.pem;\n"
        f"    ssl_certificate_key {directory}/localhost.key;\n"
        "    location = /ok { return 204; }\n"
        "}"
    )
    for _ in nginx(directory, port, tls_listen=tls_listen, tls_servers=named):
        yield TlsServer(tls_port, directory / "ca.pem")


def event() -> Event:
    return Event(message=Message("orders", 0, 1, b"{}"), id="orders/0/1", type="order.created")


async def deliver(url: str) -> DeliveryResult:
    target = TargetConfig.model_validate({"url": url, "timeout_s": 5})
    transport = H1Transport(target, integration="tls", max_connections=2)
    try:
        first = await transport.deliver(event())
        second = await transport.deliver(event())
        assert (first.outcome, first.error) == (second.outcome, second.error)
        return first
    finally:
        await transport.close()


async def test_a_certificate_from_a_trusted_ca_for_the_name_is_accepted(
    tls_server: TlsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_server.ca_file))

    result = await deliver(f"https://localhost:{tls_server.port}/ok")

    assert (result.outcome, result.status) == (Outcome.DELIVERED, 204)


async def test_a_certificate_from_an_unknown_ca_is_refused(tls_server: TlsServer) -> None:
    result = await deliver(f"https://localhost:{tls_server.port}/ok")

    assert result.outcome is Outcome.RETRY
    assert result.error is not None
    assert result.error.startswith("TLS error: ")
    assert "unable to get local issuer certificate" in result.error


async def test_a_certificate_for_another_name_is_refused(
    tls_server: TlsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_server.ca_file))

    # By address: no SNI, so nginx shows default.invalid's certificate.
    result = await deliver(f"https://127.0.0.1:{tls_server.port}/ok")

    assert result.outcome is Outcome.RETRY
    assert result.error is not None
    assert "TLS error: " in result.error
    assert "mismatch" in result.error, result.error
