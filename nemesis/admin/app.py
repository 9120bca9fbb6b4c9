"""The admin API (FastAPI): health, readiness, ``/metrics``, live status and live changes.

Reading is open (it is meant for a cluster-internal port, like ``/metrics``).
Changing needs ``Authorization: Bearer <admin.token>``: 401 without it, 403
with a wrong one, 403 for every change when no token is configured (the API
is read-only then). A change that does not fit is a 422 naming the field
(``body.delivery.workers``); the whole configuration is validated with the
change, so ``delivery.buffer`` must still hold a ``delivery.batch.size``.

Live changes land as overrides over the integration's YAML and apply at once
(``nemesis.runtime.app``): workers resize, the buffer bound moves, batches,
rate limits, disabled types and pause take effect without a restart and
without touching a message in flight. ``GET /integrations/{name}`` shows for
every live field its value, where it came from (default, YAML, override) and
the drift; ``DELETE .../overrides[/{field}]`` goes back to the YAML, and so
does a reload that finds the YAML saying the same value.
"""

# No ``from __future__ import annotations``: FastAPI reads the route signatures at
# run time, and the token check's annotation names a local dependency.
import asyncio
import hmac
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Final

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from pydantic import ValidationError

from nemesis import __version__
from nemesis.admin import schemas
from nemesis.admin.server import ServiceFailures
from nemesis.admin.status import dlq_unavailable, integration_status, reload_result
from nemesis.config.models import NAME_PATTERN
from nemesis.errors import StateError
from nemesis.fleet.member import FleetMember
from nemesis.fleet.status import fleet_status
from nemesis.runtime.app import Proxy
from nemesis.runtime.overrides import LiveField
from nemesis.runtime.reload import ConfigReloader
from nemesis.runtime.sizing import size_for

# Not ready when every describe of the broker failed for this long.
BROKER_UNREACHABLE_S: Final = 30.0

_REFUSED: Final[dict[int | str, dict[str, Any]]] = {
    401: {"model": schemas.ErrorMessage, "description": "No bearer token."},
    403: {"model": schemas.ErrorMessage, "description": "Wrong token, or changes disabled."},
}
_UNKNOWN: Final[dict[int | str, dict[str, Any]]] = {
    404: {"model": schemas.ErrorMessage, "description": "No such integration."}
}
_STORE_DOWN: Final[dict[int | str, dict[str, Any]]] = {
    503: {"model": schemas.ErrorMessage, "description": "The fleet's state store is unreachable."}
}
_UNREADABLE: Final[dict[int | str, dict[str, Any]]] = {
    400: {"model": schemas.ErrorMessage, "description": "The body is not JSON text."}
}

IntegrationName = Annotated[
    str, Path(pattern=NAME_PATTERN, max_length=63, description="The integration's name.")
]


