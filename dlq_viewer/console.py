"""The team console: a team's integrations with their live state, and the owners' controls.

Where the figures come from: each replica of the fleet writes, every few
seconds, a report of every integration it runs into the fleet's state store
(``nemesis.fleet.reports``, written by ``nemesis.runtime.reports``); the
live overrides are in the same store. The console reads both (two reads per
page) and adds an integration's reports up across the replicas that run it.
So it shows the same wherever the viewer runs (inside ``nemesis run`` or
alone, on one replica or many), and it calls no replica: it needs neither
their addresses nor a credential for their admin APIs.

Changes go where the admin API's go in a fleet: into the store's overrides,
which every replica applies at its next poll of the store. They are checked
as the admin API checks them (the YAML with every override laid over it
must validate) and written to the audit log with who and what.

Who may do what:

- the **owners** (an identity one of whose teams is in the integration's
  ``owners``) see it and may pause, resume, re-tune it, flag message types
  off, and put it back to its YAML;
- **other identities with access** (platform admins who are not owners) see
  it read-only: the console is the team's page, and a platform change to a
  team's integration goes through the admin API or the CLI;
- everyone else does not see it at all: another team's integration answers
  404, exactly as one that does not exist.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import orjson
from pydantic import ValidationError

from nemesis.clock import Clock
from nemesis.config import overrides as live
from nemesis.config.models import IntegrationConfig
from nemesis.dlq import Action, DeadLetterFilter, DeadLetterStore, Status
from nemesis.errors import DlqError
from nemesis.fleet.port import FleetView, StateStore, StoredReport
from nemesis.identity import Identity

log = logging.getLogger(__name__)

STALE_PERIODS: Final = 3  # a report older than this many of its periods is stale
RATE_KEYS: Final = ("delivered", "filtered", "retried", "dead_lettered")
MAX_TYPES: Final = 1000
MAX_TYPE_CHARS: Final = 200
_BREAKER_RANK: Final = {"closed": 0, "half_open": 1, "open": 2}
NUMBER_FIELDS: Final = (
    ("delivery.workers", "Workers", int),
    ("delivery.buffer", "Buffer", int),
    ("delivery.batch.size", "Batch size", int),
    ("delivery.batch.max_wait_ms", "Batch wait (ms)", int),
    ("rate_limits.main", "Rate, main flow (msg/s)", float),
    ("rate_limits.retry", "Rate, retry tiers (msg/s)", float),
    ("rate_limits.replay", "Rate, replay (msg/s)", float),
)
NULLABLE: Final = frozenset({"rate_limits.main", "rate_limits.retry", "rate_limits.replay"})


class ConsoleRefused(Exception):
    """A change that does not fit (a bad value, an unknown field); the message names the field."""


class StoreUnavailable(Exception):
    """The fleet's state store did not answer; nothing was changed."""


@dataclass(frozen=True, slots=True)
class Replica:
    """One replica's last report of an integration."""

    member_id: str
    age_s: float
    stale: bool
    state: str
    issues: Mapping[str, str]


@dataclass(frozen=True)
class IntegrationView:
    """What the console shows of one integration."""

    name: str
    owners: Sequence[str]
    owner: bool  # the viewer may change it
    paused: bool  # the running value (the YAML with the overrides)
    state: str  # running, paused, failed, ...; "not reported" when no replica reports it
    replicas: Sequence[Replica]
    lag_messages: int | None
    lag_seconds: float | None
    since_last_read_s: float | None
    rates: Mapping[str, float] | None  # per second, summed over the replicas
    breaker: str | None
    retry_backlog: int | None
    waiting_for_dlq: int | None
    dlq_waiting: int  # dead letters in the DLQ store, not yet requeued or discarded
    issues: Sequence[tuple[str, str]]  # (flow, why)
    settings: Sequence[live.Setting]
    drift: Sequence[live.Setting]
    disabled_types: Sequence[str]
    set_by: Mapping[str, str] = field(default_factory=dict)  # field -> who set the override

    @property
    def reported(self) -> bool:
        """Whether some replica reports it now."""
        return any(not replica.stale for replica in self.replicas)


