"""Who may call which admin route: the access rule, decided once for every route.

The caller is the identity of a bearer token (``admin.token``: the platform;
an ``auth.tokens`` entry: its teams) or of a trusted SSO proxy's headers
(``nemesis.identity``). A bearer token that proves nobody is refused (403)
on every route but health and readiness.

- ``/healthz``, ``/readyz``: anyone.
- ``/metrics``: ``admin.metrics_token`` or the platform; anyone while
  neither a metrics token nor a team identity is configured.
- Reads of integrations, ``/fleet``, ``/audit``, ``/sizing``: an identity,
  which sees its teams' integrations (the platform all); anyone, seeing
  all, while no team identity is configured (``auth:`` has no users,
  tokens or trusted header), as before teams existed.
- ``/config``: the platform (anyone while no team identity is configured).
- Changes of an integration: an identity, on its teams' integrations (the
  platform on all); none while neither ``admin.token`` nor a team is set.
- ``/config/reload``: the platform (it reads every team's files).

An integration another team owns answers 404 exactly as one that does not
exist: a team learns nothing of the others. A change by an SSO identity
(a browser behind the proxy) must not come from another site
(``Sec-Fetch-Site``, ``Origin``): a page elsewhere cannot pause an
integration through a signed-in operator's browser. Bearer tokens are never
sent by a browser on its own.
"""

# No ``from __future__ import annotations``: FastAPI reads the dependencies' signatures.
import hmac
from dataclasses import dataclass
from typing import Annotated, Final
from urllib.parse import urlsplit

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from nemesis.identity import ANYONE, Identities, Identity

_CROSS_SITE: Final = frozenset({"cross-site", "same-site"})


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(401, detail, headers={"WWW-Authenticate": "Bearer"})


@dataclass(frozen=True, slots=True)
class Caller:
    """What a request proved: an identity, a scrape credential, or nothing."""

    identity: Identity | None
    scraper: bool = False  # sent admin.metrics_token
    wrong: bool = False  # sent a credential that proves nobody


class AdminAccess:
    """The dependencies the admin routes declare: ``reader``, ``changer``, ``platform``, ..."""

    def __init__(self, identities: Identities, *, metrics_token: str | None = None) -> None:
        self.identities = identities
        self._metrics = None if not metrics_token else metrics_token.encode()
        bearer = HTTPBearer(
            auto_error=False,
            scheme_name="adminToken",
            description=(
                "admin.token (the platform), a team's token from auth.tokens, or"
                " admin.metrics_token for /metrics"
            ),
        )

        def caller(
            request: Request,
            credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
        ) -> Caller:
            token = Identities.bearer(request.headers.get("authorization"))
            if token is not None:
                identity = identities.from_token(token)
                if identity is not None:
                    return Caller(identity)
                if self._metrics is not None and hmac.compare_digest(token.encode(), self._metrics):
                    return Caller(None, scraper=True)
                return Caller(None, wrong=True)
            if credentials is not None or request.headers.get("authorization"):
                return Caller(None, wrong=True)
            peer = None if request.client is None else request.client.host
            return Caller(identities.from_trusted_header(request.headers, peer))

        self.caller = caller
        CallerDep = Annotated[Caller, Depends(caller)]

        def reader(found: CallerDep) -> Identity:
            """The identity reads are scoped by (``ANYONE`` while no team is configured)."""
            if found.identity is not None:
                return found.identity
            if not identities.has_teams:
                return ANYONE  # reading is open, whatever the request sent
            if found.wrong:
                raise HTTPException(403, "wrong token")
            if found.scraper:
                raise HTTPException(403, "admin.metrics_token reads /metrics only")
            raise _unauthorized(
                "send Authorization: Bearer <token> (a team's token from auth.tokens, or"
                " admin.token)"
            )

        def changer(request: Request, found: CallerDep) -> Identity:
            """The identity a change is made (and audited) as."""
            identity = found.identity
            if identity is None:
                if not identities.has_teams and not identities.has_platform_token:
                    raise HTTPException(403, "changes are disabled: admin.token is not configured")
                if found.wrong or found.scraper:
                    raise HTTPException(403, "wrong token")
                raise _unauthorized(
                    "send Authorization: Bearer <admin.token, or a team's token from auth.tokens>"
                )
            if identity.method == "sso" and _cross_site(request):
                raise HTTPException(403, "a change from another site is refused")
            return identity

        def platform_reader(identity: Annotated[Identity, Depends(reader)]) -> Identity:
            if not identity.admin:
                raise HTTPException(403, "for the platform only (admin.token or an admin)")
            return identity

        def platform_changer(identity: Annotated[Identity, Depends(changer)]) -> Identity:
            if not identity.admin:
                raise HTTPException(403, "for the platform only (admin.token or an admin)")
            return identity

        def scraper(found: CallerDep) -> None:
            if found.scraper or (found.identity is not None and found.identity.admin):
                return
            if self._metrics is None and not identities.has_teams:
                return  # open, as /metrics is on a cluster-internal port without teams
            if found.wrong:
                raise HTTPException(403, "wrong token")
            if found.identity is not None:
                raise HTTPException(403, "/metrics is the platform's: send admin.metrics_token")
            raise _unauthorized("send Authorization: Bearer <admin.metrics_token>")

        self.reader = reader
        self.changer = changer
        self.platform_reader = platform_reader
        self.platform_changer = platform_changer
        self.scraper = scraper


def _cross_site(request: Request) -> bool:
    """True when a browser says the request comes from a page of another site or origin."""
    if request.headers.get("sec-fetch-site", "").lower() in _CROSS_SITE:
        return True
    origin = request.headers.get("origin")
    if origin is None:
        return False
    host = request.headers.get("host", "")
    try:
        return origin == "null" or urlsplit(origin).netloc.lower() != host.lower()
    except ValueError:
        return True
