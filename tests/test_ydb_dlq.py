"""The YDB DLQ store's statements, and the server's rules it must follow: no server needed.

Every statement is checked the way YDB would first see it: each ``$name``
in the text is declared with the type of the value sent for it, no value
appears in the text, and the parameters go through the SDK's own protobuf
conversion (which refuses a value that does not fit its declared type).
Every row the store writes is checked against the NOT NULL columns of the
``CREATE TABLE`` it sends. The store itself runs on ``tests/ydb_fake.py``
(a database that plays the server's rules) here and in the contract suite
(``tests/test_dlq_store.py``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import pytest
import ydb
from ydb import convert

import nemesis.dlq.ydb as dlq_ydb
from nemesis.dlq import Action, DeadLetter, DeadLetterFilter, Reason, Status
from nemesis.dlq.core import Window, fold_failures
from nemesis.dlq.ydb import LETTER_COLUMNS, Query, YdbDeadLetterStore, Yql, tiebreak
from nemesis.errors import DlqError
from tests import ydb_fake
from tests.ydb_fake import FAST_RETRY, FakeYdb

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
    folded = fold_failures([letter(1), letter(2)], {}, (), START_US)
    inserts = [{**row, "tiebreak": tiebreak(row["id"])} for row in folded.inserts]
    queries = [
        yql.schema_version(),
        yql.write_schema_version(1),
        yql.put_state(["a" * 32], ["0123456789abcdef"]),
        yql.mark_state(["a" * 32], frozenset({"alpha"})),
        yql.mark_state(["a" * 32], None),
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
        yql.stats(EVERYTHING, Window.of(START_US / 1e6, 3600.0, 24)),
        yql.recent_actions(16),
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
    put = yql.put_rows(inserts, [], folded.signatures)
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


@pytest.mark.parametrize("directory", ["nemesis/dlq", "/nemesis/dlq/"])
def test_tables_live_under_the_configured_directory(directory: str) -> None:
    assert Yql(directory).table("letters") == "`nemesis/dlq/letters`"


# --- the server's rules -----------------------------------------------------------------


def not_null_columns(ddl: str) -> tuple[str, set[str], list[str]]:
    """A table's path, NOT NULL columns and key, read from its ``CREATE TABLE`` text."""
    found = re.match(r"CREATE TABLE IF NOT EXISTS `([^`]+)`", ddl)
    assert found is not None, ddl
    key = re.search(r"PRIMARY KEY \(([^)]*)\)", ddl)
    assert key is not None, ddl
    return (
        found.group(1),
        set(re.findall(r"^\s*`(\w+)` \w+ NOT NULL", ddl, re.M)),
        re.findall(r"`(\w+)`", key.group(1)),
    )


def written_columns(query: Query) -> list[tuple[str, str, set[str]]]:
    """(verb, table, columns) of every row-writing statement of ``query``."""
    writes = []
    for verb, path, rows in re.findall(
        r"(UPSERT INTO|REPLACE INTO|INSERT INTO|UPDATE) `([^`]+)`(?: ON)? SELECT \* FROM"
        r" AS_TABLE\((\$p\d+)\)",
        query.body,
    ):
        members = re.findall(r"(\w+):", str(query.params[rows].value_type))
        writes.append((verb, path, set(members)))
    for verb, path, names in re.findall(
        r"(UPSERT INTO|INSERT INTO) `([^`]+)` \(([^)]*)\) VALUES", query.body
    ):
        writes.append((verb, path, set(re.findall(r"`(\w+)`", names))))
    return writes


def test_every_row_the_store_writes_carries_the_not_null_columns_of_its_table() -> None:
    # YDB compiles UPSERT/REPLACE/INSERT ... AS_TABLE against the whole table:
    # a row type without a NOT NULL column is refused ("Missing not null column
    # in input"), even for a row that exists. Partial rows go through UPDATE ON.
    tables = {
        path: (columns, key) for path, columns, key in map(not_null_columns, yql.create_tables())
    }
    existing = {
        letter(1).id: {
            "id": letter(1).id,
            "status": "requeued",
            "dead_lettered_us": START_US - 10**6,
            "reason": "http_4xx",
            "http_status": 422,
            "attempts": 1,
            "stage": None,
            "signature": "0123456789abcdef",
            "error": "e",
            "history": None,
            "metadata": "{}",
        }
    }
    folded = fold_failures([letter(1, attempts=2), letter(2)], existing, (), START_US)
    assert (len(folded.inserts), len(folded.updates), len(folded.signatures)) == (1, 1, 1)
    inserts = [{**row, "tiebreak": tiebreak(row["id"])} for row in folded.inserts]
    put = yql.put_rows(inserts, folded.updates, folded.signatures)
    assert put is not None
    mark = {
        "id": letter(1).id,
        "status": "requeued",
        "requeue_count": 1,
        "last_action": "requeue",
        "last_action_by": "alice",
        "last_action_us": START_US,
    }
    action = {
        "seq": 1,
        "at_us": START_US,
        "who": "alice",
        "act": "requeue",
        "integrations": '["alpha"]',
        "affected": 3,
        "description": "status=dead",
    }
    writes = [
        put,
        yql.mark([mark]),
        yql.record_action(action, [{"integration": "alpha", "action_seq": 1}]),
        yql.write_schema_version(1),
    ]
    checked = 0
    for query in writes:
        check(query)
        for verb, path, columns in written_columns(query):
            not_null, key = tables[path]
            if verb == "UPDATE":
                assert set(key) <= columns, (path, columns)
            else:
                assert not_null <= columns, (verb, path, sorted(not_null - columns))
            checked += 1
    assert checked == 7  # signatures, new letters, updated letters, mark, action, links, meta


