"""The viewer application: pages, the JSON API, sign-in, security headers, error pages.

Every answer carries a strict Content-Security-Policy (scripts and styles
from this site's files only, nothing inline, no frames), so even a bug in
escaping could not run a message's script. Every error the caller can cause
(a bad filter, a forged cursor, an unknown id, a missing CSRF token) is a
4xx with a sentence, as HTML for pages and JSON under ``/api``; only a bug
is a 500, and it never shows a traceback.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dlq_viewer import render
from dlq_viewer.actions import BULK_PAUSE_S, ROUND_SIZE, BulkJobs, JobsBusy, Requeuer
from dlq_viewer.api import SECURITY_SCHEMES
from dlq_viewer.api import router as api_router
from dlq_viewer.auth import Authenticator, IPNetwork, LoginStore, SessionRevocations
from dlq_viewer.console import Console
from dlq_viewer.console_pages import router as console_router
from dlq_viewer.context import (
    CsrfRejected,
    NotFound,
    SignInRequired,
    Viewer,
    identify,
    is_api,
)
from dlq_viewer.filters import form_time
from dlq_viewer.pages import router as pages_router
from dlq_viewer.pages import sign_in_redirect
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import AuthConfig, IntegrationConfig
from nemesis.dlq import DeadLetterStore
from nemesis.errors import BrokerError, DlqError, InvalidQuery
from nemesis.fleet.port import StateStore

log = logging.getLogger(__name__)

PACKAGE = Path(__file__).resolve().parent
MAX_BODY_BYTES = 1024 * 1024
COUNT_CAP = 10_000

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)
SECURITY_HEADERS = (
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
    ("permissions-policy", "camera=(), microphone=(), geolocation=(), payment=(), usb=()"),
)


class SecurityHeaders:
    """Adds the security headers to every answer; refuses oversized request bodies early."""

    def __init__(self, app: ASGIApp, *, hsts: bool) -> None:
        self.app = app
        self.hsts = hsts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        static = scope["path"].startswith("/static/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS:
                    # A response may carry a stricter policy of its own (downloads: a sandbox).
                    headers.setdefault(name, value)
                if self.hsts:
                    headers["strict-transport-security"] = "max-age=31536000"
                # Payloads are private: no page or API answer is kept by a browser or a proxy.
                headers["cache-control"] = "public, max-age=86400" if static else "no-store"
            await send(message)

        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            problem = _body_problem(scope)
            if problem is not None:
                status, text = problem
                response = JSONResponse({"detail": text}, status_code=status)
                await response(scope, receive, send_with_headers)
                return
        await self.app(scope, receive, send_with_headers)


def _body_problem(scope: Scope) -> tuple[int, str] | None:
    headers = dict(scope["headers"])
    length = headers.get(b"content-length")
    if length is None:
        if headers.get(b"transfer-encoding"):
            return 411, "send a Content-Length"
        return None
    if not length.isdigit():
        return 400, "malformed Content-Length"
    if int(length) > MAX_BODY_BYTES:
        return 413, f"request bodies are limited to {MAX_BODY_BYTES} bytes"
    return None


def _static_url_factory() -> Any:
    versions = {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()[:10]
        for path in (PACKAGE / "static").iterdir()
        if path.is_file()
    }

    def static_url(name: str) -> str:
        # The content hash in the URL lets browsers cache a file until it changes.
        return f"/static/{name}?v={versions.get(name, '0')}"

    return static_url


def _templates(clock: Clock) -> Jinja2Templates:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(PACKAGE / "templates"),
        autoescape=True,
        # A misspelt name fails the page in tests instead of rendering as nothing.
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters.update(
        reveal=render.reveal,
        utc=render.utc,
        iso=render.iso,
        number=render.number,
        duration=render.duration,
        ago=lambda seconds: render.ago(seconds, clock.time()),
    )
    environment.globals.update(
        static_url=_static_url_factory(),
        share=render.share,
        form_time=_form_time_value,
    )
    return Jinja2Templates(env=environment)


def _form_time_value(text: str) -> str:
    # A bound passed as Unix seconds (from a confirmation) shows as a date in the form.
    try:
        return form_time(float(text)) if text else ""
    except (ValueError, OverflowError, OSError):
        return text


def create_app(
    store: DeadLetterStore,
    *,
    integrations: Mapping[str, IntegrationConfig],
    auth: AuthConfig,
    requeue: Requeuer,
    clock: Clock = SYSTEM_CLOCK,
    decoders: Mapping[str, render.PayloadDecoder] | None = None,
    bulk_round_size: int = ROUND_SIZE,
    bulk_pause_s: float = BULK_PAUSE_S,
    count_cap: int = COUNT_CAP,
    trusted_proxies: Sequence[IPNetwork] = (),
    session_revocations: SessionRevocations | None = None,
    login_store: LoginStore | None = None,
    state: StateStore | None = None,
) -> FastAPI:
    """The DLQ viewer over ``store``; serve it with ``dlq_viewer.serve_viewer``.

    ``integrations`` is read on every request (owners decide who sees what),
    so a mapping that a configuration reload updates applies at once.
    ``requeue`` is the replay path (``replay_requeuer(store, broker)``);
    ``decoders`` maps integration names to payload decoders (Protobuf).
    The list page counts matches up to ``count_cap`` before it answers and
    fetches larger counts afterwards; bulk actions work in rounds of
    ``bulk_round_size`` rows with ``bulk_pause_s`` between them.
    ``trusted_proxies`` are the reverse proxies whose forwarded client
    addresses sign-in throttling believes; ``session_revocations`` remembers
    ended sessions and ``login_store`` counts failed sign-ins and spends
    sign-in forms (each in this process's memory unless given one replicas share).
    ``state`` is the fleet's state store: with it, ``/console`` shows each
    team its integrations' live state and lets the owners pause and re-tune
    them (``dlq_viewer.console``).
    The store stays the caller's: the app never closes it.
    """
    jobs = BulkJobs(store, requeue, clock=clock, round_size=bulk_round_size, pause_s=bulk_pause_s)
    viewer = Viewer(
        store=store,
        integrations=integrations,
        auth=Authenticator(auth, clock=clock, revocations=session_revocations, logins=login_store),
        requeuer=requeue,
        jobs=jobs,
        clock=clock,
        templates=_templates(clock),
        decoders=decoders or {},
        secure_cookies=auth.secure_cookies,
        count_cap=count_cap,
        trusted_proxies=tuple(trusted_proxies),
        console=None if state is None else Console(state, integrations, store, clock=clock),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            async with jobs:
                yield
        finally:
            await viewer.auth.aclose()

    app = FastAPI(
        title="Nemesis DLQ viewer",
        summary="Browse, search, requeue and discard dead letters.",
        version="1",
        openapi_url="/api/openapi.json",
        # The interactive docs load scripts from a CDN, which the CSP (and an offline host) refuses.
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
    )
    app.state.viewer = viewer
    _declare_security(app)
    app.add_middleware(SecurityHeaders, hsts=auth.secure_cookies)
    app.mount("/static", StaticFiles(directory=PACKAGE / "static"), name="static")
    app.include_router(api_router)
    app.include_router(pages_router)
    app.include_router(console_router)
    _add_error_handlers(app, viewer)
    return app


def _declare_security(app: FastAPI) -> None:
    """Puts the API's security schemes into its OpenAPI document (routes name theirs)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {})["securitySchemes"] = SECURITY_SCHEMES
        return app.openapi_schema or build()

    app.openapi = openapi  # type: ignore[method-assign]


def _add_error_handlers(app: FastAPI, viewer: Viewer) -> None:
    async def answer(request: Request, status: int, heading: str, message: str) -> Response:
        if is_api(request):
            headers = {"www-authenticate": "Bearer"} if status == 401 else None
            return JSONResponse({"detail": message}, status_code=status, headers=headers)
        identity = await identify(request, viewer)
        return viewer.templates.TemplateResponse(
            request,
            "error.html",
            {
                "identity": identity,
                "csrf_token": viewer.auth.csrf_token(identity) if identity else "",
                "flash": None,
                "nav": "",
                "heading": heading,
                "message": message,
                "back_href": "/" if identity else "/login",
                "back_label": "Overview" if identity else "Sign in",
            },
            status_code=status,
        )

    async def sign_in_required(request: Request, exc: Exception) -> Response:
        if is_api(request):
            return await answer(request, 401, "Sign-in required", "sign in, or send a bearer token")
        return sign_in_redirect(request)

    async def csrf_rejected(request: Request, exc: Exception) -> Response:
        return await answer(
            request,
            403,
            "This form has expired",
            "The request did not carry this site's CSRF token. Reload the page and try again.",
        )

    async def not_found(request: Request, exc: Exception) -> Response:
        return await answer(request, 404, "Not found", str(exc))

    async def invalid_query(request: Request, exc: Exception) -> Response:
        return await answer(request, 400, "That request does not work", str(exc))

    async def jobs_busy(request: Request, exc: Exception) -> Response:
        return await answer(request, 429, "Too many bulk actions", str(exc))

    async def store_failed(request: Request, exc: Exception) -> Response:
        log.error("DLQ store error on %s %s: %s", request.method, request.url.path, exc)
        return await answer(
            request,
            503,
            "The dead-letter store is not answering",
            "It may be busy with a large action. Try again in a moment.",
        )

    async def send_failed(request: Request, exc: Exception) -> Response:
        # A requeue the broker or a queue refused (down, gone, the credentials): the rows
        # sent before it are marked, the rest stay dead.
        log.error("requeue failed on %s %s: %s", request.method, request.url.path, exc)
        return await answer(request, 503, "The requeue could not send everything", str(exc))

    async def malformed(request: Request, exc: Exception) -> Response:
        if is_api(request) and isinstance(exc, RequestValidationError):
            # FastAPI's usual 422, minus the echo of the input (it may be huge or hostile).
            errors = [
                {
                    "loc": list(error.get("loc", ())),
                    "msg": error.get("msg", ""),
                    "type": error.get("type", ""),
                }
                for error in exc.errors()[:20]
            ]
            return JSONResponse({"detail": errors}, status_code=422)
        return await answer(
            request, 400, "That request does not work", "Some of its fields are malformed."
        )

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            return await answer(request, 404, "Not found", "There is no such page.")
        if exc.status_code == 405:
            return await answer(
                request, 405, "Not allowed", "This address does not take that method."
            )
        detail = exc.detail if isinstance(exc.detail, str) else "The request was refused."
        return await answer(request, exc.status_code, "Request refused", detail)

    app.add_exception_handler(SignInRequired, sign_in_required)
    app.add_exception_handler(CsrfRejected, csrf_rejected)
    app.add_exception_handler(NotFound, not_found)
    app.add_exception_handler(InvalidQuery, invalid_query)
    app.add_exception_handler(JobsBusy, jobs_busy)
    app.add_exception_handler(DlqError, store_failed)
    app.add_exception_handler(BrokerError, send_failed)
    app.add_exception_handler(RequestValidationError, malformed)
    app.add_exception_handler(StarletteHTTPException, http_error)