def create_admin_app(
    proxy: Proxy,
    *,
    token: str | None = None,
    reloader: ConfigReloader | None = None,
    services: ServiceFailures | None = None,
    fleet: FleetMember | None = None,
) -> FastAPI:
    """The admin API over a proxy; ``token`` guards changes (None: read-only).

    ``services``: the side services (the DLQ viewer) that are not serving, a
    reason for ``/readyz`` to answer 503. With ``fleet``, live changes are
    stored for the whole fleet before they apply here
    (``nemesis.fleet.member``), and ``GET /fleet`` shows it.
    """
    app = FastAPI(
        title="Nemesis admin API",
        version=__version__,
        summary="Health, metrics, live status and live re-tuning of the Nemesis proxy.",
        redoc_url=None,
    )
    authorized = [Depends(_token_check(token))]

    def statuses(names: list[str]) -> list[schemas.IntegrationStatus]:
        snapshot = proxy.snapshot(set(names))
        return [
            integration_status(
                integration,
                now=snapshot.monotonic,
                topics={flow.name: flow.topic for flow in proxy.flows(integration.config)},
            )
            for integration in sorted(snapshot.integrations, key=lambda i: i.name)
        ]

    def status_of(name: str) -> schemas.IntegrationStatus:
        if name not in proxy.groups:
            raise HTTPException(404, f"no integration {name!r}")
        return statuses([name])[0]

    async def set_live(name: str, changes: Mapping[str, Any]) -> None:
        """Lays live values over the YAML: for the whole fleet when there is one."""
        if fleet is None:
            proxy.set_overrides(name, changes)
            return
        try:
            await fleet.set_overrides(name, changes, set_by=f"admin API of {fleet.member_id}")
        except StateError as exc:
            raise HTTPException(503, f"the change was not made: {exc}") from None

    async def clear_live(name: str, fields: list[str] | None) -> None:
        if fleet is None:
            proxy.clear_overrides(name, fields)
            return
        try:
            await fleet.clear_overrides(name, fields)
        except StateError as exc:
            raise HTTPException(503, f"the change was not made: {exc}") from None

    @app.get("/healthz", tags=["health"])
    async def health() -> schemas.Health:
        """Liveness: the event loop answers."""
        return schemas.Health(status="ok")

    @app.get(
        "/readyz",
        tags=["health"],
        responses={503: {"model": schemas.Readiness, "description": "Not ready."}},
    )
    async def readiness(response: Response) -> schemas.Readiness:
        """Readiness: the proxy runs its integrations, reaches its broker and its DLQ store."""
        reasons: list[str] = []
        if proxy.stopping:
            reasons.append("stopping: draining in-flight deliveries")
        elif not proxy.running:
            reasons.append("starting")
        lag = proxy.lag_monitor.statistics()
        unreachable = lag.unreachable_since
        if unreachable is not None:
            down_s = proxy.clock.monotonic() - unreachable
            if down_s >= BROKER_UNREACHABLE_S:
                reasons.append(f"broker unreachable for {down_s:.0f}s: {lag.last_error}")
        if services is not None:
            reasons.extend(services.reasons())
        waiting = dlq_unavailable(r for g in proxy.groups.values() for r in g.runners.values())
        if waiting is not None:
            reasons.append(waiting)
        if reasons:
            response.status_code = 503
        return schemas.Readiness(
            status="not_ready" if reasons else "ready",
            reasons=reasons,
            integrations=len(proxy.groups),
        )

    @app.get(
        "/metrics",
        tags=["health"],
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
    )
    async def metrics() -> Response:
        """Prometheus text format (docs/design.md, section 8)."""
        # Collected on the loop (the collectors read live state unlocked), rendered off it.
        families = list(proxy.metrics.registry.collect())
        body = await asyncio.to_thread(generate_latest, _Collected(families))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/integrations", tags=["integrations"])
    async def list_integrations() -> schemas.IntegrationList:
        """Every integration with its live status, settings, drift, lag and sizing."""
        every = sorted(proxy.groups)
        return schemas.IntegrationList(integrations=statuses(every))

    @app.get("/integrations/{name}", tags=["integrations"], responses=_UNKNOWN)
    async def get_integration(name: IntegrationName) -> schemas.IntegrationStatus:
        """One integration's live status."""
        return status_of(name)

    @app.patch(
        "/integrations/{name}",
        tags=["integrations"],
        dependencies=authorized,
        responses={**_UNREADABLE, **_REFUSED, **_UNKNOWN, **_STORE_DOWN},
    )
    async def patch_integration(
        name: IntegrationName, patch: schemas.IntegrationPatch
    ) -> schemas.IntegrationStatus:
        """Sets live values over the YAML for the whole fleet; nothing restarts.

        They apply here at once, on the other replicas within a poll of the
        state store, and on a replica that starts later; they stay until
        cleared or until the YAML says the same.
        """
        status_of(name)
        changes = patch.changes()
        try:
            await set_live(name, changes)
        except ValidationError as exc:
            raise _unfit(exc, ("body",), changes) from None
        return status_of(name)

    @app.post(
        "/integrations/{name}/pause",
        tags=["integrations"],
        dependencies=authorized,
        responses={**_REFUSED, **_UNKNOWN, **_STORE_DOWN},
    )
    async def pause(name: IntegrationName) -> schemas.IntegrationStatus:
        """Stops reading (in-flight deliveries finish); an override of ``paused``."""
        status_of(name)
        await set_live(name, {"paused": True})
        return status_of(name)

    @app.post(
        "/integrations/{name}/resume",
        tags=["integrations"],
        dependencies=authorized,
        responses={**_REFUSED, **_UNKNOWN, **_STORE_DOWN},
    )
    async def resume(name: IntegrationName) -> schemas.IntegrationStatus:
        """Reads again; an override of ``paused`` (none when the YAML says not paused)."""
        status_of(name)
        await set_live(name, {"paused": False})
        return status_of(name)

    @app.delete(
        "/integrations/{name}/overrides",
        tags=["integrations"],
        dependencies=authorized,
        responses={**_REFUSED, **_UNKNOWN, **_STORE_DOWN},
    )
    async def clear_overrides(name: IntegrationName) -> schemas.IntegrationStatus:
        """Back to the YAML for every live field, on the whole fleet."""
        status_of(name)
        await clear_live(name, None)
        return status_of(name)

    @app.delete(
        "/integrations/{name}/overrides/{field}",
        tags=["integrations"],
        dependencies=authorized,
        responses={**_REFUSED, **_UNKNOWN, **_STORE_DOWN},
    )
    async def clear_override(name: IntegrationName, field: LiveField) -> schemas.IntegrationStatus:
        """Back to the YAML for one live field, on the whole fleet."""
        status_of(name)
        try:
            await clear_live(name, [field])
        except ValidationError as exc:
            # What is left over the YAML does not fit without this one.
            raise _unfit(exc, ("path", "field"), {}) from None
        return status_of(name)

    @app.get(
        "/fleet",
        tags=["fleet"],
        responses={404: {"model": schemas.ErrorMessage, "description": "Not in a fleet."}},
    )
    async def fleet_members() -> schemas.FleetStatus:
        """The replicas sharing the state store, who runs which integration, the overrides.

        Read from the store now; when it does not answer, as this replica last
        read it, with the failure in ``last_error``.
        """
        if fleet is None:
            raise HTTPException(404, "this proxy runs without a fleet state store")
        last_error = fleet.statistics().last_error
        try:
            view = await fleet.store.view()
        except StateError as exc:
            view, last_error = fleet.view, str(exc)
        replicas = {name: group.yaml.replicas for name, group in proxy.groups.items()}
        status = fleet_status(view, replicas, now=proxy.clock.time(), location=fleet.store.location)
        return schemas.FleetStatus(
            location=status.location,
            generation=status.generation,
            member_id=fleet.member_id,
            members=[
                schemas.FleetMemberStatus(
                    member_id=m.member_id,
                    host=m.host,
                    pid=m.pid,
                    started_at=m.started_at,
                    heartbeat_age_s=m.heartbeat_age_s,
                    lease_left_s=m.lease_left_s,
                    draining=m.draining,
                    running=m.running,
                    this=m.member_id == fleet.member_id,
                )
                for m in status.members
            ],
            integrations=[
                schemas.FleetPlacement(
                    name=i.name,
                    replicas=i.replicas,
                    assigned=list(i.assigned),
                    running=list(i.running),
                )
                for i in status.integrations
            ],
            overrides=[
                schemas.FleetOverride(
                    integration=o.integration,
                    field=o.field,
                    value=o.value,
                    version=o.version,
                    set_by=o.set_by,
                    set_at=o.set_at,
                )
                for o in status.overrides
            ],
            last_error=last_error,
        )

    @app.get("/config", tags=["config"])
    async def config_status() -> schemas.ConfigStatus:
        """The integrations directory and what the last reload found (problems by file)."""
        last = None if reloader is None else reloader.last
        return schemas.ConfigStatus(
            directory=None if reloader is None else str(reloader.directory),
            watching=reloader is not None and reloader.watching,
            last_reload=None if last is None else reload_result(last),
        )

    @app.post(
        "/config/reload",
        tags=["config"],
        dependencies=authorized,
        responses={
            **_REFUSED,
            404: {"model": schemas.ErrorMessage, "description": "No integrations directory."},
        },
    )
    async def reload() -> schemas.ReloadResult:
        """Reads integrations/*.yaml again now (as SIGHUP and the file watch do)."""
        if reloader is None:
            raise HTTPException(404, "this proxy was not started from an integrations directory")
        return reload_result(await reloader.reload("api"))

    @app.get("/sizing", tags=["config"])
    async def sizing(
        rps: Annotated[float, Query(ge=0, le=1e7, description="Messages per second.")],
        latency_ms: Annotated[
            float, Query(ge=0, le=600_000, description="Handler time per delivery.")
        ],
        batch_size: Annotated[int, Query(ge=1, le=10_000)] = 1,
        headroom: Annotated[float, Query(ge=1, le=10)] = 1.5,
    ) -> schemas.SizingFigure:
        """``nemesis size``: workers N = R x T with headroom, and the buffer it implies."""
        figure = size_for(rps, latency_ms / 1000, batch_size=batch_size, headroom=headroom)
        return schemas.SizingFigure(
            rps=figure.rps,
            latency_ms=latency_ms,
            batch_size=figure.batch_size,
            headroom=figure.headroom,
            in_flight=figure.in_flight,
            workers=figure.workers,
            buffer=figure.buffer,
            capped=figure.capped,
        )

    return app


