"""The DLQ store: pure signature rules, then contract cases on every store.

Contract cases take the ``store`` fixture, parametrized over ``STORES``: the
sqlite store on a real file, the YDB store on ``tests/ydb_fake.py`` (a
database that plays a YDB server's rules), and the postgres store on a real
PostgreSQL server the session starts (``tests/postgres_server.py``), in a
schema of each test's own; ``tests/contract`` runs them again on a real YDB
when ``NEMESIS_YDB_ENDPOINT`` names one. Cases that need
one store's internals (the SQLite scan bound, batch sizes, the file), the
core's folding of failures and the real CLI come last.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nemesis.dlq.core as dlq_core
import nemesis.dlq.sqlite as dlq_sqlite
from nemesis.backends.postgres import PostgresDlqConfig
from nemesis.broker.embedded import open_embedded
from nemesis.broker.port import key_bytes, key_text
from nemesis.clock import Clock
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.dlq import (
    Action,
    DeadLetter,
    DeadLetterFilter,
    DeadLetterRow,
    DeadLetterStore,
    PageRequest,
    PutResult,
    Reason,
    Status,
    dead_letter_id,
    failure_signature,
    normalise_error,
    open_sqlite_dlq,
)
from nemesis.dlq.cursor import decode_cursor, encode_cursor
from nemesis.dlq.port import MAX_ERROR_CHARS, MAX_TEXT_CHARS
from nemesis.dlq.postgres import open_postgres_dlq
from nemesis.dlq.requeue import replay_of, requeue
from nemesis.dlq.signature import MAX_PATTERN_CHARS, escape_like
from nemesis.dlq.ydb import YdbDeadLetterStore
from nemesis.errors import DlqError, InvalidCursor, InvalidQuery, NemesisError
from nemesis.topology import META_LAST_SPAN
from tests.postgres_server import PostgresServer
from tests.ydb_fake import FAST_RETRY, FakeYdb

START = 1_800_000_000.0
DAY = 86400.0


class FakeClock:
    """Wall time that tests move by hand."""

    def __init__(self, start: float = START) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now - START

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)

    def advance(self, seconds: float) -> None:
        self.now += seconds


StoreFactory = Callable[[Path, Clock], Awaitable[DeadLetterStore]]
# A kind's factory, given the test's request (for fixtures only some kinds need).
FactoryOf = Callable[[pytest.FixtureRequest], StoreFactory]


async def _sqlite(directory: Path, clock: Clock) -> DeadLetterStore:
    return await open_sqlite_dlq(directory / "dlq.db", clock=clock)


def _postgres(request: pytest.FixtureRequest) -> StoreFactory:
    """The postgres store on the session's server, in a schema new at each call."""
    server: PostgresServer = request.getfixturevalue("postgres_server")

    async def factory(directory: Path, clock: Clock) -> DeadLetterStore:
        schema = f"t_{uuid.uuid4().hex[:16]}"
        config = PostgresDlqConfig(dsn=server.dsn(), schema_name=schema, pool_size=4)
        return await open_postgres_dlq(config, clock=clock)

    return factory


async def _ydb_fake(directory: Path, clock: Clock) -> DeadLetterStore:
    # The YDB store's own code on the SDK's retry loop, over a database that
    # plays the server's rules (tests/ydb_fake.py); a real server: tests/contract.
    store = YdbDeadLetterStore(
        cast(Any, FakeYdb().pool()), directory="nemesis/dlq", clock=clock, retry_settings=FAST_RETRY
    )
    await store.open()
    return store


STORES: dict[str, FactoryOf] = {
    "sqlite": lambda _: _sqlite,
    "ydb-fake": lambda _: _ydb_fake,
    "postgres": _postgres,
}


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=sorted(STORES))
async def store(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> AsyncIterator[DeadLetterStore]:
    opened = await STORES[request.param](request)(tmp_path, clock)
    try:
        yield opened
    finally:
        await opened.close()


def letter(
    offset: int,
    *,
    integration: str = "orders-to-loyalty",
    error: str | None = None,
    reason: Reason = Reason.HTTP_4XX,
    http_status: int | None = 422,
    payload: bytes | None = None,
    at: float | None = None,
    event_id: str | None = None,
    **fields: Any,
) -> DeadLetter:
    """A failure of message ``orders:0:<offset>``."""
    return DeadLetter(
        integration=integration,
        event_id=event_id or f"orders:0:{offset}",
        payload=payload if payload is not None else f'{{"order": {offset}}}'.encode(),
        reason=reason,
        error=error if error is not None else f"422 missing field `city` in order {offset}",
        source_topic="orders",
        source_partition=0,
        source_offset=offset,
        http_status=http_status,
        dead_lettered_at=at,
        **fields,
    )


async def all_pages(
    store: DeadLetterStore, where: DeadLetterFilter, limit: int
) -> list[DeadLetterRow]:
    """Every row the filter matches, by following cursors to the end."""
    rows: list[DeadLetterRow] = []
    cursor: str | None = None
    for _ in range(10_000):
        page = await store.query(where, PageRequest(limit=limit, cursor=cursor))
        rows.extend(page.rows)
        cursor = page.next_cursor
        if cursor is None:
            return rows
    raise AssertionError("paging did not end")


def model_matches(row: DeadLetterRow, where: DeadLetterFilter) -> bool:
    """The filter's meaning, written plainly against a full row."""
    if where.integrations is not None and row.integration not in where.integrations:
        return False
    if where.reason is not None and row.reason != where.reason:
        return False
    if where.status is not None and row.status != where.status:
        return False
    if where.http_status is not None and row.http_status != where.http_status:
        return False
    if where.signature is not None and row.signature != where.signature:
        return False
    if where.since is not None and row.dead_lettered_at < where.since:
        return False
    if where.until is not None and row.dead_lettered_at >= where.until:
        return False
    if where.text:
        needle = where.text.lower()
        return needle in row.error.lower() or needle in row.payload.decode().lower()
    return True


# --- pure rules -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "pattern"),
    [
        ("422 missing field `city` in order 12345", "<n> missing field `city` in order <n>"),
        (
            "order 3f2b8c1e-5d4a-4b6c-9e8f-0a1b2c3d4e5f not found",
            "order <uuid> not found",
        ),
        ("customer 5f3a9b2c1d7e blocked", "customer <hex> blocked"),
        ("bad pointer 0x7ffe3a2c", "bad pointer <hex>"),
        ("amount 12.50 and 1,000 items", "amount <n> and <n> items"),
        ("  many\n\tspaces   here ", "many spaces here"),
        ("utf8 decode failed at byte 17", "utf<n> decode failed at byte <n>"),
        ("words like deadbeef and accede stay", "words like deadbeef and accede stay"),
    ],
)
def test_normalise_error_replaces_the_variable_parts(error: str, pattern: str) -> None:
    assert normalise_error(error) == pattern


def test_normalise_error_is_bounded() -> None:
    assert len(normalise_error("x" * 10_000)) == MAX_PATTERN_CHARS


