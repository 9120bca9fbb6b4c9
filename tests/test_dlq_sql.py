"""The filter-to-SQL builder of the DLQ stores (``nemesis.dlq.sql``), in each store's dialect.

What each statement returns is the contract suite's (``tests/test_dlq_store.py``,
on every store); here, how the conditions are written: every value a
parameter, positional parameters in the order they stand, and each store's
dialect agreeing with the store on its times and tie-breaker.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from nemesis.dlq import DeadLetterFilter, Reason, Status
from nemesis.dlq.core import StoreCore
from nemesis.dlq.postgres import POSTGRES, PostgresDeadLetterStore
from nemesis.dlq.sql import EVERY_PART, NOT_TEXT, TEXT, Dialect, Kind
from nemesis.dlq.sqlite import SQLITE, SqliteDeadLetterStore
from nemesis.dlq.ydb import YQL, YdbDeadLetterStore

DIALECTS: dict[str, tuple[Dialect, type[StoreCore], str]] = {
    # name: (dialect, its store, what a placeholder looks like)
    "sqlite": (SQLITE, SqliteDeadLetterStore, r"\?"),
    "postgres": (POSTGRES, PostgresDeadLetterStore, r"\$\d+"),
    "ydb": (YQL, YdbDeadLetterStore, r"\$p\d+"),
}
HOSTILE = DeadLetterFilter(
    integrations=frozenset({"alpha", "it's", "b'; DROP TABLE x; --"}),
    reason=Reason.HTTP_4XX,
    status=Status.DEAD,
    http_status=422,
    signature="0123456789abcdef",
    since=1_700_000_000.0,
    until=1_900_000_000.0,
    text="%'; DROP TABLE x; -- 50%_off \\ $1 ? :p0",
)
KEY = (1_800_000_000_000_000, 7_777_777)


class Recorder:
    """Binds values as each dialect's store does: ``?``, ``$n`` or ``$pN``, by name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.values: list[tuple[Any, Kind]] = []

    def __call__(self, value: Any, kind: Kind) -> str:
        self.values.append((value, kind))
        n = len(self.values)
        return {"sqlite": "?", "postgres": f"${n}", "ydb": f"$p{n - 1}"}[self.name]


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_every_value_of_a_filter_and_a_key_is_a_parameter(name: str) -> None:
    dialect, _, placeholder = DIALECTS[name]
    bind = Recorder(name)
    conditions = [
        *dialect.conditions(HOSTILE, bind),
        *dialect.after(bind, KEY),
        *dialect.not_after(bind, KEY),
    ]
    text = dialect.joined(conditions)
    for value in ("DROP", "it's", "alpha", "422", "0123456789abcdef", "1800", "7777", "50%"):
        assert value not in text, (value, text)
    # The only literals are the dialect's own: LIKE's escape, encode()'s format.
    assert set(re.findall(r"'[^']*'", text)) <= {"'\\'", "'escape'"}, text
    places = re.findall(placeholder, text)
    if name == "sqlite":  # positional: one value per place, in order
        assert len(places) == len(bind.values)
    else:  # numbered or named: every value used, nothing else
        assert len(set(places)) == len(bind.values)
    # The time, the text search and the scope reach the statement as parameters.
    sent = [value for value, _ in bind.values]
    assert dialect.times.to_us(1_700_000_000.0) in sent
    assert KEY[1] in sent
    assert any("drop table x" in str(value) for value in sent)


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_values_are_bound_in_the_order_their_places_stand(name: str) -> None:
    # Each place is bound once, left to right: a positional dialect needs nothing more.
    dialect, _, _ = DIALECTS[name]
    bind = Recorder("sqlite")
    conditions = dialect.conditions(
        DeadLetterFilter(status=Status.DEAD, http_status=500, since=1.0), bind
    ) + dialect.after(bind, (5, 6))
    assert [kind for _, kind in bind.values] == [
        Kind.TEXT,
        Kind.HTTP_STATUS,
        Kind.TIME,
        *(
            [Kind.TIME, Kind.TIEBREAK]
            if dialect.row_values
            else [Kind.TIME, Kind.TIME, Kind.TIEBREAK]
        ),
    ]
    assert [value for value, _ in bind.values][:3] == ["dead", 500, 1_000_000]
    assert len(conditions) == 3 + (1 if dialect.row_values else 2)


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_the_parts_of_a_filter_split_its_conditions(name: str) -> None:
    dialect, _, _ = DIALECTS[name]
    whole = dialect.conditions(HOSTILE, Recorder(name))
    candidates = dialect.conditions(HOSTILE, Recorder(name), NOT_TEXT)
    text = dialect.conditions(HOSTILE, Recorder(name), {TEXT})
    assert len(whole) == len(candidates) + len(text) == 8  # since and until are two
    assert dialect.conditions(HOSTILE, Recorder(name), EVERY_PART) == whole
    assert dialect.conditions(DeadLetterFilter(), Recorder(name)) == []
    assert dialect.joined([]) == dialect.true
    assert dialect.after(Recorder(name), None) == []


@pytest.mark.parametrize("name", sorted(DIALECTS))
def test_each_dialect_holds_its_stores_times_and_tie_breaker(name: str) -> None:
    dialect, store, _ = DIALECTS[name]
    assert dialect.times == store.times
    assert dialect.tiebreak == store.tiebreak_column
