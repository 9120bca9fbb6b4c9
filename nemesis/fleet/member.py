"""One replica's part in a fleet: its lease, its integrations, its shares, the live overrides.

A ``FleetMember`` sits beside the proxy (``nemesis.runtime.app.Proxy``),
which asks it, before starting an integration, whether the integration runs
here (``runs_here``). The member:

1. **Joins**: writes its row (``heartbeat``), renews it every third of the
   lease, and forgets rows of processes on its own host and node that no
   longer exist (a predecessor killed with ``kill -9``) at once rather than
   after a lease (``nemesis.processes``: a member id ends with its node).
2. **Watches** the store's generation every ``poll_s`` (one small read) and
   reads the whole view when it moved, when a peer's lease may have run out,
   or while it waits for a handover. A member whose lease has expired is
   deleted by whoever notices first; that moves the generation.
3. **Places** every integration as the planner says (``nemesis.fleet.plan``:
   rendezvous hashing over the active members, then what to start, release
   and share) and carries the plan out: it starts those it should run, once
   no live member outside their owners still runs them (the old owner drains
   and commits first) or after ``handover_wait_s``; it drains and stops those
   it should no longer run, then says so in the store. The broker's
   partition fencing covers the overlap either way.
4. **Shares** each running integration's rate limits by the number of
   members running it (the owners, or more while one hands over).
5. **Keeps overrides fleet-wide**: a live change through any replica's admin
   API goes to the store first, then applies here; every other member
   applies it at its next poll, and a restarted one at its start. An
   override the YAML now says is deleted from the store (drift no more).

**When the store cannot be reached**, the member keeps running what it runs
and takes or gives up nothing (each look fails before it can act); it logs
the outage once, and once more when the store answers again. Its peers'
leases have run out meanwhile if the outage was long, though they may all be
alive: for ``lease_s`` after it reaches the store again the member **settles**:
it renews its own lease at once, counts every member whose row is there as
live (forgetting nobody itself) and starts no integration it does not run,
so that the others' heartbeats come in before it acts on the membership.
(The first heartbeat back still deletes the rows whose lease ran out, as
every heartbeat does; their members write them again with their next one.)
After that, a member that did not renew is forgotten as usual.

Shutting down (``proxy.stop()``), the member marks itself draining, so the
others compute owners without it; once the proxy has drained it leaves
(deletes its row and assignments), and the new owners start.

What it knows goes to ``/metrics`` (``nemesis_fleet_*``, docs/fleet.md): the
gauges are computed from ``statistics()`` when Prometheus scrapes, from the
view the member already holds (no extra read of the store, no timer); the
failed store calls and the handovers are counted where they happen. A
handover is the start here of an integration that another member ran or
was placed on, timed from the decision to run it here (the wait for the old
owner included); the first start of an integration nobody ran is none.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from prometheus_client.core import GaugeMetricFamily, Metric
from pydantic import ValidationError

from nemesis import processes
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config import overrides as live
from nemesis.config.limits import Breach, Caps, live_change_breaches
from nemesis.config.models import IntegrationConfig
from nemesis.errors import StateError
from nemesis.fleet.plan import Plan, Situation, live_ids, plan, runners_of
from nemesis.fleet.port import FleetView, MemberInfo, StateStore
from nemesis.metrics import FLEET_STATE_OPERATIONS, Metrics

log = logging.getLogger(__name__)

T = TypeVar("T")


class FleetGroup(Protocol):
    """What the member reads of one of the proxy's integrations."""

    @property
    def yaml(self) -> IntegrationConfig: ...

    @property
    def overrides(self) -> dict[str, Any]: ...


class FleetProxy(Protocol):
    """What the member needs of the proxy (``nemesis.runtime.app.Proxy``)."""

    @property
    def groups(self) -> Mapping[str, FleetGroup]: ...

    @property
    def stopping(self) -> bool: ...

    def set_placement(self, runs_here: Any) -> None: ...

    def start_integration(self, name: str) -> None: ...

    async def release_integration(self, name: str) -> None: ...

    def set_runners(self, name: str, runners: int) -> None: ...

    def replace_overrides(self, name: str, overrides: Mapping[str, Any]) -> Any: ...

    def set_overrides(self, name: str, changes: Mapping[str, Any]) -> Any: ...

    def clear_overrides(self, name: str, fields: Collection[str] | None = None) -> Any: ...


