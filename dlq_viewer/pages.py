"""The HTML pages: overview, messages, one message, groups, confirmations, jobs, audit, sign-in."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.datastructures import FormData

from dlq_viewer import render
from dlq_viewer.actions import BulkJob, act_on_ids
from dlq_viewer.auth import (
    DEVICE_COOKIE,
    DEVICE_TTL_S,
    LOGIN_COOKIE,
    LOGIN_FORM_TTL_S,
    SESSION_COOKIE,
    from_own_origin,
)
from dlq_viewer.context import (
    FLASH_COOKIE,
    MAX_FORM_FIELDS,
    Acting,
    FlashKind,
    MaybeSignedIn,
    NotFound,
    SignedIn,
    Viewer,
    ViewerDep,
    audit_view,
    client_of,
    in_scope,
    job_id,
    letter_id,
    open_flash,
    safe_local_path,
    scope_of,
    seal_flash,
)
from dlq_viewer.filters import RANGES, STATUS_ANY, ListFilter
from nemesis.backends.sqs import META_QUEUE_URL
from nemesis.dlq import (
    MAX_PAGE_ROWS,
    Action,
    DeadLetterFilter,
    DeadLetterRow,
    PageRequest,
    Reason,
    Stats,
    Status,
    TimeBucket,
)
from nemesis.errors import InvalidQuery
from nemesis.identity import Identity
from nemesis.topology import META_LAST_SPAN
from nemesis.tracecontext import parse_traceparent, record_context

router = APIRouter(include_in_schema=False)

PAGE_SIZES = (25, 50, 100, 200)
PREVIEW_BYTES = 160  # payload bytes a list row shows under its error
MAX_SELECTED = MAX_PAGE_ROWS
STATUS_CHOICES = (
    (Status.DEAD.value, "Dead (waiting)"),
    (Status.REQUEUED.value, "Requeued"),
    (Status.DISCARDED.value, "Discarded"),
    (STATUS_ANY, "Any status"),
)
CHART_RANGES = {
    "24h": ("24 hours", 3600.0, 24, "hour"),
    "7d": ("7 days", 6 * 3600.0, 28, "6 hours"),
    "30d": ("30 days", 86400.0, 30, "day"),
}
VERBS = {Action.REQUEUE: ("requeue", "requeued"), Action.DISCARD: ("discard", "discarded")}


# --- helpers --------------------------------------------------------------------------


def page(
    request: Request,
    viewer: Viewer,
    identity: Identity,
    template: str,
    context: Mapping[str, Any],
    *,
    nav: str = "",
    status: int = 200,
) -> Response:
    """Renders ``template`` with what every page needs, and consumes the flash message."""
    flash = open_flash(viewer, request.cookies.get(FLASH_COOKIE))
    response = viewer.templates.TemplateResponse(
        request,
        template,
        {
            "identity": identity,
            "csrf_token": viewer.auth.csrf_token(identity),
            "flash": flash,
            "nav": nav,
            "now": viewer.clock.time(),
            **context,
        },
        status_code=status,
    )
    if flash is not None:
        response.delete_cookie(FLASH_COOKIE, path="/")
    return response


def redirect(
    viewer: Viewer, target: str, flash: tuple[FlashKind, str] | None = None
) -> RedirectResponse:
    """A 303 to a page on this site, carrying a message for it."""
    response = RedirectResponse(target, status_code=303)
    if flash is not None:
        response.set_cookie(
            FLASH_COOKIE,
            seal_flash(viewer, *flash),
            max_age=60,
            path="/",
            httponly=True,
            samesite="strict",
            secure=viewer.secure_cookies,
        )
    return response


def sign_in_redirect(request: Request) -> RedirectResponse:
    """To the sign-in page, coming back here afterwards."""
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    target = "/login" if here == "/" else f"/login?{urlencode({'next': here})}"
    return RedirectResponse(target, status_code=303)


def visible_integrations(viewer: Viewer, scope: frozenset[str] | None) -> list[str]:
    """The integration names a filter form offers."""
    return sorted(viewer.integrations if scope is None else scope)


def filter_context(viewer: Viewer, scope: frozenset[str] | None) -> dict[str, Any]:
    """What the filter form macro needs."""
    return {
        "integration_names": visible_integrations(viewer, scope),
        "reasons": [reason.value for reason in Reason],
        "statuses": STATUS_CHOICES,
        "ranges": [(key, label) for key, (label, _) in RANGES.items()],
        "scope": scope,
    }


def preview(row: DeadLetterRow) -> str:
    """The start of a payload, on one line."""
    text = row.payload[:PREVIEW_BYTES].decode("utf-8", errors="replace")
    text = " ".join(text.split())
    return text + ("…" if row.payload_truncated or len(row.payload) > PREVIEW_BYTES else "")


def page_size(text: str | None) -> int:
    """The page size asked for, one of ``PAGE_SIZES``."""
    if not text:
        return 50
    if not text.isdigit() or int(text) not in PAGE_SIZES:
        raise InvalidQuery(f"limit: one of {', '.join(map(str, PAGE_SIZES))}")
    return int(text)


def form_values(form: FormData) -> dict[str, str]:
    """A form's text fields (the last value of each)."""
    return {key: value for key, value in form.items() if isinstance(value, str)}


