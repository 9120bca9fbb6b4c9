"""The fleet's state store port: members, assignments, live overrides and a generation.

Replicas of one ``nemesis run`` configuration share one state store. What it
holds, and what each part means:

- **members**: one row per running replica (``Member``): who it is (host,
  pid, when it started), its last heartbeat and its lease expiry. A member
  renews its lease every third of the lease time; a row whose lease has
  expired belongs to a replica that died without saying goodbye, and the
  first member to notice deletes it (with its assignments). A member that
  is shutting down marks itself ``draining``: it takes no new integration
  and hands its own over once each has drained.
- **assignments**: which member runs which integration *now* (a member adds
  its row before it starts an integration and removes it once the
  integration has drained and committed). Who *should* run it is computed
  by every member alike (``nemesis.fleet.placement``); the rows say who
  does, so a new owner can wait for the old one to let go.
- **overrides**: live values set through any replica's admin API, one row
  per integration and field: the value as JSON, the ``version`` (the
  generation that set it), who set it and when.
- **generation**: one counter bumped by every change above except a lease
  renewal, so a replica polls one small row to learn whether anything
  changed.
- **revoked sessions**: the DLQ viewer's signed-out sessions, each until its
  cookie would have expired, so that every replica refuses a copy of the
  cookie (``nemesis.fleet.revocations``; they do not move the generation:
  the viewer asks for one session id when a cookie arrives).
- **sign-in failures and spent sign-in forms**: the viewer's throttle counts
  and the nonces of sign-in forms already posted (``nemesis.fleet.logins``),
  so that every replica slows a guesser alike and a form works once.

Every call is one transaction. Times are wall-clock seconds of the member
that writes them: the hosts of one fleet need clocks that agree well within
the lease time (NTP does). Every store raises ``StateError`` (retriable) when
the store cannot answer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

# The most revoked sessions a store keeps (as many as the viewer remembers in memory).
MAX_REVOKED_ROWS: Final = 100_000
# The most sign-in keys with failures, and spent sign-in forms, a store keeps (each).
MAX_LOGIN_ROWS: Final = 100_000


class Tx(Protocol):
    """One open transaction of a SQL store (``core`` holds the logic over it)."""

    def execute(self, sql: str, parameters: Sequence[object] = ()) -> int:
        """Runs a statement; returns the rows it changed."""
        ...

    def query(self, sql: str, parameters: Sequence[object] = ()) -> list[tuple[Any, ...]]:
        """Runs a SELECT; returns its rows."""
        ...


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """Who a member is: what it writes about itself at every heartbeat."""

    member_id: str
    host: str
    pid: int
    started_at: float
    draining: bool = False


@dataclass(frozen=True, slots=True)
class Member:
    """One member row as stored."""

    member_id: str
    host: str
    pid: int
    started_at: float
    heartbeat_at: float
    lease_until: float
    draining: bool

    def live(self, now: float) -> bool:
        """Whether its lease still runs at ``now``."""
        return self.lease_until > now


@dataclass(frozen=True, slots=True)
class Assignment:
    """A member runs an integration (or is starting or draining it)."""

    integration: str
    member_id: str
    since: float


@dataclass(frozen=True, slots=True)
class StoredOverride:
    """One live value of one integration, as the admin API set it."""

    integration: str
    field: str
    value: Any  # decoded from JSON
    version: int  # the generation that set it
    set_by: str
    set_at: float


@dataclass(frozen=True, slots=True)
class StoredReport:
    """What one member last said of one integration it runs (``nemesis.fleet.reports``)."""

    integration: str
    member_id: str
    at: float  # when it wrote it (seconds since the epoch)
    body: dict[str, Any]  # decoded from JSON (``nemesis.runtime.reports``)


@dataclass(frozen=True, slots=True)
class FleetView:
    """Everything the store holds, read in one transaction."""

    generation: int
    members: tuple[Member, ...]
    assignments: tuple[Assignment, ...]
    overrides: tuple[StoredOverride, ...]

    def overrides_of(self, integration: str) -> dict[str, StoredOverride]:
        """The stored overrides of one integration, by field."""
        return {o.field: o for o in self.overrides if o.integration == integration}


class StateStore(Protocol):
    """Where the replicas of one fleet meet; every method is one transaction."""

    @property
    def location(self) -> str:
        """Where the store is, in words (for logs and ``nemesis fleet status``)."""
        ...

    async def generation(self) -> int:
        """The change counter: equal to the last answer means nothing changed but leases."""
        ...

    async def heartbeat(self, member: MemberInfo, *, now: float, lease_s: float) -> int:
        """Renews (or first writes) the member's row until ``now + lease_s``.

        Rows whose lease expired before ``now`` are deleted with their
        assignments. Returns the generation after the call.
        """
        ...

    async def forget(self, member_ids: Collection[str]) -> int:
        """Deletes members (and their assignments) known to be gone; returns the generation."""
        ...

    async def view(self) -> FleetView:
        """Every member, assignment and override, with the generation they are at."""
        ...

    async def assign(self, integration: str, member_id: str, *, now: float) -> None:
        """Records that the member runs the integration (idempotent)."""
        ...

    async def unassign(self, integration: str, member_id: str) -> None:
        """Records that the member no longer runs the integration (idempotent)."""
        ...

    async def leave(self, member_id: str) -> None:
        """Deletes the member's row and its assignments: it has stopped."""
        ...

    async def set_overrides(
        self,
        integration: str,
        values: Mapping[str, Any],
        *,
        cleared: Collection[str] = (),
        set_by: str,
        now: float,
    ) -> int:
        """Stores live values (JSON-able) and deletes ``cleared`` fields; returns the version."""
        ...

    async def clear_overrides(
        self, integration: str, fields: Collection[str] | None = None
    ) -> None:
        """Deletes the integration's overrides (only ``fields`` when given)."""
        ...

    async def drop_caught_up(self, integration: str, versions: Mapping[str, int]) -> None:
        """Deletes overrides the YAML now says, each only if still at the version given."""
        ...

    async def close(self) -> None:
        """Closes the connection."""
        ...

    async def publish_reports(
        self, member_id: str, reports: Mapping[str, Mapping[str, Any]], *, now: float
    ) -> None:
        """Replaces the member's reports of the integrations it runs (the team console's)."""
        ...

    async def reports(self) -> tuple[StoredReport, ...]:
        """Every member's last report of every integration it runs."""
        ...

    async def revoke_session(
        self,
        session_id: str,
        expires_at: float,
        *,
        now: float,
        max_rows: int = MAX_REVOKED_ROWS,
    ) -> int:
        """Records a signed-out viewer session until ``expires_at``.

        Expired rows go first; when ``max_rows`` are still stored, the rows
        expiring soonest are deleted to make room (this one is always
        kept). Returns how many live revocations were pushed out.
        """
        ...

    async def session_revoked_until(self, session_id: str, *, now: float) -> float | None:
        """Until when ``session_id`` is revoked; None when it is not (or no longer)."""
        ...

    async def login_failures(
        self, keys: Sequence[str], *, since: float
    ) -> dict[str, tuple[int, float]]:
        """Each key's failed sign-ins and the latest one's time, for keys failed after ``since``."""
        ...

    async def login_failed(
        self, keys: Sequence[str], *, now: float, since: float, max_rows: int = MAX_LOGIN_ROWS
    ) -> dict[str, int]:
        """Counts a failed sign-in at ``now`` for each key (quiet since ``since``: from one)."""
        ...

    async def login_succeeded(self, keys: Sequence[str]) -> None:
        """Forgets the failed sign-ins of ``keys``."""
        ...

    async def spend_login_nonce(
        self, nonce: str, expires_at: float, *, now: float, max_rows: int = MAX_LOGIN_ROWS
    ) -> bool:
        """Spends a sign-in form's nonce until ``expires_at``: True once, False after that."""
        ...