@dataclass(frozen=True, slots=True)
class FleetOptions:
    lease_s: float = 10.0
    poll_s: float = 1.0
    # How long a new owner waits for the old one to drain before it starts anyway.
    handover_wait_s: float = 30.0


@dataclass
class FleetStatistics:
    """What this member knows now: for the admin API and logs."""

    member_id: str
    generation: int
    draining: bool
    running: list[str]
    waiting: list[str]  # integrations it should run, waiting for the old owner
    releasing: list[str]
    last_error: str | None = None
    members_active: int = 0  # live and not draining, as last read (this one included)
    members_draining: int = 0
    placed: int = 0  # integrations the placement gives this member
    unplaced: int = 0  # integrations no live member runs
    underplaced: int = 0  # integrations that fewer of their owners run than the placement says
    synced_at: float | None = None  # the end of the last look at the store that succeeded
    lease_until: float | None = None  # as last renewed


def new_member_id(host: str, pid: int) -> str:
    """``host-pid-random-node``: readable, unique across restarts, and says where it runs."""
    return f"{host}-{pid}-{secrets.token_hex(3)}-{processes.node()}"


def node_of(member_id: str) -> str:
    """The node a member id names (its last part; anything for an id of another form)."""
    return member_id.rpartition("-")[2]


class FleetMember:
    """This replica in the fleet: lease, placement, shares and fleet-wide overrides."""

    def __init__(
        self,
        store: StateStore,
        proxy: FleetProxy,
        *,
        options: FleetOptions = FleetOptions(),
        clock: Clock = SYSTEM_CLOCK,
        host: str | None = None,
        pid: int | None = None,
        member_id: str | None = None,
        metrics: Metrics | None = None,
        caps: Caps | None = None,
    ) -> None:
        self.store = store
        self._proxy = proxy
        # The platform's caps: stored live values over them are not applied here.
        self._caps = caps or Caps()
        self._options = options
        self._clock = clock
        host = host or socket.gethostname()
        pid = os.getpid() if pid is None else pid
        self._info = MemberInfo(
            member_id=member_id or new_member_id(host, pid),
            host=host,
            pid=pid,
            started_at=clock.time(),
        )
        self._view = FleetView(0, (), (), ())
        self._plan = Plan()
        self._running: set[str] = set()
        self._releasing: set[str] = set()
        self._decided: dict[str, float] = {}  # to run here, waiting: since when
        self._next_heartbeat = 0.0
        self._next_expiry = float("inf")
        self._refused: dict[tuple[str, int], str] = {}  # overrides that do not fit, logged once
        self._last_error: str | None = None
        self._placed: set[str] = set()  # the integrations the last placement saw
        self._tasks: asyncio.TaskGroup | None = None
        self._live_others: frozenset[str] = frozenset()  # as last read
        self._members_draining = 0
        self._taking_over: set[str] = set()  # waiting ones that another member ran or owned
        self._synced_at: float | None = None
        self._lease_until: float | None = None
        self._unreachable_since: float | None = None  # the current outage of the store
        self._settle_until = 0.0  # after an outage: act on no membership before this
        self._metrics = metrics if metrics is not None else Metrics()
        for operation in FLEET_STATE_OPERATIONS:
            self._metrics.fleet_state_errors.labels(operation)  # a zero to rise from
        self._handovers = self._metrics.fleet_handovers.labels()
        self._handover_duration = self._metrics.fleet_handover_duration.labels()
        self._metrics.add_live_collector(self._metric_families)
        proxy.set_placement(self.runs_here)

    # --- reading ------------------------------------------------------------------

    @property
    def member_id(self) -> str:
        return self._info.member_id

    @property
    def view(self) -> FleetView:
        """The store as last read."""
        return self._view

    @property
    def active(self) -> tuple[str, ...]:
        """The live members that take integrations, as last read."""
        return self._plan.active

    def runs_here(self, name: str) -> bool:
        """Whether the integration runs on this member (the proxy asks before starting it)."""
        return name in self._running

    def owners_of(self, name: str) -> tuple[str, ...]:
        """The members that should run an integration, as this member sees the fleet."""
        return self._plan.owners.get(name, ())

    def statistics(self) -> FleetStatistics:
        now = self._clock.time()
        me = self.member_id
        running = set(self._running)  # a copy: a release may end meanwhile
        runners = runners_of(self._view.assignments, self._live_others)
        groups = list(self._proxy.groups)
        unplaced = underplaced = placed = 0
        for name in groups:
            wanted = self.owners_of(name)
            runs = runners.get(name, frozenset()) | ({me} if name in running else frozenset())
            placed += me in wanted
            unplaced += not runs
            underplaced += not runs.issuperset(wanted)
        return FleetStatistics(
            member_id=self.member_id,
            generation=self._view.generation,
            draining=self._info.draining,
            running=sorted(self._running),
            waiting=sorted(n for n, t in self._decided.items() if t <= now),
            releasing=sorted(self._releasing),
            last_error=self._last_error,
            members_active=len(self._plan.active),
            members_draining=self._members_draining,
            placed=placed,
            unplaced=unplaced,
            underplaced=underplaced,
            synced_at=self._synced_at,
            lease_until=self._lease_until,
        )

    # --- the run ------------------------------------------------------------------

    async def join(self) -> None:
        """Writes this member's row and places the integrations once (before the proxy runs)."""
        await self._forget_dead_neighbours()
        await self._heartbeat()
        await self._refresh()
        self._synced_at = self._clock.time()

    async def run(self) -> None:
        """Watches the store until cancelled, then leaves the fleet."""
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                while True:
                    await self._clock.sleep(self._options.poll_s)
                    try:
                        await self.tick()
                    except StateError as exc:
                        self._failed(exc)
                    except Exception:
                        # A supervisor boundary: a bug here must not stop the deliveries.
                        log.exception("fleet: looking at the state store failed; trying again")
        finally:
            self._tasks = None
            with contextlib.suppress(StateError, TimeoutError):
                await asyncio.shield(self._stored("leave", self.store.leave(self.member_id)))

    async def tick(self) -> None:
        """One look at the store; acts on what changed."""
        now = self._clock.time()
        if self._proxy.stopping and not self._info.draining:
            self._info = dataclasses.replace(self._info, draining=True)
            self._next_heartbeat = now
        if now >= self._next_heartbeat or self._unreachable_since is not None:
            # After an outage at once: the others settle on the heartbeats they see.
            generation = await self._heartbeat()
        else:
            generation = await self._stored("generation", self.store.generation())
        if self._unreachable_since is not None:
            self._recovered(now)
        if (
            generation != self._view.generation
            or now >= self._next_expiry
            or self._decided
            or self._settle_until
            or self._proxy.groups.keys() != self._placed
        ):
            await self._refresh()
        self._last_error = None
        self._synced_at = self._clock.time()

    async def leave(self) -> None:
        """Deletes this member's row and assignments (after the proxy has drained)."""
        await self._stored("leave", self.store.leave(self.member_id))

    # --- live overrides, fleet-wide ------------------------------------------------

    async def set_overrides(self, name: str, changes: Mapping[str, Any], *, set_by: str) -> None:
        """Stores live values for the whole fleet, then applies them here.

        Raises KeyError for an unknown integration, pydantic's ValidationError
        when the values do not fit, StateError when the store cannot take them.
        """
        group = self._proxy.groups[name]
        yaml = group.yaml
        live.apply_overrides(yaml, live.caught_up(yaml, {**group.overrides, **changes}))
        kept = live.caught_up(yaml, changes)
        cleared = [path for path in changes if path not in kept]
        now = self._clock.time()
        await self._stored(
            "set_overrides",
            self.store.set_overrides(name, kept, cleared=cleared, set_by=set_by, now=now),
        )
        self._proxy.set_overrides(name, changes)

    async def clear_overrides(self, name: str, fields: Collection[str] | None = None) -> None:
        """Back to the YAML for the whole fleet (every live field when ``fields`` is None)."""
        group = self._proxy.groups[name]
        kept = {} if fields is None else live.only(group.overrides, fields)
        live.apply_overrides(group.yaml, kept)
        await self._stored("clear_overrides", self.store.clear_overrides(name, fields))
        self._proxy.clear_overrides(name, fields)

    # --- the parts ----------------------------------------------------------------

    async def _heartbeat(self) -> int:
        now = self._clock.time()
        generation = await self._stored(
            "heartbeat",
            self.store.heartbeat(self._info, now=now, lease_s=self._options.lease_s),
        )
        self._next_heartbeat = now + self._options.lease_s / 3
        self._lease_until = now + self._options.lease_s
        return generation

    async def _forget_dead_neighbours(self) -> None:
        """Forgets members of this host and node whose process is gone (no lease wait)."""
        view = await self._stored("view", self.store.view())
        gone = [
            m.member_id
            for m in view.members
            if m.member_id != self.member_id
            and processes.is_dead_neighbour(m.host, m.pid, node_of(m.member_id))
        ]
        if gone:
            log.info("fleet: forgetting members of this host that are gone: %s", ", ".join(gone))
            await self._stored("forget", self.store.forget(gone))

    def _recovered(self, now: float) -> None:
        """The store answers again: settle for a lease before acting on the membership."""
        since = self._unreachable_since
        assert since is not None
        self._unreachable_since = None
        self._settle_until = now + self._options.lease_s
        log.warning(
            "fleet: reaches the state store again after %.0fs; starting no integration for"
            " %gs while the other members renew their leases",
            now - since,
            self._options.lease_s,
        )

    async def _refresh(self) -> None:
        view = await self._stored("view", self.store.view())
        now = self._clock.time()
        settling = now < self._settle_until
        if not settling:
            self._settle_until = 0.0
        live = live_ids(view.members, now, settling=settling)
        expired = [m.member_id for m in view.members if m.member_id not in live]
        if expired:
            log.warning("fleet: members whose lease ran out: %s", ", ".join(expired))
            await self._stored("forget", self.store.forget(expired))
            view = await self._stored("view", self.store.view())
        self._view = view
        await self._apply_overrides(view)
        integrations = {name: g.yaml.replicas for name, g in self._proxy.groups.items()}
        before = self._plan
        now_plan = plan(
            Situation(
                me=self.member_id,
                now=now,
                members=view.members,
                assignments=view.assignments,
                integrations=integrations,
                draining=self._info.draining,
                settling=settling,
                running=frozenset(self._running),
                releasing=frozenset(self._releasing),
                decided=dict(self._decided),
                taking_over=frozenset(self._taking_over),
                owned_before=before.owners,
                handover_wait_s=self._options.handover_wait_s,
            )
        )
        if now_plan.active != before.active:
            log.info(
                "fleet: %d active members: %s", len(now_plan.active), ", ".join(now_plan.active)
            )
        self._plan = now_plan
        others = [m for m in view.members if m.member_id != self.member_id and m.member_id in live]
        self._next_expiry = min((m.lease_until for m in others), default=float("inf"))
        self._live_others = frozenset(m.member_id for m in others)
        self._members_draining = sum(m.draining for m in others) + self._info.draining
        await self._carry_out(now_plan, now)
        self._placed = set(integrations)

    async def _carry_out(self, plan: Plan, now: float) -> None:
        """Does what the plan says, and nothing it does not."""
        me = self.member_id
        self._decided = dict(plan.decided)
        self._taking_over = set(plan.takeovers)
        for name in plan.start:
            await self._stored("assign", self.store.assign(name, me, now=now))
            since = self._decided.pop(name)
            self._running.add(name)
            self._proxy.set_runners(name, plan.shares[name])
            self._proxy.start_integration(name)
            if name in self._taking_over:
                self._taking_over.discard(name)
                self._handovers.inc()
                self._handover_duration.observe(now - since)
        for name in plan.reassert:
            # Forgotten while this member could not renew its lease: it runs it still.
            await self._stored("assign", self.store.assign(name, me, now=now))
        for name, runners in plan.shares.items():
            if name not in plan.start:
                self._proxy.set_runners(name, runners)
        for name in plan.release:
            self._releasing.add(name)
            if self._tasks is None:
                await self._release(name)  # before run(): nothing started, nothing to drain
            else:
                self._tasks.create_task(self._release(name), name=f"fleet:release:{name}")
        for name in plan.unassign:  # removed by a reload
            self._running.discard(name)
            await self._stored("unassign", self.store.unassign(name, me))

    async def _release(self, name: str) -> None:
        """Drains and stops an integration that moved to another member, then says so."""
        try:
            log.info("fleet: integration %s moves to another member; draining it here", name)
            await self._proxy.release_integration(name)
        except Exception:
            # It stopped here all the same (or never ran); the new owner must not wait for it.
            log.exception("fleet: integration %s: stopping it here failed", name)
        finally:
            self._running.discard(name)
            self._releasing.discard(name)
        try:
            await self._stored("unassign", self.store.unassign(name, self.member_id))
        except StateError as exc:
            # The others start after handover_wait_s without this row's deletion.
            self._failed(exc)

    async def _apply_overrides(self, view: FleetView) -> None:
        for name, group in self._proxy.groups.items():
            stored = view.overrides_of(name)
            yaml = group.yaml
            said = {p: o.version for p, o in stored.items() if live.get_field(yaml, p) == o.value}
            if said:
                await self._stored("drop_caught_up", self.store.drop_caught_up(name, said))
            wanted = {path: o.value for path, o in stored.items() if path not in said}
            if wanted == group.overrides:
                continue
            try:
                breaches = self._over_caps(name, wanted)
                if not breaches:
                    self._proxy.replace_overrides(name, wanted)
                    continue
                why = "; ".join(f"{b.field}: {b.message}" for b in breaches)
                problem = f"the stored overrides of {name} are over the platform's caps: {why}"
            except (ValidationError, KeyError) as exc:
                problem = f"the stored overrides of {name} do not fit this member's YAML: {exc}"
            key = (name, view.generation)
            if key not in self._refused:
                self._refused[key] = problem
                log.error("fleet: %s", problem, extra={"integration": name})

    def _over_caps(self, name: str, wanted: Mapping[str, Any]) -> list[Breach]:
        """What applying the stored ``wanted`` here would set over a cap (as a live change).

        Raises pydantic's ValidationError when they do not fit the YAML.
        """
        if not self._caps.any:
            return []
        groups = self._proxy.groups
        current = {
            n: live.apply_overrides(g.yaml, live.caught_up(g.yaml, g.overrides))
            for n, g in groups.items()
        }
        group = groups[name]
        changed = live.apply_overrides(group.yaml, live.caught_up(group.yaml, wanted))
        running = current[name]
        changes = {
            path: value
            for path, value in wanted.items()
            if live.get_field(running, path) != live.get_field(changed, path)
        }
        return live_change_breaches(self._caps, running, changed, changes, current)

    async def _stored(self, operation: str, call: Awaitable[T]) -> T:
        """Awaits one call of the state store; a failure is counted by its operation."""
        try:
            return await call
        except StateError:
            self._metrics.fleet_state_errors.labels(operation).inc()
            raise

    def _metric_families(self) -> Iterator[Metric]:
        """The ``nemesis_fleet_*`` gauges, from this member's statistics (at scrape time)."""
        stats = self.statistics()
        members = GaugeMetricFamily(
            "nemesis_fleet_members",
            "Live members of the fleet as this member last read the state store, by state:"
            " active (takes integrations) or draining (shutting down).",
            labels=["state"],
        )
        members.add_metric(["active"], stats.members_active)
        members.add_metric(["draining"], stats.members_draining)
        yield members
        integrations = GaugeMetricFamily(
            "nemesis_fleet_integrations",
            "Integrations on this member by state: placed here, running here, waiting here for"
            " the old owner to let go, releasing (draining before another member takes them).",
            labels=["state"],
        )
        integrations.add_metric(["placed"], stats.placed)
        integrations.add_metric(["running"], len(stats.running))
        integrations.add_metric(["waiting"], len(stats.waiting))
        integrations.add_metric(["releasing"], len(stats.releasing))
        yield integrations
        yield GaugeMetricFamily(
            "nemesis_fleet_unplaced_integrations",
            "Integrations no live member runs, as this member sees the fleet.",
            value=stats.unplaced,
        )
        yield GaugeMetricFamily(
            "nemesis_fleet_underplaced_integrations",
            "Integrations that fewer of their owners run than the placement gives them (moving"
            " ones included), as this member sees the fleet.",
            value=stats.underplaced,
        )
        yield GaugeMetricFamily(
            "nemesis_fleet_generation",
            "The state store's change counter, as this member last read it.",
            value=stats.generation,
        )
        if stats.synced_at is not None:
            yield GaugeMetricFamily(
                "nemesis_fleet_last_sync_timestamp_seconds",
                "When this member last looked at the state store without a failure (Unix time).",
                value=stats.synced_at,
            )
        if stats.lease_until is not None:
            yield GaugeMetricFamily(
                "nemesis_fleet_lease_expiry_timestamp_seconds",
                "When this member's lease runs out unless renewed (Unix time); the others take"
                " it for dead after that.",
                value=stats.lease_until,
            )

    def _failed(self, exc: StateError) -> None:
        """A call of the store failed: logged once per outage (``_recovered`` ends it)."""
        self._last_error = str(exc)
        if self._unreachable_since is not None:
            return
        self._unreachable_since = self._clock.time()
        log.error(
            "fleet: cannot reach the state store: %s; the integrations here keep running,"
            " and none is taken or given up until it answers again",
            exc,
        )
