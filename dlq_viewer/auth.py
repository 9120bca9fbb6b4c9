"""Who is asking: password sessions, API tokens, a trusted SSO header; CSRF tokens.

A browser signs in with a password and gets a session cookie: a payload
(user, session id, expiry, password fingerprint) and its HMAC-SHA256 under
the session secret. Signing out records the session id as revoked until the
cookie would have expired (``SessionRevocations``: in memory for one process,
``SharedSessionRevocations`` over the fleet's state store for replicas), so a
copy of the cookie is refused from then on, by every replica.
Changing a user's password or removing the user ends their sessions at once
(the fingerprint no longer matches); teams and the admin flag are read from
the configuration on every request, so they apply at once too.

Failed sign-ins slow down, they never lock out (``LoginThrottle``): after a
few failures for one user name from one client address, each further try
waits twice as long as the last, up to ``MAX_DELAY_S``. A person who knows
the password waits at most that long, whoever else is guessing; the same
person from another address is not slowed at all. A looser count per
address slows one client guessing many names. The client address is the
TCP peer, or the forwarded address when the peer is a configured reverse
proxy (``client_address``).

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
import heapq
import hmac
import ipaddress
import json
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from dlq_viewer.passwords import hash_password, verify_password
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import AuthConfig, UserConfig
from nemesis.errors import StateError
from nemesis.identity import Identities, Identity, Method

log = logging.getLogger(__name__)

SESSION_COOKIE = "nemesis_session"
LOGIN_COOKIE = "nemesis_login"
MAX_COOKIE_CHARS = 1024
# Failed sign-ins that cost nothing: per user name and client address, and per address
# across names (one client trying many names). After them each try waits twice as long
# as the one before, from FIRST_DELAY_S up to MAX_DELAY_S; a quiet key is forgotten.
FREE_FAILURES = 5
FREE_ADDRESS_FAILURES = 50
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
FORGET_AFTER_S = 900.0
_THROTTLE_KEYS = 10_000  # remembered keys; the least recently failed are forgotten first
MAX_REVOKED = 100_000  # ended sessions remembered in memory until their cookies expire
_SHARED_PER_CALL = 16  # sign-outs kept here during an outage, written to the store per call
STORE_RETRY_S = 5.0  # after the state store failed a call, it is asked again this much later
_CONCURRENT_HASHES = 2  # scrypt costs 32 MiB and tens of milliseconds each

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_MAX_HOPS = 32  # forwarded hops looked at, nearest first


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class LoginThrottle:
    """Exponential delays after failed sign-ins, per key; bounded, never a lockout, bounded memory.

    A key's first ``free_failures`` cost nothing; after the n-th failure beyond
    them the key waits ``first_delay_s * 2**(n-1)`` (at most ``max_delay_s``)
    from that failure. A try while a key waits is refused without checking the
    password, so guessing gains nothing by hurrying. A key quiet for
    ``forget_after_s`` starts over.
    """

    def __init__(
        self,
        clock: Clock,
        *,
        free_failures: int = FREE_FAILURES,
        first_delay_s: float = FIRST_DELAY_S,
        max_delay_s: float = MAX_DELAY_S,
        forget_after_s: float = FORGET_AFTER_S,
    ):
        self._clock = clock
        self._free = free_failures
        self._first_delay_s = first_delay_s
        self._max_delay_s = max_delay_s
        self._forget_after_s = forget_after_s
        # key -> (failures, when the last one happened), least recently failed first
        self._failures: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()

    def delay_s(self, failures: int) -> float:
        """How long a key waits after its ``failures``-th failure."""
        beyond = failures - self._free - 1
        if beyond < 0:
            return 0.0
        return min(self._max_delay_s, self._first_delay_s * 2.0 ** min(beyond, 62))

    def retry_after_s(self, *keys: str) -> float:
        """Seconds until every one of ``keys`` may try again; 0 when all may now."""
        now = self._clock.monotonic()
        wait = 0.0
        for key in keys:
            found = self._failures.get(key)
            if found is None:
                continue
            failures, last = found
            if now - last >= self._forget_after_s:
                del self._failures[key]
                continue
            wait = max(wait, last + self.delay_s(failures) - now)
        return wait

    def failed(self, *keys: str) -> None:
        """Records one failure for each key."""
        now = self._clock.monotonic()
        for key in keys:
            failures, last = self._failures.pop(key, (0, now))
            if now - last >= self._forget_after_s:
                failures = 0
            self._failures[key] = (failures + 1, now)
            while len(self._failures) > _THROTTLE_KEYS:
                self._failures.popitem(last=False)

    def succeeded(self, *keys: str) -> None:
        """Forgets the failures of ``keys``."""
        for key in keys:
            self._failures.pop(key, None)


class SessionRevocations(Protocol):
    """Ended sessions, remembered until their cookies would expire anyway.

    Every replica of the viewer must see the same revocations, so a shared
    store stands behind this (``SharedSessionRevocations``);
    ``MemorySessionRevocations`` serves one process.
    """

    async def revoke(self, session_id: str, expires_at: float) -> None:
        """Refuses ``session_id`` from now until ``expires_at`` (Unix seconds)."""
        ...

    async def is_revoked(self, session_id: str) -> bool:
        """True when ``session_id`` was revoked."""
        ...


class MemorySessionRevocations:
    """Revocations in this process's memory; expired ones are dropped, the count is bounded."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK, *, max_entries: int = MAX_REVOKED) -> None:
        self._clock = clock
        self._max_entries = max_entries
        self._until: dict[str, float] = {}
        self._expiring: list[tuple[float, str]] = []  # a heap: the soonest expiry first

    async def revoke(self, session_id: str, expires_at: float) -> None:
        """Refuses ``session_id`` until ``expires_at``."""
        self._drop_expired()
        if session_id in self._until:
            return
        while len(self._until) >= self._max_entries:
            # Full: forget the revocation whose cookie expires soonest (the least to lose).
            _, oldest = heapq.heappop(self._expiring)
            self._until.pop(oldest, None)
            log.warning("over %d ended sessions remembered: forgot one early", self._max_entries)
        self._until[session_id] = expires_at
        heapq.heappush(self._expiring, (expires_at, session_id))

    async def is_revoked(self, session_id: str) -> bool:
        """True when ``session_id`` was revoked and its cookie has not expired."""
        self._drop_expired()
        return session_id in self._until

    def __len__(self) -> int:
        return len(self._until)

    def _drop_expired(self) -> None:
        now = self._clock.time()
        while self._expiring and self._expiring[0][0] <= now:
            _, session_id = heapq.heappop(self._expiring)
            self._until.pop(session_id, None)


