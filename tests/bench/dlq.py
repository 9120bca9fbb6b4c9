"""DLQ store benchmark: the UI's queries on a million dead letters.

Fills a fresh SQLite DLQ file (the store's own schema, rows written with
executemany in large batches; the store's ``put`` is timed apart on a
sample), then prints the median milliseconds of:
  list pages (first page and a page deep in the list) under several filters,
  a text search, ``count``, ``groups``, ``stats`` and ``select_ids``,
each through the store's async API (thread hop included). The baseline,
measured in the same run: the same pages as one plain ``ORDER BY ...
LIMIT/OFFSET`` query that leaves the plan to SQLite. It is as fast or faster
where the first matches sit at the top of any index, and slow where SQLite
sorts (one big integration) or walks past rows (deep pages, rare filters).

Usage: `python tests/bench/dlq.py [--rows N] [--path FILE] [--reuse]`
(`--reuse` skips the fill when FILE already holds the rows).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from nemesis.dlq import (
    DeadLetter,
    DeadLetterFilter,
    PageRequest,
    Reason,
    Status,
    dead_letter_id,
    open_sqlite_dlq,
)
from nemesis.dlq.signature import normalise_error, pattern_signature

NOW = 1_800_000_000.0
SPAN_S = 180 * 86400.0
INTEGRATIONS = [f"team-{i:03d}-sink" for i in range(200)]
# Zipf-like: the largest integration holds about a sixth of the rows, the tail a few hundred each.
WEIGHTS = [1 / (i + 1) ** 1.1 for i in range(len(INTEGRATIONS))]
REASONS: list[tuple[Reason, int | None, str, float]] = [
    (Reason.HTTP_4XX, 422, "422 missing field `city` in order {n}", 30),
    (Reason.HTTP_4XX, 400, "400 bad request: amount {n}.{n} is negative", 12),
    (Reason.HTTP_4XX, 409, "409 conflict: order {uuid} already settled", 8),
    (Reason.RETRIES_EXHAUSTED, 503, "503 Service Unavailable after {n} attempts", 18),
    (Reason.RETRIES_EXHAUSTED, None, "timeout after {n} ms (connect to 10.0.{n}.{n})", 8),
    (Reason.DECODE_ERROR, None, "invalid JSON at line {n} column {n}", 10),
    (Reason.VERDICT_DEAD, 200, "handler said dead: customer {hex} blocked", 8),
    (Reason.PIPELINE_ERROR, None, "stage enrich: KeyError 'region' in event {uuid}", 5),
    (Reason.GRPC_STATUS, None, "INVALID_ARGUMENT: sku {n} unknown", 1),
]
STATUSES = [(Status.DEAD, 85), (Status.REQUEUED, 10), (Status.DISCARDED, 5)]
NEEDLE = "needle-7f3a"  # in about one payload in 10,000

INSERT = (
    "INSERT INTO dlq_letters (id, integration, status, reason, http_status, signature,"
    " dead_lettered_us, first_failure_us, attempts, requeue_count, event_id, source_topic,"
    " source_partition, source_offset, msg_key, stage, payload_size, error, metadata, payload)"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
INSERT_SIGNATURE = (
    "INSERT OR IGNORE INTO dlq_signatures (signature, integration, reason, http_status,"
    " pattern, sample_error) VALUES (?, ?, ?, ?, ?, ?)"
)


def fill_text(template: str, rnd: random.Random) -> str:
    text = template
    while "{n}" in text:
        text = text.replace("{n}", str(rnd.randrange(1, 100_000)), 1)
    text = text.replace("{uuid}", str(uuid.UUID(int=rnd.getrandbits(128))))
    return text.replace("{hex}", f"{rnd.getrandbits(48):012x}")


def fill(path: Path, rows: int, batch: int = 50_000) -> float:
    """Writes ``rows`` dead letters with executemany (indexes dropped); returns seconds."""
    rnd = random.Random(7)
    signatures: dict[tuple[str, int], tuple[str, str]] = {}
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous=OFF")
    started = time.perf_counter()
    # Indexes are built once after the load (the store's open recreates them):
    # much faster than maintaining seven of them row by row.
    indexes = [
        name
        for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'dlq_letters'"
            " AND sql IS NOT NULL"
        )
    ]
    for name in indexes:
        conn.execute(f"DROP INDEX {name}")
    at_us = int((NOW - SPAN_S) * 1e6)
    step_us = int(SPAN_S * 1e6 / (rows * 0.8))  # a fifth of the rows do not advance the time
    for start in range(0, rows, batch):
        values: list[tuple[Any, ...]] = []
        new_signatures: list[tuple[Any, ...]] = []
        names = rnd.choices(INTEGRATIONS, WEIGHTS, k=batch)
        kinds = rnd.choices(range(len(REASONS)), [r[3] for r in REASONS], k=batch)
        states = rnd.choices([s for s, _ in STATUSES], [w for _, w in STATUSES], k=batch)
        for i in range(start, min(start + batch, rows)):
            name, kind, state = names[i - start], kinds[i - start], states[i - start]
            reason, http_status, template, _ = REASONS[kind]
            error = fill_text(template, rnd)
            if (name, kind) not in signatures:
                pattern = normalise_error(error)
                signature = pattern_signature(name, reason, http_status, pattern)
                signatures[name, kind] = (signature, pattern)
                new_signatures.append((signature, name, reason, http_status, pattern, error))
            signature, _pattern = signatures[name, kind]
            # One row in five shares its time with the previous one: ties for the keyset.
            if rnd.random() >= 0.2:
                at_us += rnd.randrange(1, 2 * step_us)
            offset = i
            event_id = f"orders:{i % 16}:{offset}"
            payload = orjson.dumps(
                {
                    "order_id": f"ord-{offset}",
                    "city": rnd.choice(["msk", "spb", "kzn", "ekb"]),
                    "amount": rnd.randrange(100, 100_000) / 100,
                    "customer": {"id": f"c-{rnd.randrange(10**6)}", "tier": "gold"},
                    "items": [{"sku": f"sku-{rnd.randrange(5000)}", "qty": 1}] * 3,
                    "note": NEEDLE if rnd.random() < 0.0001 else "x" * 60,
                }
            )
            values.append(
                (
                    dead_letter_id(name, event_id),
                    name,
                    state.value,
                    reason.value,
                    http_status,
                    signature,
                    at_us,
                    at_us - rnd.randrange(0, 3_600_000_000),
                    rnd.randrange(1, 5),
                    1 if state is Status.REQUEUED else 0,
                    event_id,
                    "orders",
                    i % 16,
                    offset,
                    f"key-{rnd.randrange(10**5)}",
                    None,
                    len(payload),
                    error,
                    '{"type":"order.created","source":"shop"}',
                    payload,
                )
            )
        conn.execute("BEGIN")
        conn.executemany(INSERT_SIGNATURE, new_signatures)
        conn.executemany(INSERT, values)
        conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return time.perf_counter() - started


async def timed(job: Callable[[], Awaitable[Any]], runs: int = 7) -> tuple[float, Any]:
    """Median milliseconds over ``runs`` after one warm-up, and the last result."""
    result = await job()
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        result = await job()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples), result


def _in_list(names: frozenset[str]) -> str:
    return f"integration IN ({','.join('?' * len(names))})"


def naive_page(path: Path, where: str, params: list[Any], offset: int) -> float:
    """The baseline: one plain query, SQLite's own index choice, OFFSET paging."""
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA cache_size=-65536")
    sql = (
        "SELECT id, integration, status, reason, error, payload FROM dlq_letters"
        f" WHERE {where} ORDER BY dead_lettered_us DESC, seq DESC LIMIT 50 OFFSET ?"
    )
    conn.execute(sql, [*params, offset]).fetchall()
    samples = []
    for _ in range(5):
        started = time.perf_counter()
        conn.execute(sql, [*params, offset]).fetchall()
        samples.append((time.perf_counter() - started) * 1000)
    conn.close()
    return statistics.median(samples)


