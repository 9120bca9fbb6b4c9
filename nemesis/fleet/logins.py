"""The DLQ viewer's failed sign-ins and spent sign-in forms, shared by every replica.

The viewer slows guessing (``dlq_viewer.auth``): each key (a user name and
client address, a client address, a browser the user signed in on) counts
its failed sign-ins, and after a few each try waits longer. Counted in one
process, every replica would grant its own free guesses; counted here, the
fleet grants them once. A sign-in form's nonce is spent here too, so a form
posted once cannot be posted again on any replica.

Two small tables in each store kind, created with the fleet's other tables:

- failures: ``key`` (a hash the viewer makes: no user name or address is
  stored), ``failures`` and ``last_at``, the time of the latest one. A key
  quiet since ``since`` starts over; each failure deletes up to
  ``STALE_PER_CALL`` such rows. When ``max_rows`` are still stored, the
  least recently failed keys make room (as one process forgets them);
- spent nonces: ``nonce`` and ``expires_at``, when the form would have
  expired anyway; each spend deletes up to ``STALE_PER_CALL`` expired rows,
  and when ``max_rows`` are still stored, the soonest to expire make room.

The jobs run in one store transaction each; the statements are each kind's
own (``LoginQueries``), the logic is once, below.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from nemesis.fleet.port import Tx

STALE_PER_CALL: Final = 32  # stale rows one call deletes, and live ones it evicts, at most
FAILURES_TABLE: Final = "fleet_login_failures"
NONCES_TABLE: Final = "fleet_login_nonces"


@dataclass(frozen=True, slots=True)
class LoginQueries:
    """A kind's statements for sign-in counts and nonces; positional parameters as named."""

    schema: tuple[str, ...]  # CREATE TABLE IF NOT EXISTS ...
    failures: str  # (key) -> (failures, last_at)
    insert_failures: str  # (key, failures, last_at); the key has no row
    delete_failures: str  # (key)
    failure_rows: str  # -> (rows)
    stale_failures: str  # (since) -> (key) of rows with last_at <= since, oldest first
    oldest_failures: str  # -> (key), the least recently failed first
    nonce: str  # (nonce) -> (expires_at)
    insert_nonce: str  # (nonce, expires_at); the nonce has no row
    delete_nonce: str  # (nonce)
    nonce_rows: str  # -> (rows)
    expired_nonces: str  # (now) -> (nonce) of rows with expires_at <= now, soonest first
    soonest_nonces: str  # -> (nonce), the soonest to expire first


def _sql(*, text: str, real: str, integer: str) -> LoginQueries:
    """The statements SQLite and PostgreSQL share (``?`` placeholders)."""
    f, n = FAILURES_TABLE, NONCES_TABLE
    return LoginQueries(
        schema=(
            f"CREATE TABLE IF NOT EXISTS {f} (\n    key {text} PRIMARY KEY,\n"
            f"    failures {integer} NOT NULL,\n    last_at {real} NOT NULL\n)",
            f"CREATE INDEX IF NOT EXISTS {f}_last ON {f} (last_at)",
            f"CREATE TABLE IF NOT EXISTS {n} (\n    nonce {text} PRIMARY KEY,\n"
            f"    expires_at {real} NOT NULL\n)",
            f"CREATE INDEX IF NOT EXISTS {n}_expiry ON {n} (expires_at)",
        ),
        failures=f"SELECT failures, last_at FROM {f} WHERE key = ?",
        insert_failures=f"INSERT INTO {f} (key, failures, last_at) VALUES (?, ?, ?)",
        delete_failures=f"DELETE FROM {f} WHERE key = ?",
        failure_rows=f"SELECT COUNT(*) FROM {f}",
        stale_failures=f"SELECT key FROM {f} WHERE last_at <= ? ORDER BY last_at"
        f" LIMIT {STALE_PER_CALL}",
        oldest_failures=f"SELECT key FROM {f} ORDER BY last_at LIMIT {STALE_PER_CALL}",
        nonce=f"SELECT expires_at FROM {n} WHERE nonce = ?",
        insert_nonce=f"INSERT INTO {n} (nonce, expires_at) VALUES (?, ?)",
        delete_nonce=f"DELETE FROM {n} WHERE nonce = ?",
        nonce_rows=f"SELECT COUNT(*) FROM {n}",
        expired_nonces=f"SELECT nonce FROM {n} WHERE expires_at <= ? ORDER BY expires_at"
        f" LIMIT {STALE_PER_CALL}",
        soonest_nonces=f"SELECT nonce FROM {n} ORDER BY expires_at LIMIT {STALE_PER_CALL}",
    )


SQLITE_LOGINS: Final = _sql(text="TEXT", real="REAL", integer="INTEGER")


def postgres_logins(numbered: Callable[[str], str]) -> LoginQueries:
    """PostgreSQL's: the SQLite statements with ``numbered`` placeholders and its own types."""
    typed = _sql(text='text COLLATE "C"', real="double precision", integer="bigint")
    return LoginQueries(
        schema=typed.schema,
        **{
            name: numbered(getattr(typed, name))
            for name in LoginQueries.__dataclass_fields__
            if name != "schema"
        },
    )