class SessionStore(Protocol):
    """Where replicas share revocations: the fleet's state store has these two calls."""

    async def revoke_session(self, session_id: str, expires_at: float, *, now: float) -> int:
        """Stores a revocation; returns how many others it pushed out (the store was full)."""
        ...

    async def session_revoked_until(self, session_id: str, *, now: float) -> float | None:
        """Until when ``session_id`` is revoked, or None."""
        ...


@dataclass(frozen=True, slots=True)
class SharedRevocationStatistics:
    """A snapshot of ``SharedSessionRevocations``."""

    unshared: int  # sign-outs made here that the store does not hold yet
    store_answering: bool  # False from a call the store failed to the next it answered


class SharedSessionRevocations:
    """Revocations every replica shares through a store, and remembers here too.

    A sign-out is written to the store and to this process's memory; a
    cookie is refused when either holds its session (a revocation read
    from the store is remembered here too). The store is the shared
    source; memory is what this replica still knows when the store does
    not answer (``StateError``):

    - ``is_revoked`` answers from memory (the sign-outs made on this
      replica or seen here before) and logs one warning per outage; the
      store is asked again ``STORE_RETRY_S`` after it failed, so a store that
      hangs slows one request now and then, not every one. Refusing
      every session instead would lock every password user out of the
      viewer for the outage, which is when they need it; the cost is that a
      copy of a cookie signed out on another replica works here until the
      store answers again (or the cookie expires);
    - ``revoke`` keeps the revocation here, refused at once on this replica,
      and writes it to the store at a later call that finds it answering
      (a few per call), so the others learn of it when the store is back. A
      warning names each sign-out the others cannot see yet.
    """

    def __init__(
        self, store: SessionStore, clock: Clock = SYSTEM_CLOCK, *, max_entries: int = MAX_REVOKED
    ) -> None:
        self._store = store
        self._clock = clock
        self._local = MemorySessionRevocations(clock, max_entries=max_entries)
        self._max_unshared = max_entries
        self._unshared: dict[str, float] = {}  # revoked here, not yet in the store
        self._store_down = False
        self._retry_at = 0.0  # monotonic: when a store that failed is asked again

    async def revoke(self, session_id: str, expires_at: float) -> None:
        """Refuses ``session_id`` until ``expires_at`` here at once, and on every replica."""
        await self._local.revoke(session_id, expires_at)
        if len(self._unshared) >= self._max_unshared:
            soonest = min(self._unshared, key=self._unshared.__getitem__)
            del self._unshared[soonest]  # still refused here, while memory holds it
            log.warning(
                "over %d sign-outs wait for the state store: one stays in this process only",
                self._max_unshared,
            )
        self._unshared[session_id] = expires_at
        if not await self._share():
            log.warning(
                "a viewer session was signed out here while the state store does not answer:"
                " other replicas accept its cookie until the store answers again"
            )

    async def is_revoked(self, session_id: str) -> bool:
        """True when this process or the store knows ``session_id`` was revoked."""
        if await self._local.is_revoked(session_id):
            return True
        if self._skip_store() or (self._unshared and not await self._share()):
            return False
        try:
            until = await self._store.session_revoked_until(session_id, now=self._clock.time())
        except StateError as exc:
            self._failed(exc)
            return False
        self._answered()
        if until is None:
            return False
        await self._local.revoke(session_id, until)
        return True

    def statistics(self) -> SharedRevocationStatistics:
        """What waits for the store, and whether it answered last time."""
        return SharedRevocationStatistics(
            unshared=len(self._unshared), store_answering=not self._store_down
        )

    async def _share(self) -> bool:
        """Writes the sign-outs only this process holds, the newest first; False: no answer."""
        if self._skip_store():
            return False
        now = self._clock.time()
        for session_id in list(reversed(self._unshared))[:_SHARED_PER_CALL]:
            expires_at = self._unshared.get(session_id)
            if expires_at is None:
                continue  # another request shared it meanwhile
            if expires_at > now:
                try:
                    pushed_out = await self._store.revoke_session(session_id, expires_at, now=now)
                except StateError as exc:
                    self._failed(exc)
                    return False
                self._answered()
                if pushed_out:
                    log.warning(
                        "the state store holds its most revoked sessions: forgot the %d whose"
                        " cookies expire soonest",
                        pushed_out,
                    )
            self._unshared.pop(session_id, None)
        return True

    def _skip_store(self) -> bool:
        return self._store_down and self._clock.monotonic() < self._retry_at

    def _failed(self, exc: StateError) -> None:
        self._retry_at = self._clock.monotonic() + STORE_RETRY_S
        if not self._store_down:
            self._store_down = True
            log.warning(
                "the state store does not answer (%s): viewer sessions are checked against the"
                " sign-outs this process knows of until it does",
                exc,
            )

    def _answered(self) -> None:
        if self._store_down:
            self._store_down = False
            log.info("the state store answers again: viewer sign-outs are shared again")