class Console:
    """Reads the team's integrations from the state store and makes the owners' changes."""

    def __init__(
        self,
        state: StateStore,
        integrations: Mapping[str, IntegrationConfig],
        dlq: DeadLetterStore,
        *,
        clock: Clock,
    ) -> None:
        self.state = state
        self.integrations = integrations  # the YAML, read on every request (reloads apply)
        self.dlq = dlq
        self.clock = clock

    # --- reading ------------------------------------------------------------------

    def visible(self, identity: Identity) -> list[str]:
        """The integrations ``identity`` may see, sorted."""
        return sorted(name for name, config in self.integrations.items() if identity.owns(config))

    def config_of(self, identity: Identity, name: str) -> IntegrationConfig | None:
        """The YAML of ``name`` if ``identity`` may see it, else None (unknown alike)."""
        config = self.integrations.get(name)
        if config is None or not identity.owns(config):
            return None
        return config

    @staticmethod
    def is_owner(identity: Identity, config: IntegrationConfig) -> bool:
        """Whether ``identity`` may change ``config`` from the console (a team that owns it)."""
        return bool(identity.teams.intersection(config.owners))

    async def views(self, identity: Identity, names: Iterable[str]) -> list[IntegrationView]:
        """The console's view of each of ``names`` (visible to ``identity`` already)."""
        names = list(names)
        if not names:
            return []
        try:
            view = await self.state.view()
            reports = await self.state.reports()
        except Exception as exc:  # noqa: BLE001 - any store failure is the same to a page
            raise StoreUnavailable(str(exc)) from None
        waiting = await self._dlq_waiting(names)
        by_name: dict[str, list[StoredReport]] = {}
        live_members = {m.member_id for m in view.members}
        for report in reports:
            if report.member_id in live_members:
                by_name.setdefault(report.integration, []).append(report)
        return [
            self._view(identity, name, view, by_name.get(name, []), waiting.get(name, 0))
            for name in names
        ]

    async def _dlq_waiting(self, names: Sequence[str]) -> dict[str, int]:
        where = DeadLetterFilter(integrations=frozenset(names), status=Status.DEAD)
        stats = await self.dlq.stats(where, now=self.clock.time(), bucket_s=3600.0, buckets=1)
        return {item.integration: item.total for item in stats.by_integration}

    def _view(
        self,
        identity: Identity,
        name: str,
        fleet: FleetView,
        reports: Sequence[StoredReport],
        dlq_waiting: int,
    ) -> IntegrationView:
        config = self.integrations[name]
        stored = fleet.overrides_of(name)
        overrides = {path: override.value for path, override in stored.items()}
        settings = list(live.settings(config, overrides))
        running = {setting.field: setting.value for setting in settings}
        now = self.clock.time()
        replicas = []
        fresh: list[Mapping[str, Any]] = []
        for report in reports:
            body = report.body
            every = _number(body.get("every_s")) or 5.0
            age = max(now - report.at, 0.0)
            stale = age > STALE_PERIODS * every
            issues = body.get("issues")
            replicas.append(
                Replica(
                    member_id=report.member_id,
                    age_s=age,
                    stale=stale,
                    state=str(body.get("state", "unknown")),
                    issues={str(k): str(v) for k, v in issues.items()}
                    if isinstance(issues, dict)
                    else {},
                )
            )
            if not stale:
                fresh.append(body)
        issues = sorted(
            {
                (flow, text)
                for replica in replicas
                if not replica.stale
                for flow, text in replica.issues.items()
            }
        )
        disabled = running.get("flags.disabled_types")
        return IntegrationView(
            name=name,
            owners=list(config.owners),
            owner=self.is_owner(identity, config),
            paused=bool(running.get("paused")),
            state=_state(fresh),
            replicas=replicas,
            lag_messages=_sum_int(fresh, "lag_messages"),
            lag_seconds=_max(fresh, "lag_seconds"),
            since_last_read_s=_min(fresh, "since_last_read_s"),
            rates=_rates(fresh),
            breaker=_breaker(fresh),
            retry_backlog=_sum_int(fresh, "retry_backlog"),
            waiting_for_dlq=_sum_int(fresh, "waiting_for_dlq"),
            dlq_waiting=dlq_waiting,
            issues=issues,
            settings=settings,
            drift=[setting for setting in settings if setting.drift],
            disabled_types=[str(t) for t in disabled] if isinstance(disabled, list) else [],
            set_by={path: override.set_by for path, override in stored.items()},
        )

    # --- changing -------------------------------------------------------------------

    async def change(
        self, identity: Identity, name: str, changes: Mapping[str, Any], action: Action
    ) -> str:
        """Stores live values over the YAML for the whole fleet, audited; returns what changed.

        Values the YAML says already are not stored (no drift), as the admin
        API does. Raises ``ConsoleRefused`` when they do not fit.
        """
        config = self.integrations[name]
        current = await self._overrides(name)
        unknown = set(changes) - set(live.LIVE_FIELDS)
        if unknown:
            raise ConsoleRefused(f"not a live field: {', '.join(sorted(unknown))}")
        try:
            live.apply_overrides(config, live.caught_up(config, {**current, **changes}))
        except ValidationError as exc:
            raise ConsoleRefused(_first_error(exc)) from None
        kept = live.caught_up(config, changes)
        cleared = [path for path in changes if path not in kept]
        set_by = f"{identity.actor} through the DLQ viewer"
        try:
            await self.state.set_overrides(
                name, kept, cleared=cleared, set_by=set_by, now=self.clock.time()
            )
        except Exception as exc:  # noqa: BLE001 - any store failure: nothing changed
            raise StoreUnavailable(str(exc)) from None
        described = describe(changes)
        await self._audit(identity, action, name, described, len(changes))
        return described

    async def reset(self, identity: Identity, name: str) -> None:
        """Every live field of ``name`` back to the YAML, for the whole fleet, audited."""
        try:
            await self.state.clear_overrides(name)
        except Exception as exc:  # noqa: BLE001
            raise StoreUnavailable(str(exc)) from None
        await self._audit(identity, Action.RESET, name, "back to the YAML: every live field", 1)

    async def _overrides(self, name: str) -> dict[str, Any]:
        try:
            view = await self.state.view()
        except Exception as exc:  # noqa: BLE001
            raise StoreUnavailable(str(exc)) from None
        return {path: o.value for path, o in view.overrides_of(name).items()}

    async def _audit(
        self, identity: Identity, action: Action, name: str, description: str, count: int
    ) -> None:
        log.info(
            "audit: %s by %s on %s: %s (team console)",
            action.value,
            identity.actor,
            name,
            description,
            extra={"action": action.value, "who": identity.actor, "integration": name},
        )
        try:
            await self.dlq.record_action(
                who=identity.actor,
                action=action,
                integrations=[name],
                count=count,
                description=f"{description} (team console)",
                at=self.clock.time(),
            )
        except DlqError as exc:
            # The change is made; the log line above is its record.
            log.error(  # noqa: TRY400 - the store's failure is in the message
                "audit: the audit log did not take %s by %s on %s (%s)",
                action.value,
                identity.actor,
                name,
                exc,
            )