def ydb_logins(directory: str) -> LoginQueries:
    """YDB's: tables ``login_failures`` and ``login_nonces`` under ``directory``."""
    base = directory.strip("/")
    f, n = f"`{base}/login_failures`", f"`{base}/login_nonces`"
    utf8 = "DECLARE $p0 AS Utf8;\n"
    return LoginQueries(
        schema=(
            f"CREATE TABLE IF NOT EXISTS {f} (\n    `key` Utf8 NOT NULL,\n"
            "    `failures` Int64 NOT NULL,\n    `last_at` Double NOT NULL,\n"
            "    PRIMARY KEY (`key`)\n)",
            f"CREATE TABLE IF NOT EXISTS {n} (\n    `nonce` Utf8 NOT NULL,\n"
            "    `expires_at` Double NOT NULL,\n    PRIMARY KEY (`nonce`)\n)",
        ),
        failures=f"{utf8}SELECT failures, last_at FROM {f} WHERE key = $p0;",
        insert_failures=f"{utf8}DECLARE $p1 AS Int64;\nDECLARE $p2 AS Double;\n"
        f"UPSERT INTO {f} (`key`, `failures`, `last_at`) VALUES ($p0, $p1, $p2);",
        delete_failures=f"{utf8}DELETE FROM {f} WHERE key = $p0;",
        failure_rows=f"SELECT COUNT(*) AS n FROM {f};",
        stale_failures="DECLARE $p0 AS Double;\n"
        f"SELECT key FROM {f} WHERE last_at <= $p0 ORDER BY last_at LIMIT {STALE_PER_CALL};",
        oldest_failures=f"SELECT key FROM {f} ORDER BY last_at LIMIT {STALE_PER_CALL};",
        nonce=f"{utf8}SELECT expires_at FROM {n} WHERE nonce = $p0;",
        insert_nonce=f"{utf8}DECLARE $p1 AS Double;\n"
        f"UPSERT INTO {n} (`nonce`, `expires_at`) VALUES ($p0, $p1);",
        delete_nonce=f"{utf8}DELETE FROM {n} WHERE nonce = $p0;",
        nonce_rows=f"SELECT COUNT(*) AS n FROM {n};",
        expired_nonces="DECLARE $p0 AS Double;\n"
        f"SELECT nonce FROM {n} WHERE expires_at <= $p0 ORDER BY expires_at"
        f" LIMIT {STALE_PER_CALL};",
        soonest_nonces=f"SELECT nonce FROM {n} ORDER BY expires_at LIMIT {STALE_PER_CALL};",
    )


def failures(
    tx: Tx, q: LoginQueries, keys: Sequence[str], *, since: float
) -> dict[str, tuple[int, float]]:
    """Each key's failures and the time of its latest, for keys that failed after ``since``."""
    found = {}
    for key in keys:
        rows = tx.query(q.failures, (key,))
        if rows and float(rows[0][1]) > since:
            found[key] = (int(rows[0][0]), float(rows[0][1]))
    return found


def failed(
    tx: Tx, q: LoginQueries, keys: Sequence[str], *, now: float, since: float, max_rows: int
) -> dict[str, int]:
    """Counts one failure at ``now`` for each key (one quiet since ``since`` starts over)."""
    for (stale,) in tx.query(q.stale_failures, (since,)):
        tx.execute(q.delete_failures, (stale,))
    counts = {}
    for key in keys:
        rows = tx.query(q.failures, (key,))
        before = int(rows[0][0]) if rows and float(rows[0][1]) > since else 0
        if rows:
            tx.execute(q.delete_failures, (key,))
        else:
            _make_room(tx, q.failure_rows, q.oldest_failures, q.delete_failures, max_rows)
        tx.execute(q.insert_failures, (key, before + 1, now))
        counts[key] = before + 1
    return counts


def succeeded(tx: Tx, q: LoginQueries, keys: Sequence[str]) -> None:
    """Forgets the failures of ``keys``."""
    for key in keys:
        tx.execute(q.delete_failures, (key,))


def spend_nonce(
    tx: Tx, q: LoginQueries, nonce: str, expires_at: float, *, now: float, max_rows: int
) -> bool:
    """Spends a sign-in form's nonce: True the first time, False when it was spent before."""
    for (expired,) in tx.query(q.expired_nonces, (now,)):
        tx.execute(q.delete_nonce, (expired,))
    if tx.query(q.nonce, (nonce,)):
        return False
    _make_room(tx, q.nonce_rows, q.soonest_nonces, q.delete_nonce, max_rows)
    tx.execute(q.insert_nonce, (nonce, expires_at))
    return True


def _make_room(tx: Tx, count: str, first: str, delete: str, max_rows: int) -> None:
    rows = int(tx.query(count)[0][0])
    if rows >= max_rows:
        for (victim,) in tx.query(first)[: rows - max_rows + 1]:
            tx.execute(delete, (victim,))
