"""The admin API (FastAPI): health, readiness, ``/metrics``, live status and live changes.

Who may call what is one table, in ``nemesis.admin.access``: each team reads
and changes its own integrations with its own token (``auth.tokens``) or
through an SSO proxy (``auth.trusted_header``), the platform all of them
with ``admin.token``; ``/metrics`` takes ``admin.metrics_token``. Without
team identities the API reads as it always did: open, with changes for
``admin.token`` (none without it). Every change is audited
(``nemesis.admin.audit``) and ``GET /audit`` shows the caller's share of the
audit log. Every answer carries a CSP, ``X-Frame-Options`` and ``nosniff``;
``/docs`` is a page of this process, with no script and nothing from
elsewhere (``nemesis.admin.docs``). A change that does not fit is a 422 naming the field
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
import math
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Final

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from pydantic import ValidationError

from nemesis import __version__
from nemesis.admin import schemas
from nemesis.admin.access import AdminAccess
from nemesis.admin.audit import AdminAudit, AuditStore, describe
from nemesis.admin.docs import add_docs, secure_headers
from nemesis.admin.server import ServiceFailures
from nemesis.admin.status import dlq_unavailable, integration_status, reload_result
from nemesis.config.limits import Breach, Caps, live_change_breaches
from nemesis.config.models import NAME_PATTERN, AuthConfig
from nemesis.config.overrides import LiveField, apply_overrides
from nemesis.dlq.port import Action, PageRequest
from nemesis.errors import BrokerError, DlqError, InvalidQuery, StateError
from nemesis.fleet.member import FleetMember
from nemesis.fleet.status import fleet_status
from nemesis.identity import Identities, Identity
from nemesis.runtime.app import Proxy
from nemesis.runtime.reload import ConfigReloader
from nemesis.runtime.sizing import size_for

# Not ready when every describe of the broker failed for this long.
BROKER_UNREACHABLE_S: Final = 30.0

_REFUSED: Final[dict[int | str, dict[str, Any]]] = {
    401: {"model": schemas.ErrorMessage, "description": "No bearer token."},
    403: {"model": schemas.ErrorMessage, "description": "Wrong token, or changes disabled."},
}
_SIGN_IN: Final[dict[int | str, dict[str, Any]]] = {
    401: {"model": schemas.ErrorMessage, "description": "No credential (team identities are set)."},
    403: {"model": schemas.ErrorMessage, "description": "Wrong token."},
}
_ERROR_REF: Final = {"$ref": "#/components/schemas/ErrorMessage"}
_PLATFORM: Final[dict[int | str, dict[str, Any]]] = {
    **_SIGN_IN,
    403: {"model": schemas.ErrorMessage, "description": "Wrong token, or not the platform."},
}
_UNKNOWN: Final[dict[int | str, dict[str, Any]]] = {
    404: {"model": schemas.ErrorMessage, "description": "No such integration (or not yours)."}
}
_STORE_DOWN: Final[dict[int | str, dict[str, Any]]] = {
    503: {"model": schemas.ErrorMessage, "description": "The fleet's state store is unreachable."}
}
_BROKER_DOWN: Final[dict[int | str, dict[str, Any]]] = {
    503: {"model": schemas.ErrorMessage, "description": "The broker did not answer."}
}
_UNREADABLE: Final[dict[int | str, dict[str, Any]]] = {
    400: {"model": schemas.ErrorMessage, "description": "The body is not JSON text."}
}

IntegrationName = Annotated[
    str, Path(pattern=NAME_PATTERN, max_length=63, description="The integration's name.")
]


def _operation_id(route: APIRoute) -> str:
    # Named for what they do (``list_integrations``), not FastAPI's path-and-method blend.
    return route.name


def create_admin_app(
    proxy: Proxy,
    *,
    token: str | None = None,
    auth: AuthConfig | None = None,
    metrics_token: str | None = None,
    audit: AuditStore | None = None,
    reloader: ConfigReloader | None = None,
    services: ServiceFailures | None = None,
    fleet: FleetMember | None = None,
    caps: Caps | None = None,
) -> FastAPI:
    """The admin API over a proxy; ``token`` is the platform's (None: no platform token).

    ``auth``: the team identities (``nemesis.identity``); ``metrics_token``:
    Prometheus's credential; ``audit``: where changes are recorded beside the
    log line (the DLQ store). ``services``: the side services (the DLQ
    viewer) that are not serving, a reason for ``/readyz`` to answer 503.
    With ``fleet``, live changes are stored for the whole fleet before they
    apply here (``nemesis.fleet.member``), and ``GET /fleet`` shows it.
    ``caps``: the platform's limits a live change must stay within
    (``nemesis.config.limits``).
    """
    app = FastAPI(
        title="Nemesis admin API",
        version=__version__,
        summary="Health, metrics, live status and live re-tuning of the Nemesis proxy.",
        docs_url=None,
        redoc_url=None,
        generate_unique_id_function=_operation_id,
    )
    secure_headers(app)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    access = AdminAccess(
        Identities(AuthConfig() if auth is None else auth, platform_token=token),
        metrics_token=metrics_token,
    )
    trail = AdminAudit(audit, clock=proxy.clock)
    Reader = Annotated[Identity, Depends(access.reader)]
    Changer = Annotated[Identity, Depends(access.changer)]
    PlatformReader = Annotated[Identity, Depends(access.platform_reader)]
    PlatformChanger = Annotated[Identity, Depends(access.platform_changer)]

    def visible(identity: Identity) -> list[str]:
        """The integrations ``identity`` may see, sorted."""
        configs = proxy.integrations
        return sorted(
            name for name in proxy.groups if name in configs and identity.owns(configs[name])
        )

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

    def status_of(name: str, identity: Identity) -> schemas.IntegrationStatus:
        config = proxy.integrations.get(name)
        if name not in proxy.groups or config is None or not identity.owns(config):
            # Another team's integration answers as one that does not exist.
            raise HTTPException(404, f"no integration {name!r}")
        return statuses([name])[0]

    async def set_live(
        name: str, changes: Mapping[str, Any], identity: Identity, action: Action
    ) -> None:
        """Lays live values over the YAML (for the whole fleet when there is one), audited."""
        if fleet is None:
            proxy.set_overrides(name, changes)
        else:
            try:
                await fleet.set_overrides(
                    name,
                    changes,
                    set_by=f"{identity.actor} through the admin API of {fleet.member_id}",
                )
            except StateError as exc:
                raise HTTPException(503, f"the change was not made: {exc}") from None
        await trail.record(identity, action, [name], describe(changes), count=len(changes))

    def over_caps(name: str, changes: Mapping[str, Any]) -> list[Breach]:
        """What a live change would set over the platform's caps (none: it may be made)."""
        assert caps is not None
        group = proxy.groups[name]
        try:
            changed = apply_overrides(group.yaml, {**group.overrides, **changes})
        except ValidationError:
            return []  # refused as a whole by the models, with their own message
        return live_change_breaches(caps, group.config, changed, changes, proxy.integrations)

    async def clear_live(name: str, fields: list[str] | None, identity: Identity) -> None:
        if fleet is None:
            proxy.clear_overrides(name, fields)
        else:
            try:
                await fleet.clear_overrides(name, fields)
            except StateError as exc:
                raise HTTPException(503, f"the change was not made: {exc}") from None
        what = "every live field" if fields is None else ", ".join(fields)
        await trail.record(identity, Action.RESET, [name], f"back to the YAML: {what}")

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
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            # The refusals are JSON, like every other route's (the route's own class is text).
            **{
                code: {
                    "description": answer["description"],
                    "content": {"application/json": {"schema": _ERROR_REF}},
                }
                for code, answer in _SIGN_IN.items()
            },
        },
    )
    async def metrics(_: Annotated[None, Depends(access.scraper)]) -> Response:
        """Prometheus text format (docs/design.md, section 8)."""
        # Collected on the loop (the collectors read live state unlocked), rendered off it.
        families = list(proxy.metrics.registry.collect())
        body = await asyncio.to_thread(generate_latest, _Collected(families))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/integrations", tags=["integrations"], responses=_SIGN_IN)
    async def list_integrations(identity: Reader) -> schemas.IntegrationList:
        """The caller's integrations with their live status, settings, drift, lag and sizing."""
        return schemas.IntegrationList(integrations=statuses(visible(identity)))

    @app.get("/integrations/{name}", tags=["integrations"], responses={**_SIGN_IN, **_UNKNOWN})
    async def get_integration(name: IntegrationName, identity: Reader) -> schemas.IntegrationStatus:
        """One integration's live status."""
        return status_of(name, identity)

    @app.patch(
        "/integrations/{name}",
        tags=["integrations"],
        responses={**_UNREADABLE, **_REFUSED, **_UNKNOWN, **_STORE_DOWN},
    )
    async def patch_integration(
        name: IntegrationName, patch: schemas.IntegrationPatch, identity: Changer
    ) -> schemas.IntegrationStatus:
        """Sets live values over the YAML for the whole fleet; nothing restarts.

        They apply here at once, on the other replicas within a poll of the
        state store, and on a replica that starts later; they stay until
        cleared or until the YAML says the same.
        """
        status_of(name, identity)
        changes = patch.changes()
        if caps is not None:
            over = over_caps(name, changes)
            if over:
                raise RequestValidationError(
                    [
                        {"loc": ["body", *b.field.split(".")], "msg": b.message, "type": "over_cap"}
                        for b in over
                    ]
                )
        try:
            await set_live(name, changes, identity, Action.TUNE)
        except ValidationError as exc:
            raise _unfit(exc, ("body",), changes) from None
        return status_of(name, identity)

    @app.post(
        "/integrations/{name}/pause",
        tags=["integrations"],
        responses={**_REFUSED, **_UNKNOWN, **_STORE_DOWN},
    )
    async def pause(name: IntegrationName, identity: Changer) -> schemas.IntegrationStatus:
        """Stops reading (in-flight deliveries finish); an override of ``paused``."""
        status_of(name, identity)
        await set_live(name, {"paused": True}, identity, Action.PAUSE)
        return status_of(name, identity)

    @app.post(
        "/integrations/{name}/resume",
        tags=["integrations"],
        responses={**_REFUSED, **_UNKNOWN, **_STORE_DOWN},
    )
    async def resume(name: IntegrationName, identity: Changer) -> schemas.IntegrationStatus:
        """Reads again; an override of ``paused`` (none when the YAML says not paused)."""
        status_of(name, identity)
        await set_live(name, {"paused": False}, identity, Action.RESUME)
        return status_of(name, identity)

    @app.delete(
        "/integrations/{name}/overrides",
        tags=["integrations"],
        responses={**_REFUSED, **_UNKNOWN, **_STORE_DOWN},
    )
    async def clear_overrides(
        name: IntegrationName, identity: Changer
    ) -> schemas.IntegrationStatus:
        """Back to the YAML for every live field, on the whole fleet."""
        status_of(name, identity)
        await clear_live(name, None, identity)
        return status_of(name, identity)

    @app.delete(
        "/integrations/{name}/overrides/{field}",
        tags=["integrations"],
        responses={**_REFUSED, **_UNKNOWN, **_STORE_DOWN},
    )
    async def clear_override(
        name: IntegrationName, field: LiveField, identity: Changer
    ) -> schemas.IntegrationStatus:
        """Back to the YAML for one live field, on the whole fleet."""
        status_of(name, identity)
        try:
            await clear_live(name, [field], identity)
        except ValidationError as exc:
            # What is left over the YAML does not fit without this one.
            raise _unfit(exc, ("path", "field"), {}) from None
        return status_of(name, identity)

    @app.get(
        "/integrations/{name}/offsets",
        tags=["integrations"],
        responses={**_SIGN_IN, **_UNKNOWN, **_BROKER_DOWN},
    )
    async def offsets(name: IntegrationName, identity: Reader) -> schemas.OffsetsStatus:
        """Committed offset, end offset and lag per flow and partition."""
        from nemesis.cli_offsets import _flow_json, _flow_offsets

        status_of(name, identity)
        try:
            found = [
                _flow_json(await _flow_offsets(proxy.broker, flow))
                for flow in proxy.flows(proxy.integrations[name])
            ]
        except BrokerError as exc:
            raise HTTPException(503, f"the broker did not answer: {exc}") from None
        return schemas.OffsetsStatus.model_validate({"integration": name, "flows": found})

    @app.post(
        "/integrations/{name}/offsets/skip",
        tags=["integrations"],
        responses={
            **_UNREADABLE,
            **_REFUSED,
            **_UNKNOWN,
            **_BROKER_DOWN,
            409: {"model": schemas.ErrorMessage, "description": "Not paused, or nothing to move."},
        },
    )
    async def skip(
        name: IntegrationName, request: schemas.SkipRequest, identity: Changer
    ) -> schemas.SkipResult:
        """Passes over the next ``count`` messages unread: only while the integration is paused.

        The way out when one message blocks an ordered integration; each move
        is in the audit log.
        """
        from nemesis.cli_offsets import _committed

        if not status_of(name, identity).paused:
            raise HTTPException(409, f"integration {name!r} is not paused: pause it first")
        flows = {flow.name: flow for flow in proxy.flows(proxy.integrations[name])}
        flow = flows.get(request.flow)
        if flow is None:
            raise HTTPException(409, f"no flow {request.flow!r} (flows: {', '.join(flows)})")
        admin = proxy.broker.admin
        moves = []
        try:
            described = await admin.describe_topic(flow.topic)
            chosen = [
                p
                for p in described.partitions
                if request.partition is None or p.partition == request.partition
            ]
            if not chosen:
                raise HTTPException(409, f"topic {flow.topic} has no partition {request.partition}")
            for info in chosen:
                target = _committed(info, flow.consumer) + request.count
                moves.append(await admin.seek(flow.topic, flow.consumer, info.partition, target))
        except BrokerError as exc:
            raise HTTPException(503, f"the broker did not answer: {exc}") from None
        finally:
            if moves:  # what moved is audited even when a later partition failed
                moved = "; ".join(f"p{m.partition} {m.before}->{m.after}" for m in moves)
                await trail.record(
                    identity,
                    Action.SKIP,
                    [name],
                    f"offsets skip --count {request.count}: flow {flow.name}, topic {flow.topic},"
                    f" consumer {flow.consumer}: {moved}",
                    count=sum(abs(m.after - m.before) for m in moves),
                )
        return schemas.SkipResult(
            integration=name,
            flow=flow.name,
            moves=[
                schemas.OffsetMove(partition=m.partition, before=m.before, after=m.after)
                for m in moves
            ],
        )

    @app.get(
        "/fleet",
        tags=["fleet"],
        responses={
            **_SIGN_IN,
            404: {"model": schemas.ErrorMessage, "description": "Not in a fleet."},
        },
    )
    async def fleet_members(identity: Reader) -> schemas.FleetStatus:
        """The replicas sharing the state store, who runs which integration, the overrides.

        Read from the store now; when it does not answer, as this replica last
        read it, with the failure in ``last_error``. A team sees its own
        integrations and their overrides.
        """
        if fleet is None:
            raise HTTPException(404, "this proxy runs without a fleet state store")
        last_error = fleet.statistics().last_error
        try:
            view = await fleet.store.view()
        except StateError as exc:
            view, last_error = fleet.view, str(exc)
        seen = set(visible(identity))
        replicas = {
            name: group.yaml.replicas for name, group in proxy.groups.items() if name in seen
        }
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
                if i.name in seen
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
                if o.integration in seen
            ],
            last_error=last_error,
        )

    @app.get("/config", tags=["config"], responses=_PLATFORM)
    async def config_status(_: PlatformReader) -> schemas.ConfigStatus:
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
        responses={
            **_REFUSED,
            404: {"model": schemas.ErrorMessage, "description": "No integrations directory."},
        },
    )
    async def reload(identity: PlatformChanger) -> schemas.ReloadResult:
        """Reads integrations/*.yaml again now (as SIGHUP and the file watch do)."""
        if reloader is None:
            raise HTTPException(404, "this proxy was not started from an integrations directory")
        result = reload_result(await reloader.reload("api"))
        await trail.record(
            identity, Action.RELOAD, [], "integrations directory read again", count=0
        )
        return result

    @app.get("/sizing", tags=["config"], responses=_SIGN_IN)
    async def sizing(
        _: Reader,
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

    @app.get(
        "/audit",
        tags=["audit"],
        responses={
            **_SIGN_IN,
            400: {"model": schemas.ErrorMessage, "description": "A cursor this API did not give."},
            404: {"model": schemas.ErrorMessage, "description": "No audit log configured."},
            503: {"model": schemas.ErrorMessage, "description": "The audit log does not answer."},
        },
    )
    async def audit_log(
        identity: Reader,
        limit: Annotated[int, Query(ge=1, le=500)] = 50,
        cursor: Annotated[str | None, Query(max_length=512)] = None,
    ) -> schemas.AuditPage:
        """Who changed what and when, newest first: a team sees the entries of its integrations."""
        if trail.store is None:
            raise HTTPException(404, "this proxy keeps no audit log (no DLQ store)")
        scope = None if identity.admin else frozenset(visible(identity))
        try:
            page = await trail.store.actions(
                PageRequest(limit=limit, cursor=cursor), integrations=scope
            )
        except InvalidQuery as exc:
            raise HTTPException(400, str(exc)) from None
        except DlqError as exc:
            raise HTTPException(503, f"the audit log does not answer: {exc}") from None
        entries = []
        for record in page.rows:
            names = list(record.integrations)
            shown = names if scope is None else [n for n in names if n in scope]
            entries.append(
                schemas.AuditEntry(
                    seq=record.seq,
                    at=record.at,
                    who=record.who,
                    action=record.action.value,
                    integrations=shown,
                    # A count over other teams' integrations too would tell of them.
                    count=record.count if len(shown) == len(names) else None,
                    description=record.description if len(shown) == len(names) else "",
                )
            )
        return schemas.AuditPage(entries=entries, next_cursor=page.next_cursor)

    add_docs(app)
    return app


class _Collected(Collector):
    """Families collected already, for rendering off the event loop."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def _json_safe(value: Any) -> Any:
    """``value`` with every float JSON cannot hold (``1e400`` read as inf, NaN) as text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item) for item in value]
    return value


async def _invalid_request(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422, with what the client sent echoed only as JSON can carry it.

    The default handler echoes the offending input; a number too large for a
    float (``1e400``) arrives as infinity, which JSON has no word for, and the
    answer would fail as a 500.
    """
    assert isinstance(exc, RequestValidationError)
    errors = _json_safe(jsonable_encoder(exc.errors()))
    return JSONResponse({"detail": errors}, status_code=422)


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
