"""Building blocks for tests of the viewer (and of what embeds it): people, integrations, letters.

Passwords here are hashed with the smallest scrypt cost the configuration
accepts, so that a test suite signing in dozens of times stays fast.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from dlq_viewer.actions import replay_requeuer
from dlq_viewer.app import create_app
from dlq_viewer.passwords import hash_password, hash_token
from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import (
    AuthConfig,
    EmbeddedBackendConfig,
    IntegrationConfig,
    TokenConfig,
    UserConfig,
)
from nemesis.dlq import DeadLetter, DeadLetterStore, Reason, open_sqlite_dlq

if TYPE_CHECKING:
    import httpx

TEST_SCRYPT_N = 2**14
TEST_SECRET = "test-session-secret-0123456789abcdef-0123456789"


@dataclass(frozen=True, slots=True)
class Person:
    """A user with a known password."""

    name: str
    password: str
    teams: tuple[str, ...] = ()
    admin: bool = False


@dataclass(frozen=True, slots=True)
class Client:
    """An API client with a known token."""

    name: str
    token: str
    teams: tuple[str, ...] = ()
    admin: bool = False


@dataclass(frozen=True)
class Access:
    """People and clients, and the ``AuthConfig`` that admits them."""

    people: Sequence[Person]
    clients: Sequence[Client] = ()
    extra: Mapping[str, object] = field(default_factory=dict)

    def config(self) -> AuthConfig:
        """The auth section for these people and clients (plain-HTTP cookies, a fixed secret)."""
        return self._config

    @functools.cached_property
    def _config(self) -> AuthConfig:
        # Hashing is the slow part of a test's setup; one Access hashes its passwords once.
        return AuthConfig.model_validate(
            {
                "session_secret": TEST_SECRET,
                "secure_cookies": False,
                "users": [
                    UserConfig(
                        name=person.name,
                        password_hash=hash_password(person.password, n=TEST_SCRYPT_N),
                        teams=list(person.teams),
                        admin=person.admin,
                    )
                    for person in self.people
                ],
                "tokens": [
                    TokenConfig(
                        name=client.name,
                        token_hash=hash_token(client.token),
                        teams=list(client.teams),
                        admin=client.admin,
                    )
                    for client in self.clients
                ],
                **self.extra,
            }
        )


def integration(
    name: str, owners: Sequence[str], url: str = "http://127.0.0.1:9/", **sections: object
) -> IntegrationConfig:
    """An integration owned by ``owners`` (its target is not called unless a proxy runs)."""
    document: dict[str, object] = {
        "name": name,
        "owners": list(owners),
        "source": {"topic": "orders", "consumer": name},
        "target": {"url": url, "timeout_s": 2},
    }
    document.update(sections)
    return IntegrationConfig.model_validate(document)


def letter(
    integration_name: str,
    n: int,
    *,
    payload: bytes | None = None,
    reason: Reason = Reason.HTTP_4XX,
    http_status: int | None = 422,
    error: str | None = None,
    at: float | None = None,
    metadata: Mapping[str, str] | None = None,
    key: str | None = None,
    partition: int = 0,
) -> DeadLetter:
    """The ``n``-th dead letter of an integration, with a JSON payload unless one is given."""
    return DeadLetter(
        integration=integration_name,
        event_id=f"orders:{partition}:{n}",
        payload=payload if payload is not None else f'{{"order_id": "ord-{n}", "n": {n}}}'.encode(),
        reason=reason,
        error=error if error is not None else f"422 missing field `city` in order {n}",
        source_topic="orders",
        source_partition=partition,
        source_offset=n,
        http_status=http_status,
        key=key if key is not None else f"customer-{n % 7}",
        metadata=dict(metadata or {"type": "order.created"}),
        dead_lettered_at=at,
    )


STANDARD_ACCESS = Access(
    people=(
        Person("alice", "alice-password", ("team-a",)),
        Person("bob", "bob-password", ("team-b",)),
        Person("root", "root-password", admin=True),
    ),
    clients=(
        Client("bot-a", "nmsv_test-token-team-a", ("team-a",)),
        Client("bot-root", "nmsv_test-token-admin", admin=True),
    ),
)


@dataclass(frozen=True, slots=True)
class ViewerEnv:
    """A viewer over real parts: the DLQ (a SQLite file by default), the embedded log, the app."""

    store: DeadLetterStore
    broker: EmbeddedBroker
    app: FastAPI
    integrations: dict[str, IntegrationConfig]


@contextlib.asynccontextmanager
async def viewer_env(
    directory: Path,
    *,
    integrations: Mapping[str, IntegrationConfig],
    access: Access = STANDARD_ACCESS,
    auth: AuthConfig | None = None,
    clock: Clock = SYSTEM_CLOCK,
    lifespan: bool = True,
    open_store: Callable[[Path, Clock], Awaitable[DeadLetterStore]] | None = None,
    **app_options: Any,
) -> AsyncIterator[ViewerEnv]:
    """Opens the store and the log under ``directory`` and builds the app.

    With ``lifespan`` the app's startup and shutdown run here (for httpx's
    ASGI transport); without, a server that runs them itself must serve it.
    ``open_store(directory, clock)`` opens another DLQ store than the SQLite file.
    """
    if open_store is None:
        store: DeadLetterStore = await open_sqlite_dlq(directory / "dlq.db", clock=clock)
    else:
        store = await open_store(directory, clock)
    try:
        broker = await open_embedded(EmbeddedBackendConfig(path=str(directory / "log.db")))
        try:
            configs = dict(integrations)
            app = create_app(
                store,
                integrations=configs,
                auth=auth or access.config(),
                requeue=replay_requeuer(store, broker, clock=clock),
                clock=clock,
                **app_options,
            )
            if not lifespan:
                yield ViewerEnv(store, broker, app, configs)
                return
            async with app.router.lifespan_context(app):
                yield ViewerEnv(store, broker, app, configs)
        finally:
            await broker.close()
    finally:
        await store.close()


_CSRF_FIELD = re.compile(r'name="csrf_token" value="([^"]+)"')
_CSRF_META = re.compile(r'<meta name="csrf-token" content="([^"]+)">')


async def sign_in(client: httpx.AsyncClient, person: Person) -> str:
    """Signs ``person`` in through the form, as a browser would; returns their CSRF token."""
    form = await client.get("/login")
    token = _CSRF_FIELD.search(form.text)
    assert token is not None, "the sign-in form has no CSRF field"
    answer = await client.post(
        "/login",
        data={
            "username": person.name,
            "password": person.password,
            "csrf_token": token.group(1),
            "next": "/",
        },
    )
    assert answer.status_code == 303, f"sign-in of {person.name} failed: {answer.status_code}"
    return await csrf_of(client)


async def csrf_of(client: httpx.AsyncClient, path: str = "/audit") -> str:
    """The CSRF token a signed-in page carries."""
    page = await client.get(path)
    found = _CSRF_META.search(page.text)
    assert found is not None, f"{path} ({page.status_code}) carries no CSRF token"
    return found.group(1)


async def eventually(
    check: Callable[[], bool | Awaitable[bool]], *, timeout_s: float = 10.0, what: str = ""
) -> None:
    """Polls until ``check()`` holds; ``TimeoutError`` naming ``what`` after ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                result = check()
                if await result if inspect.isawaitable(result) else result:
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise TimeoutError(f"{what or 'condition'} not met after {timeout_s}s") from None
