"""Nemesis exceptions, one tree.

::

    NemesisError
    ├── ConfigError            invalid configuration (carries file, line, field)
    ├── BrokerError            a topic backend failed          retriable
    │   ├── BrokerTimeout      a blocking call ran out of time retriable
    │   ├── TopicNotFound      the topic does not exist
    │   ├── TopicExists        create of an existing topic
    │   ├── SessionLost        the partition session ended     (stale work, not retriable)
    │   └── BrokerAccessDenied credentials refused by the backend (retrying cannot help)
    ├── DeliveryError          a transport could not deliver   retriable
    ├── DlqError               the dead-letter store failed    retriable
    │   ├── DlqTimeout         a store call ran out of time    retriable
    │   └── InvalidQuery       a filter or page the store refuses (the caller's 4xx)
    │       └── InvalidCursor  a page cursor the store did not issue
    └── StateError             the fleet's state store failed  retriable

Whether an error may be retried is data on its class (``retriable``). Library
exceptions (sqlite3, aiohttp, ydb) are translated at the backend boundary.
Delivery *outcomes* are values (``nemesis.delivery.Outcome``), not exceptions.
"""

from __future__ import annotations

from dataclasses import dataclass


class NemesisError(Exception):
    """Root of every error Nemesis raises on purpose."""

    retriable: bool = False


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    """One problem in one configuration file."""

    file: str
    line: int | None
    field: str | None
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return (
            f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"
        )


@dataclass(frozen=True, slots=True)
class OmittedProblems(ConfigProblem):
    """Stands for the problems of one file past the first ones reported (sorted last)."""

    count: int = 0


class ConfigError(NemesisError):
    """Configuration could not be loaded; ``problems`` lists every one found."""

    def __init__(self, problems: list[ConfigProblem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


class BrokerError(NemesisError):
    retriable = True


class BrokerTimeout(BrokerError):
    retriable = True


class TopicNotFound(BrokerError):
    retriable = False


class TopicExists(BrokerError):
    retriable = False


class SessionLost(BrokerError):
    retriable = False


class BrokerAccessDenied(BrokerError):
    """The backend refused the credentials or the permission (YDB: unauthenticated/unauthorized)."""

    retriable = False


class DeliveryError(NemesisError):
    retriable = True


class DlqError(NemesisError):
    """The dead-letter store could not do what was asked."""

    retriable = True


class DlqTimeout(DlqError):
    """A store call did not finish within its timeout."""

    retriable = True


class InvalidQuery(DlqError):
    """A filter, page or bulk request outside the store's limits: the caller's mistake."""

    retriable = False


class InvalidCursor(InvalidQuery):
    """A page cursor that is malformed or was issued for another kind of list."""


class StateError(NemesisError):
    """The fleet's state store (members, assignments, live overrides) could not answer."""

    retriable = True