def test_similar_failures_share_a_signature_and_others_do_not() -> None:
    base = failure_signature("a", Reason.HTTP_4XX, 422, "missing field `city` in order 1")
    assert base == failure_signature("a", Reason.HTTP_4XX, 422, "missing field `city` in order 2")
    assert len(base) == 16
    others = {
        failure_signature("b", Reason.HTTP_4XX, 422, "missing field `city` in order 1"),
        failure_signature("a", Reason.VERDICT_DEAD, 422, "missing field `city` in order 1"),
        failure_signature("a", Reason.HTTP_4XX, 400, "missing field `city` in order 1"),
        failure_signature("a", Reason.HTTP_4XX, None, "missing field `city` in order 1"),
        failure_signature("a", Reason.HTTP_4XX, 422, "missing field `street` in order 1"),
    }
    assert base not in others
    assert len(others) == 5


def test_a_row_id_is_the_integration_and_the_event_id() -> None:
    first = dead_letter_id("a", "orders:0:7")
    assert first == dead_letter_id("a", "orders:0:7")
    assert first != dead_letter_id("b", "orders:0:7")
    assert first != dead_letter_id("a", "orders:0:8")
    assert len(first) == 32
    assert int(first, 16) >= 0
    assert letter(7, integration="a").id == first


@pytest.mark.parametrize(
    ("text", "escaped"),
    [("50%", "50\\%"), ("a_b", "a\\_b"), ("back\\slash", "back\\\\slash"), ("it's", "it's")],
)
def test_escape_like(text: str, escaped: str) -> None:
    assert escape_like(text) == escaped


def test_cursors_round_trip_and_keep_their_kind() -> None:
    cursor = encode_cursor("dlq", (1_800_000_000_000_000, 42))
    assert decode_cursor(cursor, "dlq", (int, int)) == (1_800_000_000_000_000, 42)
    with pytest.raises(InvalidCursor):
        decode_cursor(cursor, "dlq-audit", (int,))
    with pytest.raises(InvalidCursor):
        decode_cursor(cursor, "dlq", (int, str))


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=300))
def test_any_text_as_a_cursor_decodes_or_fails_cleanly(text: str) -> None:
    try:
        key = decode_cursor(text, "dlq", (int, int))
    except InvalidCursor:
        return
    assert all(type(part) is int for part in key)


# --- contract: writing ------------------------------------------------------------