def empty_stats(now: float, bucket_s: float, buckets: int) -> Stats:
    """The overview of nothing, for someone whose teams own no integration."""
    end = (math.floor(now / bucket_s) + 1) * bucket_s
    return Stats(
        now=now,
        total=0,
        last_hour=0,
        oldest_at=None,
        newest_at=None,
        by_integration=[],
        by_reason={},
        bucket_s=bucket_s,
        buckets=[TimeBucket(end - (buckets - i) * bucket_s, 0) for i in range(buckets)],
    )


# --- overview ------------------------------------------------------------------------------


@router.get("/", response_class=HTMLResponse)
async def overview(
    request: Request,
    identity: SignedIn,
    viewer: ViewerDep,
) -> Response:
    """Dead letters per integration and reason, over time, and the largest groups."""
    chart_range = request.query_params.get("range", "24h")
    if chart_range not in CHART_RANGES:
        raise InvalidQuery(f"range: one of {', '.join(CHART_RANGES)}")
    range_label, bucket_s, buckets, bucket_label = CHART_RANGES[chart_range]
    now = viewer.clock.time()
    scope = scope_of(identity, viewer)
    where = DeadLetterFilter(integrations=scope, status=Status.DEAD)
    if where.matches_nothing:
        stats = empty_stats(now, bucket_s, buckets)
        top_groups: Sequence[Any] = []
    else:
        stats = await viewer.store.stats(where, now=now, bucket_s=bucket_s, buckets=buckets)
        top_groups = await viewer.store.groups(where, limit=5)
    reasons = sorted(stats.by_reason.items(), key=lambda item: (-item[1], item[0]))
    return page(
        request,
        viewer,
        identity,
        "overview.html",
        {
            "stats": stats,
            "scope": scope,
            "growing": [item for item in stats.by_integration if item.last_hour],
            "chart": render.bar_chart(stats.buckets, stats.bucket_s),
            "chart_range": chart_range,
            "chart_ranges": [(key, value[0]) for key, value in CHART_RANGES.items()],
            "range_label": f"last {range_label}",
            "bucket_label": bucket_label,
            "reasons_breakdown": reasons,
            "reasons_peak": max((count for _, count in reasons), default=0),
            "top_groups": top_groups,
        },
        nav="overview",
    )


# --- messages ------------------------------------------------------------------------------


@router.get("/messages", response_class=HTMLResponse)
async def messages(
    request: Request,
    identity: SignedIn,
    viewer: ViewerDep,
) -> Response:
    """The filtered list, newest first, keyset-paged, with counts and bulk actions."""
    params = request.query_params
    now = viewer.clock.time()
    scope = scope_of(identity, viewer)
    form = ListFilter()
    error = None
    rows: Sequence[DeadLetterRow] = []
    next_cursor = None
    count: int | None = None
    cursor = params.get("cursor") or None
    limit = 50
    count_url = ""
    try:
        form = ListFilter.from_params(params)
        where = form.to_filter(scope, now)
        limit = page_size(params.get("limit"))
        result = await viewer.store.query(
            where, PageRequest(limit=limit, cursor=cursor), preview_bytes=PREVIEW_BYTES
        )
        rows, next_cursor = result.rows, result.next_cursor
        if where.text is None:
            # Counting stops at the cap, so the page answers as fast for a million
            # rows as for a thousand; past it, the page fetches the exact count after.
            count = await viewer.store.count(where, limit=viewer.count_cap + 1)
        if count is None or count > viewer.count_cap:
            # A text search reads rows to count them: that comes after the page, too.
            count_url = "/api/messages/count?" + urlencode(_api_params(form, now), doseq=True)
    except InvalidQuery as exc:
        error = str(exc)
        rows, next_cursor, cursor = [], None, None
    base = form.params()
    if limit != 50:
        base["limit"] = str(limit)
    query = urlencode(base)
    here = "/messages" + (f"?{query}" if query else "")
    if cursor:
        here += ("&" if query else "?") + urlencode({"cursor": cursor})
    return page(
        request,
        viewer,
        identity,
        "messages.html",
        {
            **filter_context(viewer, scope),
            "form": form,
            "error": error,
            "rows": rows,
            "count": count,
            "count_cap": viewer.count_cap,
            "count_url": count_url,
            "cursor": cursor,
            "next_cursor": next_cursor,
            "query": query,
            "next_query": urlencode({**base, "cursor": next_cursor or ""}),
            "here": here,
            "limit": limit,
            "preview": preview,
            "scanned_more": bool(form.q) and not rows and next_cursor is not None,
            "scan_rows": 20_000,
        },
        nav="messages",
        status=400 if error else 200,
    )


