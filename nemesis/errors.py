"""Nemesis exceptions, one tree.

::

    NemesisError
    ├── ConfigError            invalid configuration (carries file, line, field)
    ├── BrokerError            a topic backend failed
    │   ├── BrokerTimeout      a blocking call ran out of time
    │   ├── TopicNotFound      the topic does not exist
    │   ├── TopicExists        create of an existing topic
    │   └── BrokerAccessDenied credentials refused by the backend (retrying cannot help)
    ├── DlqError               the dead-letter store failed
    │   ├── DlqTimeout         a store call ran out of time
    │   └── InvalidQuery       a filter or page the store refuses (the caller's 4xx)
    │       └── InvalidCursor  a page cursor the store did not issue
    └── StateError             the fleet's state store failed

A ``BrokerError``, ``DlqError`` or ``StateError`` itself, or a timeout, says
the other side did not answer: the caller's loop tries again later. The other
leaves are answers that retrying cannot change. Library exceptions (sqlite3,
aiohttp, ydb) are translated at the backend boundary. Delivery *outcomes* are
values (``nemesis.delivery.Outcome``), not exceptions.
"""

from __future__ import annotations

from dataclasses import dataclass


class NemesisError(Exception):
    """Root of every error Nemesis raises on purpose."""


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
    """A topic backend could not do what was asked (it may answer later)."""


class BrokerTimeout(BrokerError):
    """A blocking call of a topic backend ran out of time."""


class TopicNotFound(BrokerError):
    """The topic does not exist."""


class TopicExists(BrokerError):
    """A create of a topic that exists already."""


class BrokerAccessDenied(BrokerError):
    """The backend refused the credentials or the permission (YDB: unauthenticated/unauthorized)."""


class DlqError(NemesisError):
    """The dead-letter store could not do what was asked."""


class DlqTimeout(DlqError):
    """A store call did not finish within its timeout."""


class InvalidQuery(DlqError):
    """A filter, page or bulk request outside the store's limits: the caller's mistake."""


class InvalidCursor(InvalidQuery):
    """A page cursor that is malformed or was issued for another kind of list."""


class StateError(NemesisError):
    """The fleet's state store (members, assignments, live overrides) could not answer."""
