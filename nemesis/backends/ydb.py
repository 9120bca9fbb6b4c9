"""The ``ydb`` kinds: YDB topics as the broker, YDB tables as the DLQ and the state store.

The SDK is imported only when a factory runs (``nemesis.broker.ydb``,
``nemesis.dlq.ydb``, ``nemesis.fleet.ydb``): a process on the embedded broker never loads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field, model_validator

from nemesis.backends.base import (
    BackendModel,
    BrokerKind,
    DlqKind,
    DlqModel,
    ProcessConfig,
    StateKind,
    StateModel,
)
from nemesis.config_base import DurationS, Model, defaults

if TYPE_CHECKING:
    from nemesis.broker.port import Broker
    from nemesis.clock import Clock
    from nemesis.dlq.port import DeadLetterStore
    from nemesis.fleet.port import StateStore


class YdbCredentialsConfig(Model):
    """How Nemesis signs in to YDB; secrets come from ``${VAR}`` references, never the file.

    ``anonymous``: none (a local YDB). ``token``: an access token (IAM, OAuth).
    ``static``: a YDB user and password. ``service_account``: an authorized
    key JSON file (needs the ``ydb[yc]`` extra). ``metadata``: the cloud VM's
    metadata service. ``env``: the SDK's own ``YDB_*`` environment variables.
    """

    mode: Literal["anonymous", "token", "static", "service_account", "metadata", "env"] = (
        "anonymous"
    )
    token: str | None = None
    user: str | None = None
    password: str | None = None
    key_file: str | None = None

    @model_validator(mode="after")
    def _what_the_mode_needs(self) -> YdbCredentialsConfig:
        needed = {"token": ("token",), "static": ("user",), "service_account": ("key_file",)}
        missing = [name for name in needed.get(self.mode, ()) if not getattr(self, name)]
        if missing:
            raise ValueError(f"credentials mode {self.mode!r} needs {' and '.join(missing)}")
        return self


class YdbConnectionConfig(Model):
    """Where a YDB database is and how to reach it."""

    endpoint: Annotated[str, Field(pattern=r"^grpcs?://[^/\s]+$")]  # grpcs:// for TLS
    database: Annotated[str, Field(pattern=r"^/\S+$")]  # /local, /ru-central1/b1g.../etn...
    credentials: YdbCredentialsConfig = defaults(YdbCredentialsConfig)
    # PEM file with the CA certificates for grpcs:// (None: the SDK's bundled roots).
    root_certificates: str | None = None
    connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 10.0
    # Every call to YDB is bounded by this: the SDK itself retries forever.
    request_timeout_s: Annotated[float, Field(gt=0, le=600)] = 30.0


class YdbBackendConfig(YdbConnectionConfig, BackendModel):
    """YDB topics: the production broker (``nemesis.broker.ydb``)."""

    kind: Literal["ydb"] = "ydb"
    # Topics live under <database>/<directory>; "" is the database root.
    directory: Annotated[str, Field(pattern=r"^[A-Za-z0-9._/-]*$")] = ""
    retention: DurationS = 7 * 86400.0
    default_partitions: Annotated[int, Field(ge=1, le=1024)] = 4
    reader_buffer_bytes: Annotated[int, Field(ge=64 * 1024)] = 16 * 1024 * 1024
    # Messages, and bytes, of a paused partition held in memory; past either the
    # partition's messages are dropped and read again after its resume (YDB
    # cannot pause one partition: see nemesis/broker/ydb/README.md).
    pause_stash_messages: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    pause_stash_bytes: Annotated[int, Field(ge=1024)] = 8 * 1024 * 1024

    def consumer_name_problem(self, name: str) -> str | None:
        # The server's AddReadRuleToConfig (ydb/services/lib/actors/pq_schema_actor.cpp)
        # answers BAD_REQUEST "consumer ... has illegal symbols" to either character.
        illegal = "".join(sorted({c for c in name if c in "/|"}))
        if illegal:
            shown = " and ".join(repr(c) for c in illegal)
            return f"YDB refuses {shown} in a consumer name ({name!r}): use '.', '-' or '_'"
        return None


class YdbDlqConfig(DlqModel):
    """The DLQ in YDB tables, with a TTL on the dead-letter time (``nemesis.dlq.ydb``)."""

    kind: Literal["ydb"] = "ydb"
    # The directory of the DLQ tables, relative to the database.
    path: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*$")] = "nemesis/dlq"
    retention: DurationS = 180 * 86400.0
    # None: the backend's connection (the backend must then be ydb).
    connection: YdbConnectionConfig | None = None

    def location(self, data_dir: str) -> str:
        return f"ydb:{self.path}"

    def check_backend(self, backend: BackendModel) -> None:
        if self.connection is None and not isinstance(backend, YdbBackendConfig):
            raise ValueError(
                "dlq.kind ydb needs dlq.connection (endpoint, database) unless the backend is ydb"
            )


async def open_ydb_backend(config: ProcessConfig, clock: Clock) -> Broker:
    from nemesis.broker.ydb import open_ydb

    assert isinstance(config.backend, YdbBackendConfig)  # chosen by kind
    return await open_ydb(config.backend, clock=clock)


async def open_ydb_store(
    config: ProcessConfig, broker: Broker | None, clock: Clock
) -> DeadLetterStore:
    """The YDB DLQ; without a connection of its own it shares the YDB broker's driver."""
    from nemesis.broker.ydb import YdbBroker
    from nemesis.dlq.ydb import open_ydb_dlq

    dlq = config.dlq
    assert isinstance(dlq, YdbDlqConfig)  # chosen by kind
    if dlq.connection is None and isinstance(broker, YdbBroker):
        return await open_ydb_dlq(dlq, driver=broker.driver, connection=broker.config, clock=clock)
    backend = config.backend if isinstance(config.backend, YdbBackendConfig) else None
    return await open_ydb_dlq(dlq, connection=backend, clock=clock)


class YdbStateConfig(StateModel):
    """The fleet's state in YDB tables (``nemesis.fleet.ydb``): replicas on several hosts."""

    kind: Literal["ydb"] = "ydb"
    # The directory of the fleet's tables, relative to the database. One fleet per
    # directory: two configurations on one would take each other for replicas.
    path: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*$")] = "nemesis/fleet"
    # None: the backend's connection (the backend must then be ydb).
    connection: YdbConnectionConfig | None = None

    def location(self, data_dir: str) -> str:
        return f"ydb:{self.path}"

    def check_backend(self, backend: BackendModel) -> None:
        if self.connection is None and not isinstance(backend, YdbBackendConfig):
            raise ValueError(
                "state.kind ydb needs state.connection (endpoint, database)"
                " unless the backend is ydb"
            )


async def open_ydb_state_store(config: ProcessConfig) -> StateStore:
    """The YDB state store; without a connection of its own it reaches the backend's database."""
    from nemesis.fleet.ydb import open_ydb_state

    assert isinstance(config.state, YdbStateConfig)  # chosen by kind
    backend = config.backend if isinstance(config.backend, YdbBackendConfig) else None
    return await open_ydb_state(config.state, connection=backend)


YDB = BrokerKind("ydb", YdbBackendConfig, open_ydb_backend)
YDB_DLQ = DlqKind("ydb", YdbDlqConfig, open_ydb_store)
YDB_STATE = StateKind("ydb", YdbStateConfig, open_ydb_state_store)
