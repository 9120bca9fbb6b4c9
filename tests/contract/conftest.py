"""The backends the contract cases run against: embedded, kafka, and YDB when configured.

The kafka cases run against Apache Kafka (``tests/kafka_broker.py``): one
broker per session on 127.0.0.1, shared by the cases, each naming its topics
and groups with a prefix of its own; the backend has its default settings
(the idempotent producer on), and the sqlite DLQ.

The YDB cases run when ``NEMESIS_YDB_ENDPOINT`` (and, unless it is
``/local``, ``NEMESIS_YDB_DATABASE``) name a server, e.g. ``ydbplatform/local-ydb``
(see ``nemesis/broker/ydb/README.md``); ``NEMESIS_YDB_TOKEN`` signs in with
a token when the server wants one. Without the endpoint they are reported
as skipped, with the reason, never silently left out. Each YDB case works
in a directory of its own and drops its topics and tables at the end.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from nemesis.backends import open_backend, open_dlq
from nemesis.broker.port import Broker
from nemesis.config.models import (
    EmbeddedBackendConfig,
    NemesisConfig,
    SqliteDlqConfig,
    YdbBackendConfig,
    YdbCredentialsConfig,
    YdbDlqConfig,
)
from nemesis.dlq import DeadLetterStore
from tests.kafka_broker import KafkaBroker, Namespace, kafka_backend_config

YDB_ENDPOINT = os.environ.get("NEMESIS_YDB_ENDPOINT", "")
YDB_DATABASE = os.environ.get("NEMESIS_YDB_DATABASE", "/local")
YDB_TOKEN = os.environ.get("NEMESIS_YDB_TOKEN", "")

needs_ydb = pytest.mark.skipif(
    not YDB_ENDPOINT,
    reason="NEMESIS_YDB_ENDPOINT is not set: no YDB server to run the ydb backend's cases against",
)

BACKENDS = [
    pytest.param("embedded", id="embedded"),
    pytest.param("kafka", id="kafka"),
    pytest.param("ydb", id="ydb", marks=needs_ydb),
]


def ydb_backend_config(directory: str) -> YdbBackendConfig:
    credentials = (
        YdbCredentialsConfig(mode="token", token=YDB_TOKEN) if YDB_TOKEN else YdbCredentialsConfig()
    )
    return YdbBackendConfig(
        endpoint=YDB_ENDPOINT,
        database=YDB_DATABASE,
        credentials=credentials,
        directory=directory,
        connect_timeout_s=10,
        request_timeout_s=30,
    )


@dataclass
class Backend:
    """One backend under test: its configuration, and what a case opened on it."""

    kind: str
    config: NemesisConfig
    opened: list[Any] = field(default_factory=list)
    # The case's own topic and consumer names: the kafka cases share one broker.
    names: Namespace = field(default_factory=Namespace)

    async def broker(self) -> Broker:
        """A broker over this backend; a second call is a second process, or a restart."""
        broker = await open_backend(self.config)
        self.opened.append(broker)
        return broker

    async def dlq(self, broker: Broker | None = None) -> DeadLetterStore:
        store = await open_dlq(self.config, broker=broker)
        self.opened.append(store)
        return store

    async def close(self) -> None:
        for resource in reversed(self.opened):
            await resource.close()
        self.opened.clear()


def embedded_config(directory: Path) -> NemesisConfig:
    return NemesisConfig(
        # A long lease keeps the heartbeats out of the way: in one process readers
        # rebalance through pokes, and closing a reader releases its leases.
        backend=EmbeddedBackendConfig(path=str(directory / "nemesis.db"), lease_s=30.0),
        dlq=SqliteDlqConfig(path=str(directory / "dlq.db")),
        data_dir=str(directory),
    )


def kafka_config(bootstrap: str, directory: Path) -> NemesisConfig:
    return NemesisConfig(
        backend=kafka_backend_config(bootstrap),
        dlq=SqliteDlqConfig(path=str(directory / "dlq.db")),
        data_dir=str(directory),
    )


def ydb_config(name: str) -> NemesisConfig:
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40]
    directory = f"nemesis-contract/{slug}-{secrets.token_hex(4)}"
    return NemesisConfig(
        backend=ydb_backend_config(directory),
        dlq=YdbDlqConfig(path=f"{directory}/dlq"),
    )


async def drop_everything(config: NemesisConfig) -> None:
    """Drops the topics and DLQ tables a YDB case created."""
    from ydb.aio.query.pool import QuerySessionPool

    from nemesis.broker.ydb import YdbBroker

    broker = await open_backend(config)
    assert isinstance(broker, YdbBroker)
    try:
        for topic in await broker.admin.list_topics():
            await broker.admin.drop_topic(topic)
        if isinstance(config.dlq, YdbDlqConfig):
            pool = QuerySessionPool(broker.driver, size=1)
            for table in ("letters", "signatures", "actions", "action_integrations", "meta"):
                await pool.execute_with_retries(f"DROP TABLE IF EXISTS `{config.dlq.path}/{table}`")
            await cast(Callable[[], Awaitable[None]], pool.stop)()  # untyped in the SDK
    finally:
        await broker.close()


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Backend]:
    kind = request.param
    if kind == "kafka":
        # Started on first use, so a run of the other backends' cases needs no JVM.
        broker: KafkaBroker = request.getfixturevalue("kafka")
        config = kafka_config(broker.bootstrap, tmp_path)
    elif kind == "embedded":
        config = embedded_config(tmp_path)
    else:
        config = ydb_config(request.node.name)
    under_test = Backend(kind, config)
    try:
        yield under_test
    finally:
        await under_test.close()
        if kind == "ydb":
            await drop_everything(config)
