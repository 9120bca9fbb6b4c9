"""YDB configuration, credentials, driver settings and error translation: no server needed."""

from __future__ import annotations

import asyncio
import importlib.util
import textwrap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import ydb
from pydantic import ValidationError
from ydb import issues

from nemesis.broker.ydb.connection import (
    StaticLogin,
    credentials,
    driver_config,
    object_path,
    relative_name,
)
from nemesis.broker.ydb.errors import broker_error, dlq_error, table_call, topic_call
from nemesis.config import load_process_config
from nemesis.config.models import (
    EmbeddedBackendConfig,
    NemesisConfig,
    SqliteDlqConfig,
    YdbBackendConfig,
    YdbConnectionConfig,
    YdbCredentialsConfig,
    YdbDlqConfig,
)
from nemesis.errors import (
    BrokerAccessDenied,
    BrokerError,
    BrokerTimeout,
    ConfigError,
    DlqError,
    DlqTimeout,
    TopicExists,
    TopicNotFound,
)

LOCAL = {"endpoint": "grpc://localhost:2136", "database": "/local"}


def write(directory: Path, text: str) -> Path:
    path = directory / "nemesis.yaml"
    path.write_text(textwrap.dedent(text).lstrip("\n"), encoding="utf-8")
    return path


# --- configuration -------------------------------------------------------------------------


def test_the_backend_and_the_dlq_are_chosen_by_kind() -> None:
    default = NemesisConfig()
    assert isinstance(default.backend, EmbeddedBackendConfig)
    assert isinstance(default.dlq, SqliteDlqConfig)
    config = NemesisConfig.model_validate(
        {
            "backend": {"kind": "ydb", **LOCAL, "directory": "nemesis"},
            "dlq": {"kind": "ydb"},
            "state": {"kind": "ydb"},
        }
    )
    assert isinstance(config.backend, YdbBackendConfig)
    assert (config.backend.endpoint, config.backend.database) == ("grpc://localhost:2136", "/local")
    assert config.backend.credentials.mode == "anonymous"
    assert isinstance(config.dlq, YdbDlqConfig)
    assert (config.dlq.path, config.dlq.connection) == ("nemesis/dlq", None)
    # The fields the CLI reads of either backend exist on both.
    assert config.backend.default_partitions == 4
    assert config.backend.retention == 7 * 86400


def test_a_ydb_dlq_needs_a_connection_unless_the_backend_is_ydb() -> None:
    with pytest.raises(ValidationError, match=r"dlq\.connection"):
        NemesisConfig.model_validate({"dlq": {"kind": "ydb"}})
    config = NemesisConfig.model_validate({"dlq": {"kind": "ydb", "connection": LOCAL}})
    assert isinstance(config.dlq, YdbDlqConfig)
    assert config.dlq.connection == YdbConnectionConfig(**LOCAL)


@pytest.mark.parametrize(
    ("credentials_section", "message"),
    [
        ({"mode": "token"}, "needs token"),
        ({"mode": "static"}, "needs user"),
        ({"mode": "service_account"}, "needs key_file"),
        ({"mode": "kerberos"}, "Input should be"),
    ],
)
def test_each_credentials_mode_asks_for_what_it_needs(
    credentials_section: dict[str, str], message: str
) -> None:
    with pytest.raises(ValidationError, match=message):
        YdbCredentialsConfig.model_validate(credentials_section)


def test_a_ydb_backend_file_with_secrets_from_the_environment(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        backend:
          kind: ydb
          endpoint: grpcs://ydb.example.net:2135
          database: /ru-central1/b1g/etn
          credentials: {mode: token, token: "${YDB_TOKEN}"}
          request_timeout_s: 5
        dlq: {kind: ydb}
        state: {kind: ydb}
        """,
    )
    config = load_process_config(path, env={"YDB_TOKEN": "t0ken"})
    assert isinstance(config.backend, YdbBackendConfig)
    assert config.backend.credentials.token == "t0ken"
    assert config.backend.request_timeout_s == 5


def test_problems_in_a_ydb_section_name_the_field_and_line(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        backend:
          kind: ydb
          database: local
          connect_timeout_s: -1
        single_host: true
        """,
    )
    with pytest.raises(ConfigError) as info:
        load_process_config(path, env={})
    # The kind's tag does not appear in the field names.
    assert [(p.line, p.field) for p in info.value.problems] == [
        (1, "backend.endpoint"),
        (3, "backend.database"),
        (4, "backend.connect_timeout_s"),
    ]


# --- credentials and the driver -------------------------------------------------------------


def auth_metadata(chosen: ydb.Credentials) -> object:
    return cast(Callable[[], object], chosen.auth_metadata)()  # untyped in the SDK


def test_credentials_by_mode() -> None:
    assert isinstance(credentials(YdbCredentialsConfig()), ydb.AnonymousCredentials)
    token = credentials(YdbCredentialsConfig(mode="token", token="t0ken"))
    assert isinstance(token, ydb.AccessTokenCredentials)
    assert auth_metadata(token) == [("x-ydb-auth-ticket", "t0ken")]
    static = credentials(YdbCredentialsConfig(mode="static", user="root", password="secret"))
    assert isinstance(static, StaticLogin)
    assert (static.login.user, static.login.password) == ("root", "secret")


