"""Who is asking: password sessions, API tokens, a trusted SSO header; CSRF tokens.

A browser signs in with a password and gets a session cookie: a payload
(user, nonce, expiry, password fingerprint) and its HMAC-SHA256 under the
session secret, so the server keeps no session table. Changing a user's
password or removing the user ends their sessions at once (the fingerprint
no longer matches); teams and the admin flag are read from the
configuration on every request, so they apply at once too.

Every state change by a browser needs a CSRF token: an HMAC of the
session's nonce (or, behind an SSO proxy, of the user name) that only pages
of this site can show. API tokens (``Authorization: Bearer``) are not sent
by a browser on its own, so requests carrying one need no CSRF token.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import collections
import hashlib
import hmac
import ipaddress
import json
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from dlq_viewer.passwords import hash_password, hash_token, verify_password
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import AuthConfig, IntegrationConfig, UserConfig

log = logging.getLogger(__name__)

SESSION_COOKIE = "nemesis_session"
LOGIN_COOKIE = "nemesis_login"
MAX_COOKIE_CHARS = 1024
MAX_NAME_CHARS = 128
# Failed sign-ins per user name, and per client address, before a pause. The address
# limit is higher: behind a reverse proxy every person shares the proxy's address.
MAX_FAILURES = 10
MAX_PEER_FAILURES = 100
FAILURE_WINDOW_S = 300.0
_THROTTLE_KEYS = 10_000  # remembered names and addresses; the oldest are forgotten first
_CONCURRENT_HASHES = 2  # scrypt costs 32 MiB and tens of milliseconds each
_WARNED_PEERS = 256

Method = Literal["password", "token", "sso"]


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
        return f"{self.name} (API token)" if self.method == "token" else self.name

    def scope(self, integrations: Mapping[str, IntegrationConfig]) -> frozenset[str] | None:
        """The integrations this identity may see and act on; None: all (an admin)."""
        if self.admin:
            return None
        return frozenset(
            name for name, config in integrations.items() if self.teams.intersection(config.owners)
        )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class LoginThrottle:
    """Counts failed sign-ins per key in a sliding window; bounded memory."""

    def __init__(
        self, clock: Clock, *, limit: int = MAX_FAILURES, window_s: float = FAILURE_WINDOW_S
    ):
        self._clock = clock
        self._limit = limit
        self._window_s = window_s
        self._failures: collections.OrderedDict[str, collections.deque[float]] = (
            collections.OrderedDict()
        )

    def retry_after_s(self, *keys: str) -> float:
        """Seconds until any of ``keys`` may try again; 0 when all may now."""
        now = self._clock.monotonic()
        wait = 0.0
        for key in keys:
            times = self._failures.get(key)
            if times is None:
                continue
            while times and times[0] <= now - self._window_s:
                times.popleft()
            if len(times) >= self._limit:
                wait = max(wait, times[0] + self._window_s - now)
        return wait

    def failed(self, *keys: str) -> None:
        """Records one failure for each key."""
        now = self._clock.monotonic()
        for key in keys:
            times = self._failures.pop(key, None) or collections.deque(maxlen=self._limit)
            times.append(now)
            self._failures[key] = times
            while len(self._failures) > _THROTTLE_KEYS:
                self._failures.popitem(last=False)

    def succeeded(self, *keys: str) -> None:
        """Forgets the failures of ``keys``."""
        for key in keys:
            self._failures.pop(key, None)


class Authenticator:
    """Turns credentials into an ``Identity``, and signs what proves one later."""

    def __init__(self, config: AuthConfig, *, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self._clock = clock
        if config.session_secret is None:
            log.warning(
                "auth.session_secret is not set: using a random one, so viewer sessions end when"
                " this process stops (set it from ${NEMESIS_SESSION_SECRET})"
            )
        secret = config.session_secret or secrets.token_urlsafe(48)
        self._key = hashlib.sha256(b"nemesis-viewer\x00" + secret.encode()).digest()
        self._users = {user.name: user for user in config.users}
        self._tokens = {token.token_hash: token for token in config.tokens}
        self._admin_teams = frozenset(config.admin_teams)
        self._proxies = (
            [] if config.trusted_header is None else list(config.trusted_header.trusted_proxies)
        )
        self.user_throttle = LoginThrottle(clock)
        self.peer_throttle = LoginThrottle(clock, limit=MAX_PEER_FAILURES)
        self._hashing = asyncio.Semaphore(_CONCURRENT_HASHES)
        self._decoy_hash: str | None = None
        self._warned: set[str] = set()

    # --- signing ---------------------------------------------------------------

    def sign(self, purpose: str, data: str) -> str:
        """An HMAC of ``data`` for one ``purpose`` (a signature for one use fails for another)."""
        mac = hmac.new(self._key, f"{purpose}\x00{data}".encode(), hashlib.sha256)
        return _b64(mac.digest())

    def verify(self, signature: str, purpose: str, data: str) -> bool:
        """True when ``signature`` is ``sign(purpose, data)``; constant time."""
        return hmac.compare_digest(self.sign(purpose, data).encode(), signature.encode())

    def _fingerprint(self, user: UserConfig) -> str:
        return self.sign("password", f"{user.name}\x00{user.password_hash}")[:16]

    # --- identities ------------------------------------------------------------

    def _identity(
        self, name: str, teams: frozenset[str], admin: bool, method: Method, seed: str | None
    ) -> Identity:
        return Identity(name, teams, admin or bool(teams & self._admin_teams), method, seed)

    def _user_identity(self, user: UserConfig, method: Method, seed: str | None) -> Identity:
        return self._identity(user.name, frozenset(user.teams), user.admin, method, seed)

    async def check_password(self, name: str, password: str) -> UserConfig | None:
        """The user whose name and password these are, else None (constant-ish time)."""
        user = self._users.get(name)
        async with self._hashing:
            if user is None:
                # Hash anyway, so that an unknown name answers as slowly as a wrong password.
                if self._decoy_hash is None:
                    self._decoy_hash = await asyncio.to_thread(hash_password, secrets.token_hex(8))
                await asyncio.to_thread(verify_password, password, self._decoy_hash)
                return None
            ok = await asyncio.to_thread(verify_password, password, user.password_hash)
        return user if ok else None

    def new_session(self, user: UserConfig) -> str:
        """A session cookie value for ``user``, valid for ``session_ttl_s``."""
        expires = int(self._clock.time() + self.config.session_ttl_s)
        payload = json.dumps(
            {
                "u": user.name,
                "n": secrets.token_urlsafe(16),
                "e": expires,
                "f": self._fingerprint(user),
            },
            separators=(",", ":"),
        )
        data = _b64(payload.encode())
        return f"{data}.{self.sign('session', data)}"

    def from_session(self, cookie: str | None) -> Identity | None:
        """The identity a session cookie proves, or None (forged, expired, user gone)."""
        if not cookie or len(cookie) > MAX_COOKIE_CHARS or cookie.count(".") != 1:
            return None
        data, signature = cookie.split(".")
        if not self.verify(signature, "session", data):
            return None
        try:
            payload = json.loads(_unb64(data))
            name, nonce, expires, fingerprint = (
                payload["u"],
                payload["n"],
                payload["e"],
                payload["f"],
            )
        except (ValueError, binascii.Error, KeyError, TypeError):
            return None
        user = self._users.get(name) if isinstance(name, str) else None
        if (
            user is None
            or not isinstance(expires, int)
            or expires <= self._clock.time()
            or fingerprint != self._fingerprint(user)
        ):
            return None
        return self._user_identity(user, "password", f"session\x00{nonce}")

    def from_bearer(self, authorization: str | None) -> Identity | None:
        """The identity of an ``Authorization: Bearer <token>`` header, or None."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > 256:
            return None
        found = self._tokens.get(hash_token(token))
        if found is None:
            return None
        return self._identity(found.name, frozenset(found.teams), found.admin, "token", None)

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
        return self._identity(name, frozenset(teams), admin, "sso", f"sso\x00{name}")

    # --- CSRF ------------------------------------------------------------------

    def csrf_token(self, identity: Identity) -> str:
        """The token pages embed in forms and send in ``X-CSRF-Token``."""
        if identity.csrf_seed is None:
            return ""
        return self.sign("csrf", identity.csrf_seed)

    def check_csrf(self, identity: Identity, token: str | None) -> bool:
        """True when ``token`` belongs to ``identity`` (always for API-token identities)."""
        if identity.csrf_seed is None:
            return True
        if not token or len(token) > 128:
            return False
        return self.verify(token, "csrf", identity.csrf_seed)

    def new_login_nonce(self) -> str:
        """A random value for the login form's cookie (CSRF before there is a session)."""
        return secrets.token_urlsafe(16)

    def login_form_token(self, nonce: str) -> str:
        """The login form's hidden token for the nonce in its cookie."""
        return self.sign("login", nonce)

    def check_login_form(self, nonce: str | None, token: str | None) -> bool:
        """True when the login form's token matches the nonce cookie."""
        if not nonce or not token or len(nonce) > 64 or len(token) > 128:
            return False
        return self.verify(token, "login", nonce)
