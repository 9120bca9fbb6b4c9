"""The JSON API under ``/api``: the pages' operations for scripts and the CLI.

Authenticate with ``Authorization: Bearer <token>`` (tokens from
``auth.tokens``) or a browser session; a session's state changes need its
CSRF token in ``X-CSRF-Token``. Times are Unix seconds (UTC). A filter
left open matches everything the caller may see; the caller's teams decide
which integrations that is, and an integration outside them matches
nothing. Errors are ``{"detail": ...}``: 400 for a filter or cursor the
store refuses, 401 without credentials, 403 without a CSRF token, 404 for
anything unknown or not yours, 422 for a malformed field, 429 when too many
bulk actions are running.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from dlq_viewer.actions import BulkJob, JobState, act_on_ids
from dlq_viewer.auth import SESSION_COOKIE
from dlq_viewer.context import (
    Acting,
    NotFound,
    SignedIn,
    Viewer,
    ViewerDep,
    audit_view,
    in_scope,
    letter_id,
    scope_of,
)
from dlq_viewer.filters import check_time, filter_terms, integration_name, parse_time, search_text
from dlq_viewer.pages import payload_response, submit_job, visible_job
from dlq_viewer.render import utc
from nemesis.dlq import (
    MAX_PAGE_ROWS,
    MAX_TEXT_CHARS,
    Action,
    ActionRecord,
    DeadLetterFilter,
    DeadLetterRow,
    Group,
    PageRequest,
    Reason,
    Status,
)
from nemesis.dlq.port import shown_key
from nemesis.dlq.requeue import ActionResult
from nemesis.errors import InvalidQuery
from nemesis.identity import Identity, Method

router = APIRouter(prefix="/api", tags=["dlq"])

MAX_IDS = 1000
MAX_QUERY_INTEGRATIONS = 100
PREVIEW_BYTES = 256
SIGNATURE = r"^[0-9a-f]{16}$"
LETTER_ID = r"^[0-9a-f]{32}$"


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- how to authenticate, and how a request fails (the OpenAPI document says both) --------------

SECURITY_SCHEMES: dict[str, dict[str, str]] = {
    "bearerToken": {
        "type": "http",
        "scheme": "bearer",
        "description": "An API token of auth.tokens (`python -m dlq_viewer.hash_password --token`"
        " makes one); requests carrying it need no CSRF token.",
    },
    "sessionCookie": {
        "type": "apiKey",
        "in": "cookie",
        "name": SESSION_COOKIE,
        "description": "The session a browser gets by signing in at /login.",
    },
    "csrfToken": {
        "type": "apiKey",
        "in": "header",
        "name": "X-CSRF-Token",
        "description": "With a session cookie, every change carries the session's CSRF token"
        ' (the pages\' <meta name="csrf-token">).',
    },
}
_READ_SECURITY: list[dict[str, list[str]]] = [{"bearerToken": []}, {"sessionCookie": []}]
_CHANGE_SECURITY: list[dict[str, list[str]]] = [
    {"bearerToken": []},
    {"sessionCookie": [], "csrfToken": []},
]


class ErrorOut(ApiModel):
    """Why a request was refused (422 answers list the fields instead)."""

    detail: str


_ERRORS: dict[int, str] = {
    400: "A filter, time or cursor that does not work (``detail`` names the field),"
    " or a malformed Content-Length.",
    401: "No valid session or bearer token.",
    403: "A session's change without its CSRF token.",
    404: "No such thing, or not one of yours (the same answer).",
    411: "A body without Content-Length.",
    413: "A body over 1 MiB.",
    429: "Too many bulk actions are queued or running.",
    503: "The dead-letter store is not answering; try again.",
}


def _documented(codes: Sequence[int], *, changes: bool = False) -> dict[str, Any]:
    """Route options declaring its security and its error answers in the OpenAPI document."""
    codes = sorted({401, *codes, *((400, 403, 411, 413) if changes else ())})
    return {
        "responses": {code: {"model": ErrorOut, "description": _ERRORS[code]} for code in codes},
        "openapi_extra": {"security": _CHANGE_SECURITY if changes else _READ_SECURITY},
    }


# --- answers ---------------------------------------------------------------------------------


class PastFailureOut(ApiModel):
    """An earlier failure of a message."""

    dead_lettered_at: float
    reason: Reason
    http_status: int | None
    attempts: int
    error: str


class MessageOut(ApiModel):
    """A dead letter in a list (the payload's start only)."""

    id: str
    integration: str
    event_id: str
    status: Status
    reason: Reason
    http_status: int | None
    error: str
    signature: str = Field(description="its failure group")
    attempts: int
    first_failure_at: float
    dead_lettered_at: float
    requeue_count: int
    last_action: Action | None
    last_action_by: str | None
    last_action_at: float | None
    source_topic: str
    source_partition: int
    source_offset: int
    key: str | None
    stage: str | None
    payload_size: int
    payload_preview: str = Field(
        description="the payload's first bytes as UTF-8 (invalid bytes replaced)"
    )

    @classmethod
    def of(cls, row: DeadLetterRow) -> MessageOut:
        """The list form of a row."""
        return cls(**_common(row))


class MessageDetailOut(MessageOut):
    """One dead letter with its whole payload, metadata and history."""

    metadata: dict[str, str]
    history: list[PastFailureOut]
    payload_base64: str
    payload_text: str | None = Field(
        description="the payload as UTF-8, or null when it is not text"
    )

    @classmethod
    def of(cls, row: DeadLetterRow) -> MessageDetailOut:
        """The detail form of a row."""
        try:
            text: str | None = row.payload.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        return cls(
            **_common(row),
            metadata=dict(row.metadata),
            history=[
                PastFailureOut(
                    dead_lettered_at=past.dead_lettered_at,
                    reason=past.reason,
                    http_status=past.http_status,
                    attempts=past.attempts,
                    error=past.error,
                )
                for past in row.history
            ],
            payload_base64=base64.b64encode(row.payload).decode("ascii"),
            payload_text=text,
        )


def _common(row: DeadLetterRow) -> dict[str, object]:
    return {
        "id": row.id,
        "integration": row.integration,
        "event_id": row.event_id,
        "status": row.status,
        "reason": row.reason,
        "http_status": row.http_status,
        "error": row.error,
        "signature": row.signature,
        "attempts": row.attempts,
        "first_failure_at": row.first_failure_at,
        "dead_lettered_at": row.dead_lettered_at,
        "requeue_count": row.requeue_count,
        "last_action": row.last_action,
        "last_action_by": row.last_action_by,
        "last_action_at": row.last_action_at,
        "source_topic": row.source_topic,
        "source_partition": row.source_partition,
        "source_offset": row.source_offset,
        "key": shown_key(row.key),
        "stage": row.stage,
        "payload_size": row.payload_size,
        "payload_preview": row.payload[:PREVIEW_BYTES].decode("utf-8", errors="replace"),
    }


class MessagePageOut(ApiModel):
    """A page of dead letters, newest first; pass ``next_cursor`` as ``cursor`` for the next."""

    rows: list[MessageOut]
    next_cursor: str | None


class CountOut(ApiModel):
    """How many dead letters a filter matches."""

    count: int


class GroupOut(ApiModel):
    """Failures with one signature (integration, reason, HTTP status, error pattern)."""

    signature: str
    integration: str
    reason: Reason
    http_status: int | None
    pattern: str
    sample_error: str
    count: int
    first_at: float
    last_at: float

    @classmethod
    def of(cls, group: Group) -> GroupOut:
        """The API form of a group."""
        return cls(
            signature=group.signature,
            integration=group.integration,
            reason=group.reason,
            http_status=group.http_status,
            pattern=group.pattern,
            sample_error=group.sample_error,
            count=group.count,
            first_at=group.first_at,
            last_at=group.last_at,
        )


class IntegrationStatsOut(ApiModel):
    """One integration's share of the overview."""

    integration: str
    total: int
    last_hour: int
    by_reason: dict[Reason, int]
    oldest_at: float
    newest_at: float


class BucketOut(ApiModel):
    """Dead letters in ``[start, start + bucket_s)``."""

    start: float
    count: int


class StatsOut(ApiModel):
    """The overview: totals, per integration (growing first), per reason, over time."""

    now: float
    total: int
    last_hour: int
    oldest_at: float | None
    newest_at: float | None
    by_integration: list[IntegrationStatsOut]
    by_reason: dict[Reason, int]
    bucket_s: float
    buckets: list[BucketOut]


class ActionResultOut(ApiModel):
    """What a requeue or discard of ids moved, per integration."""

    action: Action
    count: int
    by_integration: dict[str, int]

    @classmethod
    def of(cls, result: ActionResult) -> ActionResultOut:
        """The API form of an action's result."""
        return cls(action=result.action, count=result.count, by_integration=result.by_integration)


class JobOut(ApiModel):
    """A bulk action running in the background."""

    id: str
    action: Action
    state: JobState
    actor: str
    description: str
    expected: int
    done: int
    rounds: int
    percent: float
    finished: bool
    created_at: float
    started_at: float | None
    finished_at: float | None
    error: str | None
    by_integration: dict[str, int]

    @classmethod
    def of(cls, job: BulkJob) -> JobOut:
        """The API form of a job."""
        return cls(
            id=job.id,
            action=job.action,
            state=job.state,
            actor=job.actor,
            description=job.description,
            expected=job.expected,
            done=job.done,
            rounds=job.rounds,
            percent=round(job.percent, 1),
            finished=job.finished,
            created_at=job.created_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            error=job.error,
            by_integration=dict(job.by_integration),
        )


class AuditEntryOut(ApiModel):
    """One audit-log entry."""

    seq: int
    at: float
    who: str
    action: Action
    integrations: list[str]
    # Messages of your integrations the action touched (an admin sees the whole count); null
    # for an older entry that also covered other teams' integrations and has no split.
    count: int | None
    description: str


class AuditPageOut(ApiModel):
    """Audit entries, newest first."""

    rows: list[AuditEntryOut]
    next_cursor: str | None


class MeOut(ApiModel):
    """The caller, and the integrations they may see and act on."""

    name: str
    teams: list[str]
    admin: bool
    method: Method
    integrations: list[str] | None = Field(description="null for an admin: every integration")


# --- requests -----------------------------------------------------------------------------------


class FilterIn(ApiModel):
    """Which dead letters a bulk action covers (only ``dead`` ones are ever acted on)."""

    integrations: Annotated[
        list[Annotated[str, Field(max_length=63)]] | None, Field(max_length=1000)
    ] = None
    reason: Reason | None = None
    http_status: Annotated[int, Field(ge=100, le=599)] | None = None
    group: Annotated[str, Field(pattern=SIGNATURE)] | None = None
    since: float | None = None
    until: float | None = None
    text: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | None = None


class JobIn(ApiModel):
    """A bulk action over a filter."""

    action: Literal["requeue", "discard"]
    filter: FilterIn = FilterIn()


class IdsIn(ApiModel):
    """Dead letters by id."""

    ids: Annotated[
        list[Annotated[str, Field(pattern=LETTER_ID)]], Field(min_length=1, max_length=MAX_IDS)
    ]


# --- filters from the query string --------------------------------------------------------------


def _scoped(names: Sequence[str], scope: frozenset[str] | None) -> frozenset[str] | None:
    if not names:
        return scope
    wanted = frozenset(integration_name(name) for name in names)
    return wanted if scope is None else wanted & scope


def query_filter(
    integration: Annotated[
        list[str] | None, Query(description="repeat for several; omitted: all you may see")
    ] = None,
    reason: Reason | None = None,
    status: Annotated[Status | None, Query(description="omitted: any status")] = None,
    http_status: Annotated[int | None, Query(ge=100, le=599)] = None,
    group: Annotated[str | None, Query(pattern=SIGNATURE)] = None,
    since: Annotated[
        str | None, Query(max_length=40, description="Unix seconds or ISO 8601 (UTC if no zone)")
    ] = None,
    until: Annotated[str | None, Query(max_length=40)] = None,
    q: Annotated[
        str | None,
        Query(max_length=MAX_TEXT_CHARS, description="text inside the payload or the error"),
    ] = None,
    *,
    identity: SignedIn,
    viewer: ViewerDep,
) -> DeadLetterFilter:
    """The filter in the query string, within the caller's scope."""
    names = integration or []
    if len(names) > MAX_QUERY_INTEGRATIONS:
        raise InvalidQuery(f"name at most {MAX_QUERY_INTEGRATIONS} integrations")
    return DeadLetterFilter(
        integrations=_scoped(names, scope_of(identity, viewer)),
        reason=reason,
        status=status,
        http_status=http_status,
        signature=group,
        since=None if since is None else parse_time(since, "since"),
        until=None if until is None else parse_time(until, "until"),
        text=search_text(q) if q else None,
    )


QueryFilter = Annotated[DeadLetterFilter, Depends(query_filter)]


# --- endpoints ------------------------------------------------------------------------------------


@router.get("/me", **_documented(()))
async def me(identity: SignedIn, viewer: ViewerDep) -> MeOut:
    """Who you are and what you may see."""
    scope = scope_of(identity, viewer)
    return MeOut(
        name=identity.name,
        teams=sorted(identity.teams),
        admin=identity.admin,
        method=identity.method,
        integrations=None if scope is None else sorted(scope),
    )


@router.get("/messages", **_documented((400, 503)))
async def list_messages(
    where: QueryFilter,
    viewer: ViewerDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_ROWS)] = 50,
    cursor: Annotated[str | None, Query(max_length=256)] = None,
) -> MessagePageOut:
    """Dead letters, newest first, one keyset page at a time.

    A text search reads at most a bounded stretch of rows per page, so a page
    may hold fewer rows than asked (even none) and still have a ``next_cursor``.
    """
    page = await viewer.store.query(where, PageRequest(limit=limit, cursor=cursor))
    return MessagePageOut(
        rows=[MessageOut.of(row) for row in page.rows], next_cursor=page.next_cursor
    )


