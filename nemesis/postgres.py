"""A pool of PostgreSQL connections for the state store's postgres kinds, and its errors.

``open_pool`` connects as a ``PostgresConnectionConfig`` says (DSN or
fields, TLS, timeouts); ``Translated`` turns what the driver (asyncpg) and
the network raise into the caller's error tree, naming the database by
host, port and name, never by its password. A store module (the DLQ's,
``nemesis.dlq.postgres``) holds only its statements.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import asyncpg

from nemesis.backends.postgres import PostgresConnectionConfig
from nemesis.errors import NemesisError

T = TypeVar("T")

# What asyncpg and the network raise: the server's errors, the client's (a connection
# the server cut can end in an InternalClientError too), refused and broken connections.
_NETWORK_ERRORS = (
    OSError,
    asyncpg.InterfaceError,
    asyncpg.InternalClientError,
    asyncpg.PostgresError,
)


class _QuietFloorRetries(logging.Filter):
    """Drops asyncpg's warning, with a traceback, at each failed reconnect of a pool's floor.

    While the server is down the pool retries in the background and logs each try; the
    store's callers report the outage themselves, once, with the translated error.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Failed to restore the pool connection floor")


_POOL_LOG = logging.getLogger("asyncpg.pool")


@dataclass(frozen=True)
class Translated:
    """Runs a call, raising ``error`` (or ``timeout``) named after the database instead."""

    where: str  # e.g. "the PostgreSQL DLQ at db.example.net:5432/nemesis"
    error: type[NemesisError]
    timeout: type[NemesisError]
    secrets: tuple[str, ...] = field(default=(), repr=False)  # never in a message: the password

    async def __call__(self, what: str, call: Awaitable[T]) -> T:
        try:
            return await call
        except (TimeoutError, asyncpg.QueryCanceledError) as exc:
            raise self.timeout(f"{self.where}: {what}: timed out ({self.text(exc)})") from None
        except _NETWORK_ERRORS as exc:
            raise self.error(f"{self.where}: {what}: {self.text(exc)}") from None

    def text(self, exc: BaseException) -> str:
        text = str(exc).strip() or type(exc).__name__
        for secret in sorted(self.secrets, key=len, reverse=True):  # the whole DSN first
            if secret:
                text = text.replace(secret, "***")
        return text


def describe(
    config: PostgresConnectionConfig,
    what: str,
    error: type[NemesisError],
    timeout: type[NemesisError],
) -> Translated:
    """The error translation of a store on ``config``; ``what`` names it ("the PostgreSQL DLQ")."""
    secrets = [s.get_secret_value() for s in (config.dsn, config.password) if s is not None]
    if config.dsn is not None:
        password = urlsplit(config.dsn.get_secret_value()).password
        secrets += [password, unquote(password)] if password else []
    return Translated(f"{what} at {config.address()}", error, timeout, tuple(secrets))


def ssl_option(config: PostgresConnectionConfig) -> ssl.SSLContext | str | None:
    """asyncpg's ``ssl`` argument for ``config.sslmode`` (None: the DSN's or asyncpg's default).

    The verifying modes get a context of their own, so that ``ssl_root_cert``
    (and only it) holds the CAs trusted; the others are passed by name.
    """
    mode = config.sslmode
    if mode not in ("verify-ca", "verify-full"):
        return mode
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=config.ssl_root_cert)
    context.check_hostname = mode == "verify-full"
    return context


async def open_pool(
    config: PostgresConnectionConfig,
    translated: Translated,
    *,
    min_size: int = 1,
    search_path: str | None = None,
) -> asyncpg.Pool:
    """A connected pool (``min_size`` connections made now, so a bad address fails at once).

    ``search_path``: the schema unqualified table names are found in.
    """
    options: dict[str, Any] = {}
    if config.dsn is not None:
        options["dsn"] = config.dsn.get_secret_value()
    else:
        options.update(host=config.host, port=config.port, user=config.user)
        if config.database is not None:
            options["database"] = config.database
        if config.password is not None:
            options["password"] = config.password.get_secret_value()
    try:
        tls = ssl_option(config)
    except OSError as exc:  # the CA file is missing, unreadable or not PEM (ssl.SSLError)
        reason = exc.strerror or str(exc)
        raise translated.error(
            f"{translated.where}: ssl_root_cert {config.ssl_root_cert}: {reason}"
        ) from None
    if tls is not None:
        options["ssl"] = tls
    if not any(isinstance(f, _QuietFloorRetries) for f in _POOL_LOG.filters):
        _POOL_LOG.addFilter(_QuietFloorRetries())
    timeout_ms = round(config.statement_timeout_s * 1000)
    pool = asyncpg.create_pool(
        min_size=min(min_size, config.pool_size),
        max_size=config.pool_size,
        timeout=config.connect_timeout_s,
        # The client's bound sits a little past the server's, so that the server's
        # cancellation (a clean error, the connection kept) normally comes first.
        command_timeout=config.statement_timeout_s + 1.0,
        server_settings={
            "application_name": "nemesis",
            "statement_timeout": str(timeout_ms),
            "idle_in_transaction_session_timeout": str(timeout_ms * 2),
            **({} if search_path is None else {"search_path": search_path}),
        },
        **options,
    )
    try:
        # asyncpg's connect timeout covers one attempt; this bounds the whole opening.
        async with asyncio.timeout(config.connect_timeout_s * 2):
            await translated("connect", pool)
    except ValueError as exc:  # settings the driver refuses (asyncpg parses the DSN late)
        pool.terminate()
        raise translated.error(
            f"{translated.where}: invalid connection settings: {translated.text(exc)}"
        ) from None
    except TimeoutError:
        pool.terminate()
        raise translated.timeout(
            f"{translated.where}: connect: no answer within {config.connect_timeout_s * 2:g}s"
        ) from None
    except BaseException:
        pool.terminate()
        raise
    return pool


async def close_pool(pool: asyncpg.Pool, timeout_s: float) -> None:
    """Closes the pool's connections gracefully, or cuts them after ``timeout_s``.

    A graceful close waits for every lent connection to come back; a call
    stuck on a dead server must not hold up a process's shutdown.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await pool.close()
    except (TimeoutError, *_NETWORK_ERRORS):
        pool.terminate()