async def test_the_same_source_message_dead_lettered_twice_is_one_row(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    first_at = clock.time()
    result = await store.put([letter(1, attempts=3, first_failure_at=first_at - 60)])
    assert (result.inserted, result.updated) == (1, 0)
    clock.advance(30)
    result = await store.put(
        [letter(1, attempts=5, error="409 conflict on order 1", http_status=409)]
    )
    assert (result.inserted, result.updated) == (0, 1)

    assert await store.count(DeadLetterFilter()) == 1
    row = await store.get(letter(1).id)
    assert row is not None
    assert row.first_failure_at == pytest.approx(first_at - 60)
    assert row.dead_lettered_at == pytest.approx(clock.time())
    assert (row.attempts, row.http_status, row.error) == (5, 409, "409 conflict on order 1")
    assert row.signature == failure_signature(
        row.integration, Reason.HTTP_4XX, 409, "409 conflict on order 1"
    )
    assert row.status is Status.DEAD
    assert row.requeue_count == 0
    [past] = row.history
    assert (past.attempts, past.http_status) == (3, 422)
    assert past.error == "422 missing field `city` in order 1"
    assert past.dead_lettered_at == pytest.approx(first_at)


async def test_a_requeued_message_that_fails_again_is_the_same_row_dead_again(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    await store.put([letter(1)])
    assert await store.mark_requeued([letter(1).id], by="alice") == 1
    clock.advance(60)
    # The replay carries the event id, so the new failure finds the row.
    await store.put([letter(1, error="422 missing field `city` again")])

    row = await store.get(letter(1).id)
    assert row is not None
    assert row.status is Status.DEAD
    assert row.requeue_count == 1
    assert (row.last_action, row.last_action_by) == (Action.REQUEUE, "alice")
    assert len(row.history) == 1
    assert await store.count(DeadLetterFilter()) == 1


async def test_a_requeue_keeps_the_span_of_the_attempt_that_gave_up_and_a_new_failure_its_own(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    first, second = f"00-{trace}-00f067aa0ba902b7-01", f"00-{trace}-b7ad6b7169203331-01"
    await store.put([letter(1, metadata={"type": "order", META_LAST_SPAN: first})])
    await store.put([letter(2, metadata={"type": "order"})])  # as older rows are: no span
    row = await store.get(letter(1).id)
    assert row is not None
    assert replay_of(row).metadata[META_LAST_SPAN] == first
    old = await store.get(letter(2).id)
    assert old is not None
    assert META_LAST_SPAN not in replay_of(old).metadata
    assert await store.mark_requeued([row.id], by="alice") == 1
    clock.advance(60)
    # The replay fails again: the row now names that attempt's span.
    await store.put([letter(1, attempts=2, metadata={"type": "order", META_LAST_SPAN: second})])
    again = await store.get(letter(1).id)
    assert again is not None
    assert dict(again.metadata) == {"type": "order", META_LAST_SPAN: second}
    assert replay_of(again).metadata[META_LAST_SPAN] == second
    listed = (await store.query(DeadLetterFilter())).rows
    assert {r.id: r.metadata.get(META_LAST_SPAN) for r in listed} == {
        again.id: second,
        old.id: None,
    }


async def test_a_discarded_message_that_comes_back_stays_discarded(
    store: DeadLetterStore,
) -> None:
    await store.put([letter(1)])
    await store.mark_discarded([letter(1).id], by="bob")
    await store.put([letter(1)])  # a redelivery of a failure already dropped
    row = await store.get(letter(1).id)
    assert row is not None
    assert row.status is Status.DISCARDED


async def test_one_message_twice_in_one_batch_and_in_two_integrations(
    store: DeadLetterStore,
) -> None:
    result = await store.put(
        [letter(1, attempts=1), letter(1, attempts=2), letter(1, integration="other")]
    )
    assert (result.inserted, result.updated) == (2, 1)
    row = await store.get(letter(1).id)
    assert row is not None
    assert row.attempts == 2
    assert len(row.history) == 1
    assert await store.count(DeadLetterFilter(integrations=frozenset({"other"}))) == 1


async def test_get_returns_what_was_written(store: DeadLetterStore, clock: FakeClock) -> None:
    payload = b"\x00\xff binary \x80 payload"
    written = letter(
        9,
        payload=payload,
        key="customer-7",
        metadata={"type": "order.created", "nemesis-event-id": "orders:0:9"},
        stage="enrich",
        reason=Reason.PIPELINE_ERROR,
        http_status=None,
        error="KeyError: 'region'",
    )
    await store.put([written])
    row = await store.get(written.id)
    assert row is not None
    assert (row.id, row.integration, row.event_id) == (
        written.id,
        written.integration,
        "orders:0:9",
    )
    assert (row.payload, row.payload_size, row.payload_truncated) == (payload, len(payload), False)
    assert dict(row.metadata) == {"type": "order.created", "nemesis-event-id": "orders:0:9"}
    assert (row.key, row.stage, row.reason, row.http_status) == (
        "customer-7",
        "enrich",
        Reason.PIPELINE_ERROR,
        None,
    )
    assert (row.source_topic, row.source_partition, row.source_offset) == ("orders", 0, 9)
    assert row.first_failure_at == row.dead_lettered_at == pytest.approx(clock.time())
    assert (row.last_action, row.last_action_by, row.last_action_at) == (None, None, None)
    assert await store.get("0" * 32) is None
    many = await store.get_many([written.id, "0" * 32, written.id])
    assert [r.id for r in many] == [written.id]


CAP = 16 * 1024 * 1024  # a YDB cell's limit, which every store keeps


async def test_a_payload_over_16_mib_is_stored_cut_keeping_its_real_size(
    store: DeadLetterStore,
) -> None:
    """Every store keeps at most 16 MiB of a payload (a YDB cell's limit), the same way."""
    big = bytes(range(256)) * (CAP // 256) + b"past the limit"
    exact = b"e" * CAP
    written = [letter(1, payload=big), letter(2, payload=exact)]
    assert await store.put(written) == PutResult(2, 0)
    cut = await store.get(written[0].id)
    assert cut is not None
    assert (len(cut.payload), cut.payload_size, cut.payload_truncated) == (CAP, len(big), True)
    assert cut.payload == big[:CAP]
    whole = await store.get(written[1].id)
    assert whole is not None
    assert (whole.payload == exact, whole.payload_size, whole.payload_truncated) == (
        True,
        CAP,
        False,
    )
    # The same failure again (a retried write) changes nothing, and lists tell the real size.
    assert await store.put(written[:1]) == PutResult(0, 1)
    page = await store.query(DeadLetterFilter())
    assert sorted(r.payload_size for r in page.rows) == [CAP, len(big)]
    assert dlq_core.MAX_STORED_PAYLOAD_BYTES == CAP


async def test_a_requeue_leaves_a_letter_whose_payload_was_cut_dead(
    tmp_path: Path, clock: FakeClock
) -> None:
    store = await open_sqlite_dlq(tmp_path / "dlq.db", clock=clock)
    broker = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    try:
        big, small = letter(1, payload=b"b" * (CAP + 1)), letter(2)
        await store.put([big, small])
        result = await requeue(store, broker, [big.id, small.id], by="ops", clock=clock)
        assert (result.count, result.payload_cut) == (1, 1)
        statuses = {row.id: row.status for row in await store.get_many([big.id, small.id])}
        assert statuses == {big.id: Status.DEAD, small.id: Status.REQUEUED}
    finally:
        await broker.close()
        await store.close()


async def test_a_record_is_kept_as_written_binary_key_headers_and_tombstone(
    store: DeadLetterStore,
) -> None:
    headers = (
        ("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        ("x-dup", b"one"),
        ("x-null", None),
        ("x-dup", b"\xff\x00 two"),
        ("x-empty", b""),
    )
    binary_key = key_text(b"\xff\xfe key \x00")
    kinds = {
        1: letter(1, payload=b"", key=binary_key, headers=headers, tombstone=True),
        2: letter(2, payload=b"", key="клиент", headers=headers[:1]),
        3: letter(3, payload=b"\x80", key=None),
    }
    await store.put(list(kinds.values()))
    listed = {row.source_offset: row for row in (await store.query(DeadLetterFilter())).rows}
    for offset, written in kinds.items():
        row = await store.get(written.id)
        assert row is not None
        for kept in (row, listed[offset]):
            assert kept.key == written.key
            assert kept.headers == written.headers
            assert kept.tombstone is written.tombstone
            assert dict(kept.metadata) == dict(written.metadata)
        # A requeue writes the record back as it was read.
        again = replay_of(row)
        assert (again.key, again.headers, again.tombstone) == (
            written.key,
            written.headers,
            written.tombstone,
        )
    one = await store.get(kinds[1].id)
    assert one is not None
    assert key_bytes(one.key or "") == b"\xff\xfe key \x00"


async def test_lists_carry_a_payload_preview_and_long_errors_are_cut(
    store: DeadLetterStore,
) -> None:
    await store.put([letter(1, payload=b"x" * 5000, error="e" * (MAX_ERROR_CHARS + 100))])
    [row] = (await store.query(DeadLetterFilter(), preview_bytes=100)).rows
    assert (row.payload, row.payload_size, row.payload_truncated) == (b"x" * 100, 5000, True)
    assert len(row.error) == MAX_ERROR_CHARS
    assert row.error.endswith("…")
    full = await store.get(row.id)
    assert full is not None
    assert full.payload == b"x" * 5000


# --- contract: filters and paging ------------------------------------------------


async def _filter_dataset(store: DeadLetterStore, clock: FakeClock) -> list[DeadLetterRow]:
    """60 rows over three integrations, every reason, three statuses, ten points in time."""
    letters = []
    reasons = list(Reason)
    for n in range(60):
        integration = ("alpha", "beta", "gamma")[n % 3]
        reason = reasons[n % len(reasons)]
        http_status = (422, 400, None)[n % 3 if reason is Reason.HTTP_4XX else 2]
        error = (
            f"{http_status} missing field `city` in order {n}"
            if n % 2
            else f"timeout after {n} ms calling shop"
        )
        payload = json.dumps({"order": n, "city": "Kazan" if n % 5 == 0 else "msk"}).encode()
        letters.append(
            letter(
                n,
                integration=integration,
                reason=reason,
                http_status=http_status,
                error=error,
                payload=payload,
                at=START + (n % 10) * 60,
            )
        )
    await store.put(letters)
    ids = [item.id for item in letters]
    await store.mark_requeued(ids[::7], by="alice")
    await store.mark_discarded(ids[1::11], by="bob")
    return list(await store.get_many(ids))


async def test_every_filter_matches_its_plain_meaning(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    rows = await _filter_dataset(store, clock)
    signature = next(r.signature for r in rows if r.integration == "beta" and "city" in r.error)
    many = frozenset({"alpha", "beta", *(f"other-{i}" for i in range(40))})
    filters = [
        DeadLetterFilter(),
        DeadLetterFilter(integrations=frozenset({"alpha"})),
        DeadLetterFilter(integrations=frozenset({"alpha", "gamma"})),
        DeadLetterFilter(integrations=frozenset({"nobody"})),
        DeadLetterFilter(integrations=frozenset()),
        DeadLetterFilter(integrations=many),  # more branches than one query takes
        DeadLetterFilter(integrations=many, status=Status.DEAD),
        *(DeadLetterFilter(reason=reason) for reason in Reason),
        *(DeadLetterFilter(status=status) for status in Status),
        DeadLetterFilter(http_status=422),
        DeadLetterFilter(http_status=404),
        DeadLetterFilter(signature=signature),
        DeadLetterFilter(signature=signature, status=Status.DEAD),
        DeadLetterFilter(since=START + 120),
        DeadLetterFilter(until=START + 120),
        DeadLetterFilter(since=START + 120, until=START + 300),
        DeadLetterFilter(since=START + 120, until=START + 120),
        DeadLetterFilter(text="kazan"),
        DeadLetterFilter(text="KAZAN"),
        DeadLetterFilter(text="missing field `city`"),
        DeadLetterFilter(text="order 1"),
        DeadLetterFilter(text="nothing like this"),
        DeadLetterFilter(text=""),
        DeadLetterFilter(
            integrations=frozenset({"alpha", "beta"}),
            reason=Reason.HTTP_4XX,
            status=Status.DEAD,
        ),
        DeadLetterFilter(integrations=frozenset({"beta"}), reason=Reason.DECODE_ERROR),
        DeadLetterFilter(reason=Reason.HTTP_4XX, status=Status.DEAD, http_status=400),
        DeadLetterFilter(integrations=frozenset({"alpha", "gamma"}), text="msk", since=START + 60),
    ]
    for where in filters:
        expected = {r.id for r in rows if model_matches(r, where)}
        listed = await all_pages(store, where, limit=7)
        assert [r.id for r in listed if r.id in expected] == [r.id for r in listed], where
        assert {r.id for r in listed} == expected, where
        assert len(listed) == len(expected), where
        times = [r.dead_lettered_at for r in listed]
        assert times == sorted(times, reverse=True), where
        assert await store.count(where) == len(expected), where
        assert set(await store.select_ids(where, 1000)) == expected, where


async def test_text_search_takes_wildcards_and_quotes_literally(store: DeadLetterStore) -> None:
    payloads = {
        1: b"a discount of 50% applies",
        2: b"field a_b is unknown",
        3: b'it\'s "quoted" here',
        4: b"a back\\slash here",
        5: b"plain text 50 and ab",
    }
    await store.put([letter(n, payload=p, error="boom") for n, p in payloads.items()])

    async def found(text: str) -> set[int]:
        page = await store.query(DeadLetterFilter(text=text))
        return {row.source_offset for row in page.rows}

    assert await found("%") == {1}
    assert await found("50%") == {1}
    assert await found("_") == {2}
    assert await found("a_b") == {2}
    assert await found("'") == {3}
    assert await found('"quoted"') == {3}
    assert await found("\\") == {4}
    assert await found("' OR 1=1 --") == set()
    assert await found("50") == {1, 5}


HOSTILE_TEXTS = (
    "%'; DROP TABLE x; --",
    "'); DELETE FROM dlq_letters; --",
    "' OR integration = 'beta' --",
    '" OR ""="',
    "%",
    "_",
    "\\",
    "?",
    "$1",
    ":p0",
    "$p0",
    "*/ OR 1=1 /*",
)


async def test_hostile_search_text_is_data_and_never_widens_the_scope(
    store: DeadLetterStore,
) -> None:
    # Each text stands literally in one payload of each team's integration, and
    # in no other row: a search finds exactly alpha's row for it, never beta's.
    letters = [
        letter(n * 2 + side, integration=team, payload=f"<{text}>".encode(), error="boom")
        for n, text in enumerate(HOSTILE_TEXTS)
        for side, team in enumerate(("alpha", "beta"))
    ]
    letters.append(letter(1000, integration="alpha", payload=b"plain", error="plain"))
    await store.put(letters)
    alpha = frozenset({"alpha"})
    for n, text in enumerate(HOSTILE_TEXTS):
        # "%", "_" and "\\" stand inside other texts too: each finds the texts holding it.
        holding = {m * 2 for m, other in enumerate(HOSTILE_TEXTS) if text.lower() in other.lower()}
        where = DeadLetterFilter(integrations=alpha, text=text)
        assert {r.source_offset for r in (await store.query(where)).rows} == holding, text
        assert n * 2 in holding
        assert await store.count(where) == len(holding), text
        assert len(await store.select_ids(where, 100)) == len(holding), text
        assert sum(g.count for g in await store.groups(where)) == len(holding), text
        stats = await store.stats(where)
        assert [s.integration for s in stats.by_integration] == ["alpha"], text
        assert stats.total == len(holding), text
    # Nothing ran: every row is still there.
    assert await store.count(DeadLetterFilter()) == len(letters)
    assert await store.count(DeadLetterFilter(integrations=alpha)) == len(HOSTILE_TEXTS) + 1


async def found_by_text(store: DeadLetterStore, text: str) -> set[int]:
    """The source offsets of the rows a text search lists; it counts as many."""
    page = await store.query(DeadLetterFilter(text=text))
    assert await store.count(DeadLetterFilter(text=text)) == len(page.rows)
    return {row.source_offset for row in page.rows}


async def test_text_search_reads_the_payload_as_bytes_on_every_store(
    store: DeadLetterStore,
) -> None:
    # The payload is any bytes: after a NUL, around bytes that are not UTF-8,
    # the search text's own bytes are what is looked for, and nothing else.
    payloads = {
        1: b"head\x00tail needle",  # text after a NUL byte
        2: b"caf\xc3\xa9\xa9 bytes",  # an "é" followed by a stray continuation byte
        3: b"\xed\xa0\x80 surrogate",  # an encoded surrogate: no U+FFFD in these bytes
        4: b"\xe0\x83\xa9 overlong",  # an overlong "é": not the bytes of "é"
        5: b"\xc1 \\path STRA\xc3\x9fE \xc3\x89T\xc3\x89",
    }
    await store.put([letter(n, payload=p, error="boom") for n, p in payloads.items()])

    assert await found_by_text(store, "NEEDLE") == {1}
    assert await found_by_text(store, "tail") == {1}
    assert await found_by_text(store, "é") == {2}
    assert await found_by_text(store, "\ufffd") == set()
    assert await found_by_text(store, "\\PATH") == {5}
    assert await found_by_text(store, "straße") == {5}  # ASCII letters fold...
    assert await found_by_text(store, "été") == set()  # ...and only they: É is not é
    assert await found_by_text(store, "ÉTÉ") == {5}
    assert await found_by_text(store, "301") == set()  # byte 0xC1 is not the text "301" (its octal)


async def test_a_nul_in_the_search_text_is_looked_for_as_each_column_keeps_it(
    store: DeadLetterStore,
) -> None:
    # Stored text keeps each NUL as U+FFFD, and the search text is compared with
    # it the same way; the payload keeps its bytes, NULs too, and so does the search.
    await store.put(
        [
            letter(1, error="bad\x00answer", payload=b"{}"),
            letter(2, error="boom", payload=b"raw\x00bytes"),
            letter(3, error="boom", payload="raw\ufffdbytes".encode()),
            letter(4, error="plain", payload=b"plain"),
        ]
    )

    assert await found_by_text(store, "d\x00a") == {1}
    assert await found_by_text(store, "d\ufffda") == {1}
    assert await found_by_text(store, "raw\x00bytes") == {2}
    assert await found_by_text(store, "RAW\ufffdBYTES") == {3}
    assert await found_by_text(store, "\x00") == {1, 2}


def test_filters_and_pages_outside_the_limits_are_refused() -> None:
    with pytest.raises(InvalidQuery, match="longer than"):
        DeadLetterFilter(text="x" * (MAX_TEXT_CHARS + 1))
    DeadLetterFilter(text="x" * MAX_TEXT_CHARS)
    for bad in (
        {"http_status": 99},
        {"http_status": 600},
        {"signature": "not-a-signature"},
        {"signature": "ABCDEF0123456789"},
        {"since": 10.0, "until": 5.0},
        {"since": float("nan")},
        {"until": float("inf")},
        {"integrations": frozenset(str(i) for i in range(1001))},
    ):
        with pytest.raises(InvalidQuery):
            DeadLetterFilter(**bad)
    for limit in (0, -1, 501):
        with pytest.raises(InvalidQuery):
            PageRequest(limit=limit)
    assert issubclass(InvalidCursor, InvalidQuery)
    assert issubclass(InvalidQuery, NemesisError)


async def test_store_calls_outside_the_limits_are_refused(store: DeadLetterStore) -> None:
    for call in (
        store.select_ids(DeadLetterFilter(), 0),
        store.select_ids(DeadLetterFilter(), 100_001),
        store.count(DeadLetterFilter(), limit=-1),
        store.groups(DeadLetterFilter(), limit=0),
        store.stats(DeadLetterFilter(), bucket_s=0),
        store.stats(DeadLetterFilter(), buckets=0),
        store.query(DeadLetterFilter(), preview_bytes=-1),
    ):
        with pytest.raises(InvalidQuery):
            await call


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


@pytest.mark.parametrize(
    "cursor",
    [
        "",
        "garbage",
        "!!!!",
        "x" * 10_000,
        _b64(b"not json"),
        _b64(b"\xff\xfe"),
        _b64(b'{"kind": "dlq"}'),
        _b64(b'["dlq", 1]'),
        _b64(b'["dlq", 1, 2, 3]'),
        _b64(b'["dlq", "1", 2]'),
        _b64(b'["dlq", true, 2]'),
        _b64(b'["dlq", 1.5, 2]'),
        _b64(b'["dlq", 100000000000000000000000, 2]'),
        _b64(b'["dlq-audit", 5]'),
        _b64(b'["other", 1, 2]'),
    ],
)
async def test_a_forged_cursor_is_a_clean_error(store: DeadLetterStore, cursor: str) -> None:
    await store.put([letter(1)])
    await store.record_action(
        who="a", action=Action.REQUEUE, integrations=["x"], count=1, description="d"
    )
    with pytest.raises(InvalidCursor):
        await store.query(DeadLetterFilter(), PageRequest(cursor=cursor))
    # Each list takes only its own cursors.
    if decoded_kind(cursor) != "dlq-audit":
        with pytest.raises(InvalidCursor):
            await store.actions(PageRequest(cursor=cursor))
    letters_cursor = encode_cursor("dlq", (1, 1))
    with pytest.raises(InvalidCursor):
        await store.actions(PageRequest(cursor=letters_cursor))


def decoded_kind(cursor: str) -> object:
    try:
        return json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))[0]
    except (ValueError, IndexError, KeyError, TypeError):
        return None


async def test_a_well_formed_cursor_only_positions_the_page(store: DeadLetterStore) -> None:
    await store.put([letter(1), letter(2, integration="secret")])
    # A hand-made position in the far future: the filter still decides what is seen.
    forged = encode_cursor("dlq", (2**62, 2**62))
    page = await store.query(
        DeadLetterFilter(integrations=frozenset({"orders-to-loyalty"})),
        PageRequest(cursor=forged),
    )
    assert [row.source_offset for row in page.rows] == [1]


async def test_paging_with_ties_in_time_visits_every_row_once(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    letters = [letter(n, integration=("a", "b")[n % 2], at=START + (n % 4)) for n in range(121)]
    await store.put(letters)
    for where in (
        DeadLetterFilter(),
        DeadLetterFilter(integrations=frozenset({"a", "b"})),
        DeadLetterFilter(integrations=frozenset({"b"}), status=Status.DEAD),
    ):
        expected = {item.id for item in letters if model_matches_letter(item, where)}
        for limit in (1, 7, 50, 500):
            rows = await all_pages(store, where, limit)
            ids = [row.id for row in rows]
            assert len(ids) == len(set(ids)) == len(expected)
            assert set(ids) == expected
            assert [r.dead_lettered_at for r in rows] == sorted(
                (r.dead_lettered_at for r in rows), reverse=True
            )


def model_matches_letter(item: DeadLetter, where: DeadLetterFilter) -> bool:
    return where.integrations is None or item.integration in where.integrations


async def test_rows_written_while_paging_do_not_shift_the_pages(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    await store.put([letter(n, at=START + n) for n in range(30)])
    first = await store.query(DeadLetterFilter(), PageRequest(limit=10))
    clock.advance(1000)
    await store.put([letter(n) for n in range(100, 110)])  # newer than anything seen
    rest = await all_pages_from(store, first.next_cursor, limit=10)
    ids = [row.id for row in (*first.rows, *rest)]
    assert len(ids) == len(set(ids)) == 30


async def all_pages_from(
    store: DeadLetterStore, cursor: str | None, limit: int
) -> list[DeadLetterRow]:
    rows: list[DeadLetterRow] = []
    while cursor is not None:
        page = await store.query(DeadLetterFilter(), PageRequest(limit=limit, cursor=cursor))
        rows.extend(page.rows)
        cursor = page.next_cursor
    return rows


_rows_strategy = st.lists(
    st.tuples(st.integers(0, 5), st.sampled_from(["a", "b", "c"]), st.booleans()),
    min_size=1,
    max_size=60,
)


@pytest.mark.parametrize("kind", sorted(STORES))
@settings(max_examples=25, deadline=None)
@given(
    rows=_rows_strategy,
    limit=st.integers(1, 20),
    integrations=st.none() | st.frozensets(st.sampled_from(["a", "b", "c", "z"])),
    status=st.none() | st.sampled_from([Status.DEAD, Status.REQUEUED]),
)
def test_keyset_paging_returns_each_matching_row_once_newest_first(
    request: pytest.FixtureRequest,
    kind: str,
    rows: list[tuple[int, str, bool]],
    limit: int,
    integrations: frozenset[str] | None,
    status: Status | None,
) -> None:
    async def scenario(directory: Path, factory: StoreFactory) -> None:
        store = await factory(directory, FakeClock())
        try:
            letters = [
                letter(n, integration=name, at=START + tick)
                for n, (tick, name, _requeued) in enumerate(rows)
            ]
            await store.put(letters)
            requeued = [item.id for item, row in zip(letters, rows, strict=True) if row[2]]
            await store.mark_requeued(requeued, by="prop")
            where = DeadLetterFilter(integrations=integrations, status=status)
            expected = {
                item.id
                for item, (_tick, name, was_requeued) in zip(letters, rows, strict=True)
                if (integrations is None or name in integrations)
                and (status is None or (status is Status.REQUEUED) == was_requeued)
            }
            seen = await all_pages(store, where, limit)
            ids = [row.id for row in seen]
            assert len(ids) == len(set(ids))
            assert set(ids) == expected
            times = [row.dead_lettered_at for row in seen]
            assert times == sorted(times, reverse=True)
        finally:
            await store.close()

    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(scenario(Path(directory), STORES[kind](request)))


async def test_count_can_stop_early(store: DeadLetterStore) -> None:
    await store.put([letter(n) for n in range(25)])
    assert await store.count(DeadLetterFilter()) == 25
    assert await store.count(DeadLetterFilter(), limit=10) == 10
    assert await store.count(DeadLetterFilter(), limit=100) == 25
    assert await store.count(DeadLetterFilter(), limit=0) == 0


# --- contract: groups and the overview -------------------------------------------


async def test_failures_group_by_their_normalised_signature(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    await store.put([letter(n, at=START + n) for n in range(30)])  # 422 missing field `city`
    await store.put(
        [
            letter(
                100 + n,
                reason=Reason.RETRIES_EXHAUSTED,
                http_status=503,
                error=f"503 after {n} attempts to 10.0.0.{n}",
                at=START + 1000 + n,
            )
            for n in range(5)
        ]
    )
    await store.put([letter(n, integration="other", at=START) for n in range(3)])

    groups = await store.groups(DeadLetterFilter())
    assert [(g.integration, g.count) for g in groups] == [
        ("orders-to-loyalty", 30),
        ("orders-to-loyalty", 5),
        ("other", 3),
    ]
    city = groups[0]
    assert city.pattern == "<n> missing field `city` in order <n>"
    assert city.sample_error == "422 missing field `city` in order 0"
    assert (city.reason, city.http_status) == (Reason.HTTP_4XX, 422)
    assert (city.first_at, city.last_at) == pytest.approx((START, START + 29))
    assert groups[1].pattern == "<n> after <n> attempts to <n>"

    # A group is a filter: its rows, its count, its bulk action.
    in_group = DeadLetterFilter(signature=city.signature)
    assert await store.count(in_group) == 30
    assert len(await store.select_ids(in_group, 1000)) == 30
    assert await store.mark_discarded(await store.select_ids(in_group, 10), by="carol") == 10

    dead = await store.groups(DeadLetterFilter(status=Status.DEAD))
    assert [g.count for g in dead] == [20, 5, 3]
    assert (dead[0].first_at, dead[0].last_at) == pytest.approx((START, START + 19))
    mine = await store.groups(DeadLetterFilter(integrations=frozenset({"other"})))
    assert [(g.integration, g.count) for g in mine] == [("other", 3)]
    assert await store.groups(DeadLetterFilter(integrations=frozenset())) == []
    recent = await store.groups(DeadLetterFilter(since=START + 1000))
    assert [g.count for g in recent] == [5]
    retried = await store.groups(DeadLetterFilter(reason=Reason.RETRIES_EXHAUSTED))
    assert [g.http_status for g in retried] == [503]
    assert [g.count for g in await store.groups(DeadLetterFilter(text="10.0.0.3"))] == [1]
    assert len(await store.groups(DeadLetterFilter(), limit=1)) == 1


async def test_stats_give_counts_growth_and_a_time_series(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    now = START + 10 * 3600
    clock.now = now
    # quiet: 10 old failures; busy: 2 old and 6 within the last hour.
    await store.put(
        [letter(n, integration="quiet", at=START + n * 60) for n in range(10)]
        + [letter(100 + n, integration="busy", at=START + 3600) for n in range(2)]
        + [
            letter(
                200 + n,
                integration="busy",
                reason=Reason.DECODE_ERROR,
                http_status=None,
                error="bad JSON",
                at=now - 60 * (n + 1),
            )
            for n in range(6)
        ]
    )
    stats = await store.stats(DeadLetterFilter(), bucket_s=3600, buckets=12)
    assert stats.now == now
    assert (stats.total, stats.last_hour) == (18, 6)
    assert [s.integration for s in stats.by_integration] == ["busy", "quiet"]
    busy, quiet = stats.by_integration
    assert (busy.total, busy.last_hour) == (8, 6)
    assert dict(busy.by_reason) == {Reason.HTTP_4XX: 2, Reason.DECODE_ERROR: 6}
    assert (quiet.total, quiet.last_hour) == (10, 0)
    assert quiet.oldest_at == pytest.approx(START)
    assert stats.oldest_at == pytest.approx(START)
    assert stats.newest_at == pytest.approx(now - 60)
    assert dict(stats.by_reason) == {Reason.HTTP_4XX: 12, Reason.DECODE_ERROR: 6}

    assert stats.bucket_s == 3600
    assert len(stats.buckets) == 12
    starts = [b.start for b in stats.buckets]
    assert starts == [starts[0] + i * 3600 for i in range(12)]
    assert stats.buckets[-1].start <= now < stats.buckets[-1].start + 3600
    assert sum(b.count for b in stats.buckets) == 18
    assert stats.buckets[-1].count + stats.buckets[-2].count == 6

    scoped = await store.stats(DeadLetterFilter(integrations=frozenset({"quiet"})))
    assert (scoped.total, [s.integration for s in scoped.by_integration]) == (10, ["quiet"])
    empty = await store.stats(DeadLetterFilter(integrations=frozenset()))
    assert (empty.total, empty.oldest_at, empty.by_integration) == (0, None, [])
    assert sum(b.count for b in empty.buckets) == 0
    decode = await store.stats(DeadLetterFilter(reason=Reason.DECODE_ERROR))
    assert (decode.total, decode.last_hour) == (6, 6)


# --- contract: actions ---------------------------------------------------------------


async def test_status_changes_touch_only_dead_rows_in_scope(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    await store.put([letter(n) for n in range(6)] + [letter(9, integration="theirs")])
    ids = [letter(n).id for n in range(6)]
    theirs = letter(9, integration="theirs").id

    assert await store.mark_requeued(ids[:3], by="alice", at=START + 5) == 3
    assert await store.mark_requeued(ids[:3], by="alice") == 0  # requeued already
    assert await store.mark_discarded(ids[:4], by="bob") == 1  # only the one still dead
    assert await store.mark_requeued(ids[3:4], by="bob") == 0  # discarded stays discarded
    assert await store.mark_requeued(["0" * 32], by="bob") == 0
    assert await store.mark_requeued([], by="bob") == 0
    mine = frozenset({"orders-to-loyalty"})
    assert await store.mark_discarded([theirs, ids[4]], by="eve", integrations=mine) == 1
    assert await store.mark_discarded([theirs], by="eve", integrations=frozenset()) == 0

    rows = {row.id: row for row in await store.get_many([*ids, theirs])}
    assert rows[ids[0]].status is Status.REQUEUED
    assert rows[ids[0]].requeue_count == 1
    assert (rows[ids[0]].last_action, rows[ids[0]].last_action_by) == (Action.REQUEUE, "alice")
    assert rows[ids[0]].last_action_at == pytest.approx(START + 5)
    assert rows[ids[3]].status is Status.DISCARDED
    assert rows[ids[3]].requeue_count == 0
    assert rows[ids[3]].last_action_at == pytest.approx(clock.time())
    assert rows[ids[4]].status is Status.DISCARDED
    assert rows[ids[5]].status is Status.DEAD
    assert rows[theirs].status is Status.DEAD
    assert rows[theirs].last_action is None


async def test_a_bulk_action_by_filter_runs_in_rounds_until_nothing_is_left(
    store: DeadLetterStore,
) -> None:
    await store.put([letter(n, integration=("a", "b")[n % 2]) for n in range(50)])
    where = DeadLetterFilter(integrations=frozenset({"a"}), status=Status.DEAD)
    changed = 0
    while ids := await store.select_ids(where, 7):
        changed += await store.mark_requeued(ids, by="ops", integrations=frozenset({"a"}))
    assert changed == 25
    assert await store.count(DeadLetterFilter(status=Status.REQUEUED)) == 25
    assert await store.count(DeadLetterFilter(integrations=frozenset({"b"}))) == 25


async def test_the_audit_log_records_who_did_what_and_pages(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    for n in range(5):
        clock.advance(10)
        await store.record_action(
            who=f"user-{n}",
            action=Action.REQUEUE if n % 2 == 0 else Action.DISCARD,
            integrations=["a"] if n < 3 else ["b", "a", "b"],
            count=n * 10,
            description=f"status=dead reason=http_4xx #{n}",
        )
    recorded = await store.record_action(
        who="admin", action=Action.DISCARD, integrations=["c"], count=1, description="one id"
    )
    assert (recorded.who, recorded.integrations) == ("admin", ("c",))
    assert recorded.at == pytest.approx(clock.time())

    first = await store.actions(PageRequest(limit=4))
    assert [a.who for a in first.rows] == ["admin", "user-4", "user-3", "user-2"]
    assert first.rows[1].integrations == ("a", "b")
    assert (first.rows[1].action, first.rows[1].count) == (Action.REQUEUE, 40)
    assert first.rows[1].description == "status=dead reason=http_4xx #4"
    assert first.next_cursor is not None
    rest = await store.actions(PageRequest(limit=4, cursor=first.next_cursor))
    assert [a.who for a in rest.rows] == ["user-1", "user-0"]
    assert rest.next_cursor is None

    scoped = await store.actions(integrations=frozenset({"b"}))
    assert [a.who for a in scoped.rows] == ["user-4", "user-3"]
    assert (await store.actions(integrations=frozenset())).rows == []


# --- contract: retention ---------------------------------------------------------------


async def test_retention_deletes_rows_older_than_180_days(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    await store.put([letter(n, at=START + n * DAY) for n in range(10)])
    await store.put([letter(100, error="a failure of its own", at=START)])
    clock.now = START + 183.5 * DAY  # rows from days 0..3 (and the lone one) are older than 180
    assert await store.enforce_retention() == 5
    assert await store.count(DeadLetterFilter()) == 6
    assert await store.enforce_retention() == 0
    groups = await store.groups(DeadLetterFilter())
    assert [g.count for g in groups] == [6]
    assert await store.enforce_retention(now=START + 1000 * DAY) == 6
    assert await store.count(DeadLetterFilter()) == 0


# --- sqlite only -------------------------------------------------------------------------


async def test_sqlite_retention_runs_in_batches_and_none_keeps_everything(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dlq_core, "DELETE_BATCH", 3)
    async with await open_sqlite_dlq(tmp_path / "a.db", clock=clock, retention_s=DAY) as store:
        await store.put([letter(n, at=START) for n in range(10)])
        clock.advance(2 * DAY)
        assert await store.enforce_retention() == 10
    async with await open_sqlite_dlq(tmp_path / "b.db", clock=clock, retention_s=None) as store:
        await store.put([letter(n, at=START - 1000 * DAY) for n in range(3)])
        assert await store.enforce_retention() == 0
        assert await store.count(DeadLetterFilter()) == 3
    with pytest.raises(ValueError, match="retention_s"):
        await open_sqlite_dlq(tmp_path / "c.db", retention_s=0)


async def test_sqlite_text_search_stops_at_its_scan_bound_and_resumes(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dlq_sqlite, "TEXT_SCAN_ROWS", 10)
    async with await open_sqlite_dlq(tmp_path / "dlq.db", clock=clock) as store:
        needles = {3, 25, 26, 47}
        await store.put(
            [
                letter(n, payload=b"needle" if n in needles else b"hay", at=START + n)
                for n in range(50)
            ]
        )
        where = DeadLetterFilter(text="needle")
        first = await store.query(where, PageRequest(limit=50))
        assert [row.source_offset for row in first.rows] == [47]  # rows 49..40 examined
        assert first.next_cursor is not None
        rows = [*first.rows, *await all_pages_after(store, where, first.next_cursor)]
        assert [row.source_offset for row in rows] == [47, 26, 25, 3]
        assert await store.count(where) == 4  # counting is not bounded
        assert len(await store.select_ids(where, 100)) == 4

        # The same across several index branches (one per status) merged into one order.
        await store.mark_requeued([letter(n).id for n in range(0, 50, 3)], by="x")
        await store.mark_discarded([letter(n).id for n in range(1, 50, 5)], by="x")
        where = DeadLetterFilter(integrations=frozenset({"orders-to-loyalty"}), text="needle")
        first = await store.query(where, PageRequest(limit=1))
        rows = [*first.rows, *await all_pages_after(store, where, first.next_cursor)]
        assert [row.source_offset for row in rows] == [47, 26, 25, 3]


async def all_pages_after(
    store: DeadLetterStore, where: DeadLetterFilter, cursor: str | None
) -> list[DeadLetterRow]:
    rows: list[DeadLetterRow] = []
    while cursor is not None:
        page = await store.query(where, PageRequest(limit=50, cursor=cursor))
        rows.extend(page.rows)
        cursor = page.next_cursor
    return rows


async def test_sqlite_select_ids_spans_several_rounds(
    tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dlq_core, "SELECT_ROUND", 4)
    async with await open_sqlite_dlq(tmp_path / "dlq.db", clock=clock) as store:
        await store.put([letter(n, at=START + n % 3) for n in range(30)])
        ids = await store.select_ids(DeadLetterFilter(), 17)
        assert len(ids) == len(set(ids)) == 17
        everything = await store.select_ids(DeadLetterFilter(), 1000)
        assert len(set(everything)) == 30
        assert everything[:17] == list(ids)


async def test_sqlite_file_persists_and_refuses_a_newer_schema(
    tmp_path: Path, clock: FakeClock
) -> None:
    path = tmp_path / "dir" / "dlq.db"
    async with await open_sqlite_dlq(path, clock=clock) as store:
        await store.put([letter(1)])
    async with await open_sqlite_dlq(path, clock=clock) as store:
        assert await store.count(DeadLetterFilter()) == 1
    with sqlite3.connect(path) as conn:
        # A rollback journal: no WAL, no memory-mapped -shm beside the file.
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal"
        beside = {p.name for p in path.parent.iterdir()} - {"dlq.db", "dlq.db-journal"}
        assert not beside
        conn.execute("UPDATE dlq_meta SET value = '99' WHERE key = 'schema_version'")
    conn.close()
    with pytest.raises(DlqError, match="newer"):
        await open_sqlite_dlq(path, clock=clock)


async def test_sqlite_store_errors_are_dlq_errors(tmp_path: Path, clock: FakeClock) -> None:
    store = await open_sqlite_dlq(tmp_path / "dlq.db", clock=clock)
    await store.close()
    await store.close()  # twice is fine
    with pytest.raises(DlqError):
        await store.count(DeadLetterFilter())
    with pytest.raises(DlqError):
        await store.put([letter(1)])


async def test_sqlite_two_stores_share_one_file(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "dlq.db"
    async with (
        await open_sqlite_dlq(path, clock=clock) as writer,
        await open_sqlite_dlq(path, clock=clock) as reader,
    ):
        await asyncio.gather(
            writer.put([letter(n) for n in range(20)]),
            reader.put([letter(n, integration="second") for n in range(20)]),
        )
        assert await reader.count(DeadLetterFilter()) == 40
        assert (
            await writer.mark_requeued(await reader.select_ids(DeadLetterFilter(), 40), by="x")
            == 40
        )


# --- contract: odd values ----------------------------------------------------------


async def test_an_empty_payload_lists_and_reads_back_empty(store: DeadLetterStore) -> None:
    await store.put([letter(1, payload=b"")])
    [row] = (await store.query(DeadLetterFilter())).rows
    assert (row.payload, row.payload_size, row.payload_truncated) == (b"", 0, False)
    full = await store.get(row.id)
    assert full is not None
    assert full.payload == b""
    assert [r.id for r in (await store.query(DeadLetterFilter(text="order"))).rows] == [row.id]


async def test_text_with_nul_characters_is_kept_with_a_replacement_character(
    store: DeadLetterStore,
) -> None:
    # A handler's answer may hold a NUL; PostgreSQL's text cannot: every store keeps U+FFFD.
    odd = letter(1, error="bad\x00answer", key="k\x00", stage="s\x00", event_id="orders:0:\x00")
    assert (await store.put([odd])).inserted == 1
    assert (await store.put([odd])).inserted == 0  # still the same row
    row = await store.get(odd.id)
    assert row is not None
    assert (row.error, row.key, row.stage, row.event_id) == (
        "bad\ufffdanswer", "k\ufffd", "s\ufffd", "orders:0:\ufffd"
    )  # fmt: skip
    assert [r.id for r in (await store.query(DeadLetterFilter(text="d\ufffda"))).rows] == [odd.id]
    await store.query(DeadLetterFilter(text="d\x00a"))  # a NUL in the search is no error
    assert await store.get("no\x00such") is None
    assert await store.mark_requeued([odd.id], by="a\x00b") == 1
    await store.record_action(
        who="a\x00b", action=Action.REQUEUE, integrations=["x\x00"], count=1, description="\x00"
    )
    [entry] = (await store.actions()).rows
    assert (entry.who, entry.integrations, entry.description) == (
        "a\ufffdb",
        ("x\ufffd",),
        "\ufffd",
    )


async def test_times_far_out_of_range_match_as_the_range_ends_would(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    # Stored times are clamped too (to 1970 and the year 2262).
    await store.put([letter(1), letter(2, at=4e9), letter(3, at=-1e20)])
    everything = DeadLetterFilter(since=-1e20, until=1e20)
    assert len((await store.query(everything)).rows) == 3
    assert await store.count(everything) == 3
    assert sum(g.count for g in await store.groups(everything)) == 3
    assert len(await store.select_ids(everything, 10)) == 3
    assert await store.count(DeadLetterFilter(since=1e20)) == 0
    assert await store.count(DeadLetterFilter(until=-1e20)) == 0
    assert (await store.stats(everything)).total == 3
    for now in (1e20, -1e20):
        stats = await store.stats(DeadLetterFilter(), now=now)
        assert len(stats.buckets) == 24
    await store.put([letter(4, at=1e20)])
    assert await store.count(DeadLetterFilter(since=1e10)) == 1
    assert await store.enforce_retention(now=1e20) == 3
    with pytest.raises(InvalidQuery):
        await store.stats(DeadLetterFilter(), bucket_s=1e300)


async def test_a_failure_written_again_is_in_its_row_once(
    store: DeadLetterStore, clock: FakeClock
) -> None:
    # A write retried after its commit went unanswered brings the same failure twice.
    first, second = letter(1, at=clock.time()), letter(1, attempts=2, at=clock.time() + 30)
    await store.put([first])
    await store.put([second])
    assert (await store.put([second])).inserted == 0
    await store.put([first, second])
    row = await store.get(first.id)
    assert row is not None
    assert row.attempts == 2
    assert [past.attempts for past in row.history] == [1]


# --- the core: folding failures into rows -------------------------------------------


def test_new_failures_become_whole_rows_and_a_repeat_in_the_batch_folds_into_them() -> None:
    at = START * 1_000_000
    first = letter(1, attempts=1, metadata={"type": "t"}, key="k", stage="enrich", at=START)
    again = letter(1, attempts=2, error="409 conflict", http_status=409, at=START)
    folded = dlq_core.fold_failures([first, again, letter(2, at=START)], {}, (), round(at))
    assert (folded.inserted, folded.updated) == (2, 1)
    one = next(r for r in folded.inserts if r["id"] == first.id)
    assert set(one) == set(dlq_core.LETTER_COLUMNS)
    assert (one["attempts"], one["http_status"], one["error"]) == (2, 409, "409 conflict")
    assert one["signature"] == failure_signature(
        first.integration, Reason.HTTP_4XX, 409, "409 conflict"
    )
    # The stage follows the latest failure; key and metadata are the message's.
    assert (one["msg_key"], one["stage"], one["metadata"]) == ("k", None, '{"type":"t"}')
    [past] = json.loads(one["history"])
    assert past == [at, "http_4xx", 422, 1, "422 missing field `city` in order 1"]
    # Letters 1 and 2 share a signature (their errors differ in a number only).
    assert sorted(s["sample_error"] for s in folded.signatures) == [
        "409 conflict",
        "422 missing field `city` in order 1",
    ]


def test_a_failure_of_an_existing_row_updates_its_failure_columns() -> None:
    at = round(START * 1_000_000)
    existing = {
        letter(1).id: {
            "id": letter(1).id,
            "status": Status.REQUEUED.value,
            "dead_lettered_us": at - 10**6,
            "reason": "http_4xx",
            "http_status": 422,
            "attempts": 3,
            "stage": None,
            "signature": "0123456789abcdef",
            "error": "x" * 600,
            "history": json.dumps([[0, "http_4xx", 400, 1, "old"]] * 10),
            "metadata": '{"type":"t"}',
        },
        letter(2).id: {
            "id": letter(2).id,
            "status": Status.DISCARDED.value,
            "dead_lettered_us": at - 10**6,
            "reason": "http_4xx",
            "http_status": 422,
            "attempts": 1,
            "stage": None,
            "signature": "0123456789abcdef",
            "error": "e",
            "history": None,
            "metadata": "{}",
        },
    }
    span = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    folded = dlq_core.fold_failures(
        [
            letter(1, error="y" * (MAX_ERROR_CHARS + 5), at=START, metadata={META_LAST_SPAN: span}),
            letter(2, at=START),
        ],
        existing,
        (),
        at,
    )
    assert (folded.inserted, folded.updated, folded.inserts) == (0, 2, [])
    requeued, discarded = (
        next(r for r in folded.updates if r["id"] == letter(n).id) for n in (1, 2)
    )
    assert set(requeued) == set(dlq_core.FAILURE_COLUMNS)
    # A requeued message that failed again is dead again; a discarded one stays discarded.
    assert requeued["status"] == "dead"
    assert discarded["status"] == "discarded"
    assert len(requeued["error"]) == MAX_ERROR_CHARS
    assert requeued["error"].endswith("…")
    history = json.loads(requeued["history"])
    assert len(history) == 10  # the oldest fell off
    assert history[-1] == [at - 10**6, "http_4xx", 422, 3, "x" * 499 + "…"]
    # The message's metadata stays; the span of the attempt that gave up is the latest's.
    assert json.loads(requeued["metadata"]) == {"type": "t", META_LAST_SPAN: span}
    assert discarded["metadata"] == "{}"


# --- the real CLI -----------------------------------------------------------------


async def test_the_cli_lists_a_dead_letter_with_an_empty_payload(tmp_path: Path) -> None:
    (tmp_path / "nemesis.yaml").write_text("data_dir: data\n", encoding="utf-8")
    store = await open_sqlite_dlq(tmp_path / "data" / "dlq.db")
    try:
        await store.put([letter(1, payload=b"")])
    finally:
        await store.close()
    for extra in ((), ("--json",)):
        listed = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "nemesis", "dlq", "list", "-c", "nemesis.yaml", *extra],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert listed.returncode == 0, listed.stderr
        assert "Traceback" not in listed.stderr
        assert letter(1).id[:12] in listed.stdout


async def test_the_cli_shows_that_a_stored_payload_was_cut(tmp_path: Path) -> None:
    (tmp_path / "nemesis.yaml").write_text("data_dir: data\n", encoding="utf-8")
    store = await open_sqlite_dlq(tmp_path / "data" / "dlq.db")
    try:
        await store.put([letter(1, payload=b"{" * (CAP + 10)), letter(2)])
    finally:
        await store.close()
    for offset, cut in ((1, True), (2, False)):
        shown = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "nemesis", "dlq", "show", letter(offset).id, "--json"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert shown.returncode == 0, shown.stderr
        document = json.loads(shown.stdout)
        assert document.get("payload_truncated", False) is cut
        assert document["payload_size"] == (CAP + 10 if cut else len(letter(2).payload))
