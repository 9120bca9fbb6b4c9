"""What the two HTTP transports share: their constants and the check of ``target.headers``.

``nemesis.delivery.h1`` (Nemesis' own client) and ``nemesis.delivery.http``
(aiohttp's) send the same extra headers, keep connections alive as long and
read as much of an answer; this module holds those choices once.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from urllib.parse import unquote, urlsplit

from nemesis import __version__
from nemesis.delivery.contract import SIGNING_HEADERS
from nemesis.delivery.port import config_problem
from nemesis.errors import ConfigError

if TYPE_CHECKING:
    from nemesis.config.models import TargetConfig

USER_AGENT: Final = f"nemesis/{__version__}"

# A longer response body is not read to the end: closing the connection is cheaper.
DRAIN_LIMIT_BYTES: Final = 256 * 1024
# Below the idle timeout of common servers (uvicorn and Node 5 s), so a pooled
# connection is rarely reused just as the handler closes it.
KEEPALIVE_S: Final = 4.0

# Header names that belong to the contract or to HTTP framing, not to target.headers.
RESERVED_HEADERS: Final = frozenset({"content-type", "content-length", "transfer-encoding"})
# An HTTP header name is a token (RFC 9110); the JSON Schema of integrations says so too.
HEADER_NAME_PATTERN: Final = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
UNSAFE_VALUE_PATTERN: Final = r"[\x00-\x08\x0a-\x1f\x7f]"
_TOKEN: Final = re.compile(HEADER_NAME_PATTERN)
_UNSAFE_VALUE_CHARS: Final = re.compile(UNSAFE_VALUE_PATTERN)


def checked_headers(headers: Mapping[str, str], integration: str) -> dict[str, str]:
    """``target.headers`` with lowercased names; a ``ConfigError`` naming the first bad one.

    Refused: a name that is not an HTTP token, a header the contract or the
    framing sets (``ce-*``, ``content-type``, ``webhook-signature``...), and a
    value with control characters (a CR/LF would split the request).
    """
    checked: dict[str, str] = {}
    for name, value in headers.items():
        field = f"target.headers.{name}"
        lowered = name.lower()
        if not _TOKEN.fullmatch(name):
            raise ConfigError([config_problem(integration, field, "not a valid HTTP header name")])
        if lowered.startswith("ce-") or lowered in RESERVED_HEADERS:
            message = "set by Nemesis (handler contract)"
            raise ConfigError([config_problem(integration, field, message)])
        if lowered in SIGNING_HEADERS:
            message = "set by Nemesis when target.signing is configured"
            raise ConfigError([config_problem(integration, field, message)])
        if _UNSAFE_VALUE_CHARS.search(value):
            message = "control characters in the value"
            raise ConfigError([config_problem(integration, field, message)])
        checked[lowered] = value
    return checked


_UNSAFE_IN_HEAD: Final = re.compile(r"[\r\n\x00]")


@dataclass(frozen=True, slots=True)
class HttpUrl:
    """An http(s) target URL taken apart, as a request needs it."""

    tls: bool
    host: str
    port: int | None  # as written; None: the scheme's default
    path: str  # with the query, never empty
    username: str | None  # percent-decoded
    password: str | None


def parse_http_url(url: str, integration: str) -> HttpUrl:
    """``target.url`` taken apart; a ``ConfigError`` for a bad port, a missing host, CR/LF."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError([config_problem(integration, "target.url", str(exc))]) from None
    if parts.hostname is None:
        raise ConfigError([config_problem(integration, "target.url", "names no host")])
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    if _UNSAFE_IN_HEAD.search(path) or " " in path:
        message = "blanks or CR/LF in the path"
        raise ConfigError([config_problem(integration, "target.url", message)])
    return HttpUrl(
        tls=parts.scheme == "https",
        host=parts.hostname,
        port=port,
        path=path,
        username=None if parts.username is None else unquote(parts.username),
        password=None if parts.password is None else unquote(parts.password),
    )


def check_http_target(target: TargetConfig, integration: str) -> None:
    """What building an HTTP transport checks of its target, without loading one.

    ``nemesis validate`` runs this: the scheme, the URL and the headers. A
    ``ConfigError`` names the field.
    """
    if target.scheme not in ("http", "https"):
        raise ConfigError(
            [config_problem(integration, "target.url", "the HTTP transport needs http(s)://")]
        )
    parse_http_url(target.url, integration)
    checked_headers(target.headers, integration)
