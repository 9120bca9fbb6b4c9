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
waits twice as long as the last, up to ``MAX_DELAY_S``. A looser count per
address slows one client guessing many names. A browser where the user
signed in before carries a device cookie (OWASP's "device cookies") and
counts only its own failures, so whoever shares its address and guesses the
user's password cannot hold it back; the same person from another address
is not slowed either. The counts live in a ``LoginStore``: the fleet's state
store (``SharedLoginStore``), so every replica counts the same failures, or
this process's memory. The client address is the TCP peer, or the forwarded
address when the peer is a configured reverse proxy (``client_address``).

The sign-in form's nonce and token work once (the nonce is spent in the
``LoginStore``) and only from the viewer's own origin (``from_own_origin``):
a page on another port of the same host is same-site to a browser, which
sends it this site's cookies, but is another origin.

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
import contextlib
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
DEVICE_COOKIE = "nemesis_device"
LOGIN_FORM_TTL_S = 3600  # a sign-in form (its nonce cookie) works this long, and once
DEVICE_TTL_S = 30 * 86400  # a browser a user signed in on is known this long after the last time
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
MAX_SHARE_RETRY_S = 300.0  # sign-outs the store did not take are retried at most this far apart
_CONCURRENT_HASHES = 2  # scrypt costs 32 MiB and tens of milliseconds each

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
_MAX_HOPS = 32  # forwarded hops looked at, nearest first


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class LoginStore(Protocol):
    """Where sign-in failures are counted and sign-in forms spent: the state store has these calls.

    Keys and nonces are opaque text (``LoginThrottle`` hashes its keys); times are Unix seconds.
    """

    async def login_failures(
        self, keys: Sequence[str], *, since: float
    ) -> dict[str, tuple[int, float]]:
        """Each key's failures and when the latest was, for keys that failed after ``since``."""
        ...

    async def login_failed(self, keys: Sequence[str], *, now: float, since: float) -> object:
        """Counts one failure at ``now`` for each key (one quiet since ``since`` starts over)."""
        ...

    async def login_succeeded(self, keys: Sequence[str]) -> None:
        """Forgets the failures of ``keys``."""
        ...

    async def spend_login_nonce(self, nonce: str, expires_at: float, *, now: float) -> bool:
        """True the first time a form's ``nonce`` is spent, False after that."""
        ...


class MemoryLoginStore:
    """``LoginStore`` in this process's memory, bounded: one process, or the store's stand-in."""

    def __init__(self, *, max_entries: int = _THROTTLE_KEYS) -> None:
        self._max_entries = max_entries
        # key -> (failures, when the last one happened), least recently failed first
        self._failures: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()
        self._spent: dict[str, float] = {}
        self._expiring: list[tuple[float, str]] = []  # a heap: the soonest to expire first

    async def login_failures(
        self, keys: Sequence[str], *, since: float
    ) -> dict[str, tuple[int, float]]:
        """Each key's failures and when the latest was, for keys that failed after ``since``."""
        found = {}
        for key in keys:
            entry = self._failures.get(key)
            if entry is not None and entry[1] > since:
                found[key] = entry
        return found

    async def login_failed(
        self, keys: Sequence[str], *, now: float, since: float
    ) -> dict[str, int]:
        """Counts one failure at ``now`` for each key; the least recently failed are forgotten."""
        counts = {}
        for key in keys:
            failures, last = self._failures.pop(key, (0, now))
            if last <= since:
                failures = 0
            self._failures[key] = (failures + 1, now)
            counts[key] = failures + 1
            while len(self._failures) > self._max_entries:
                self._failures.popitem(last=False)
        return counts

    async def login_succeeded(self, keys: Sequence[str]) -> None:
        """Forgets the failures of ``keys``."""
        for key in keys:
            self._failures.pop(key, None)

    async def spend_login_nonce(self, nonce: str, expires_at: float, *, now: float) -> bool:
        """True the first time ``nonce`` is spent; spent ones are kept until they expire."""
        while self._expiring and (
            self._expiring[0][0] <= now or len(self._spent) >= self._max_entries
        ):
            _, old = heapq.heappop(self._expiring)
            self._spent.pop(old, None)
        if nonce in self._spent:
            return False
        self._spent[nonce] = expires_at
        heapq.heappush(self._expiring, (expires_at, nonce))
        return True