@router.get("/messages/count", **_documented((400, 503)))
async def count_messages(where: QueryFilter, viewer: ViewerDep) -> CountOut:
    """How many dead letters match (a text search reads every candidate: seconds at millions)."""
    return CountOut(count=await viewer.store.count(where))


async def _visible(viewer: Viewer, identity: Identity, message_id: str) -> DeadLetterRow:
    row = await viewer.store.get(letter_id(message_id))
    if row is None or not in_scope(row.integration, scope_of(identity, viewer)):
        raise NotFound("message")
    return row


@router.get("/messages/{message_id}", **_documented((404, 503)))
async def get_message(
    message_id: str,
    identity: SignedIn,
    viewer: ViewerDep,
) -> MessageDetailOut:
    """One dead letter with its whole payload (base64, and as text when it is UTF-8)."""
    return MessageDetailOut.of(await _visible(viewer, identity, message_id))


_PAYLOAD_DOC = _documented((404, 503))


@router.get(
    "/messages/{message_id}/payload",
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}, **_PAYLOAD_DOC["responses"]},
    openapi_extra=_PAYLOAD_DOC["openapi_extra"],
)
async def get_payload(
    message_id: str,
    identity: SignedIn,
    viewer: ViewerDep,
) -> Response:
    """The payload's bytes, as a download."""
    return payload_response(await _visible(viewer, identity, message_id))


