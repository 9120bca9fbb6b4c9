"""The admin API's own ``/docs`` page and the headers every answer carries.

``/docs`` is rendered here from the OpenAPI document: every operation, its
parameters, body and answers, as plain HTML with no script, no style sheet
and nothing loaded from elsewhere. Nobody pastes a token into it (an
interactive page that did would hand the token to whatever script it
loads); ``/openapi.json`` is there for tools. Its CSP allows nothing but
the page itself (``default-src 'none'``), and every other answer carries
one that allows nothing at all, with ``X-Frame-Options: DENY`` and
``X-Content-Type-Options: nosniff``.
"""

from __future__ import annotations

import base64
import hashlib
import html
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from fastapi import FastAPI, Request, Response
from fastapi.responses import HTMLResponse

API_CSP: Final = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
# The page has one inline style element, allowed by its hash and nothing else.
_STYLE: Final = (
    "body{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}"
    "code{background:#f2f2f2;padding:0 .2rem}h3{margin-bottom:.2rem}"
)
SECURITY_HEADERS: Final = {
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
_METHODS: Final = ("get", "post", "put", "patch", "delete")


def _style_hash() -> str:
    return base64.b64encode(hashlib.sha256(_STYLE.encode()).digest()).decode()


DOCS_CSP: Final = (
    f"default-src 'none'; style-src 'sha256-{_style_hash()}'; frame-ancestors 'none';"
    " base-uri 'none'; form-action 'none'"
)


def secure_headers(app: FastAPI) -> None:
    """Every answer of ``app`` gets the security headers and the API's CSP (unless it set one)."""

    @app.middleware("http")
    async def add_headers(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        response.headers.setdefault("Content-Security-Policy", API_CSP)
        return response


def add_docs(app: FastAPI) -> None:
    """``GET /docs``: the API's reference, rendered from its OpenAPI document."""

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        page = render_docs(app.openapi())
        return HTMLResponse(page, headers={"Content-Security-Policy": DOCS_CSP})


def _text(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _schema_name(schema: Mapping[str, Any]) -> str:
    ref = schema.get("$ref")
    if isinstance(ref, str):
        return ref.rsplit("/", 1)[-1]
    if "anyOf" in schema:
        return " | ".join(_schema_name(part) for part in schema["anyOf"])
    if schema.get("type") == "array":
        return f"list of {_schema_name(schema.get('items', {}))}"
    if "enum" in schema:
        return " | ".join(repr(v) for v in schema["enum"])
    return str(schema.get("type", "any"))


def render_docs(spec: Mapping[str, Any]) -> str:
    """The reference page of an OpenAPI document: escaped text, links within the page."""
    info = spec.get("info", {})
    parts = [
        "<!doctype html><html lang=en><head><meta charset=utf-8>",
        f"<title>{_text(info.get('title', 'API'))}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{_text(info.get('title', 'API'))} {_text(info.get('version', ''))}</h1>",
        f"<p>{_text(info.get('summary', ''))}</p>",
        "<p>Calls take <code>Authorization: Bearer &lt;token&gt;</code>: a team's token sees"
        " and changes that team's integrations, <code>admin.token</code> every one. The"
        " machine-readable document is <a href=openapi.json>openapi.json</a>.</p>",
    ]
    for path, operations in spec.get("paths", {}).items():
        for method in _METHODS:
            operation = operations.get(method)
            if operation is None:
                continue
            anchor = _text(operation.get("operationId", f"{method}-{path}"))
            parts.append(
                f"<h3 id={anchor}><code>{method.upper()} {_text(path)}</code></h3>"
                f"<p>{_text(operation.get('summary', ''))}: "
                f"{_text(operation.get('description', ''))}</p><ul>"
            )
            for parameter in operation.get("parameters", []):
                schema = parameter.get("schema", {})
                parts.append(
                    f"<li>{_text(parameter.get('in', ''))} <code>{_text(parameter.get('name'))}"
                    f"</code>: {_text(_schema_name(schema))}</li>"
                )
            body = operation.get("requestBody", {}).get("content", {})
            for media, content in body.items():
                schema_name = _schema_name(content.get("schema", {}))
                parts.append(f"<li>body ({_text(media)}): {_text(schema_name)}</li>")
            for code, answer in operation.get("responses", {}).items():
                parts.append(
                    f"<li>answers {_text(code)}: {_text(answer.get('description', ''))}</li>"
                )
            parts.append("</ul>")
    parts.append("</body></html>")
    return "".join(parts)
