"""The dead-letter store: one row per dead message, for the runner, the UI and the CLI.

``DeadLetterStore`` (``nemesis.dlq.port``) is the port; ``nemesis.dlq.core``
implements it over a store's queries. ``open_sqlite_dlq`` opens the embedded
store; ``nemesis.dlq.ydb`` (imported on demand: it loads the YDB SDK) the other.
"""

from typing import TYPE_CHECKING, Any, Final

from nemesis.dlq.port import (
    DEFAULT_RETENTION_S,
    MAX_PAGE_ROWS,
    MAX_SELECT_IDS,
    MAX_TEXT_CHARS,
    Action,
    ActionPage,
    ActionRecord,
    DeadLetter,
    DeadLetterFilter,
    DeadLetterRow,
    DeadLetterStore,
    Group,
    IntegrationStats,
    Page,
    PageRequest,
    PastFailure,
    PutResult,
    Reason,
    Stats,
    Status,
    TimeBucket,
)
from nemesis.dlq.signature import dead_letter_id, failure_signature, normalise_error

if TYPE_CHECKING:
    from nemesis.dlq.sqlite import SqliteDeadLetterStore, open_sqlite_dlq

# The SQLite store is imported on first use: the CLI's commands that only name the
# port's types (``nemesis --help`` among them) do not load a store.
_LAZY: Final = {"SqliteDeadLetterStore", "open_sqlite_dlq"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from nemesis.dlq import sqlite

        return getattr(sqlite, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DEFAULT_RETENTION_S",
    "MAX_PAGE_ROWS",
    "MAX_SELECT_IDS",
    "MAX_TEXT_CHARS",
    "Action",
    "ActionPage",
    "ActionRecord",
    "DeadLetter",
    "DeadLetterFilter",
    "DeadLetterRow",
    "DeadLetterStore",
    "Group",
    "IntegrationStats",
    "Page",
    "PageRequest",
    "PastFailure",
    "PutResult",
    "Reason",
    "SqliteDeadLetterStore",
    "Stats",
    "Status",
    "TimeBucket",
    "dead_letter_id",
    "failure_signature",
    "normalise_error",
    "open_sqlite_dlq",
]
