"""The dead-letter store: one row per dead message, for the runner, the UI and the CLI.

``DeadLetterStore`` (``nemesis.dlq.port``) is the port; ``nemesis.dlq.core``
implements it over a store's queries. ``open_sqlite_dlq`` opens the embedded
store; ``nemesis.dlq.ydb`` (imported on demand: it loads the YDB SDK) the other.
"""

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
from nemesis.dlq.sqlite import SqliteDeadLetterStore, open_sqlite_dlq

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