async def fake_store(database: FakeYdb) -> YdbDeadLetterStore:
    store = YdbDeadLetterStore(
        cast(Any, database.pool()), directory="nemesis/dlq", retry_settings=FAST_RETRY
    )
    await store.open()
    return store


async def test_a_second_failure_a_requeue_and_a_discard_write_rows_the_server_accepts() -> None:
    database = FakeYdb()
    store = await fake_store(database)
    try:
        await store.put([letter(1), letter(2)])
        assert await store.mark_requeued([letter(1).id], by="alice") == 1
        await store.put([letter(1, attempts=2, dead_lettered_at=START_US / 1e6 + 60)])
        assert await store.mark_discarded([letter(2).id], by="bob") == 1
        again = await store.get(letter(1).id)
        assert again is not None
        assert (again.status, again.requeue_count, len(again.history)) == (Status.DEAD, 1, 1)
        assert any(text.count("UPDATE `nemesis/dlq/letters` ON") for text in database.statements)
    finally:
        await store.close()


async def test_an_answer_without_the_result_sets_of_its_selects_is_a_clear_error() -> None:
    database = FakeYdb()
    store = await fake_store(database)
    try:
        await store.put([letter(1)])
        database.lose_result_sets = True
        with pytest.raises(DlqError, match=r"count dead letters: .*0 result sets .* 1 SELECT"):
            await store.count(DeadLetterFilter())
        with pytest.raises(DlqError, match="result sets"):
            await store.put([letter(2)])
    finally:
        await store.close()


async def test_writes_whose_commit_was_undetermined_are_retried_and_count_once() -> None:
    database = FakeYdb()
    store = await fake_store(database)
    try:
        await store.put([letter(1)])
        # Each write commits, answers Undetermined, and the SDK runs it again.
        database.undetermined_commits = 1
        result = await store.put([letter(1, attempts=2, dead_lettered_at=START_US / 1e6 + 60)])
        assert database.undetermined_commits == 0
        assert (result.inserted, result.updated) == (0, 1)
        row = await store.get(letter(1).id)
        assert row is not None
        assert row.attempts == 2
        assert [past.attempts for past in row.history] == [1]  # not twice

        database.undetermined_commits = 1
        assert await store.mark_requeued([letter(1).id], by="alice", at=START_US / 1e6) == 1
        row = await store.get(letter(1).id)
        assert row is not None
        assert row.requeue_count == 1

        database.undetermined_commits = 1
        record = await store.record_action(
            who="alice", action=Action.REQUEUE, integrations=["a"], count=1, description="x"
        )
        assert database.undetermined_commits == 0
        log = await store.actions()
        assert [entry.seq for entry in log.rows] == [record.seq] == [1]
    finally:
        await store.close()


def test_times_far_out_of_range_fit_the_unsigned_columns() -> None:
    where = DeadLetterFilter(since=-1e20, until=1e20)
    text = check(yql.page(where, None, 10, 0, None))
    assert "DECLARE" in text
    early_and_late = letter(1, dead_lettered_at=-3.0, first_failure_at=1e20)
    folded = fold_failures([early_and_late], {}, (), 0, YdbDeadLetterStore.times)
    [row] = folded.inserts
    assert row["dead_lettered_us"] == 0
    assert 0 < row["first_failure_us"] < 2**63