# --- reading the forms --------------------------------------------------------------


def tuning_changes(form: Mapping[str, str], running: Mapping[str, Any]) -> dict[str, Any]:
    """The live numbers a tuning form sets that differ from their running values.

    An empty rate field is "unlimited"; an empty count field is left as it
    is. Raises ``ConsoleRefused`` naming the field that is not a number.
    """
    changes: dict[str, Any] = {}
    for path, label, kind in NUMBER_FIELDS:
        if path not in form:
            continue
        text = form[path].strip()
        value: Any
        if not text:
            if path not in NULLABLE:
                continue
            value = None
        else:
            try:
                value = kind(text) if kind is float else int(text, 10)
            except ValueError:
                raise ConsoleRefused(f"{path} ({label}): {text[:40]!r} is not a number") from None
            if kind is float and value != value:  # NaN
                raise ConsoleRefused(f"{path} ({label}): not a number")
        if value != running.get(path):
            changes[path] = value
    return changes


def flag_types(text: str) -> list[str]:
    """The message types of a flags form (one per line or comma-separated), checked."""
    names = []
    for part in text.replace(",", "\n").splitlines():
        name = part.strip()
        if not name:
            continue
        if len(name) > MAX_TYPE_CHARS or not name.isprintable():
            raise ConsoleRefused(
                f"flags.disabled_types: a type is at most {MAX_TYPE_CHARS} printable characters"
            )
        if name not in names:
            names.append(name)
    if len(names) > MAX_TYPES:
        raise ConsoleRefused(f"flags.disabled_types: at most {MAX_TYPES} types")
    return names


def describe(changes: Mapping[str, Any]) -> str:
    """``delivery.workers=4, paused=true``: the fields a change set, in JSON values."""
    return ", ".join(
        f"{path}={orjson.dumps(value).decode()}" for path, value in sorted(changes.items())
    )


# --- adding up the replicas' reports ---------------------------------------------------


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error.get("loc", ()))
    return f"{where}: {error.get('msg', 'not valid')}" if where else str(error.get("msg"))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _sum_int(reports: Sequence[Mapping[str, Any]], key: str) -> int | None:
    values = [_number(report.get(key)) for report in reports]
    found = [value for value in values if value is not None]
    return int(sum(found)) if found else None


def _max(reports: Sequence[Mapping[str, Any]], key: str) -> float | None:
    found = [v for v in (_number(r.get(key)) for r in reports) if v is not None]
    return max(found) if found else None


def _min(reports: Sequence[Mapping[str, Any]], key: str) -> float | None:
    found = [v for v in (_number(r.get(key)) for r in reports) if v is not None]
    return min(found) if found else None


def _rates(reports: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    rates = [r.get("rates") for r in reports]
    known = [rate for rate in rates if isinstance(rate, dict)]
    if not known:
        return None
    return {key: sum(_number(rate.get(key)) or 0.0 for rate in known) for key in RATE_KEYS}


def _breaker(reports: Sequence[Mapping[str, Any]]) -> str | None:
    states = [str(r.get("breaker")) for r in reports if r.get("breaker") in _BREAKER_RANK]
    return max(states, key=lambda state: _BREAKER_RANK[state]) if states else None


def _state(reports: Sequence[Mapping[str, Any]]) -> str:
    states = sorted({str(r.get("state", "unknown")) for r in reports})
    if not states:
        return "not reported"
    if "failed" in states:
        return "failed"
    return states[0] if len(states) == 1 else " / ".join(states)