class _Collected(Collector):
    """Families collected already, for rendering off the event loop."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def _token_check(token: str | None) -> Callable[..., None]:
    bearer = HTTPBearer(
        auto_error=False,
        scheme_name="adminToken",
        description="admin.token from nemesis.yaml (set it from ${NEMESIS_ADMIN_TOKEN}).",
    )
    expected = None if token is None else token.encode()

    def check(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        if expected is None:
            raise HTTPException(403, "changes are disabled: admin.token is not configured")
        if credentials is None:
            raise HTTPException(
                401,
                "send Authorization: Bearer <admin.token>",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(credentials.credentials.encode(), expected):
            raise HTTPException(403, "wrong token")

    return check


def _unfit(
    exc: ValidationError, prefix: tuple[str, ...], changes: Mapping[str, Any]
) -> RequestValidationError:
    """A 422 for a change the configuration as a whole refuses, naming the fields it touched.

    A rule across fields (the buffer must hold a batch) fails at their
    section (``delivery``); it is reported at the changed fields inside it.
    """
    errors: list[dict[str, Any]] = []
    for error in exc.errors():
        loc = tuple(str(part) for part in error["loc"])
        section = ".".join(loc)
        inside = [path for path in changes if path == section or path.startswith(section + ".")]
        # Of the changed fields in the section, those the rule's message names.
        words = set(re.findall(r"[a-z_]+", str(error["msg"]).lower()))
        named = [path for path in inside if words & set(path[len(section) :].split("."))]
        touched = named or inside or [section]
        errors.extend(
            {
                "loc": [*prefix, *path.split(".")] if path else list(prefix),
                "msg": error["msg"],
                "type": error["type"],
            }
            for path in touched
        )
    return RequestValidationError(errors)