class _StoreHealth:
    """Whether the state store answered its last call; one that failed is asked again later."""

    def __init__(self, clock: Clock, *, down: str, back: str) -> None:
        self._clock = clock
        self._down_message = down
        self._back_message = back
        self.down = False
        self._retry_at = 0.0  # monotonic: when a store that failed is asked again

    def skip(self) -> bool:
        """True while a store that failed should not be asked yet."""
        return self.down and self._clock.monotonic() < self._retry_at

    def failed(self, exc: StateError) -> None:
        self._retry_at = self._clock.monotonic() + STORE_RETRY_S
        if not self.down:
            self.down = True
            log.warning(self._down_message, exc)

    def answered(self) -> None:
        if self.down:
            self.down = False
            log.info(self._back_message)


class SharedLoginStore:
    """``LoginStore`` over the fleet's state store, so every replica counts the same failures.

    When the store does not answer (``StateError``), this process's memory
    counts and spends instead (a warning once per outage; the store is asked
    again ``STORE_RETRY_S`` later): sign-in goes on, slowed per replica as
    in a single process, rather than failing for everyone.
    """

    def __init__(self, store: LoginStore, clock: Clock = SYSTEM_CLOCK) -> None:
        self._store = store
        self._local = MemoryLoginStore()
        self._health = _StoreHealth(
            clock,
            down="the state store does not answer (%s): viewer sign-in failures are counted"
            " in this process until it does",
            back="the state store answers again: viewer sign-in failures are shared again",
        )

    async def login_failures(
        self, keys: Sequence[str], *, since: float
    ) -> dict[str, tuple[int, float]]:
        """Failures after ``since``, from the store (or here, when it does not answer)."""
        if not self._health.skip():
            try:
                found = await self._store.login_failures(keys, since=since)
            except StateError as exc:
                self._health.failed(exc)
            else:
                self._health.answered()
                return found
        return await self._local.login_failures(keys, since=since)

    async def login_failed(self, keys: Sequence[str], *, now: float, since: float) -> object:
        """Counts a failure for each key in the store (or here, when it does not answer)."""
        if not self._health.skip():
            try:
                counts = await self._store.login_failed(keys, now=now, since=since)
            except StateError as exc:
                self._health.failed(exc)
            else:
                self._health.answered()
                return counts
        return await self._local.login_failed(keys, now=now, since=since)

    async def login_succeeded(self, keys: Sequence[str]) -> None:
        """Forgets the failures of ``keys`` in the store and here."""
        await self._local.login_succeeded(keys)
        if self._health.skip():
            return
        try:
            await self._store.login_succeeded(keys)
        except StateError as exc:
            self._health.failed(exc)
        else:
            self._health.answered()

    async def spend_login_nonce(self, nonce: str, expires_at: float, *, now: float) -> bool:
        """Spends ``nonce`` in the store (and here: a form spent during an outage stays spent)."""
        if not await self._local.spend_login_nonce(nonce, expires_at, now=now):
            return False
        if self._health.skip():
            return True
        try:
            fresh = await self._store.spend_login_nonce(nonce, expires_at, now=now)
        except StateError as exc:
            self._health.failed(exc)
            return True
        self._health.answered()
        return fresh


