"""What every request handler needs: the viewer's parts, the caller's identity, CSRF checks."""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, Request
from fastapi.templating import Jinja2Templates

from dlq_viewer.actions import BulkJobs, Requeuer
from dlq_viewer.auth import SESSION_COOKIE, Authenticator, IPNetwork, client_address
from dlq_viewer.console import Console
from dlq_viewer.render import PayloadDecoder
from nemesis.clock import Clock
from nemesis.config.models import IntegrationConfig
from nemesis.dlq import ActionRecord, DeadLetterStore
from nemesis.identity import Identity

FLASH_COOKIE = "nemesis_flash"
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"
MAX_FORM_FIELDS = 1100  # a page of 500 checked rows and the form's own fields
_LETTER_ID = re.compile(r"^[0-9a-f]{32}$")
_JOB_ID = re.compile(r"^[0-9a-f]{16}$")

FlashKind = Literal["ok", "warn", "error"]


@dataclass(frozen=True, slots=True)
class Viewer:
    """The application's parts, shared by every request (``app.state.viewer``)."""

    store: DeadLetterStore
    integrations: Mapping[str, IntegrationConfig]  # read on every request: live reloads apply
    auth: Authenticator
    requeuer: Requeuer
    jobs: BulkJobs
    clock: Clock
    templates: Jinja2Templates
    decoders: Mapping[str, PayloadDecoder]
    secure_cookies: bool
    count_cap: int  # the list page counts up to this many rows before answering
    trusted_proxies: tuple[IPNetwork, ...] = ()  # whose X-Forwarded-For / Forwarded to believe
    console: Console | None = None  # the team console (None: no fleet state store given)


class SignInRequired(Exception):
    """No valid session, token or trusted header: pages redirect to sign-in, the API says 401."""


class CsrfRejected(Exception):
    """A state change without this site's CSRF token (or from another site)."""


class NotFound(Exception):
    """No such thing for this caller: unknown, malformed, or outside their scope (same answer)."""

    def __init__(self, what: str = "page") -> None:
        super().__init__(f"No such {what}.")
        self.what = what


def get_viewer(request: Request) -> Viewer:
    """The viewer the application was built with."""
    viewer: Viewer = request.app.state.viewer
    return viewer


ViewerDep = Annotated[Viewer, Depends(get_viewer)]


def is_api(request: Request) -> bool:
    """True for the JSON API (errors as JSON, 401 instead of a redirect)."""
    return request.url.path.startswith("/api/") or request.url.path == "/api"


async def identify(request: Request, viewer: Viewer) -> Identity | None:
    """Who is asking: an API token, a trusted SSO header, or a session cookie; else None."""
    authorization = request.headers.get("authorization")
    if authorization is not None:
        # A request that names a token stands or falls with it, never with a cookie beside it.
        return viewer.auth.from_bearer(authorization)
    peer = request.client.host if request.client is not None else None
    identity = viewer.auth.from_trusted_header(request.headers, peer)
    if identity is not None:
        return identity
    return await viewer.auth.from_session(request.cookies.get(SESSION_COOKIE))


async def current_identity(request: Request, viewer: ViewerDep) -> Identity | None:
    """``identify`` as a dependency."""
    return await identify(request, viewer)


def client_of(request: Request, viewer: Viewer) -> str:
    """The client's address (forwarded by a trusted reverse proxy, or the TCP peer)."""
    peer = request.client.host if request.client is not None else None
    return client_address(peer, request.headers, viewer.trusted_proxies)


MaybeSignedIn = Annotated[Identity | None, Depends(current_identity)]


def require_identity(identity: MaybeSignedIn) -> Identity:
    """The caller's identity; ``SignInRequired`` without one."""
    if identity is None:
        raise SignInRequired
    return identity


SignedIn = Annotated[Identity, Depends(require_identity)]


