"""Who is asking, for the admin API and the DLQ viewer alike: one identity model.

An identity is a name, the teams it belongs to and whether it is a platform
admin. Teams are matched against an integration's ``owners``: a team
identity sees and acts on exactly the integrations one of its teams owns; a
platform admin on all of them. Identities come from ``auth:`` in
``nemesis.yaml``:

- ``auth.tokens``: API tokens, stored only as their SHA-256 (``sha256$...``);
  a request proves one with ``Authorization: Bearer <token>``;
- ``auth.trusted_header``: a fronting SSO proxy names the user (and teams) in
  request headers, believed only on connections from its networks;
- ``auth.users``: people with a password (the viewer's sign-in); their teams
  also apply to the SSO identity of the same name;
- ``auth.admin_teams``: members of these teams are platform admins, and so is
  any user or token with ``admin: true``.

The admin API also knows ``admin.token``, the platform's own token from
before there were teams: it proves the platform identity (``admin.token``).
The viewer adds password sessions and CSRF tokens on top
(``dlq_viewer.auth``).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from nemesis.config.models import AuthConfig, IntegrationConfig
from nemesis.config.passwords import hash_token

log = logging.getLogger(__name__)

Method = Literal["password", "token", "sso", "platform", "anonymous"]
MAX_NAME_CHARS: Final = 128
MAX_TOKEN_CHARS: Final = 256
PLATFORM_NAME: Final = "admin.token"
_WARNED_PEERS: Final = 256


@dataclass(frozen=True, slots=True)
class Identity:
    """A signed-in user or API client, with what they may see."""

    name: str
    teams: frozenset[str]
    admin: bool
    method: Method
    csrf_seed: str | None  # what the CSRF token is derived from; None: no CSRF (API token)

    @property
    def actor(self) -> str:
        """How the audit log names this identity."""
        if self.method == "token":
            return f"{self.name} (API token)"
        if self.method == "platform":
            return f"platform ({self.name})"
        return self.name

    def owns(self, integration: IntegrationConfig) -> bool:
        """True when this identity may see and act on ``integration``."""
        return self.admin or bool(self.teams.intersection(integration.owners))

    def scope(self, integrations: Mapping[str, IntegrationConfig]) -> frozenset[str] | None:
        """The integrations this identity may see and act on; None: all (an admin)."""
        if self.admin:
            return None
        return frozenset(name for name, config in integrations.items() if self.owns(config))


PLATFORM: Final = Identity(PLATFORM_NAME, frozenset(), True, "platform", None)
# Whoever reads an admin API that has no team identities configured (it is open to read).
ANYONE: Final = Identity("anonymous", frozenset(), True, "anonymous", None)


class Identities:
    """Turns a bearer token or a trusted proxy's headers into an ``Identity``.

    ``platform_token`` is ``admin.token`` (the admin API passes it; the viewer
    does not, so that token opens only the admin API). Tokens are looked up
    by their hash, so a request costs one SHA-256 whatever the number of
    tokens.
    """

    def __init__(self, config: AuthConfig, *, platform_token: str | None = None) -> None:
        self.config = config
        self._users = {user.name: user for user in config.users}
        self._tokens = {token.token_hash: token for token in config.tokens}
        self._admin_teams = frozenset(config.admin_teams)
        self._platform = None if not platform_token else platform_token.encode()
        self._proxies = (
            [] if config.trusted_header is None else list(config.trusted_header.trusted_proxies)
        )
        self._warned: set[str] = set()

    @property
    def has_teams(self) -> bool:
        """True when the configuration names any team identity (users, tokens, an SSO proxy)."""
        return bool(self.config.users or self.config.tokens or self.config.trusted_header)

    @property
    def has_platform_token(self) -> bool:
        """True when ``admin.token`` is set."""
        return self._platform is not None

    def identity(
        self, name: str, teams: frozenset[str], admin: bool, method: Method, seed: str | None
    ) -> Identity:
        """An identity; members of ``auth.admin_teams`` are admins."""
        return Identity(name, teams, admin or bool(teams & self._admin_teams), method, seed)

    @staticmethod
    def bearer(authorization: str | None) -> str | None:
        """The token of an ``Authorization: Bearer <token>`` header, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_CHARS:
            return None
        return token

    def from_token(self, token: str) -> Identity | None:
        """The identity ``token`` proves (``admin.token`` first), or None."""
        if self._platform is not None and hmac.compare_digest(token.encode(), self._platform):
            return PLATFORM
        found = self._tokens.get(hash_token(token))
        if found is None:
            return None
        return self.identity(found.name, frozenset(found.teams), found.admin, "token", None)

    def from_bearer(self, authorization: str | None) -> Identity | None:
        """The identity of an ``Authorization: Bearer <token>`` header, or None."""
        token = self.bearer(authorization)
        return None if token is None else self.from_token(token)

    def from_trusted_header(self, headers: Mapping[str, str], peer: str | None) -> Identity | None:
        """The identity a trusted SSO proxy vouches for, or None (no header, untrusted peer)."""
        trusted = self.config.trusted_header
        if trusted is None or peer is None:
            return None
        name = headers.get(trusted.user_header.lower(), "").strip()
        if not name:
            return None
        try:
            address = ipaddress.ip_address(peer)
        except ValueError:
            return None
        if not any(address in network for network in self._proxies):
            # Once per address: anyone can send the header, and the log must not be theirs.
            if peer not in self._warned and len(self._warned) < _WARNED_PEERS:
                self._warned.add(peer)
                log.warning("ignored %s from %s: not a trusted proxy", trusted.user_header, peer)
            return None
        if len(name) > MAX_NAME_CHARS or not name.isprintable():
            return None
        teams: set[str] = set()
        if trusted.teams_header is not None:
            raw = headers.get(trusted.teams_header.lower(), "")
            teams.update(t.strip() for t in raw.split(",") if t.strip())
        user = self._users.get(name)
        admin = False
        if user is not None:
            teams.update(user.teams)
            admin = user.admin
        return self.identity(name, frozenset(teams), admin, "sso", f"sso\x00{name}")