class LoginThrottle:
    """Exponential delays after failed sign-ins, per key; bounded, never a lockout.

    A key's first ``free_failures`` cost nothing; after the n-th failure beyond
    them the key waits ``first_delay_s * 2**(n-1)`` (at most ``max_delay_s``)
    from that failure. A try while a key waits is refused without checking the
    password, so guessing gains nothing by hurrying. A key quiet for
    ``forget_after_s`` starts over. The counts live in ``store`` (the state
    store, for every replica alike), under a hash of ``kind`` and the key.
    """

    def __init__(
        self,
        store: LoginStore,
        clock: Clock,
        *,
        kind: str = "",
        free_failures: int = FREE_FAILURES,
        first_delay_s: float = FIRST_DELAY_S,
        max_delay_s: float = MAX_DELAY_S,
        forget_after_s: float = FORGET_AFTER_S,
    ):
        self._store = store
        self._clock = clock
        self._kind = kind
        self._free = free_failures
        self._first_delay_s = first_delay_s
        self._max_delay_s = max_delay_s
        self._forget_after_s = forget_after_s

    def delay_s(self, failures: int) -> float:
        """How long a key waits after its ``failures``-th failure."""
        beyond = failures - self._free - 1
        if beyond < 0:
            return 0.0
        return min(self._max_delay_s, self._first_delay_s * 2.0 ** min(beyond, 62))

    def _keys(self, keys: Sequence[str]) -> list[str]:
        # A hash: the store holds no user name or address, and every key has one short length.
        return [hashlib.sha256(f"{self._kind}\x00{key}".encode()).hexdigest()[:32] for key in keys]

    async def retry_after_s(self, *keys: str) -> float:
        """Seconds until every one of ``keys`` may try again; 0 when all may now."""
        now = self._clock.time()
        found = await self._store.login_failures(self._keys(keys), since=now - self._forget_after_s)
        wait = 0.0
        for failures, last in found.values():
            wait = max(wait, last + self.delay_s(failures) - now)
        return wait

    async def failed(self, *keys: str) -> None:
        """Records one failure for each key."""
        now = self._clock.time()
        await self._store.login_failed(self._keys(keys), now=now, since=now - self._forget_after_s)

    async def succeeded(self, *keys: str) -> None:
        """Forgets the failures of ``keys``."""
        await self._store.login_succeeded(self._keys(keys))


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

    async def aclose(self) -> None:
        """Stops any work running in the background."""
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

    async def aclose(self) -> None:
        """Nothing runs in the background."""

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
      and a task of this object writes it to the store when it answers:
      first ``STORE_RETRY_S`` later, then twice as long each time up to
      ``MAX_SHARE_RETRY_S``, until the store has taken every such sign-out
      or their cookies have expired (requests that find the store answering
      write them too). A warning names each sign-out the others cannot see
      yet, and a line says when they can. ``aclose`` stops the task.
    """

    def __init__(
        self, store: SessionStore, clock: Clock = SYSTEM_CLOCK, *, max_entries: int = MAX_REVOKED
    ) -> None:
        self._store = store
        self._clock = clock
        self._local = MemorySessionRevocations(clock, max_entries=max_entries)
        self._max_unshared = max_entries
        self._unshared: dict[str, float] = {}  # revoked here, not yet in the store
        self._health = _StoreHealth(
            clock,
            down="the state store does not answer (%s): viewer sessions are checked against the"
            " sign-outs this process knows of until it does",
            back="the state store answers again: viewer sign-outs are shared again",
        )
        self._retrying: asyncio.Task[None] | None = None

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
                " other replicas accept its cookie until the store takes it (retried in the"
                " background)"
            )
            if self._retrying is None or self._retrying.done():
                self._retrying = asyncio.create_task(
                    self._share_until_taken(), name="viewer sign-outs to the state store"
                )

    async def is_revoked(self, session_id: str) -> bool:
        """True when this process or the store knows ``session_id`` was revoked."""
        if await self._local.is_revoked(session_id):
            return True
        if self._health.skip() or (self._unshared and not await self._share()):
            return False
        try:
            until = await self._store.session_revoked_until(session_id, now=self._clock.time())
        except StateError as exc:
            self._health.failed(exc)
            return False
        self._health.answered()
        if until is None:
            return False
        await self._local.revoke(session_id, until)
        return True

    def statistics(self) -> SharedRevocationStatistics:
        """What waits for the store, and whether it answered last time."""
        return SharedRevocationStatistics(
            unshared=len(self._unshared), store_answering=not self._health.down
        )

    async def aclose(self) -> None:
        """Stops retrying: sign-outs the store has not taken stay in this process only."""
        task, self._retrying = self._retrying, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._unshared:
            log.warning(
                "%d viewer sign-outs never reached the state store: other replicas accept"
                " their cookies until they expire",
                len(self._unshared),
            )

    async def _share_until_taken(self) -> None:
        """Writes the sign-outs only this process holds, retrying with a growing pause."""
        pause_s = STORE_RETRY_S
        await self._clock.sleep(pause_s)
        while self._unshared:
            if await self._share():
                continue  # a few per call: go on at once while the store takes them
            pause_s = min(pause_s * 2, MAX_SHARE_RETRY_S)
            await self._clock.sleep(pause_s)
        log.info("every viewer sign-out made here is in the state store: all replicas refuse them")

    async def _share(self) -> bool:
        """Writes the sign-outs only this process holds, the newest first; False: no answer."""
        if self._health.skip():
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
                    self._health.failed(exc)
                    return False
                self._health.answered()
                if pushed_out:
                    log.warning(
                        "the state store holds its most revoked sessions: forgot the %d whose"
                        " cookies expire soonest",
                        pushed_out,
                    )
            self._unshared.pop(session_id, None)
        return True


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
        logins: LoginStore | None = None,
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
        self.logins: LoginStore = MemoryLoginStore() if logins is None else logins
        # Per user name and client address; per address across names; per known browser.
        self.account_throttle = LoginThrottle(self.logins, clock, kind="account")
        self.address_throttle = LoginThrottle(
            self.logins, clock, kind="address", free_failures=FREE_ADDRESS_FAILURES
        )
        self.device_throttle = LoginThrottle(self.logins, clock, kind="device")
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
        """A value for the login form's cookie (CSRF before there is a session): expiry.random."""
        expires = int(self._clock.time()) + LOGIN_FORM_TTL_S
        return f"{expires}.{secrets.token_urlsafe(16)}"

    def login_form_token(self, nonce: str) -> str:
        """The login form's hidden token for the nonce in its cookie."""
        return self.sign("login", nonce)

    async def check_login_form(self, nonce: str | None, token: str | None) -> bool:
        """True when the form's token matches its nonce cookie, in time, and the first time.

        The nonce is spent in the login store (every replica's): a pair of
        nonce and token, once posted, never signs anyone in again.
        """
        if not nonce or not token or len(nonce) > 64 or len(token) > 128:
            return False
        if not self.verify(token, "login", nonce):
            return False
        expires, _, _ = nonce.partition(".")
        now = self._clock.time()
        if not expires.isdigit() or int(expires) <= now:
            return False
        return await self.logins.spend_login_nonce(nonce, float(expires), now=now)

    # --- sign-in throttling ------------------------------------------------------

    def new_device(self, user: UserConfig) -> str:
        """A cookie value that marks this browser as one ``user`` signed in on (a device cookie)."""
        payload = json.dumps(
            {
                "u": user.name,
                "d": secrets.token_urlsafe(16),
                "e": int(self._clock.time() + DEVICE_TTL_S),
            },
            separators=(",", ":"),
        )
        data = _b64(payload.encode())
        return f"{data}.{self.sign('device', data)}"

    def known_device(self, cookie: str | None, username: str) -> str | None:
        """The id of a genuine, live device cookie of ``username``, else None."""
        if not cookie or len(cookie) > MAX_COOKIE_CHARS or cookie.count(".") != 1:
            return None
        data, signature = cookie.split(".")
        if not self.verify(signature, "device", data):
            return None
        try:
            payload = json.loads(_unb64(data))
            name, device, expires = payload["u"], payload["d"], payload["e"]
        except (ValueError, binascii.Error, KeyError, TypeError):
            return None
        if (
            name != username
            or not isinstance(device, str)
            or not isinstance(expires, int)
            or expires <= self._clock.time()
        ):
            return None
        return device

    async def sign_in_wait_s(self, username: str, address: str, device: str | None) -> float:
        """Seconds this sign-in must wait before its password is checked; 0: check it now.

        A browser where ``username`` signed in before (``device``, from
        ``known_device``) counts its own failures only: whoever else guesses
        that user's password from the same address cannot hold it back.
        """
        if device is not None:
            return await self.device_throttle.retry_after_s(device)
        return max(
            await self.account_throttle.retry_after_s(_account_key(username, address)),
            await self.address_throttle.retry_after_s(address),
        )

    async def sign_in_failed(self, username: str, address: str, device: str | None) -> None:
        """Counts a wrong password against the keys ``sign_in_wait_s`` reads."""
        if device is not None:
            await self.device_throttle.failed(device)
            return
        await self.account_throttle.failed(_account_key(username, address))
        await self.address_throttle.failed(address)

    async def sign_in_succeeded(self, username: str, address: str, device: str | None) -> None:
        """Clears the user's own counts; an address's count stays (it may be guessing others)."""
        if device is not None:
            await self.device_throttle.succeeded(device)
        await self.account_throttle.succeeded(_account_key(username, address))

    async def aclose(self) -> None:
        """Stops what the revocations run in the background (a retry of sign-outs)."""
        await self.revocations.aclose()


def _account_key(username: str, address: str) -> str:
    return f"{username.lower()}\x00{address}"


def from_own_origin(headers: Mapping[str, str], *, scheme: str, secure: bool) -> bool:
    """False when a browser says a request comes from another origin than the viewer's.

    ``Sec-Fetch-Site``, which every current browser sends, decides: it must
    be ``same-origin`` (or ``none``: typed in by the user); ``same-site`` is
    refused too, since a page on another port of the same host is same-site.
    Without it, an ``Origin`` must be the viewer's own: the scheme it is
    served over (or ``https`` when cookies are secure, for a proxy that ends
    TLS in front of it) and the ``Host`` the browser asked for. ``null`` is
    what a browser sends from the viewer's own pages (their Referrer-Policy
    is ``no-referrer``), so it passes there. A client that sends neither (a
    script) is not a browser carrying someone's cookies, and passes.
    """
    site = headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    origin = headers.get("origin")
    if origin is None or origin == "null":
        return True
    host = headers.get("host", "")
    schemes = {scheme, "https"} if secure else {scheme}
    return bool(host) and origin in {f"{name}://{host}" for name in schemes}