def _api_params(form: ListFilter, now: float) -> dict[str, str]:
    """The same filter for ``/api/messages/count``, with absolute times."""
    values = {
        "integration": form.integration,
        "reason": form.reason,
        "status": "" if form.status == STATUS_ANY else form.status,
        "http_status": form.http_status,
        "group": form.group,
        "q": form.q,
    }
    since, until = form.time_range(now)
    if since is not None:
        values["since"] = repr(since)
    if until is not None:
        values["until"] = repr(until)
    return {key: value for key, value in values.items() if value}


async def _visible_row(viewer: Viewer, identity: Identity, message_id: str) -> DeadLetterRow:
    row = await viewer.store.get(letter_id(message_id))
    # Someone else's message answers exactly like a missing one.
    if row is None or not in_scope(row.integration, scope_of(identity, viewer)):
        raise NotFound("message")
    return row


@router.get("/messages/{message_id}", response_class=HTMLResponse)
async def message(
    request: Request,
    message_id: str,
    identity: SignedIn,
    viewer: ViewerDep,
) -> Response:
    """One dead letter: error, payload, metadata, source, history, actions."""
    row = await _visible_row(viewer, identity, message_id)
    decoder = viewer.decoders.get(row.integration)
    label = getattr(decoder, "label", "decoded")
    view = render.payload_view(row.payload, decoder=decoder, decoder_label=label)
    return page(
        request,
        viewer,
        identity,
        "message.html",
        {
            "row": row,
            "view": view,
            "hidden_count": render.hidden_characters(view.text)
            + render.hidden_characters(row.error),
            # The trace its attempts were in (the producer's, or one Nemesis started), and
            # that a requeue continues: docs/tracing.md.
            "trace": record_context(row.metadata, row.headers),
            # (trace id, span id, flags) of the attempt that gave up, when it was recorded.
            "last_span": parse_traceparent(row.metadata.get(META_LAST_SPAN)),
        },
        nav="messages",
    )


@router.get("/messages/{message_id}/payload")
async def download_payload(
    message_id: str,
    identity: SignedIn,
    viewer: ViewerDep,
) -> Response:
    """The payload's bytes as a file: never shown by the browser, whatever they contain."""
    row = await _visible_row(viewer, identity, message_id)
    return payload_response(row)


def payload_response(row: DeadLetterRow) -> Response:
    """A download of ``row``'s payload."""
    extension = "json" if render.payload_view(row.payload).kind == "json" else "bin"
    return Response(
        row.payload,
        media_type="application/octet-stream",
        headers={
            "content-disposition": f'attachment; filename="{row.integration}-{row.id}.{extension}"',
            # Even opened directly, the bytes are a sandboxed download, not a page.
            "content-security-policy": "default-src 'none'; sandbox",
        },
    )