async def create_schema(path: Path) -> None:
    store = await open_sqlite_dlq(path, retention_s=None)
    await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--path", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nemesis-dlq-bench-") as directory:
        path: Path = args.path or Path(directory) / "dlq.db"
        asyncio.run(create_schema(path))
        if not (args.reuse and path.stat().st_size > 1_000_000):
            seconds = fill(path, args.rows)
            print(f"fill: {args.rows:,} rows in {seconds:.1f}s ({args.rows / seconds:,.0f} rows/s)")
            started = time.perf_counter()
            asyncio.run(create_schema(path))
            print(f"indexes: built in {time.perf_counter() - started:.1f}s")
        print(f"file: {path} ({path.stat().st_size / 1e6:,.0f} MB)")
        asyncio.run(measure(path))


async def measure(path: Path) -> None:
    store = await open_sqlite_dlq(path, retention_s=None)
    try:
        total = await store.count(DeadLetterFilter())
        print(f"rows: {total:,}")
        ms, _ = await timed(partial(store.get, "0" * 32))
        print(f"round trip (get of a missing id, the floor of every call): {ms:.2f} ms")
        big = INTEGRATIONS[0]
        mid = INTEGRATIONS[20]
        team = frozenset(INTEGRATIONS[3:8])
        small = frozenset(INTEGRATIONS[190:195])
        filters = {
            "big integration, dead": DeadLetterFilter(
                integrations=frozenset({big}), status=Status.DEAD
            ),
            "big integration, any status": DeadLetterFilter(integrations=frozenset({big})),
            "mid integration, any status": DeadLetterFilter(integrations=frozenset({mid})),
            "5 integrations, dead": DeadLetterFilter(integrations=team, status=Status.DEAD),
            "5 small integrations, dead": DeadLetterFilter(integrations=small, status=Status.DEAD),
            "5 integrations, reason decode_error": DeadLetterFilter(
                integrations=team, reason=Reason.DECODE_ERROR
            ),
            "admin, reason + HTTP 409 + last 30 days": DeadLetterFilter(
                reason=Reason.HTTP_4XX, http_status=409, since=NOW - 30 * 86400
            ),
            "admin, no filter": DeadLetterFilter(),
        }
        ours: dict[str, float] = {}
        print("\nlist, first page of 50 (ms):")
        for label, where in filters.items():
            ms, page = await timed(partial(store.query, where, PageRequest(limit=50)))
            ours[label] = ms
            print(f"  {label:<44} {ms:8.1f}   ({len(page.rows)} rows)")

        print("\nlist, a page of 50 deep in the list (ms):")
        for label in ("big integration, dead", "admin, no filter"):
            where = filters[label]
            cursor = None
            for _ in range(200):  # 200 pages of 500: 100,000 rows deep
                page = await store.query(where, PageRequest(limit=500, cursor=cursor))
                cursor = page.next_cursor
            ms, page = await timed(
                partial(store.query, where, PageRequest(limit=50, cursor=cursor))
            )
            ours[label + ", 100,000 rows deep"] = ms
            print(f"  {label + ', 100,000 rows deep':<44} {ms:8.1f}   ({len(page.rows)} rows)")

        print("\ntext search, first page of 50 (ms):")
        searches = {
            "big integration, 'city' (everywhere)": DeadLetterFilter(
                integrations=frozenset({big}), text="city"
            ),
            f"big integration, {NEEDLE!r} (rare)": DeadLetterFilter(
                integrations=frozenset({big}), text=NEEDLE
            ),
            "admin, 'no such text' (scan bound)": DeadLetterFilter(text="no such text"),
        }
        for label, where in searches.items():
            ms, page = await timed(partial(store.query, where, PageRequest(limit=50)))
            more = "more" if page.next_cursor else "end"
            print(f"  {label:<44} {ms:8.1f}   ({len(page.rows)} rows, {more})")

        print("\ncount (ms):")
        for label in ("big integration, dead", "5 integrations, dead", "admin, no filter"):
            ms, n = await timed(partial(store.count, filters[label]))
            print(f"  {label:<44} {ms:8.1f}   ({n:,})")
        dead = DeadLetterFilter(status=Status.DEAD)
        ms, n = await timed(partial(store.count, dead))
        print(f"  {'admin, dead':<44} {ms:8.1f}   ({n:,})")

        print("\ngroups (ms):")
        for label, where in (
            ("admin, dead", dead),
            ("5 integrations, dead", filters["5 integrations, dead"]),
            ("big integration, dead", filters["big integration, dead"]),
        ):
            ms, groups = await timed(partial(store.groups, where, limit=50))
            top = groups[0] if groups else None
            detail = f"{len(groups)} groups, top {top.count:,}: {top.pattern}" if top else "none"
            print(f"  {label:<44} {ms:8.1f}   ({detail})")

        print("\nstats (ms):")
        for label, where in (
            ("admin, dead", dead),
            ("5 integrations, dead", filters["5 integrations, dead"]),
        ):
            ms, stats = await timed(partial(store.stats, where, now=NOW), runs=3)
            print(f"  {label:<44} {ms:8.1f}   ({stats.total:,} rows)")

        print("\nselect_ids for a bulk action (ms):")
        where = filters["big integration, dead"]
        ms, ids = await timed(partial(store.select_ids, where, 100_000), runs=3)
        print(f"  {'big integration, dead, 100,000 ids':<44} {ms:8.1f}   ({len(ids):,} ids)")

        print(
            "\nbaseline: the same pages as one plain SQL query with SQLite's own plan and"
            "\nLIMIT/OFFSET, on its own connection (no thread hop, no row decoding) (ms):"
        )
        for label, sql, params, offset in (
            ("5 integrations, dead", _in_list(team) + " AND status = 'dead'", sorted(team), 0),
            (
                "5 small integrations, dead",
                _in_list(small) + " AND status = 'dead'",
                sorted(small),
                0,
            ),
            ("big integration, any status", "integration = ?", [big], 0),
            (
                "big integration, dead, 100,000 rows deep",
                "integration = ? AND status = 'dead'",
                [big],
                100_000,
            ),
            ("admin, no filter, 100,000 rows deep", "1", [], 100_000),
        ):
            naive_ms = naive_page(path, sql, params, offset)
            print(
                f"  {label:<44} {naive_ms:8.1f}   (plain / store = {naive_ms / ours[label]:.1f}x)"
            )

        print("\nput, 10,000 new letters in batches of 500 (ms per batch):")
        rnd = random.Random(11)
        letters = [
            DeadLetter(
                integration=rnd.choice(INTEGRATIONS),
                event_id=f"bench:0:{i}",
                payload=b'{"order_id": "ord-1", "city": "msk"}',
                reason=Reason.HTTP_4XX,
                error=fill_text("422 missing field `city` in order {n}", rnd),
                source_topic="bench",
                source_partition=0,
                source_offset=i,
                http_status=422,
            )
            for i in range(10_000)
        ]
        started = time.perf_counter()
        for i in range(0, len(letters), 500):
            await store.put(letters[i : i + 500])
        seconds = time.perf_counter() - started
        print(f"  {seconds / 20 * 1000:.1f} ms per batch, {len(letters) / seconds:,.0f} letters/s")
    finally:
        await store.close()


if __name__ == "__main__":
    main()