def client_address(
    peer: str | None, headers: Mapping[str, str], trusted_proxies: Sequence[IPNetwork]
) -> str:
    """The client's address: the TCP peer, or what trusted reverse proxies forwarded.

    ``X-Forwarded-For`` and ``Forwarded`` are read only when the peer is one of
    ``trusted_proxies``; then the hops are walked from the nearest, past every
    trusted proxy, and the first other address is the client. A hop that is not
    an address (``unknown``, an obfuscated name) stops the walk at the proxy that
    reported it.
    """
    if peer is None:
        return "unknown"
    if not trusted_proxies or not _is_trusted(peer, trusted_proxies):
        return peer
    hops = _forwarded_hops(headers)
    client = peer
    for hop in reversed(hops):
        address = _hop_address(hop)
        if address is None:
            return client
        client = address
        if not _is_trusted(address, trusted_proxies):
            return address
    return client


def _is_trusted(address: str, networks: Sequence[IPNetwork]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def _forwarded_hops(headers: Mapping[str, str]) -> list[str]:
    forwarded = headers.get("forwarded")
    if forwarded:
        hops = []
        for element in forwarded.split(",")[-_MAX_HOPS:]:
            for pair in element.split(";"):
                name, _, value = pair.strip().partition("=")
                if name.strip().lower() == "for":
                    hops.append(value.strip().strip('"'))
        return hops
    forwarded_for = headers.get("x-forwarded-for", "")
    return [hop.strip() for hop in forwarded_for.split(",")[-_MAX_HOPS:] if hop.strip()]


def _hop_address(hop: str) -> str | None:
    """The IP address in one hop (``1.2.3.4``, ``1.2.3.4:80``, ``[::1]:80``, ``::1``), else None."""
    text = hop
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


class Authenticator:
    """Turns credentials into an ``Identity``, and signs what proves one later."""

    def __init__(
        self,
        config: AuthConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        revocations: SessionRevocations | None = None,
    ) -> None:
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
        self.identities = Identities(config)
        self.revocations: SessionRevocations = (
            MemorySessionRevocations(clock) if revocations is None else revocations
        )
        self.account_throttle = LoginThrottle(clock)  # per user name and client address
        self.address_throttle = LoginThrottle(clock, free_failures=FREE_ADDRESS_FAILURES)
        self._hashing = asyncio.Semaphore(_CONCURRENT_HASHES)
        self._decoy_hash: str | None = None

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

    def _user_identity(self, user: UserConfig, method: Method, seed: str | None) -> Identity:
        return self.identities.identity(user.name, frozenset(user.teams), user.admin, method, seed)

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

    def _session(self, cookie: str | None) -> tuple[UserConfig, str, int] | None:
        """The user, session id and expiry a session cookie carries, if it is genuine and live."""
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
            or not isinstance(nonce, str)
            or not isinstance(expires, int)
            or expires <= self._clock.time()
            or fingerprint != self._fingerprint(user)
        ):
            return None
        return user, nonce, expires

    async def from_session(self, cookie: str | None) -> Identity | None:
        """The identity a session cookie proves, or None (forged, expired, ended, user gone)."""
        session = self._session(cookie)
        if session is None:
            return None
        user, nonce, _ = session
        if await self.revocations.is_revoked(nonce):
            return None
        return self._user_identity(user, "password", f"session\x00{nonce}")

    async def end_session(self, cookie: str | None) -> None:
        """Revokes the session of ``cookie``: no copy of it works again."""
        session = self._session(cookie)
        if session is not None:
            _, nonce, expires = session
            await self.revocations.revoke(nonce, float(expires))

    def from_bearer(self, authorization: str | None) -> Identity | None:
        """The identity of an ``Authorization: Bearer <token>`` header, or None."""
        return self.identities.from_bearer(authorization)

    def from_trusted_header(self, headers: Mapping[str, str], peer: str | None) -> Identity | None:
        """The identity a trusted SSO proxy vouches for, or None (no header, untrusted peer)."""
        return self.identities.from_trusted_header(headers, peer)

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