@router.post("/messages/{message_id}/{verb}")
async def act_on_message(
    message_id: str,
    verb: str,
    identity: Acting,
    viewer: ViewerDep,
) -> Response:
    """Requeues or discards one message."""
    action = _action(verb)
    row = await _visible_row(viewer, identity, message_id)
    result = await act_on_ids(
        action,
        [row.id],
        store=viewer.store,
        requeuer=viewer.requeuer,
        actor=identity.actor,
        scope=scope_of(identity, viewer),
        description=f"message {row.id}",
        clock=viewer.clock,
    )
    note: tuple[FlashKind, str]
    if not result.count:
        note = ("warn", f"Nothing to {VERBS[action][0]}: the message is not dead any more.")
    elif action is Action.REQUEUE and META_QUEUE_URL in row.metadata:
        note = ("ok", f"Sent back to queue {row.source_topic}.")  # nemesis.broker.sqs.requeue
    elif action is Action.REQUEUE:
        note = ("ok", f"Requeued to {row.integration}'s replay flow.")
    else:
        note = ("ok", "Discarded.")
    return redirect(viewer, f"/messages/{row.id}", note)


def _action(verb: str | None) -> Action:
    if verb == "requeue":
        return Action.REQUEUE
    if verb == "discard":
        return Action.DISCARD
    raise NotFound("action")


@router.post("/actions/selected")
async def act_on_selection(
    request: Request,
    identity: Acting,
    viewer: ViewerDep,
) -> Response:
    """Requeues or discards the rows checked on a list page."""
    form = await request.form(max_files=0, max_fields=MAX_FORM_FIELDS)
    action = _action(_text(form, "action"))
    ids = [value for value in form.getlist("ids") if isinstance(value, str)]
    if not ids:
        raise InvalidQuery("select at least one message")
    if len(ids) > MAX_SELECTED:
        raise InvalidQuery(f"select at most {MAX_SELECTED} messages at once")
    for value in ids:
        letter_id(value)
    result = await act_on_ids(
        action,
        ids,
        store=viewer.store,
        requeuer=viewer.requeuer,
        actor=identity.actor,
        scope=scope_of(identity, viewer),
        description=f"{len(ids)} selected on a list page",
        clock=viewer.clock,
    )
    past = VERBS[action][1]
    skipped = len(set(ids)) - result.count
    plural = "" if result.count == 1 else "s"
    text = f"{past.capitalize()} {render.number(result.count)} message{plural}."
    if skipped:
        text += f" {render.number(skipped)} were not dead any more and were left alone."
    back = safe_local_path(_text(form, "return_to"), "/messages")
    return redirect(viewer, back, ("ok" if result.count else "warn", text))


def _text(form: FormData, name: str) -> str | None:
    value = form.get(name)
    return value if isinstance(value, str) else None


# --- bulk actions ----------------------------------------------------------------------------


@router.get("/actions/confirm", response_class=HTMLResponse)
async def confirm_bulk(
    request: Request,
    identity: SignedIn,
    viewer: ViewerDep,
) -> Response:
    """Says how many dead messages a bulk action would cover, and asks."""
    params = request.query_params
    action = _action(params.get("action"))
    now = viewer.clock.time()
    scope = scope_of(identity, viewer)
    form = ListFilter.from_params(params)
    form.to_filter(scope, now)  # the form as typed must be valid before it is frozen
    frozen = form.frozen_at(now)
    where = frozen.to_filter(scope, now)
    count = await viewer.store.count(where)
    integrations = await _integrations_of(viewer, where)
    rate = None
    if len(integrations) == 1 and integrations[0] in viewer.integrations:
        rate = viewer.integrations[integrations[0]].rate_limits.replay
    back_query = form.query()
    return page(
        request,
        viewer,
        identity,
        "confirm.html",
        {
            "action": action.value,
            "verb": VERBS[action][0],
            "count": count,
            "description": form.describe(now)
            + ("" if form.status == Status.DEAD.value else " (only the dead ones)"),
            "integrations": integrations,
            "rate": rate,
            "frozen": frozen.params(),
            "back": "/messages" + (f"?{back_query}" if back_query else ""),
        },
        nav="messages",
    )


async def _integrations_of(viewer: Viewer, where: DeadLetterFilter) -> list[str]:
    """The integrations a filter pins, if it pins them (by name or by group)."""
    if where.integrations is not None and len(where.integrations) <= 1:
        return sorted(where.integrations)
    if where.signature is not None:
        groups = await viewer.store.groups(where, limit=1)
        return [groups[0].integration] if groups else []
    return []


