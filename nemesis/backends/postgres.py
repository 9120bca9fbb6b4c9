"""The ``postgres`` kinds: the state store in a PostgreSQL database every replica reaches.

``PostgresConnectionConfig`` is where a database is and how to reach it
(``nemesis.postgres`` opens its pool); ``PostgresDlqConfig`` adds where the
DLQ's tables are (``dlq:``), ``PostgresStateConfig`` where the fleet's are
(``state:``). The driver (asyncpg) is imported only when a factory runs: a
process on another kind never loads it.

The password, whether in ``dsn`` or ``password``, is a ``SecretStr``: it is
never printed, neither in an error of the configuration nor in a log line;
write it as a ``${VAR}`` reference so that it lives in the environment, not
in the file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal
from urllib.parse import unquote, urlsplit

from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from nemesis.backends.base import DlqKind, DlqModel, ProcessConfig, StateKind, StateModel
from nemesis.config_base import DurationS, Model

if TYPE_CHECKING:
    from nemesis.broker.port import Broker
    from nemesis.clock import Clock
    from nemesis.dlq.port import DeadLetterStore
    from nemesis.fleet.port import StateStore

SslMode = Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]
# A schema or table-name prefix: put into statements as an identifier, so letters,
# digits and underscores only (PostgreSQL folds unquoted names to lower case).
IDENTIFIER_PATTERN = r"^[a-z_][a-z0-9_]{0,39}$"


class PostgresConnectionConfig(Model):
    """Where a PostgreSQL database is and how to reach it: ``dsn``, or host and the rest."""

    # A refused value is not repeated in the error: a DSN holds a password.
    model_config = ConfigDict(hide_input_in_errors=True)

    # postgresql://user:password@host:port/database?sslmode=verify-full; or the fields below.
    dsn: SecretStr | None = None
    host: str | None = None
    port: Annotated[int, Field(ge=1, le=65535)] = 5432
    database: str | None = None  # None: the user's name
    user: str | None = None  # None: the PGUSER environment variable, else the OS user
    password: SecretStr | None = None  # None: PGPASSWORD or ~/.pgpass
    # As libpq's sslmode; None: the DSN's, else prefer (TLS when the server offers it).
    sslmode: SslMode | None = None
    ssl_root_cert: str | None = None  # a PEM file of CA certificates (verify-ca, verify-full)
    pool_size: Annotated[int, Field(ge=1, le=200)] = 10  # connections of this process
    connect_timeout_s: Annotated[float, Field(gt=0, le=600)] = 10.0
    # Every statement is bounded by this, on the server and in the client.
    statement_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 30.0

    @field_validator("dsn")
    @classmethod
    def _a_postgres_url(cls, value: SecretStr | None) -> SecretStr | None:
        # The message never repeats the value: it may hold a password.
        if value is not None:
            url = value.get_secret_value()
            if not url.startswith(("postgresql://", "postgres://")):
                raise ValueError("must be a URL: postgresql://user:password@host:port/database")
            try:
                urlsplit(url).port  # noqa: B018  (parses the port, or raises)
            except ValueError:
                raise ValueError("has a port that is not a number from 0 to 65535") from None
        return value

    @model_validator(mode="after")
    def _dsn_or_fields(self) -> PostgresConnectionConfig:
        if self.dsn is not None:
            given = [
                name
                for name in ("host", "database", "user", "password")
                if getattr(self, name) is not None
            ]
            if given:
                raise ValueError(f"give either dsn or {', '.join(given)}, not both")
        elif self.host is None:
            raise ValueError("needs dsn, or host (with port, database, user, password)")
        if self.sslmode in ("verify-ca", "verify-full") and self.ssl_root_cert is None:
            raise ValueError(f"sslmode {self.sslmode} needs ssl_root_cert (a PEM file of CAs)")
        return self

    def address(self) -> str:
        """host:port/database, as errors and ``nemesis init`` name the database (no password)."""
        if self.dsn is None:
            return f"{self.host}:{self.port}/{self.database or self.user or ''}"
        url = urlsplit(self.dsn.get_secret_value())
        host = url.hostname or "localhost"
        return f"{host}:{url.port or 5432}/{unquote(url.path.lstrip('/'))}"


class PostgresDlqConfig(PostgresConnectionConfig, DlqModel):
    """The DLQ in PostgreSQL tables, shared by replicas on any number of hosts."""

    kind: Literal["postgres"] = "postgres"
    # The tables are <schema_name>.<table_prefix>letters, ...; a missing schema is created.
    schema_name: Annotated[str, Field(pattern=IDENTIFIER_PATTERN)] = "public"
    table_prefix: Annotated[str, Field(pattern=r"^[a-z0-9_]{0,40}$")] = "nemesis_dlq_"
    # Rows older than this (by dead-letter time) are deleted, hourly; 0 keeps them forever.
    retention: DurationS = 180 * 86400.0

    def location(self, data_dir: str) -> str:
        return f"postgres:{self.address()} {self.schema_name}.{self.table_prefix}*"


async def open_postgres_store(
    config: ProcessConfig, broker: Broker | None, clock: Clock
) -> DeadLetterStore:
    from nemesis.dlq.postgres import open_postgres_dlq

    assert isinstance(config.dlq, PostgresDlqConfig)  # chosen by kind
    return await open_postgres_dlq(config.dlq, clock=clock)


POSTGRES_DLQ = DlqKind("postgres", PostgresDlqConfig, open_postgres_store)


class PostgresStateConfig(PostgresConnectionConfig, StateModel):
    """The fleet's state in PostgreSQL tables (``fleet_*``): replicas on several hosts."""

    kind: Literal["postgres"] = "postgres"
    # The schema of the fleet's tables; created when missing. One fleet per schema:
    # two configurations on one schema would take each other for replicas.
    schema_name: Annotated[str, Field(pattern=IDENTIFIER_PATTERN)] = "public"

    def location(self, data_dir: str) -> str:
        return f"postgres:{self.address()} {self.schema_name}"


async def open_postgres_state_store(config: ProcessConfig) -> StateStore:
    from nemesis.fleet.postgres import open_postgres_state

    assert isinstance(config.state, PostgresStateConfig)  # chosen by kind
    return await open_postgres_state(config.state)


POSTGRES_STATE = StateKind("postgres", PostgresStateConfig, open_postgres_state_store)