@router.get("/groups", **_documented((400, 503)))
async def list_groups(
    where: QueryFilter,
    viewer: ViewerDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[GroupOut]:
    """Matching dead letters grouped by failure signature, largest first."""
    if where.matches_nothing:
        return []
    return [GroupOut.of(group) for group in await viewer.store.groups(where, limit=limit)]


@router.get("/stats", **_documented((400, 503)))
async def stats(
    where: QueryFilter,
    viewer: ViewerDep,
    bucket_s: Annotated[float, Query(ge=60, le=30 * 86400)] = 3600.0,
    buckets: Annotated[int, Query(ge=1, le=1000)] = 24,
) -> StatsOut:
    """Totals per integration and reason, oldest and newest, and counts over time."""
    result = await viewer.store.stats(
        where, now=viewer.clock.time(), bucket_s=bucket_s, buckets=buckets
    )
    return StatsOut(
        now=result.now,
        total=result.total,
        last_hour=result.last_hour,
        oldest_at=result.oldest_at,
        newest_at=result.newest_at,
        by_integration=[
            IntegrationStatsOut(
                integration=item.integration,
                total=item.total,
                last_hour=item.last_hour,
                by_reason=dict(item.by_reason),
                oldest_at=item.oldest_at,
                newest_at=item.newest_at,
            )
            for item in result.by_integration
        ],
        by_reason=dict(result.by_reason),
        bucket_s=result.bucket_s,
        buckets=[BucketOut(start=bucket.start, count=bucket.count) for bucket in result.buckets],
    )


async def _act(action: Action, body: IdsIn, identity: Identity, viewer: Viewer) -> ActionResultOut:
    result = await act_on_ids(
        action,
        body.ids,
        store=viewer.store,
        requeuer=viewer.requeuer,
        actor=identity.actor,
        scope=scope_of(identity, viewer),
        description=f"{len(set(body.ids))} by id (API)",
        clock=viewer.clock,
    )
    return ActionResultOut.of(result)


@router.post("/requeue", **_documented((503,), changes=True))
async def requeue_ids(
    body: IdsIn,
    identity: Acting,
    viewer: ViewerDep,
) -> ActionResultOut:
    """Requeues dead letters by id to their integrations' replay flows.

    Ids that are unknown, not yours, or not ``dead`` are left alone; the
    answer counts what moved.
    """
    return await _act(Action.REQUEUE, body, identity, viewer)


@router.post("/discard", **_documented((503,), changes=True))
async def discard_ids(
    body: IdsIn,
    identity: Acting,
    viewer: ViewerDep,
) -> ActionResultOut:
    """Discards dead letters by id (same rules as requeue)."""
    return await _act(Action.DISCARD, body, identity, viewer)


@router.post("/jobs", status_code=202, **_documented((400, 429, 503), changes=True))
async def start_job(
    body: JobIn,
    identity: Acting,
    viewer: ViewerDep,
) -> JobOut:
    """Starts a bulk requeue or discard of every dead letter a filter matches, now.

    Runs in the background in rounds; poll ``GET /api/jobs/{id}``. Rows
    that die after this call are not included.
    """
    now = viewer.clock.time()
    spec = body.filter
    if spec.since is not None:
        check_time(spec.since, "filter.since")
    if spec.until is not None:
        check_time(spec.until, "filter.until")
    until = now if spec.until is None else min(spec.until, now)
    where = DeadLetterFilter(
        integrations=_scoped(spec.integrations or [], scope_of(identity, viewer)),
        reason=spec.reason,
        status=Status.DEAD,
        http_status=spec.http_status,
        signature=spec.group,
        since=spec.since,
        until=until,
        text=search_text(spec.text) if spec.text else None,
    )
    expected = await viewer.store.count(where)
    action = Action(body.action)
    description = _describe(spec, until)
    job = submit_job(viewer, identity, action, where, description, expected)
    return JobOut.of(job)


def _describe(spec: FilterIn, until: float) -> str:
    parts = []
    if spec.integrations:
        parts.append(f"integrations {', '.join(sorted(spec.integrations))}")
    reason = spec.reason.value if spec.reason else None
    parts += filter_terms(spec.group, reason, spec.http_status, spec.text)
    if spec.since is not None:
        parts.append(f"since {utc(spec.since)}")
    parts.append(f"before {utc(until)}")
    return ", ".join(parts) + " (API)"


@router.get("/jobs", **_documented(()))
async def list_jobs(identity: SignedIn, viewer: ViewerDep) -> list[JobOut]:
    """Your bulk actions since the viewer started (all of them, for an admin), newest first."""
    return [
        JobOut.of(job)
        for job in viewer.jobs.recent()
        if identity.admin or job.owner == identity.actor
    ]


@router.get("/jobs/{job}", **_documented((404,)))
async def get_job(job: str, identity: SignedIn, viewer: ViewerDep) -> JobOut:
    """A bulk action's progress."""
    return JobOut.of(visible_job(viewer, identity, job))


@router.post("/jobs/{job}/stop", **_documented((404,), changes=True))
async def stop_job(job: str, identity: Acting, viewer: ViewerDep) -> JobOut:
    """Stops a bulk action after its current round."""
    found = visible_job(viewer, identity, job)
    viewer.jobs.stop(found.id)
    return JobOut.of(found)


@router.get("/audit", **_documented((400, 503)))
async def audit_log(
    identity: SignedIn,
    viewer: ViewerDep,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_ROWS)] = 50,
    cursor: Annotated[str | None, Query(max_length=256)] = None,
) -> AuditPageOut:
    """Requeues and discards, newest first (for a team: those touching its integrations)."""
    scope = scope_of(identity, viewer)
    page = await viewer.store.actions(PageRequest(limit=limit, cursor=cursor), integrations=scope)
    return AuditPageOut(
        rows=[_entry(entry, scope) for entry in page.rows], next_cursor=page.next_cursor
    )


def _entry(entry: ActionRecord, scope: frozenset[str] | None) -> AuditEntryOut:
    names, count, description = audit_view(entry, scope)
    return AuditEntryOut(
        seq=entry.seq,
        at=entry.at,
        who=entry.who,
        action=entry.action,
        integrations=names,
        count=count,
        description=description,
    )