async def test_new_rows_are_written_in_statements_the_sdk_can_send(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The SDK sends a statement's parameters in one gRPC message of at most 64 MB (smaller
    here, with the store's budget to match): big rows go in several statements."""
    monkeypatch.setattr(ydb_fake, "MAX_MESSAGE_BYTES", 1_000_000)
    monkeypatch.setattr(dlq_ydb, "STATEMENT_BYTES", 500_000, raising=False)
    database = FakeYdb()
    store = YdbDeadLetterStore(
        cast(Any, database.pool()), directory="nemesis/dlq", retry_settings=FAST_RETRY
    )
    await store.open()
    try:
        letters = [letter(n, payload=bytes([n]) * 300_000) for n in range(5)]
        assert (await store.put(letters)).inserted == 5
        upserts = [s for s in database.statements if "UPSERT INTO `nemesis/dlq/letters`" in s]
        assert len(upserts) == 5  # each row alone: two would pass the budget
        rows = await store.get_many([x.id for x in letters])
        assert sorted(len(row.payload) for row in rows) == [300_000] * 5
    finally:
        await store.close()


def test_the_fake_refuses_a_cell_over_16_mib_and_a_message_over_64_mb() -> None:
    database = FakeYdb()
    database.run(
        "CREATE TABLE IF NOT EXISTS `t` (\n`id` Int64 NOT NULL,\n`v` String,\n"
        "PRIMARY KEY (`id`)\n)",
        None,
    )
    rows = "DECLARE $p0 AS List<Struct<id:Int64,v:String?>>;\n"
    upsert = rows + "UPSERT INTO `t` SELECT * FROM AS_TABLE($p0);"
    row_type = ydb.ListType(
        ydb.StructType()
        .add_member("id", ydb.PrimitiveType.Int64)
        .add_member("v", ydb.OptionalType(ydb.PrimitiveType.String))
    )

    def value(*cells: bytes) -> dict[str, ydb.TypedValue]:
        return {"$p0": ydb.TypedValue([{"id": n, "v": v} for n, v in enumerate(cells)], row_type)}

    database.run(upsert, value(b"x" * ydb_fake.MAX_CELL_BYTES))  # 16 MiB fits
    with pytest.raises(ydb.issues.BadRequest, match="Row cell size of 16777217 bytes"):
        database.run(upsert, value(b"x" * (ydb_fake.MAX_CELL_BYTES + 1)))
    with pytest.raises(ydb.issues.BadRequest, match="Sent message larger than max"):
        database.run(upsert, value(*[b"y" * 13_000_000] * 5))


def test_an_index_is_named_only_where_the_filter_or_an_ordered_limit_uses_it() -> None:
    """A ``VIEW`` costs a lookup in the table per index row (``_view``): counts, groups and
    statistics over an unconstrained filter scan the table itself."""
    window = Window.of(START_US / 1e6, 3600.0, 24)
    plain = DeadLetterFilter(status=Status.DEAD, reason=Reason.HTTP_4XX, text="city")
    for statement in (
        yql.count(plain, None).text,
        yql.count(plain, 100).text,
        yql.groups(plain, 10).text,
        yql.stats(plain, window).body.split(";\n")[0],
    ):
        assert " VIEW " not in statement, statement
    # Ordered reads with a LIMIT take the head of by_time; the stats' time buckets a range.
    for statement in (
        yql.page(plain, None, 50, 1024, None).text,
        yql.ids_page(plain, None, 50).text,
        yql.scan_bound(plain, None).text,
        yql.stats(plain, window).body.split(";\n")[1],
    ):
        assert " VIEW by_time " in statement, statement
    # A filter on an index's leading column names that index everywhere.
    for where, index in (
        (DeadLetterFilter(since=1_700_000_000.0), "by_time"),
        (DeadLetterFilter(integrations=frozenset({"alpha"})), "by_integration"),
        (DeadLetterFilter(signature="0123456789abcdef"), "by_signature"),
    ):
        for statement in (yql.count(where, None).text, yql.groups(where, 10).text):
            assert f" VIEW {index} " in statement, statement


async def test_a_server_whose_transactions_cannot_read_their_writes_is_refused_at_open() -> None:
    """Without immediate effects (YDB before 24.1) ``put`` could not work: the store says
    so when it opens, naming what the server needs, not at the first dead letter."""
    store = YdbDeadLetterStore(
        cast(Any, FakeYdb(immediate_effects=False).pool()),
        directory="nemesis/dlq",
        retry_settings=FAST_RETRY,
    )
    with pytest.raises(DlqError, match=r"read its own writes .*YDB 24\.1 or newer") as refused:
        await store.open()
    assert "won't be seen" in str(refused.value)  # the server's own words follow
    await store.close()


async def test_the_fake_without_immediate_effects_refuses_what_such_a_server_does() -> None:
    database = FakeYdb(immediate_effects=False)
    store = YdbDeadLetterStore(
        cast(Any, database.pool()), directory="nemesis/dlq", retry_settings=FAST_RETRY
    )
    with pytest.raises(DlqError):
        await store.open()
    database.immediate_effects = True
    await store.open()
    database.immediate_effects = False
    # put writes the letters table (which has indexes) twice when a row exists and a new one
    # comes: UPSERT of the new row, UPDATE ON of the old.
    await store.put([letter(1)])
    with pytest.raises(DlqError, match="read its own writes"):
        await store.put([letter(1, dead_lettered_at=START_US / 1e6 + 5), letter(2)])
    await store.close()
