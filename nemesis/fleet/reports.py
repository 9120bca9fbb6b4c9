"""Each replica's report of the integrations it runs, in the state store, for the team console.

A replica knows the live state of what it runs (lag, rates, the breaker,
retry backlogs); nobody else does, and in a fleet no one replica runs
everything. So every member writes, every few seconds, one row per
integration it runs: ``(integration, member_id)`` its primary key, the
time, and the report as JSON text (``nemesis.runtime.reports`` builds it).
The DLQ viewer reads every row (one query) and adds up a team's
integrations across the replicas that run them, wherever the viewer runs:
beside a proxy, alone, on one host or many. It reaches no replica directly,
so it needs no address of theirs and no credential for their admin APIs.

A member replaces all of its rows in one transaction (the integrations it
no longer runs drop out); a member that leaves or is forgotten takes its
rows with it. A row is written without moving the generation: reports are
not news the fleet's members wait for. A report older than a few of its
own periods is stale (its replica stopped writing); the viewer says so.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import orjson

from nemesis.fleet.port import StoredReport, Tx

TABLE: Final = "fleet_reports"


@dataclass(frozen=True, slots=True)
class ReportQueries:
    """A kind's statements for reports; positional parameters in the order named."""

    schema: tuple[str, ...]  # CREATE TABLE IF NOT EXISTS ...
    insert: str  # (integration, member_id, at, body)
    delete_member: str  # (member_id)
    select: str  # -> (integration, member_id, at, body)


def _sql(table: str, *, text: str, real: str) -> ReportQueries:
    """The statements SQLite and PostgreSQL share (``?`` placeholders), for ``table``."""
    return ReportQueries(
        schema=(
            f"CREATE TABLE IF NOT EXISTS {table} (\n"
            f"    integration {text} NOT NULL,\n"
            f"    member_id {text} NOT NULL,\n"
            f"    at {real} NOT NULL,\n"
            "    body text NOT NULL,\n"
            "    PRIMARY KEY (integration, member_id)\n)",
        ),
        insert=f"INSERT INTO {table} (integration, member_id, at, body) VALUES (?, ?, ?, ?)",
        delete_member=f"DELETE FROM {table} WHERE member_id = ?",
        select=f"SELECT integration, member_id, at, body FROM {table}"
        " ORDER BY integration, member_id",
    )


SQLITE_REPORTS: Final = _sql(TABLE, text="TEXT", real="REAL")


def postgres_reports(numbered: Callable[[str], str]) -> ReportQueries:
    """PostgreSQL's: the SQLite statements with ``numbered`` placeholders and its own types."""
    typed = _sql(TABLE, text='text COLLATE "C"', real="double precision")
    return ReportQueries(
        schema=typed.schema,
        insert=numbered(typed.insert),
        delete_member=numbered(typed.delete_member),
        select=typed.select,
    )


def ydb_reports(directory: str) -> ReportQueries:
    """YDB's, the table ``reports`` under ``directory``; parameters ``$p0, $p1, ...``."""
    table = f"`{directory.strip('/')}/reports`"
    return ReportQueries(
        schema=(
            f"CREATE TABLE IF NOT EXISTS {table} (\n"
            "    `integration` Utf8 NOT NULL,\n"
            "    `member_id` Utf8 NOT NULL,\n"
            "    `at` Double NOT NULL,\n"
            "    `body` Utf8 NOT NULL,\n"
            "    PRIMARY KEY (`integration`, `member_id`)\n)",
        ),
        insert="DECLARE $p0 AS Utf8;\nDECLARE $p1 AS Utf8;\nDECLARE $p2 AS Double;\n"
        "DECLARE $p3 AS Utf8;\n"
        f"UPSERT INTO {table} (`integration`, `member_id`, `at`, `body`)"
        " VALUES ($p0, $p1, $p2, $p3);",
        delete_member=f"DECLARE $p0 AS Utf8;\nDELETE FROM {table} WHERE member_id = $p0;",
        select=f"SELECT integration, member_id, at, body FROM {table}"
        " ORDER BY integration, member_id;",
    )


def publish(
    tx: Tx,
    q: ReportQueries,
    member_id: str,
    reports: Mapping[str, Mapping[str, Any]],
    *,
    now: float,
) -> None:
    """Replaces every report of ``member_id`` with ``reports`` (integration -> JSON-able body)."""
    tx.execute(q.delete_member, (member_id,))
    for integration, body in sorted(reports.items()):
        tx.execute(q.insert, (integration, member_id, now, orjson.dumps(body).decode()))


def forget(tx: Tx, q: ReportQueries, member_id: str) -> None:
    """Deletes the reports of a member that left or was forgotten."""
    tx.execute(q.delete_member, (member_id,))


def read(tx: Tx, q: ReportQueries) -> tuple[StoredReport, ...]:
    """Every stored report; a body that is not a JSON object is left out."""
    found = []
    for integration, member_id, at, body in tx.query(q.select):
        try:
            decoded = orjson.loads(body)
        except orjson.JSONDecodeError:
            continue
        if isinstance(decoded, dict):
            found.append(StoredReport(str(integration), str(member_id), float(at), decoded))
    return tuple(found)
