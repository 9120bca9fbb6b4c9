"""The state store's logic, once, over a SQL connection; each store brings its queries.

A store (``nemesis.fleet.sqlite``; a PostgreSQL one is the same shape) is a
subclass of ``SqlStateStore`` that gives:

- ``queries``: a ``Queries`` of its SQL text (its placeholder style, its
  types in the schema); the statements are plain SQL both SQLite and
  PostgreSQL run (``INSERT ... ON CONFLICT DO NOTHING``, no ``RETURNING``,
  no upsert of several columns), so a new store mostly swaps placeholders;
- ``_transaction(job, write=...)``: runs ``job(tx)`` in one transaction (a
  read-only one for ``write=False``) and returns its result, where ``tx``
  is a ``Tx`` (``execute`` returns the row count, ``query`` the rows).

Times are float seconds since the epoch: a store keeps them at double
precision (``REAL`` in SQLite, ``DOUBLE PRECISION`` in PostgreSQL, whose
``REAL`` is too coarse). Override values are JSON text.

Everything else lives here: when the generation moves, how an expired
member is forgotten, how values travel as JSON, how rows become the
port's values. The jobs are synchronous functions, run wherever the store
runs its connection (a worker thread for SQLite).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson

from nemesis.fleet import logins, reports, revocations
from nemesis.fleet.port import (
    MAX_LOGIN_ROWS,
    MAX_REVOKED_ROWS,
    Assignment,
    FleetView,
    Member,
    MemberInfo,
    StoredOverride,
    StoredReport,
    Tx,
)

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Queries:
    """A store's SQL, one statement each; parameters are positional, in the order named."""

    schema: tuple[str, ...]  # CREATE TABLE IF NOT EXISTS ..., then the generation row
    generation: str  # -> (generation)
    bump: str  # generation += 1
    member_draining: str  # (member_id) -> (draining)
    update_member: str  # (host, pid, started_at, heartbeat_at, lease_until, draining, member_id)
    insert_member: str  # (member_id, host, pid, started_at, heartbeat_at, lease_until, draining)
    expired_members: str  # (now) -> (member_id)
    delete_member: str  # (member_id)
    delete_member_assignments: str  # (member_id)
    members: str  # -> (member_id, host, pid, started_at, heartbeat_at, lease_until, draining)
    assignments: str  # -> (integration, member_id, since)
    insert_assignment: str  # (integration, member_id, since); nothing when it exists
    delete_assignment: str  # (integration, member_id)
    overrides: str  # -> (integration, field, value, version, set_by, set_at)
    delete_override: str  # (integration, field)
    delete_override_at: str  # (integration, field, version)
    delete_overrides: str  # (integration)
    insert_override: str  # (integration, field, value, version, set_by, set_at)