@router.post("/actions/bulk")
async def start_bulk(
    request: Request,
    identity: Acting,
    viewer: ViewerDep,
) -> Response:
    """Starts a confirmed bulk action in the background; shows its progress page."""
    form = await request.form(max_files=0, max_fields=MAX_FORM_FIELDS)
    values = form_values(form)
    action = _action(values.get("action"))
    now = viewer.clock.time()
    scope = scope_of(identity, viewer)
    # Frozen again: a hand-made post without an end time gets one now.
    frozen = ListFilter.from_params(values).frozen_at(now)
    where = frozen.to_filter(scope, now)
    expected_text = values.get("expected", "")
    expected = int(expected_text) if expected_text.isdigit() and len(expected_text) < 10 else 0
    job = submit_job(viewer, identity, action, where, frozen.describe(now), expected)
    return redirect(viewer, f"/jobs/{job.id}")


def submit_job(
    viewer: Viewer,
    identity: Identity,
    action: Action,
    where: DeadLetterFilter,
    description: str,
    expected: int,
) -> BulkJob:
    """Queues a bulk job for ``identity`` over ``where`` (its scope applied already)."""
    return viewer.jobs.submit(
        action,
        where,
        actor=identity.actor,
        owner=identity.actor,
        scope=scope_of(identity, viewer),
        description=description,
        expected=expected,
    )


def visible_job(viewer: Viewer, identity: Identity, text: str) -> BulkJob:
    """A job its starter (or an admin) may watch; ``NotFound`` for anyone else."""
    job = viewer.jobs.get(job_id(text))
    if job is None or not (identity.admin or job.owner == identity.actor):
        raise NotFound("bulk action")
    return job


@router.get("/jobs/{job}", response_class=HTMLResponse)
async def job_page(
    request: Request,
    job: str,
    identity: SignedIn,
    viewer: ViewerDep,
) -> Response:
    """A bulk action's progress (the page polls ``/api/jobs/{id}``)."""
    found = visible_job(viewer, identity, job)
    return page(request, viewer, identity, "job.html", {"job": found}, nav="audit")


@router.post("/jobs/{job}/stop")
async def stop_job(
    job: str,
    identity: Acting,
    viewer: ViewerDep,
) -> Response:
    """Stops a bulk action after its current round."""
    found = visible_job(viewer, identity, job)
    viewer.jobs.stop(found.id)
    return redirect(viewer, f"/jobs/{found.id}", ("ok", "Stopping after the current round."))


# --- groups and audit ---------------------------------------------------------------------------


GROUP_LIMIT = 200


@router.get("/groups", response_class=HTMLResponse)
async def groups(
    request: Request,
    identity: SignedIn,
    viewer: ViewerDep,
) -> Response:
    """Failures grouped by signature, largest first, each with its bulk actions."""
    now = viewer.clock.time()
    scope = scope_of(identity, viewer)
    form = ListFilter()
    error = None
    found: Sequence[Any] = []
    try:
        form = ListFilter.from_params(request.query_params)
        form = replace(form, q="")  # groups come from indexes; text would read every row
        where = form.to_filter(scope, now)
        if not where.matches_nothing:
            found = await viewer.store.groups(where, limit=GROUP_LIMIT)
    except InvalidQuery as exc:
        error = str(exc)
    return page(
        request,
        viewer,
        identity,
        "groups.html",
        {
            **filter_context(viewer, scope),
            "form": form,
            "error": error,
            "groups": found,
            "limit": GROUP_LIMIT,
        },
        nav="groups",
        status=400 if error else 200,
    )


@router.get("/audit", response_class=HTMLResponse)
async def audit(
    request: Request,
    identity: SignedIn,
    viewer: ViewerDep,
) -> Response:
    """Who requeued or discarded what, when, and how many; and the bulk actions running."""
    scope = scope_of(identity, viewer)
    cursor = request.query_params.get("cursor") or None
    entries = await viewer.store.actions(PageRequest(limit=50, cursor=cursor), integrations=scope)
    shown = []
    for entry in entries.rows:
        # Only what the reader may see: their integrations' names, and no one else's words.
        names, count, description = audit_view(entry, scope)
        shown.append(
            {
                "at": entry.at,
                "who": entry.who,
                "action": entry.action.value,
                "count": count,
                "description": description,
                "shown_integrations": render.join_names(names),
            }
        )
    jobs = [job for job in viewer.jobs.recent() if identity.admin or job.owner == identity.actor][
        :20
    ]
    return page(
        request,
        viewer,
        identity,
        "audit.html",
        {
            "entries": shown,
            "cursor": cursor,
            "next_cursor": entries.next_cursor,
            "jobs": jobs,
        },
        nav="audit",
    )


# --- sign-in ----------------------------------------------------------------------------------