async def csrf_checked(
    request: Request,
    identity: SignedIn,
    viewer: ViewerDep,
) -> Identity:
    """The caller's identity after checking that a browser's state change came from our pages."""
    if identity.csrf_seed is None:
        return identity
    # Browsers say where a request comes from, and pages cannot forge it.
    if request.headers.get("sec-fetch-site") == "cross-site":
        raise CsrfRejected
    token = request.headers.get(CSRF_HEADER)
    if token is None and request.headers.get("content-type", "").startswith(
        ("application/x-www-form-urlencoded", "multipart/form-data")
    ):
        form = await request.form(max_files=0, max_fields=MAX_FORM_FIELDS)
        value = form.get(CSRF_FIELD)
        token = value if isinstance(value, str) else None
    if not viewer.auth.check_csrf(identity, token):
        raise CsrfRejected
    return identity


Acting = Annotated[Identity, Depends(csrf_checked)]  # signed in, and the CSRF token checked


def scope_of(identity: Identity, viewer: Viewer) -> frozenset[str] | None:
    """The integrations ``identity`` may see and act on; None: all."""
    return identity.scope(viewer.integrations)


def in_scope(integration: str, scope: frozenset[str] | None) -> bool:
    """True when ``scope`` covers ``integration``."""
    return scope is None or integration in scope


PARTIAL_AUDIT_DESCRIPTION = (
    "part of an action that also covered integrations outside your teams"
    " (what it selected is shown to admins)"
)


def audit_view(
    entry: ActionRecord, scope: frozenset[str] | None
) -> tuple[list[str], int | None, str]:
    """The integrations, count and description of an audit entry that ``scope`` may read.

    The description is free text written by whoever acted (a filter in words,
    other teams' integration names, search text), so an entry that reaches
    beyond the reader's integrations shows only their names, the part of the
    count that was theirs, and a neutral line. The count is None for such an
    entry written without per-integration counts: the total would tell a team
    how much of other teams' work the action touched.
    """
    if scope is None:
        return list(entry.integrations), entry.count, entry.description
    names = [name for name in entry.integrations if name in scope]
    if len(names) == len(entry.integrations):
        return names, entry.count, entry.description
    own = None if entry.counts is None else sum(entry.counts.get(name, 0) for name in names)
    return names, own, PARTIAL_AUDIT_DESCRIPTION


def letter_id(text: str) -> str:
    """A well-formed row id, else ``NotFound`` (a malformed id names no message)."""
    if not _LETTER_ID.match(text):
        raise NotFound("message")
    return text


def job_id(text: str) -> str:
    """A well-formed job id, else ``NotFound``."""
    if not _JOB_ID.match(text):
        raise NotFound("bulk action")
    return text


def safe_local_path(target: str | None, default: str = "/") -> str:
    """``target`` if it is a path on this site (no scheme, no host, no tricks), else ``default``."""
    if (
        not target
        or len(target) > 2000
        or not target.startswith("/")
        or target.startswith("//")
        or "\\" in target
        or any(ord(char) < 0x21 for char in target)
    ):
        return default
    return target


# --- flash messages: one line shown on the next page, carried in a signed cookie ---------


def seal_flash(viewer: Viewer, kind: FlashKind, text: str) -> str:
    """A cookie value carrying a message for the next page."""
    data = base64.urlsafe_b64encode(json.dumps([kind, text]).encode()).decode("ascii")
    return f"{data}.{viewer.auth.sign('flash', data)}"


def open_flash(viewer: Viewer, value: str | None) -> tuple[FlashKind, str] | None:
    """The message in a flash cookie, if it is one we sealed."""
    if not value or len(value) > 2048 or value.count(".") != 1:
        return None
    data, signature = value.split(".")
    if not viewer.auth.verify(signature, "flash", data):
        return None
    try:
        kind, text = json.loads(base64.urlsafe_b64decode(data))
    except (ValueError, binascii.Error, TypeError):
        return None
    if kind not in ("ok", "warn", "error") or not isinstance(text, str):
        return None
    return kind, text