async def test_static_credentials_log_in_without_blocking_the_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The login (the SDK's blocking gRPC call, here one that waits for the loop to move)
    runs beside the event loop; the driver awaits the token as the async SDK's connection
    does (``ydb/aio/connection.py``: a coroutine from ``auth_metadata`` is awaited)."""
    loop_moved = threading.Event()
    logins: list[str] = []

    def login(self: ydb.StaticCredentials) -> dict[str, object]:
        logins.append(self.user)
        # Returns at once if the loop ran meanwhile; blocked forever it would not.
        moved = loop_moved.wait(timeout=30)
        return {"expires_in": 1800, "access_token": "t0ken" if moved else "loop-was-blocked"}

    monkeypatch.setattr(ydb.StaticCredentials, "_make_token_request", login)
    static = credentials(YdbCredentialsConfig(mode="static", user="root", password="secret"))
    config = ydb.DriverConfig(endpoint="grpc://localhost:2136", database="/local")
    cast(Callable[[ydb.DriverConfig], None], static._update_driver_config)(config)

    async def meanwhile() -> None:
        await asyncio.sleep(0)
        loop_moved.set()

    beside = asyncio.create_task(meanwhile())
    metadata = auth_metadata(static)
    if asyncio.iscoroutine(metadata):
        metadata = await metadata
    await beside
    assert metadata == [("x-ydb-auth-ticket", "t0ken")]
    assert logins == ["root"]


def test_service_account_credentials_explain_what_is_missing(tmp_path: Path) -> None:
    key = tmp_path / "key.json"
    key.write_text("{}")
    if importlib.util.find_spec("jwt") is not None:
        pytest.skip("the ydb[yc] extra is installed here")
    with pytest.raises(ConfigError, match=r"ydb\[yc\]"):
        credentials(YdbCredentialsConfig(mode="service_account", key_file=str(key)))


def test_env_credentials_are_the_sdks_own_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("YDB_ACCESS_TOKEN_CREDENTIALS", "from-env")
    for name in (
        "YDB_SERVICE_ACCOUNT_KEY_FILE_CREDENTIALS",
        "YDB_USER",
        "YDB_METADATA_CREDENTIALS",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("YDB_ANONYMOUS_CREDENTIALS", "0")
    chosen = credentials(YdbCredentialsConfig(mode="env"))
    assert auth_metadata(chosen) == [("x-ydb-auth-ticket", "from-env")]


def test_driver_config_carries_endpoint_database_and_tls_roots(tmp_path: Path) -> None:
    pem = tmp_path / "ca.pem"
    pem.write_bytes(b"-----BEGIN CERTIFICATE-----\n...\n")
    config = YdbConnectionConfig(
        endpoint="grpcs://ydb.example.net:2135",
        database="/ru-central1/b1g/etn",
        root_certificates=str(pem),
    )
    built = driver_config(config)
    assert (built.endpoint, built.database) == ("ydb.example.net:2135", "/ru-central1/b1g/etn")
    assert built.secure_channel
    assert built.root_certificates == pem.read_bytes()
    assert isinstance(built.credentials, ydb.AnonymousCredentials)
    plain = driver_config(YdbConnectionConfig(**LOCAL))
    assert (plain.secure_channel, plain.root_certificates) == (False, None)
    missing = YdbConnectionConfig(**LOCAL, root_certificates=str(tmp_path / "nope.pem"))
    with pytest.raises(ConfigError, match="root_certificates"):
        driver_config(missing)


def test_object_paths() -> None:
    assert object_path("/local", "", "orders") == "/local/orders"
    assert object_path("/local/", "/nemesis/", "retry/a.1") == "/local/nemesis/retry/a.1"
    assert relative_name("/local", "nemesis", "/local/nemesis/retry/a.1") == "retry/a.1"
    with pytest.raises(BrokerError):
        relative_name("/local", "nemesis", "/local/other/x")


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (TimeoutError(), BrokerTimeout),
        (issues.DeadlineExceed("deadline"), BrokerTimeout),
        (issues.Timeout("timeout"), BrokerTimeout),
        (issues.SchemeError("path not found"), TopicNotFound),
        (issues.NotFound("no such consumer"), TopicNotFound),
        (issues.AlreadyExists("exists"), TopicExists),
        (issues.Unauthenticated("who are you"), BrokerAccessDenied),
        (issues.Unauthorized("not yours"), BrokerAccessDenied),
        (issues.Unavailable("down"), BrokerError),
        (issues.Overloaded("busy"), BrokerError),
        (issues.BadRequest("bad"), BrokerError),
    ],
)
def test_sdk_errors_become_nemesis_errors(raised: Exception, expected: type[BrokerError]) -> None:
    translated = broker_error(raised, "describe topic orders")
    assert type(translated) is expected
    assert str(translated).startswith("describe topic orders: ")
    assert type(dlq_error(raised, "put")) is (DlqTimeout if expected is BrokerTimeout else DlqError)


async def test_calls_run_under_a_deadline_and_come_out_translated() -> None:
    async def slow() -> None:
        await asyncio.sleep(10)

    async def missing() -> None:
        raise issues.SchemeError("path not found")

    async def bug() -> None:
        raise ValueError("a bug is not a broker error")

    with pytest.raises(BrokerTimeout, match="no answer in time"):
        await topic_call("describe topic orders", slow(), timeout_s=0.01)
    with pytest.raises(TopicNotFound, match="SchemeError"):
        await topic_call("describe topic orders", missing(), timeout_s=1)
    with pytest.raises(ValueError, match="a bug"):
        await topic_call("describe topic orders", bug(), timeout_s=1)
    with pytest.raises(DlqTimeout):
        await table_call("count dead letters", slow(), timeout_s=0.01)
