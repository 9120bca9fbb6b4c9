"""The team console's pages: a team's integrations, one integration, the owners' forms.

Every form is a POST carrying the CSRF token (``context.Acting``) like the
requeue forms; a change is answered with a redirect back and a flash line.
An integration the caller may not see answers 404 on every route, as one
that does not exist; one they may see but not change (a platform admin who
is not an owner) answers 403 to a change.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, Response

from dlq_viewer.console import (
    NUMBER_FIELDS,
    Console,
    ConsoleRefused,
    IntegrationView,
    StoreUnavailable,
    flag_types,
    tuning_changes,
)
from dlq_viewer.context import MAX_FORM_FIELDS, Acting, NotFound, SignedIn, Viewer, ViewerDep
from dlq_viewer.pages import page, redirect
from nemesis.config.models import IntegrationConfig
from nemesis.dlq import Action
from nemesis.identity import Identity

router = APIRouter(include_in_schema=False)

MAX_NAME_CHARS = 200


def _console(viewer: Viewer) -> Console:
    if viewer.console is None:
        raise NotFound("page")
    return viewer.console


def _visible(console: Console, identity: Identity, name: str) -> IntegrationConfig:
    config = None if len(name) > MAX_NAME_CHARS else console.config_of(identity, name)
    if config is None:
        raise NotFound("integration")
    return config


def _owned(console: Console, identity: Identity, name: str) -> IntegrationConfig:
    config = _visible(console, identity, name)
    if not console.is_owner(identity, config):
        raise HTTPException(
            403,
            "Read-only: only the integration's owners change it here"
            " (the platform uses the admin API).",
        )
    return config


def _unavailable(request: Request, viewer: Viewer, identity: Identity, exc: Exception) -> Response:
    return page(
        request,
        viewer,
        identity,
        "error.html",
        {
            "heading": "The fleet's state store is not answering",
            "message": "The console reads and changes integrations there. Try again in a moment.",
            "back_href": "/console",
            "back_label": "Console",
        },
        nav="console",
        status=503,
    )


@router.get("/console", response_class=HTMLResponse)
async def console_list(request: Request, identity: SignedIn, viewer: ViewerDep) -> Response:
    """The caller's integrations, each with its live state."""
    console = _console(viewer)
    try:
        views = await console.views(identity, console.visible(identity))
    except StoreUnavailable as exc:
        return _unavailable(request, viewer, identity, exc)
    return page(request, viewer, identity, "console.html", {"views": views}, nav="console")


@router.get("/console/{name}", response_class=HTMLResponse)
async def console_integration(
    request: Request, name: str, identity: SignedIn, viewer: ViewerDep
) -> Response:
    """One integration: its state, its live settings and drift, and the owners' forms."""
    console = _console(viewer)
    _visible(console, identity, name)
    try:
        (view,) = await console.views(identity, [name])
    except StoreUnavailable as exc:
        return _unavailable(request, viewer, identity, exc)
    return page(
        request,
        viewer,
        identity,
        "console_integration.html",
        {"view": view, "fields": _fields(view), "href": _href(name)},
        nav="console",
    )


def _href(name: str) -> str:
    from urllib.parse import quote

    return "/console/" + quote(name, safe="")


def _fields(view: IntegrationView) -> list[dict[str, Any]]:
    running = {setting.field: setting for setting in view.settings}
    return [
        {
            "path": path,
            "label": label,
            "value": "" if running[path].value is None else running[path].value,
            "yaml": running[path].yaml,
            "drift": running[path].drift,
            "step": "any" if kind is float else "1",
        }
        for path, label, kind in NUMBER_FIELDS
    ]


async def _form(request: Request) -> dict[str, str]:
    form = await request.form(max_files=0, max_fields=MAX_FORM_FIELDS)
    return {key: value for key, value in form.items() if isinstance(value, str)}


async def _change(
    request: Request,
    viewer: Viewer,
    identity: Identity,
    name: str,
    changes: dict[str, Any],
    action: Action,
    done: str,
) -> Response:
    console = _console(viewer)
    target = _href(name)
    if not changes:
        return redirect(viewer, target, ("warn", "Nothing to change: the values are as they run."))
    try:
        described = await console.change(identity, name, changes, action)
    except ConsoleRefused as exc:
        return redirect(viewer, target, ("error", f"Not changed: {exc}"))
    except StoreUnavailable:
        return redirect(
            viewer, target, ("error", "Not changed: the fleet's state store is not answering.")
        )
    return redirect(viewer, target, ("ok", f"{done}: {described}. Every replica applies it."))


@router.post("/console/{name}/pause")
async def console_pause(
    request: Request, name: str, identity: Acting, viewer: ViewerDep
) -> Response:
    """Stops reading on every replica (in-flight deliveries finish)."""
    _owned(_console(viewer), identity, name)
    return await _change(request, viewer, identity, name, {"paused": True}, Action.PAUSE, "Paused")


@router.post("/console/{name}/resume")
async def console_resume(
    request: Request, name: str, identity: Acting, viewer: ViewerDep
) -> Response:
    """Reads again on every replica."""
    _owned(_console(viewer), identity, name)
    return await _change(
        request, viewer, identity, name, {"paused": False}, Action.RESUME, "Resumed"
    )


@router.post("/console/{name}/tune")
async def console_tune(
    request: Request, name: str, identity: Acting, viewer: ViewerDep
) -> Response:
    """Sets live numbers (workers, buffer, batch, rate limits) over the YAML."""
    console = _console(viewer)
    _owned(console, identity, name)
    try:
        (view,) = await console.views(identity, [name])
        changes = tuning_changes(await _form(request), {s.field: s.value for s in view.settings})
    except ConsoleRefused as exc:
        return redirect(viewer, _href(name), ("error", f"Not changed: {exc}"))
    except StoreUnavailable:
        return redirect(
            viewer, _href(name), ("error", "Not changed: the fleet's state store is not answering.")
        )
    return await _change(request, viewer, identity, name, changes, Action.TUNE, "Re-tuned")


@router.post("/console/{name}/flags")
async def console_flags(
    request: Request, name: str, identity: Acting, viewer: ViewerDep
) -> Response:
    """Sets the message types acknowledged without delivery."""
    _owned(_console(viewer), identity, name)
    try:
        types = flag_types((await _form(request)).get("disabled_types", ""))
    except ConsoleRefused as exc:
        return redirect(viewer, _href(name), ("error", f"Not changed: {exc}"))
    return await _change(
        request,
        viewer,
        identity,
        name,
        {"flags.disabled_types": types},
        Action.TUNE,
        "Flags set",
    )


@router.post("/console/{name}/reset")
async def console_reset(
    request: Request, name: str, identity: Acting, viewer: ViewerDep
) -> Response:
    """Every live field back to the YAML (the drift ends)."""
    console = _console(viewer)
    _owned(console, identity, name)
    try:
        await console.reset(identity, name)
    except StoreUnavailable:
        return redirect(
            viewer, _href(name), ("error", "Not changed: the fleet's state store is not answering.")
        )
    return redirect(viewer, _href(name), ("ok", "Back to the YAML: every live field."))
