"""Signed-out viewer sessions in the state store, so that every replica refuses them.

The DLQ viewer signs browsers in with a cookie that carries a session id
and an expiry. Signing out records the id here until that expiry; every
replica, and a viewer running on its own over the same configuration, asks
the store before it accepts a cookie (``dlq_viewer.auth`` holds the
viewer's side: what it remembers locally, what it does when the store does
not answer).

One small table (``session_id`` its primary key, ``expires_at``) in each
store kind, created with the fleet's other tables. A row is useless once
its cookie has expired: each ``revoke`` deletes up to
``EXPIRED_PER_REVOKE`` such rows, the soonest expired first, so the table
is trimmed by the sign-outs that grow it and no timer is needed. The rows
are bounded too (``nemesis.fleet.port.MAX_REVOKED_ROWS``): a revoke that finds the table full
deletes the rows whose cookies expire soonest to make room and stores its
own, so the newest revocation is always kept; the caller learns how many
it pushed out (and logs it), so a forgotten revocation is never silent.

The jobs run in one store transaction each; the statements here are each
kind's own (``RevocationQueries``), the logic is once, below. SQLite and
PostgreSQL index the expiry; YDB scans the table (at most ``MAX_REVOKED_ROWS``
rows, once per sign-out) rather than pay for a secondary index on every
write. Checking a cookie is one read by primary key everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from nemesis.fleet.port import Tx

EXPIRED_PER_REVOKE: Final = 32  # expired rows one revoke deletes, at most
EVICTED_PER_REVOKE: Final = 32  # live rows one revoke deletes to make room, at most


@dataclass(frozen=True, slots=True)
class RevocationQueries:
    """A kind's statements for revoked sessions; positional parameters in the order named."""

    schema: tuple[str, ...]  # CREATE TABLE IF NOT EXISTS ...
    revoked_until: str  # (session_id, now) -> (expires_at) of a live revocation
    insert: str  # (session_id, expires_at); an existing row is kept or overwritten alike
    count: str  # -> (rows)
    expired: str  # (now) -> (session_id), the soonest expired first, EXPIRED_PER_REVOKE at most
    soonest: str  # -> (session_id), the soonest to expire first, EVICTED_PER_REVOKE at most
    delete: str  # (session_id)


TABLE: Final = "fleet_revoked_sessions"


def _sql(table: str, *, text: str, real: str) -> RevocationQueries:
    """The statements SQLite and PostgreSQL share (``?`` placeholders), for ``table``."""
    return RevocationQueries(
        schema=(
            f"CREATE TABLE IF NOT EXISTS {table} (\n"
            f"    session_id {text} PRIMARY KEY,\n"
            f"    expires_at {real} NOT NULL\n)",
            f"CREATE INDEX IF NOT EXISTS {table}_expiry ON {table} (expires_at)",
        ),
        revoked_until=f"SELECT expires_at FROM {table} WHERE session_id = ? AND expires_at > ?",
        insert=f"INSERT INTO {table} (session_id, expires_at) VALUES (?, ?) ON CONFLICT DO NOTHING",
        count=f"SELECT COUNT(*) FROM {table}",
        expired=f"SELECT session_id FROM {table} WHERE expires_at <= ?"
        f" ORDER BY expires_at LIMIT {EXPIRED_PER_REVOKE}",
        soonest=f"SELECT session_id FROM {table} ORDER BY expires_at LIMIT {EVICTED_PER_REVOKE}",
        delete=f"DELETE FROM {table} WHERE session_id = ?",
    )


SQLITE_REVOCATIONS: Final = _sql(TABLE, text="TEXT", real="REAL")


def postgres_revocations(numbered: Callable[[str], str]) -> RevocationQueries:
    """PostgreSQL's: the SQLite statements with ``numbered`` placeholders and its own types."""
    typed = _sql(TABLE, text='text COLLATE "C"', real="double precision")
    return RevocationQueries(
        schema=typed.schema,
        revoked_until=numbered(typed.revoked_until),
        insert=numbered(typed.insert),
        count=typed.count,
        expired=numbered(typed.expired),
        soonest=typed.soonest,
        delete=numbered(typed.delete),
    )


def ydb_revocations(directory: str) -> RevocationQueries:
    """YDB's, the table ``revoked_sessions`` under ``directory``; parameters ``$p0, $p1``."""
    table = f"`{directory.strip('/')}/revoked_sessions`"
    return RevocationQueries(
        schema=(
            f"CREATE TABLE IF NOT EXISTS {table} (\n"
            "    `session_id` Utf8 NOT NULL,\n"
            "    `expires_at` Double NOT NULL,\n"
            "    PRIMARY KEY (`session_id`)\n)",
        ),
        revoked_until="DECLARE $p0 AS Utf8;\nDECLARE $p1 AS Double;\n"
        f"SELECT expires_at FROM {table} WHERE session_id = $p0 AND expires_at > $p1;",
        insert="DECLARE $p0 AS Utf8;\nDECLARE $p1 AS Double;\n"
        f"UPSERT INTO {table} (`session_id`, `expires_at`) VALUES ($p0, $p1);",
        count=f"SELECT COUNT(*) AS n FROM {table};",
        expired="DECLARE $p0 AS Double;\n"
        f"SELECT session_id FROM {table} WHERE expires_at <= $p0"
        f" ORDER BY expires_at LIMIT {EXPIRED_PER_REVOKE};",
        soonest=f"SELECT session_id FROM {table} ORDER BY expires_at LIMIT {EVICTED_PER_REVOKE};",
        delete=f"DECLARE $p0 AS Utf8;\nDELETE FROM {table} WHERE session_id = $p0;",
    )


def revoke(
    tx: Tx,
    q: RevocationQueries,
    session_id: str,
    expires_at: float,
    *,
    now: float,
    max_rows: int,
) -> int:
    """Stores the revocation; returns how many live ones it pushed out to stay within ``max_rows``.

    Deletes expired rows first (a bounded number), then, when the table is
    still full, the rows whose cookies expire soonest.
    """
    for (expired,) in tx.query(q.expired, (now,)):
        tx.execute(q.delete, (expired,))
    if tx.query(q.revoked_until, (session_id, now)):
        return 0  # revoked already (signed out twice, or a replica's retry)
    rows = int(tx.query(q.count)[0][0])
    evicted = 0
    if rows >= max_rows:
        for (victim,) in tx.query(q.soonest)[: rows - max_rows + 1]:
            tx.execute(q.delete, (victim,))
            evicted += 1
    tx.execute(q.insert, (session_id, expires_at))
    return evicted


def revoked_until(tx: Tx, q: RevocationQueries, session_id: str, *, now: float) -> float | None:
    """When the revocation of ``session_id`` ends, or None when it is not revoked (or expired)."""
    rows = tx.query(q.revoked_until, (session_id, now))
    return float(rows[0][0]) if rows else None
