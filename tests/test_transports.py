"""The transport registry: what targets may be is derived from the kinds registered.

Real parts: the embedded log under tmp_path and a whole ``Proxy``; the
transport is ``FakeTransport``, registered for http:// as a test registers a
kind of its own, so no socket is opened.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.broker.port import ConsumerSpec, OutgoingMessage
from nemesis.clock import Clock
from nemesis.config.models import EmbeddedBackendConfig, IntegrationConfig, SigningConfig
from nemesis.delivery.port import Transport
from nemesis.errors import ConfigError
from nemesis.runtime.app import Proxy
from nemesis.runtime.runner import RunnerOptions
from nemesis.testing import FakeTransport
from nemesis.transports import (
    GRPC,
    HTTP,
    Target,
    TransportKind,
    Transports,
    default_transports,
)
from tests.operability import wait_until_true

FAST = RunnerOptions(receive_timeout_s=0.05, commit_interval_s=0.02, shutdown_grace_s=2)


def test_the_default_registry_says_which_targets_exist() -> None:
    transports = default_transports()
    assert transports.schemes() == ["http", "https", "grpc", "grpcs"]
    assert transports.clients() == ("h1", "aiohttp")
    assert transports.url_problem("grpcs://loyalty:443") is None
    assert transports.url_problem("ftp://loyalty/") == (
        "must start with http://, https://, grpc:// or grpcs:// and name a host"
    )
    assert transports.tls_problem("https") is None
    assert transports.tls_problem("grpc") == (
        "grpc:// is plain text: TLS settings apply to https:// and grpcs:// targets"
        " (use grpcs://, or remove tls)"
    )


def _opens(transport: Transport) -> Any:
    def open_fake(
        target: Target, *, integration: str, max_connections: int, clock: Clock
    ) -> Transport:
        return transport

    return open_fake


def test_a_registered_kind_joins_the_schemes_and_a_copy_leaves_the_original() -> None:
    original = default_transports()
    transports = original.copy()
    transports.register(TransportKind("ws", "ws", "wss", _opens(FakeTransport())))
    assert transports.url_problem("wss://loyalty/events") is None
    assert transports.tls_problem("ws") == (
        "ws:// is plain text: TLS settings apply to https://, grpcs:// and wss:// targets"
        " (use wss://, or remove tls)"
    )
    assert original.kind_for("ws") is None
    assert [kind.name for kind in transports.kinds.values()] == [HTTP.name, GRPC.name, "ws"]


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


def integration() -> IntegrationConfig:
    return IntegrationConfig.model_validate(
        {
            "name": "it",
            "owners": ["team-it"],
            "source": {"topic": "orders", "consumer": "it"},
            "target": {"url": "http://127.0.0.1:9/", "timeout_s": 2},
        }
    )


async def publish(broker: EmbeddedBroker, count: int) -> None:
    await broker.admin.create_topic(
        "orders", partitions=2, consumers=[ConsumerSpec("it")], exist_ok=True
    )
    writer = await broker.writer("orders")
    await writer.write([OutgoingMessage(value=orjson.dumps({"n": n})) for n in range(count)])
    await writer.close()


async def test_the_proxy_makes_its_transports_from_the_registry_it_is_given(
    broker: EmbeddedBroker,
) -> None:
    await publish(broker, 20)
    fake = FakeTransport()
    transports = Transports()
    transports.register(TransportKind("http", "http", "https", _opens(fake)))
    proxy = Proxy(broker, {"it": integration()}, transports=transports, runner_options=FAST)
    task = asyncio.create_task(proxy.run())
    try:
        await wait_until_true(lambda: len(fake.done_ids()) == 20, timeout_s=30)
    finally:
        proxy.stop()
        await task
    assert fake.closed  # the proxy owns the transport it made


async def test_a_target_whose_scheme_no_kind_serves_waits_with_the_reason(
    broker: EmbeddedBroker,
) -> None:
    await publish(broker, 1)
    transports = Transports()
    transports.register(GRPC)
    proxy = Proxy(broker, {"it": integration()}, transports=transports, runner_options=FAST)
    task = asyncio.create_task(proxy.run())
    try:
        group = proxy.groups["it"]
        await wait_until_true(lambda: "main" in group.issues, timeout_s=30)
        assert group.issues["main"] == "no transport for http:// targets"
    finally:
        proxy.stop()
        await task


async def test_a_signing_secret_unset_refuses_the_file_when_the_proxy_takes_it(
    broker: EmbeddedBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kind's preflight reads what its factory will: the refusal names the file at
    # once, not a transport that fails to start later.
    monkeypatch.delenv("NEMESIS_TEST_UNSET_SECRET", raising=False)
    plain = integration()
    signing = SigningConfig(secrets_env=["NEMESIS_TEST_UNSET_SECRET"])
    target = plain.target.model_copy(update={"signing": signing})
    signed = plain.model_copy(update={"target": target})
    file = tmp_path / "it.yaml"
    proxy = Proxy(broker, {}, pipelines_dir=tmp_path / "pipelines")

    with pytest.raises(ConfigError) as refused:
        proxy.add_integration(signed, file)

    [problem] = refused.value.problems
    assert (problem.file, problem.field) == (str(file), "target.signing.secrets_env.0")
    assert "NEMESIS_TEST_UNSET_SECRET is unset or empty" in problem.message
    assert "it" not in proxy.groups