class SqlStateStore(abc.ABC):
    """The ``StateStore`` port over any SQL store that provides its queries and transactions."""

    queries: Queries
    revocation_queries: revocations.RevocationQueries  # the viewer's signed-out sessions
    login_queries: logins.LoginQueries  # the viewer's failed sign-ins and spent sign-in forms
    report_queries: reports.ReportQueries  # what each member runs, for the team console

    @property
    @abc.abstractmethod
    def location(self) -> str:
        """Where the store is, in words."""

    @abc.abstractmethod
    async def _transaction(self, job: Callable[[Tx], T], *, write: bool = True) -> T:
        """Runs ``job`` in one transaction, rolled back if it raises (``write=False``: reads)."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Closes the store's connection."""

    def _create_schema(self, tx: Tx) -> None:
        for statement in self.schema():
            tx.execute(statement)

    def schema(self) -> tuple[str, ...]:
        """Every statement that creates this store's tables."""
        return (
            *self.queries.schema,
            *self.revocation_queries.schema,
            *self.login_queries.schema,
            *self.report_queries.schema,
        )

    # --- the port -----------------------------------------------------------------

    async def generation(self) -> int:
        return await self._transaction(self._generation, write=False)

    async def heartbeat(self, member: MemberInfo, *, now: float, lease_s: float) -> int:
        q = self.queries

        def job(tx: Tx) -> int:
            fields = (member.host, member.pid, member.started_at, now, now + lease_s)
            draining = int(member.draining)
            known = tx.query(q.member_draining, (member.member_id,))
            if known:
                tx.execute(q.update_member, (*fields, draining, member.member_id))
            else:
                tx.execute(q.insert_member, (member.member_id, *fields, draining))
            # A new member, or one that starts draining, is news to the others; a renewal is not.
            changed = not known or bool(known[0][0]) != member.draining
            expired = [row[0] for row in tx.query(q.expired_members, (now,))]
            changed |= self._forget(tx, expired)
            return self._bumped(tx) if changed else self._generation(tx)

        return await self._transaction(job)

    async def forget(self, member_ids: Collection[str]) -> int:
        def job(tx: Tx) -> int:
            return self._bumped(tx) if self._forget(tx, member_ids) else self._generation(tx)

        return await self._transaction(job)

    async def view(self) -> FleetView:
        q = self.queries

        def job(tx: Tx) -> FleetView:
            return FleetView(
                generation=self._generation(tx),
                members=tuple(
                    Member(str(m), str(h), int(p), float(s), float(b), float(u), bool(d))
                    for m, h, p, s, b, u, d in tx.query(q.members)
                ),
                assignments=tuple(
                    Assignment(str(i), str(m), float(s)) for i, m, s in tx.query(q.assignments)
                ),
                overrides=tuple(
                    StoredOverride(str(i), str(f), orjson.loads(v), int(n), str(b), float(t))
                    for i, f, v, n, b, t in tx.query(q.overrides)
                ),
            )

        return await self._transaction(job, write=False)

    async def assign(self, integration: str, member_id: str, *, now: float) -> None:
        q = self.queries

        def job(tx: Tx) -> None:
            if tx.execute(q.insert_assignment, (integration, member_id, now)):
                self._bumped(tx)

        await self._transaction(job)

    async def unassign(self, integration: str, member_id: str) -> None:
        q = self.queries

        def job(tx: Tx) -> None:
            if tx.execute(q.delete_assignment, (integration, member_id)):
                self._bumped(tx)

        await self._transaction(job)

    async def leave(self, member_id: str) -> None:
        await self.forget([member_id])

    async def set_overrides(
        self,
        integration: str,
        values: Mapping[str, Any],
        *,
        cleared: Collection[str] = (),
        set_by: str,
        now: float,
    ) -> int:
        q = self.queries
        encoded = {field: orjson.dumps(value).decode() for field, value in values.items()}

        def job(tx: Tx) -> int:
            version = self._bumped(tx)
            for field in (*encoded, *cleared):
                tx.execute(q.delete_override, (integration, field))
            for field, value in encoded.items():
                tx.execute(q.insert_override, (integration, field, value, version, set_by, now))
            return version

        return await self._transaction(job)

    async def clear_overrides(
        self, integration: str, fields: Collection[str] | None = None
    ) -> None:
        q = self.queries

        def job(tx: Tx) -> None:
            if fields is None:
                deleted = tx.execute(q.delete_overrides, (integration,))
            else:
                deleted = sum(tx.execute(q.delete_override, (integration, f)) for f in fields)
            if deleted:
                self._bumped(tx)

        await self._transaction(job)

    async def drop_caught_up(self, integration: str, versions: Mapping[str, int]) -> None:
        q = self.queries

        def job(tx: Tx) -> None:
            deleted = sum(
                tx.execute(q.delete_override_at, (integration, field, version))
                for field, version in versions.items()
            )
            if deleted:
                self._bumped(tx)

        await self._transaction(job)

    # --- the logic's pieces -------------------------------------------------------

    def _generation(self, tx: Tx) -> int:
        rows = tx.query(self.queries.generation)
        return int(rows[0][0]) if rows else 0

    def _bumped(self, tx: Tx) -> int:
        tx.execute(self.queries.bump)
        return self._generation(tx)

    def _forget(self, tx: Tx, member_ids: Collection[str]) -> bool:
        q = self.queries
        gone = 0
        for member_id in member_ids:
            tx.execute(q.delete_member_assignments, (member_id,))
            reports.forget(tx, self.report_queries, member_id)
            gone += tx.execute(q.delete_member, (member_id,))
        return gone > 0

    # --- the viewer's signed-out sessions (nemesis.fleet.revocations) ---------------

    async def revoke_session(
        self,
        session_id: str,
        expires_at: float,
        *,
        now: float,
        max_rows: int = MAX_REVOKED_ROWS,
    ) -> int:
        q = self.revocation_queries

        def job(tx: Tx) -> int:
            return revocations.revoke(tx, q, session_id, expires_at, now=now, max_rows=max_rows)

        return await self._transaction(job)

    async def session_revoked_until(self, session_id: str, *, now: float) -> float | None:
        q = self.revocation_queries

        def job(tx: Tx) -> float | None:
            return revocations.revoked_until(tx, q, session_id, now=now)

        return await self._transaction(job, write=False)

    # --- the viewer's failed sign-ins and spent sign-in forms (nemesis.fleet.logins) ------

    async def login_failures(
        self, keys: Sequence[str], *, since: float
    ) -> dict[str, tuple[int, float]]:
        q = self.login_queries

        def job(tx: Tx) -> dict[str, tuple[int, float]]:
            return logins.failures(tx, q, keys, since=since)

        return await self._transaction(job, write=False)

    async def login_failed(
        self, keys: Sequence[str], *, now: float, since: float, max_rows: int = MAX_LOGIN_ROWS
    ) -> dict[str, int]:
        q = self.login_queries

        def job(tx: Tx) -> dict[str, int]:
            return logins.failed(tx, q, keys, now=now, since=since, max_rows=max_rows)

        return await self._transaction(job)

    async def login_succeeded(self, keys: Sequence[str]) -> None:
        q = self.login_queries

        def job(tx: Tx) -> None:
            logins.succeeded(tx, q, keys)

        await self._transaction(job)

    async def spend_login_nonce(
        self, nonce: str, expires_at: float, *, now: float, max_rows: int = MAX_LOGIN_ROWS
    ) -> bool:
        q = self.login_queries

        def job(tx: Tx) -> bool:
            return logins.spend_nonce(tx, q, nonce, expires_at, now=now, max_rows=max_rows)

        return await self._transaction(job)

    # --- the members' reports, for the team console (nemesis.fleet.reports) ---------

    async def publish_reports(
        self, member_id: str, reports_: Mapping[str, Mapping[str, Any]], *, now: float
    ) -> None:
        q = self.report_queries

        def job(tx: Tx) -> None:
            reports.publish(tx, q, member_id, reports_, now=now)

        await self._transaction(job)

    async def reports(self) -> tuple[StoredReport, ...]:
        q = self.report_queries

        def job(tx: Tx) -> tuple[StoredReport, ...]:
            return reports.read(tx, q)

        return await self._transaction(job, write=False)
