"""A dead-letter filter and a list position as SQL conditions: written once, spelled per store.

Every store narrows its rows the same way: a ``DeadLetterFilter`` becomes
conditions joined by AND (``Dialect.conditions``), and a keyset position
becomes "strictly after" or "up to and including" a key in (dead-letter
time, tie-breaker) descending order (``Dialect.after``,
``Dialect.not_after``). What differs between stores is spelling, which a
store's subclass of ``Dialect`` holds: how a value becomes a parameter
(``?``, ``$n`` with a cast, a declared ``$name``), how a column is compared
with a list, how text is searched, which times its time column holds and
which column breaks ties.

Every value reaches the database as a parameter, never in a statement's
text: the list of integrations keeps one team out of another's rows, and the
search text is whatever a browser sent. Values are bound in the order they
stand in the conditions handed back, once per place they stand, so a store
whose parameters are positional (``?``) takes them in that order.

The text search is the same on every store: the search text, its ASCII
letters lowercased, is looked for in the error text and in the payload,
theirs lowercased too, as a plain substring (no character of it is a
wildcard). The error text is compared as stored, each NUL as U+FFFD
(``nemesis.dlq.core.no_nul``), so the search text's NULs become U+FFFD
there; the payload keeps its bytes, and the search text's UTF-8 bytes,
NULs included, are looked for among them.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Collection, Sequence
from typing import Any, Protocol

from nemesis.dlq.core import Key, Times, ascii_lower, no_nul
from nemesis.dlq.port import DeadLetterFilter


class Kind(enum.Enum):
    """What a bound value is, for a dialect whose parameters carry a type."""

    TEXT = "text"
    TEXTS = "texts"  # a list of text, for ``Dialect.one_of``
    HTTP_STATUS = "http_status"
    TIME = "time"  # microseconds, as the store's time column holds them
    TIEBREAK = "tiebreak"  # the store's tie-breaker of one microsecond
    BYTES = "bytes"


class Bind(Protocol):
    """A statement's parameters: binds ``value`` and answers how the statement names it."""

    def __call__(self, value: Any, kind: Kind) -> str: ...


# The parts of a filter, a store may ask for some only: each is named for the
# column it tests (TIME tests dead_lettered_us, TEXT the error and the payload).
INTEGRATION = "integration"
REASON = "reason"
STATUS = "status"
HTTP_STATUS = "http_status"
SIGNATURE = "signature"
TIME = "time"  # since and until
TEXT = "text"
EVERY_PART = frozenset((INTEGRATION, REASON, STATUS, HTTP_STATUS, SIGNATURE, TIME, TEXT))
NOT_TEXT = EVERY_PART - {TEXT}  # the candidates a text search examines


class Dialect(abc.ABC):
    """How one store's SQL spells a filter's conditions; the conditions themselves are here.

    A store subclasses it with its spelling (``times``, ``tiebreak``,
    ``contains``, and ``one_of``, ``true`` or ``row_values`` where it
    differs) and builds every condition of a filter through it.
    """

    times: Times  # the times its time column holds
    tiebreak: str  # the column that orders rows of one microsecond
    true: str = "TRUE"  # a condition every row meets
    # Whether "after a key" is one row-value comparison, ``(time, tie) < (a, b)``.
    row_values: bool = False

    # --- the spelling --------------------------------------------------------------

    def one_of(self, bind: Bind, column: str, values: Sequence[str]) -> str:
        """``column`` equals one of ``values`` (never empty)."""
        return f"{column} IN {bind(list(values), Kind.TEXTS)}"

    @abc.abstractmethod
    def contains(self, bind: Bind, in_error: str, in_payload: bytes) -> str:
        """The lowercased error holds ``in_error``, or the lowercased payload ``in_payload``."""

    # --- the conditions --------------------------------------------------------------

    def conditions(
        self, where: DeadLetterFilter, bind: Bind, parts: Collection[str] = EVERY_PART
    ) -> list[str]:
        """The filter's conditions, of ``parts`` only, to be joined by AND."""
        found: list[str] = []
        if INTEGRATION in parts and where.integrations is not None:
            found.append(self.one_of(bind, "integration", sorted(where.integrations)))
        equal = (
            (REASON, None if where.reason is None else where.reason.value, Kind.TEXT),
            (STATUS, None if where.status is None else where.status.value, Kind.TEXT),
            (HTTP_STATUS, where.http_status, Kind.HTTP_STATUS),
            (SIGNATURE, where.signature, Kind.TEXT),
        )
        for column, value, kind in equal:
            if column in parts and value is not None:
                found.append(f"{column} = {bind(value, kind)}")
        for operator, seconds in ((">=", where.since), ("<", where.until)):
            if TIME in parts and seconds is not None:
                at = bind(self.times.to_us(seconds), Kind.TIME)
                found.append(f"dead_lettered_us {operator} {at}")
        if TEXT in parts and where.text:
            needle = ascii_lower(where.text)
            found.append(self.contains(bind, no_nul(needle), needle.encode()))
        return found

    def after(self, bind: Bind, key: Key | None) -> list[str]:
        """Rows strictly after ``key`` in (time desc, tie-breaker desc) order; None: all."""
        return [] if key is None else self._from_key(bind, key, "<", "<=", "<")

    def not_after(self, bind: Bind, key: Key) -> list[str]:
        """Rows up to and including ``key`` in (time desc, tie-breaker desc) order."""
        return self._from_key(bind, key, ">=", ">=", ">")

    def _from_key(
        self, bind: Bind, key: Key, pair: str, time_range: str, strict_time: str
    ) -> list[str]:
        """``(time, tie-breaker) <pair> key``, one row-value comparison or two conditions."""
        at, tie = key
        if self.row_values:
            return [
                f"(dead_lettered_us, {self.tiebreak})"
                f" {pair} ({bind(at, Kind.TIME)}, {bind(tie, Kind.TIEBREAK)})"
            ]
        # The first condition bounds an index range; the second settles ties in time.
        return [
            f"dead_lettered_us {time_range} {bind(at, Kind.TIME)}",
            f"(dead_lettered_us {strict_time} {bind(at, Kind.TIME)}"
            f" OR {self.tiebreak} {pair} {bind(tie, Kind.TIEBREAK)})",
        ]

    def joined(self, found: Sequence[str]) -> str:
        """Conditions joined by AND (none: every row)."""
        return " AND ".join(found) or self.true
