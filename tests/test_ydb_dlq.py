"""The YDB DLQ store's statements and row folding: no server needed.

Every statement is checked the way YDB would first see it: each ``$name``
in the text is declared with the type of the value sent for it, no value
appears in the text, and the parameters go through the SDK's own protobuf
conversion (which refuses a value that does not fit its declared type).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import orjson
import pytest
import ydb
from ydb import convert

from nemesis.dlq import DeadLetter, DeadLetterFilter, Reason, Status, failure_signature
from nemesis.dlq.port import MAX_ERROR_CHARS, MAX_HISTORY
from nemesis.dlq.ydb import LETTER_COLUMNS, Query, Yql, fold_failures, tiebreak

START_US = 1_800_000_000_000_000
to_protobuf = cast(Callable[[object], object], convert.query_parameters_to_pb)  # untyped
yql = Yql("nemesis/dlq")


def letter(offset: int, **fields: Any) -> DeadLetter:
    base = DeadLetter(
        integration="orders-to-loyalty",
        event_id=f"orders:0:{offset}",
        payload=b'{"order": 1}',
        reason=Reason.HTTP_4XX,
        error=f"422 missing field `city` in order {offset}",
        source_topic="orders",
        source_partition=0,
        source_offset=offset,
        http_status=422,
        dead_lettered_at=START_US / 1e6,
    )
    return replace(base, **fields)


def check(query: Query) -> str:
    """The statement as YDB receives it, after checking its declarations and parameters."""
    used = set(re.findall(r"\$p\d+", query.body))
    assert used == set(query.params), "every parameter declared and used"
    for name, value in query.params.items():
        assert f"DECLARE {name} AS {value.value_type};" in query.text
    to_protobuf(query.params)  # the SDK's own conversion: values must fit their types
    return query.text


EVERYTHING = DeadLetterFilter(
    integrations=frozenset({"alpha", "it's"}),
    reason=Reason.HTTP_4XX,
    status=Status.DEAD,
    http_status=422,
    signature="0123456789abcdef",
    since=1_700_000_000.0,
    until=1_900_000_000.0,
    text="'; DROP TABLE letters; --",
)


def test_every_statement_declares_typed_parameters_and_inlines_no_value() -> None:
    written, signatures, _, _ = fold_failures([letter(1), letter(2)], {}, START_US)
    queries = [
        yql.schema_version(),
        yql.write_schema_version(1),
        yql.put_state(["a" * 32], ["0123456789abcdef"]),
        yql.dead_ids(["a" * 32], frozenset({"alpha"})),
        yql.dead_ids(["a" * 32], None),
        yql.expired(START_US, 1000),
        yql.delete_letters(["a" * 32]),
        yql.unused_signatures(),
        yql.delete_signatures(["0123456789abcdef"]),
        yql.get(["a" * 32]),
        yql.page(EVERYTHING, (START_US, 5), 51, 1024, (START_US - 10, 7)),
        yql.page(DeadLetterFilter(), None, 51, 1024, None),
        yql.scan_bound(EVERYTHING, None),
        yql.ids_page(EVERYTHING, (START_US, 5), 5000),
        yql.count(EVERYTHING, None),
        yql.count(DeadLetterFilter(), 100),
        yql.groups(EVERYTHING, 100),
        yql.stats(EVERYTHING, START_US - 3600 * 10**6, START_US - 86400 * 10**6, START_US, 3600),
        yql.last_action_seq(),
        yql.record_action(
            {
                "seq": 1,
                "at_us": START_US,
                "who": "alice",
                "act": "requeue",
                "integrations": '["alpha"]',
                "affected": 3,
                "description": "status=dead",
            },
            [{"integration": "alpha", "action_seq": 1}],
        ),
        yql.actions(2**63 - 1, 51, None),
        yql.actions(10, 51, frozenset({"alpha", "beta"})),
    ]
    put = yql.put_rows([w.columns for w in written if w.new], [], list(signatures.values()))
    assert put is not None
    queries.append(put)
    for query in queries:
        text = check(query)
        for value in ("DROP TABLE", "it's", "alpha", "alice", "422", "0123456789abcdef"):
            assert value not in text, (value, text)


def test_a_text_search_is_a_plain_ascii_case_insensitive_substring_test() -> None:
    query = yql.page(DeadLetterFilter(text="50% OFF_ \\"), None, 10, 100, None)
    text = check(query)
    assert "LIKE" not in text  # no pattern: % _ and \\ mean themselves
    assert "String::AsciiToLower(error)" in text
    assert "String::AsciiToLower(payload)" in text
    needles = [v.value for v in query.params.values() if v.value_type == ydb.PrimitiveType.String]
    assert needles == [b"50% off_ \\"]


def test_lists_use_the_index_the_filter_pins() -> None:
    def view(where: DeadLetterFilter) -> str:
        found = re.search(r"VIEW (\w+)", yql.page(where, None, 10, 0, None).text)
        assert found is not None
        return found.group(1)

    assert view(DeadLetterFilter()) == "by_time"
    assert view(DeadLetterFilter(reason=Reason.HTTP_4XX)) == "by_time"
    assert view(DeadLetterFilter(integrations=frozenset({"a"}))) == "by_integration"
    signature = "0123456789abcdef"
    assert view(DeadLetterFilter(signature=signature, integrations=frozenset({"a"}))) == (
        "by_signature"
    )


def test_keyset_paging_is_newest_first_and_strictly_after_the_cursor() -> None:
    text = yql.page(DeadLetterFilter(), (START_US, 99), 10, 0, None).body
    assert "ORDER BY dead_lettered_us DESC, tiebreak DESC" in text
    assert re.search(
        r"dead_lettered_us <= \$p\d+ AND \(dead_lettered_us < \$p\d+ OR tiebreak <", text
    )


def test_the_schema_keeps_the_stores_columns_and_a_ttl() -> None:
    letters = yql.create_tables()[1]
    for name, column_type in LETTER_COLUMNS:
        nullable = isinstance(column_type, ydb.OptionalType)
        assert (
            f"`{name}` {column_type}".rstrip("?") + ("" if nullable else " NOT NULL")
        ) in letters
    assert "PRIMARY KEY (`id`)" in letters
    assert (
        "INDEX by_integration GLOBAL SYNC ON (`integration`, `dead_lettered_us`, `tiebreak`)"
        in (letters)
    )
    assert yql.set_ttl(180 * 86400.0) == (
        'ALTER TABLE `nemesis/dlq/letters` SET (TTL = Interval("PT15552000S")'
        " ON dead_lettered_us AS MICROSECONDS)"
    )
    assert yql.set_ttl(None) == "ALTER TABLE `nemesis/dlq/letters` RESET (TTL)"
    assert all("IF NOT EXISTS" in ddl for ddl in yql.create_tables())


def test_new_failures_become_whole_rows_and_a_repeat_in_the_batch_folds_into_them() -> None:
    first = letter(1, attempts=1, metadata={"type": "t"}, key="k", stage="enrich")
    again = letter(1, attempts=2, error="409 conflict", http_status=409)
    rows, signatures, inserted, updated = fold_failures([first, again, letter(2)], {}, START_US)
    assert (inserted, updated) == (2, 1)
    one = next(r.columns for r in rows if r.columns["id"] == first.id)
    assert set(one) == {name for name, _ in LETTER_COLUMNS}
    assert (one["attempts"], one["http_status"], one["error"]) == (2, 409, "409 conflict")
    assert one["signature"] == failure_signature(
        first.integration, Reason.HTTP_4XX, 409, "409 conflict"
    )
    assert one["tiebreak"] == tiebreak(first.id) == int(first.id[:15], 16)
    # The stage follows the latest failure; key and metadata are the message's.
    assert (one["msg_key"], one["stage"], one["metadata"]) == ("k", None, '{"type":"t"}')
    [past] = orjson.loads(str(one["history"]))
    assert past == [START_US, "http_4xx", 422, 1, "422 missing field `city` in order 1"]
    # Letters 1 and 2 share a signature (their errors differ in a number only).
    assert sorted(str(s["sample_error"]) for s in signatures.values()) == [
        "409 conflict",
        "422 missing field `city` in order 1",
    ]


def test_a_failure_of_an_existing_row_updates_its_failure_columns() -> None:
    existing = {
        letter(1).id: {
            "id": letter(1).id,
            "status": Status.REQUEUED.value,
            "dead_lettered_us": START_US - 10**6,
            "reason": "http_4xx",
            "http_status": 422,
            "attempts": 3,
            "error": "x" * 600,
            "history": orjson.dumps([[0, "http_4xx", 400, 1, "old"]] * MAX_HISTORY).decode(),
        },
        letter(2).id: {
            "id": letter(2).id,
            "status": Status.DISCARDED.value,
            "dead_lettered_us": START_US - 10**6,
            "reason": "http_4xx",
            "http_status": 422,
            "attempts": 1,
            "error": "e",
            "history": None,
        },
    }
    rows, _, inserted, updated = fold_failures(
        [letter(1, error="y" * (MAX_ERROR_CHARS + 5)), letter(2)], existing, START_US
    )
    assert (inserted, updated) == (0, 2)
    requeued, discarded = (next(r for r in rows if r.columns["id"] == letter(n).id) for n in (1, 2))
    assert not requeued.new
    assert set(requeued.columns) == {
        "id", "status", "reason", "http_status", "signature", "dead_lettered_us",
        "attempts", "stage", "error", "history",
    }  # fmt: skip
    # A requeued message that failed again is dead again; a discarded one stays discarded.
    assert requeued.columns["status"] == "dead"
    assert discarded.columns["status"] == "discarded"
    error = str(requeued.columns["error"])
    assert len(error) == MAX_ERROR_CHARS
    assert error.endswith("…")
    history = orjson.loads(str(requeued.columns["history"]))
    assert len(history) == MAX_HISTORY  # the oldest fell off
    assert history[-1] == [START_US - 10**6, "http_4xx", 422, 3, "x" * 499 + "…"]


def test_times_before_1970_are_clamped_for_unsigned_columns() -> None:
    text = check(yql.page(DeadLetterFilter(since=-5.0, until=-1.0), (-7, 1), 10, 0, None))
    assert "DECLARE" in text
    rows, _, _, _ = fold_failures([letter(1, dead_lettered_at=-3.0, first_failure_at=-9.0)], {}, 0)
    assert (rows[0].columns["dead_lettered_us"], rows[0].columns["first_failure_us"]) == (0, 0)


@pytest.mark.parametrize("directory", ["nemesis/dlq", "/nemesis/dlq/"])
def test_tables_live_under_the_configured_directory(directory: str) -> None:
    assert Yql(directory).table("letters") == "`nemesis/dlq/letters`"
