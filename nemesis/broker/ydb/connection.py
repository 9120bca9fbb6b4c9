"""Connecting to YDB: credentials, TLS roots, the async driver, and object paths.

One ``ydb.aio.Driver`` per process serves the topic backend and the DLQ
store; ``open_driver`` waits for its first discovery under a deadline, since
the SDK would otherwise wait for a server forever.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import cast

import ydb
from ydb import issues
from ydb.aio.credentials import AbstractExpiringTokenCredentials
from ydb.aio.driver import Driver
from ydb.aio.iam import MetadataUrlCredentials, ServiceAccountCredentials

from nemesis.broker.ydb.errors import broker_error
from nemesis.config.models import YdbConnectionConfig, YdbCredentialsConfig
from nemesis.errors import BrokerError, ConfigError, ConfigProblem

# What ServiceAccountCredentials imports lazily; without them it fails on first use.
_SERVICE_ACCOUNT_MODULES = ("jwt", "yandex.cloud.iam.v1.iam_token_service_pb2_grpc")

# The SDK's credential constructors are untyped; these are their signatures.
_anonymous = cast(Callable[[], ydb.Credentials], ydb.AnonymousCredentials)
_access_token = cast(Callable[[str], ydb.Credentials], ydb.AccessTokenCredentials)
_user_password = cast(
    Callable[[str, str], ydb.StaticCredentials], ydb.StaticCredentials.from_user_password
)
_service_account_key = cast(Callable[[str], ydb.Credentials], ServiceAccountCredentials.from_file)
_metadata_service = cast(Callable[[], ydb.Credentials], MetadataUrlCredentials)


class StaticLogin(AbstractExpiringTokenCredentials):
    """``static`` credentials (user and password) whose logins never block the event loop.

    The SDK's ``StaticCredentials`` logs in with a blocking gRPC call (up to its
    10 s timeout), and makes its first one, and any after the token expired,
    on the caller's thread: with the async driver, the event loop, which
    would stall every flow of the process meanwhile. This is the async SDK's
    expiring-token credentials (the driver awaits them) around that same
    login, run on a worker thread.
    """

    def __init__(self, user: str, password: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # untyped in the SDK
        self.login = _user_password(user, password)

    def _update_driver_config(self, driver_config: ydb.DriverConfig) -> None:
        # The driver hands its endpoint over here; the login connects there.
        cast(Callable[[ydb.DriverConfig], None], self.login._update_driver_config)(driver_config)

    async def _make_token_request(self) -> dict[str, object]:
        request = cast(Callable[[], dict[str, object]], self.login._make_token_request)
        return await asyncio.to_thread(request)


def credentials(config: YdbCredentialsConfig) -> ydb.Credentials:
    """The SDK credentials object for a credentials section (see ``YdbCredentialsConfig``).

    ``static`` logs in on a worker thread (``StaticLogin``). ``metadata`` needs a
    running loop.
    """
    mode = config.mode
    if mode == "anonymous":
        return _anonymous()
    if mode == "token":
        assert config.token is not None  # the config model requires it for this mode
        return _access_token(config.token)
    if mode == "static":
        assert config.user is not None
        return StaticLogin(config.user, config.password or "")
    if mode == "service_account":
        assert config.key_file is not None
        missing = [m for m in _SERVICE_ACCOUNT_MODULES if not _importable(m)]
        if missing:
            raise _config_problem(
                "credentials.mode",
                "service_account credentials need the ydb[yc] extra"
                f" (missing: {', '.join(missing)}): pip install 'ydb[yc]'",
            )
        if not Path(config.key_file).is_file():
            raise _config_problem("credentials.key_file", f"no such file: {config.key_file}")
        return _service_account_key(config.key_file)
    if mode == "metadata":
        return _metadata_service()
    return ydb.credentials_from_env_variables()


def driver_config(config: YdbConnectionConfig) -> ydb.DriverConfig:
    """The SDK driver configuration: endpoint, database, credentials and TLS roots."""
    root_certificates: bytes | None = None
    if config.root_certificates is not None:
        try:
            root_certificates = Path(config.root_certificates).read_bytes()
        except OSError as exc:
            raise _config_problem(
                "root_certificates", f"cannot read {config.root_certificates}: {exc.strerror}"
            ) from exc
    return ydb.DriverConfig(
        endpoint=config.endpoint,
        database=config.database,
        credentials=credentials(config.credentials),
        root_certificates=root_certificates,
    )


async def open_driver(config: YdbConnectionConfig) -> Driver:
    """A connected driver; BrokerError when YDB cannot be reached in ``connect_timeout_s``."""
    driver = Driver(driver_config=driver_config(config))
    try:
        await driver.wait(timeout=config.connect_timeout_s, fail_fast=True)
    except (issues.Error, TimeoutError) as exc:
        await driver.stop(timeout=1)
        raise broker_error(exc, f"connect to {config.endpoint}{config.database}") from exc
    except BaseException:
        await driver.stop(timeout=1)
        raise
    return driver


def object_path(database: str, directory: str, name: str) -> str:
    """The absolute path of a topic or table: <database>/<directory>/<name>.

    A name that starts with ``/`` is a path of its own (a topic another team
    owns, elsewhere in the database): it is used as it is, and must lie inside
    the database, since a driver reaches only its own database's objects;
    BrokerError otherwise.
    """
    root = database.rstrip("/")
    if name.startswith("/"):
        path = name.rstrip("/")
        if not path.startswith(root + "/"):
            raise BrokerError(
                f"topic {name} is outside the database {database}: an absolute topic"
                f" name must start with {root}/"
            )
        return path
    parts = [root, directory.strip("/"), name.strip("/")]
    return "/".join(part for part in parts if part)


def relative_name(database: str, directory: str, path: str) -> str:
    """``object_path``'s inverse: the name of an object found under the directory."""
    prefix = object_path(database, directory, "") + "/"
    if not path.startswith(prefix):
        raise BrokerError(f"{path} is not under {prefix}")
    return path[len(prefix) :]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _config_problem(field: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem("nemesis.yaml", None, f"ydb.{field}", message)])
