"""The backend registry: the configured kind opens its broker and DLQ store."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ValidationError

from nemesis.backends import (
    BackendModel,
    Backends,
    BrokerKind,
    ProcessConfig,
    default_backends,
    open_backend,
    open_dlq,
)
from nemesis.broker.embedded import EmbeddedBroker
from nemesis.broker.port import Broker, PartitionSession, TopicAdmin, TopicReader, TopicWriter
from nemesis.broker.ydb import YdbAdmin, YdbBroker, YdbReader, YdbSession, YdbWriter
from nemesis.clock import Clock
from nemesis.config.models import NemesisConfig
from nemesis.dlq import DeadLetterStore, SqliteDeadLetterStore
from nemesis.dlq.ydb import YdbDeadLetterStore


def config_in(directory: Path) -> NemesisConfig:
    return NemesisConfig.model_validate(
        {
            "backend": {"kind": "embedded", "path": "log.db"},
            "dlq": {"kind": "sqlite", "path": "dlq.db", "retention": 0},
            "data_dir": str(directory),
        }
    )


async def test_the_default_kinds_open_from_the_configuration(tmp_path: Path) -> None:
    config = config_in(tmp_path)
    broker = await open_backend(config)
    try:
        assert isinstance(broker, EmbeddedBroker)
        assert broker.path == tmp_path / "log.db"
        store = await open_dlq(config, broker=broker)
        assert isinstance(store, SqliteDeadLetterStore)
        assert store.retention_s is None  # 0: keep forever
        await store.close()
    finally:
        await broker.close()
    assert set(default_backends().brokers) == {"embedded", "ydb", "kafka"}
    assert set(default_backends().dlqs) == {"sqlite", "ydb", "postgres"}


async def test_a_registry_can_be_copied_and_given_other_factories(tmp_path: Path) -> None:
    opened: list[str] = []

    async def fake_broker(config: ProcessConfig, clock: Clock) -> Broker:
        opened.append(config.backend.kind)
        raise RuntimeError("a fake that opens nothing")

    registry = default_backends().copy()
    registry.register_broker(dataclasses.replace(registry.brokers["embedded"], open=fake_broker))
    with pytest.raises(RuntimeError, match="fake"):
        await open_backend(config_in(tmp_path), backends=registry)
    assert opened == ["embedded"]
    assert default_backends().brokers["embedded"].open is not fake_broker  # fresh every time

    empty = Backends()
    with pytest.raises(ValueError, match="no broker backend of kind 'embedded'"):
        await open_backend(config_in(tmp_path), backends=empty)
    with pytest.raises(ValueError, match="no DLQ store of kind 'sqlite'"):
        await open_dlq(config_in(tmp_path), backends=empty)


async def test_a_ydb_backend_that_cannot_be_reached_is_a_broker_error() -> None:
    from nemesis.errors import BrokerError

    config = NemesisConfig.model_validate(
        {
            "backend": {
                "kind": "ydb",
                "endpoint": "grpc://127.0.0.1:9",  # nothing listens on the discard port
                "database": "/local",
                "connect_timeout_s": 0.5,
            },
            "single_host": True,
        }
    )
    with pytest.raises(BrokerError, match=r"connect to grpc://127\.0\.0\.1:9/local"):
        await open_backend(config)


def the_ydb_classes_implement_the_ports(
    broker: YdbBroker,
    admin: YdbAdmin,
    reader: YdbReader,
    writer: YdbWriter,
    session: YdbSession,
    store: YdbDeadLetterStore,
) -> tuple[Broker, TopicAdmin, TopicReader, TopicWriter, PartitionSession, DeadLetterStore]:
    """Never called: mypy checks each return value against its port's Protocol."""
    return broker, admin, reader, writer, session, store


class KafkaBackendConfig(BackendModel):
    kind: Literal["kafka"] = "kafka"
    bootstrap: str
    retention: float = 3600.0
    default_partitions: int = 6


async def open_kafka(config: ProcessConfig, clock: Clock) -> Broker:
    raise NotImplementedError


def test_a_registered_kind_brings_its_config_model_into_validation_and_the_schema() -> None:
    registry = default_backends().copy()
    registry.register_broker(BrokerKind("kafka", KafkaBackendConfig, open_kafka))

    class Config(BaseModel):
        backend: registry.backend_config() = KafkaBackendConfig(bootstrap="k:9092")  # type: ignore[valid-type]

    chosen = Config.model_validate({"backend": {"kind": "kafka", "bootstrap": "k:9092"}})
    assert isinstance(chosen.backend, KafkaBackendConfig)
    with pytest.raises(ValidationError) as refused:
        Config.model_validate({"backend": {"kind": "pulsar"}})
    [problem] = refused.value.errors()
    assert problem["loc"][-1] == "kind"
    assert "the known kinds are embedded, ydb, kafka" in problem["msg"]
    schema = str(Config.model_json_schema())
    assert "KafkaBackendConfig" in schema
    assert "Unknown" not in schema  # the unknown kind's model is not a choice


def test_the_known_kinds_are_listed_when_a_kind_is_wrong() -> None:
    with pytest.raises(
        ValidationError,
        match="unknown dlq kind 'cassandra'; the known kinds are sqlite, ydb, postgres",
    ):
        NemesisConfig.model_validate({"dlq": {"kind": "cassandra"}})


def test_the_embedded_path_never_loads_the_ydb_sdk(tmp_path: Path) -> None:
    script = (
        "import asyncio, sys\n"
        "from nemesis.backends import open_backend, open_dlq\n"
        "from nemesis.config.models import NemesisConfig\n"
        f"config = NemesisConfig(data_dir={str(tmp_path)!r})\n"
        "async def main():\n"
        "    broker = await open_backend(config)\n"
        "    store = await open_dlq(config, broker=broker)\n"
        "    await store.close()\n"
        "    await broker.close()\n"
        "asyncio.run(main())\n"
        "import nemesis.cli\n"
        "assert 'ydb' not in sys.modules, sorted(m for m in sys.modules if 'ydb' in m)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert ran.returncode == 0, ran.stderr