def _login_page(
    viewer: Viewer,
    request: Request,
    *,
    next_path: str,
    error: str | None = None,
    notice: str | None = None,
    username: str = "",
    status: int = 200,
) -> Response:
    nonce = viewer.auth.new_login_nonce()
    response = viewer.templates.TemplateResponse(
        request,
        "login.html",
        {
            "error": error,
            "notice": notice,
            "next": next_path,
            "username": username,
            "login_token": viewer.auth.login_form_token(nonce),
            "password_sign_in": bool(viewer.auth.config.users),
        },
        status_code=status,
    )
    response.set_cookie(
        LOGIN_COOKIE,
        nonce,
        max_age=LOGIN_FORM_TTL_S,
        path="/login",
        httponly=True,
        samesite="strict",
        secure=viewer.secure_cookies,
    )
    return response


@router.get("/login", response_class=HTMLResponse)
async def login_form(
    request: Request,
    identity: MaybeSignedIn,
    viewer: ViewerDep,
) -> Response:
    """The sign-in form (or straight on, for someone signed in already)."""
    next_path = safe_local_path(request.query_params.get("next"))
    if identity is not None:
        return RedirectResponse(next_path, status_code=303)
    flash = open_flash(viewer, request.cookies.get(FLASH_COOKIE))
    response = _login_page(viewer, request, next_path=next_path, notice=flash[1] if flash else None)
    if flash is not None:
        response.delete_cookie(FLASH_COOKIE, path="/")
    return response


@router.post("/login")
async def login(request: Request, viewer: ViewerDep) -> Response:
    """Checks a user name and password; starts a session."""
    form = form_values(await request.form(max_files=0, max_fields=10))
    next_path = safe_local_path(form.get("next"))
    username = form.get("username", "").strip()[:128]
    password = form.get("password", "")
    # A page elsewhere (another port of this host is same-site) must not sign a browser in.
    own_origin = from_own_origin(
        request.headers, scheme=request.url.scheme, secure=viewer.secure_cookies
    )
    if not own_origin or not await viewer.auth.check_login_form(
        request.cookies.get(LOGIN_COOKIE), form.get("csrf_token")
    ):
        return _login_page(
            viewer,
            request,
            next_path=next_path,
            username=username,
            error="The sign-in form expired. Please try again.",
            status=403,
        )
    address = client_of(request, viewer)
    # A browser this user signed in on before counts its own failures (a device cookie);
    # others count per name and address, and per address.
    device = viewer.auth.known_device(request.cookies.get(DEVICE_COOKIE), username)
    wait_s = await viewer.auth.sign_in_wait_s(username, address, device)
    if wait_s > 0:
        seconds = math.ceil(wait_s)
        refused = _login_page(
            viewer,
            request,
            next_path=next_path,
            username=username,
            error=f"Too many failed sign-ins. Try again in {render.duration(seconds)}.",
            status=429,
        )
        refused.headers["retry-after"] = str(seconds)
        return refused
    user = await viewer.auth.check_password(username, password) if username and password else None
    if user is None:
        await viewer.auth.sign_in_failed(username, address, device)
        return _login_page(
            viewer,
            request,
            next_path=next_path,
            username=username,
            error="Wrong user name or password.",
            status=401,
        )
    await viewer.auth.sign_in_succeeded(username, address, device)
    response = RedirectResponse(next_path, status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        viewer.auth.new_session(user),
        max_age=int(viewer.auth.config.session_ttl_s),
        path="/",
        httponly=True,
        samesite="strict",
        secure=viewer.secure_cookies,
    )
    response.set_cookie(
        DEVICE_COOKIE,
        viewer.auth.new_device(user),
        max_age=DEVICE_TTL_S,
        path="/login",
        httponly=True,
        samesite="strict",
        secure=viewer.secure_cookies,
    )
    response.delete_cookie(LOGIN_COOKIE, path="/login")
    return response


@router.post("/logout")
async def logout(request: Request, identity: Acting, viewer: ViewerDep) -> Response:
    """Ends the session on the server too: a copy of its cookie no longer works."""
    await viewer.auth.end_session(request.cookies.get(SESSION_COOKIE))
    response = redirect(viewer, "/login", ("ok", "Signed out."))
    response.delete_cookie(SESSION_COOKIE, path="/")
    return response


@router.get("/healthz", include_in_schema=False)
async def health() -> Response:
    """For load balancers: the process answers (no sign-in, no store call)."""
    return Response("ok\n", media_type="text/plain")
