"""The kafka backend over SASL/SCRAM-SHA-512 and over TLS, through the real CLI.

One Apache Kafka broker for the module with three listeners: PLAINTEXT,
SASL_PLAINTEXT with SCRAM-SHA-512 (the user is created when the broker's
storage is formatted) and SSL asking for a client certificate, signed by a
CA the module makes with openssl. The password reaches the CLI through the
environment (``${KAFKA_PASSWORD}`` in nemesis.yaml), never through a file;
no log, output or error of the proxy shows it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from nemesis.broker.kafka.broker import open_kafka
from nemesis.broker.port import ConsumerSpec, Message, OutgoingMessage
from nemesis.errors import BrokerAccessDenied, BrokerError
from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully
from tests.kafka_broker import (
    KafkaBroker,
    Namespace,
    ScramUser,
    TlsFiles,
    kafka_backend_config,
    make_tls_files,
    start_kafka,
)
from tests.test_kafka_e2e import committed, init, publish, wait_committed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

USER = ScramUser()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles) -> Iterator[KafkaBroker]:
    broker = start_kafka(tmp_path_factory.mktemp("secured"), scram=USER, tls=tls_files)
    try:
        yield broker
    finally:
        broker.stop()


def secured_config(space: Workspace, servers: str, security: str) -> None:
    (space.root / "nemesis.yaml").write_text(
        "backend:\n"
        "  kind: kafka\n"
        f"  bootstrap_servers: ['{servers}']\n"
        f"{security}"
        "  session_timeout_s: 6\n"
        "  heartbeat_interval_s: 1\n"
        "  connect_timeout_s: 10\n"
        "  request_timeout_s: 12\n"
        "single_host: true\n"  # one process: its state and DLQ files are enough
        "data_dir: .\n"
        "integrations_dir: integrations\n"
        "admin: {port: 0}\n"
        "viewer: {port: 0, enabled: false}\n"
    )
    (space.root / "integrations").mkdir(exist_ok=True)


SCRAM = (
    "  sasl:\n"
    "    mechanism: SCRAM-SHA-512\n"
    f"    username: {USER.username}\n"
    "    password: ${KAFKA_PASSWORD}\n"
)


def tls_block(files: TlsFiles) -> str:
    return (
        "  tls:\n"
        f"    ca_file: {files.ca}\n"
        f"    cert_file: {files.client_cert}\n"
        f"    key_file: {files.client_key}\n"
    )


async def deliver_through_the_proxy(space: Workspace, count: int) -> None:
    """Topic, publish, init, run: every message delivered and committed."""
    ns = Namespace()
    topic, name = ns("orders"), ns("loyalty")
    ids = publish(space, topic, count, partitions=2)
    async with HandlerServer() as handler:
        space.write_integration(name, integration_yaml(name, handler.url, topic=topic, workers=8))
        init(space)
        proxy = await space.start("run")
        await handler.ledger.wait_for(count, timeout_s=120)
        await wait_committed(space, topic, name, timeout_s=60)
        assert await stop_gracefully(proxy) == 0, space.logs()
    assert {json.loads(e.body)["id"] for e in handler.ledger if e.done} == ids
    assert all(c == end for c, end in committed(space, topic, name))


async def test_the_proxy_delivers_over_sasl_scram_sha_512(
    workspace: Workspace, secured: KafkaBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAFKA_PASSWORD", USER.password)
    secured_config(workspace, secured.address("SASL_PLAINTEXT"), SCRAM)
    await deliver_through_the_proxy(workspace, 500)
    assert USER.password not in workspace.logs()
    assert USER.password not in (workspace.root / "nemesis.yaml").read_text()


async def test_the_proxy_delivers_over_tls_with_a_client_certificate(
    workspace: Workspace, secured: KafkaBroker, tls_files: TlsFiles
) -> None:
    # The broker's certificate names 127.0.0.1: the host name is checked (the default).
    secured_config(workspace, secured.address("SSL"), tls_block(tls_files))
    await deliver_through_the_proxy(workspace, 500)


def test_a_wrong_password_is_refused_by_name_and_never_shown(
    workspace: Workspace, secured: KafkaBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = "not-" + USER.password
    monkeypatch.setenv("KAFKA_PASSWORD", wrong)
    secured_config(workspace, secured.address("SASL_PLAINTEXT"), SCRAM)
    listed = workspace.cli("topics", "list")
    assert listed.returncode != 0
    output = listed.stdout + listed.stderr
    # Nemesis' own error line says why, not only that no broker answered.
    (error,) = [line for line in output.splitlines() if line.startswith("nemesis:")]
    assert "SaslAuthenticationFailed" in error, output
    assert "invalid credentials" in error
    assert "Traceback" not in output
    assert wrong not in output
    assert USER.password not in output


async def test_wrong_credentials_are_access_denied(secured: KafkaBroker) -> None:
    sasl = {"mechanism": "SCRAM-SHA-512", "username": USER.username, "password": "wrong"}
    config = kafka_backend_config(secured.address("SASL_PLAINTEXT"), connect_timeout_s=5, sasl=sasl)
    with pytest.raises(BrokerAccessDenied, match="invalid credentials"):
        await open_kafka(config)


async def test_the_backend_reads_and_writes_over_sasl_and_tls(
    secured: KafkaBroker, tls_files: TlsFiles
) -> None:
    ns = Namespace()
    sasl = {"mechanism": "SCRAM-SHA-512", "username": USER.username, "password": USER.password}
    tls = {
        "ca_file": str(tls_files.ca),
        "cert_file": str(tls_files.client_cert),
        "key_file": str(tls_files.client_key),
    }
    for listener, settings in (("SASL_PLAINTEXT", {"sasl": sasl}), ("SSL", {"tls": tls})):
        broker = await open_kafka(kafka_backend_config(secured.address(listener), **settings))
        try:
            topic = ns(f"t-{listener.lower()}")
            await broker.admin.create_topic(topic, partitions=1, consumers=[ConsumerSpec(ns("c"))])
            await (await broker.writer(topic)).write(
                [OutgoingMessage(value=b"over " + listener.encode())]
            )
            reader = await broker.reader(topic, ns("c"))
            received: list[Message] = []
            for _ in range(60):
                received.extend(await reader.receive(10, 0.5))
                if received:
                    break
            assert [m.value for m in received] == [b"over " + listener.encode()]
        finally:
            await broker.close()


async def test_tls_refuses_a_broker_the_ca_did_not_sign(
    secured: KafkaBroker, tmp_path: Path
) -> None:
    stranger = make_tls_files(tmp_path / "other-ca")
    config = kafka_backend_config(
        secured.address("SSL"),
        connect_timeout_s=5,
        tls={
            "ca_file": str(stranger.ca),
            "cert_file": str(stranger.client_cert),
            "key_file": str(stranger.client_key),
        },
    )
    # The error names the reason, where aiokafka itself only says no broker answered.
    with pytest.raises(BrokerError, match="CERTIFICATE_VERIFY_FAILED"):
        await open_kafka(config)
