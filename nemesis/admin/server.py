"""HTTP servers that run beside the proxy, in its event loop (the admin API; the DLQ viewer).

``serve_beside`` starts each ``Service``, runs the proxy, and stops the
services once the proxy has drained, so health, readiness and ``/metrics``
stay answerable through a graceful shutdown.

A service that cannot listen (its port is taken, say by a second
``nemesis run`` on the same machine, which the embedded backend allows):

- a *required* one (the admin API: without it nothing reports health or
  readiness, and an orchestrator would wait on a process it cannot see)
  stops the start with ``ServiceStartError``, naming the address and the
  cause: ``nemesis run`` exits 1 before it reads a message (a second
  ``nemesis run`` on one machine needs its own ``admin.port``, or 0 for any
  free one);
- any other (the DLQ viewer) is logged as an error naming the address and
  the cause, and recorded in ``ServiceFailures``, which ``/readyz`` reports
  as a reason for not being ready: deliveries go on, and the missing viewer
  shows where an operator looks.

``UvicornService`` runs an ASGI app on uvicorn without uvicorn's own signal
handling: uvicorn would take SIGTERM and SIGINT away from the proxy, whose
handlers drain deliveries first. It binds its socket itself, so a bind error
is an ``OSError`` here rather than uvicorn's ``sys.exit``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import socket
from collections.abc import Awaitable, Collection, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import uvicorn
from starlette.types import ASGIApp

if TYPE_CHECKING:
    from nemesis.broker.port import Broker
    from nemesis.config.models import NemesisConfig
    from nemesis.dlq import DeadLetterStore
    from nemesis.fleet.port import StateStore
    from nemesis.runtime.app import Proxy

from nemesis.errors import NemesisError

log = logging.getLogger(__name__)


class ServiceStartError(NemesisError):
    """A required service (the admin API) could not listen; the process cannot be watched."""


class ServiceFailures:
    """Services beside the proxy that are not serving, and why: a reason for ``/readyz``."""

    def __init__(self) -> None:
        self._reasons: dict[str, str] = {}

    def record(self, name: str, reason: str) -> None:
        """``name`` is not serving because of ``reason``."""
        self._reasons[name] = reason

    def reasons(self) -> list[str]:
        """One line per service that is not serving."""
        return [f"{name} not serving: {reason}" for name, reason in sorted(self._reasons.items())]


class Service(Protocol):
    """Something that serves beside the proxy: bound first, served until stopped."""

    name: str

    @property
    def url(self) -> str:
        """Where it listens (meaningful once bound)."""
        ...

    def bind(self) -> None:
        """Takes the listening socket (a second call keeps it); raises OSError when it cannot."""
        ...

    async def serve(self) -> None:
        """Serves until ``stop()``."""
        ...

    def stop(self) -> None: ...


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The proxy owns SIGTERM/SIGINT (drain first); see the module docstring.
        yield


class UvicornService:
    """An ASGI app served by uvicorn on the running event loop."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        host: str,
        port: int,
        name: str,
        graceful_s: int = 5,
        lifespan: Literal["on", "off", "auto"] = "off",
        proxy_headers: bool = True,
    ) -> None:
        self.name = name
        self._host = host
        self._port = port
        self._config = uvicorn.Config(
            app,
            lifespan=lifespan,
            # False where an app trusts request.client (the viewer's trusted-proxy check).
            proxy_headers=proxy_headers,
            access_log=False,
            log_config=None,
            ws="none",
            timeout_graceful_shutdown=graceful_s,
            server_header=False,
        )
        self._server = _Server(self._config)
        self._socket: socket.socket | None = None

    @property
    def port(self) -> int:
        """The port listened on (the real one once bound with port 0)."""
        if self._socket is None:
            return self._port
        return int(self._socket.getsockname()[1])

    @property
    def url(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}"

    def bind(self) -> None:
        """Takes the listening socket (once); raises OSError (address in use, ...)."""
        if self._socket is not None:
            return
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # IPPROTO_TCP, not 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say
        # they are TCP, and uvicorn writes an answer's headers and body apart, so with Nagle
        # on the body waits for the client's delayed ACK (about 40 ms on Linux).
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
            sock.listen(self._config.backlog)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._socket = sock

    async def serve(self) -> None:
        """Serves until ``stop()``; binds first when ``bind()`` was not called."""
        if self._socket is None:
            self.bind()
        assert self._socket is not None
        log.info("%s listening on %s", self.name, self.url)
        try:
            await self._server.serve(sockets=[self._socket])
        finally:
            self._socket.close()

    @property
    def started(self) -> bool:
        return self._server.started

    def stop(self) -> None:
        """Asks the server to finish its requests and return from ``serve()``."""
        self._server.should_exit = True


async def _guarded(service: Service, failures: ServiceFailures) -> None:
    try:
        await service.serve()
    except Exception as exc:
        # A supervisor boundary: a broken side server must not stop deliveries.
        log.exception("%s failed; the proxy runs on without it", service.name)
        failures.record(service.name, f"failed: {exc}")


async def serve_beside(
    main: Awaitable[None],
    services: Sequence[Service],
    background: Sequence[Coroutine[Any, Any, None]] = (),
    *,
    required: Collection[str] = (),
    failures: ServiceFailures | None = None,
) -> None:
    """Runs ``main`` (the proxy) with the services and background jobs beside it.

    The services stop and the background jobs are cancelled once ``main``
    returns. A service named in ``required`` that cannot bind raises
    ``ServiceStartError`` before ``main`` starts; any other is logged as an
    error and recorded in ``failures`` (see the module docstring).
    """
    failures = ServiceFailures() if failures is None else failures
    serving: list[Service] = []
    for service in services:
        try:
            service.bind()
        except OSError as exc:
            cause = exc.strerror or str(exc)
            if service.name in required:
                for awaitable in (main, *background):
                    if isinstance(awaitable, Coroutine):
                        awaitable.close()  # never started: no "never awaited" warning
                raise ServiceStartError(
                    f"the {service.name} cannot listen on {service.url}: {cause}; nothing could"
                    " report health or readiness, so Nemesis does not start (free the address"
                    " or choose another one in nemesis.yaml)"
                ) from exc
            log.error(  # noqa: TRY400 - a configuration or environment problem, no traceback
                "%s NOT STARTED: cannot listen on %s: %s; the proxy runs without it and"
                " /readyz reports it",
                service.name,
                service.url,
                cause,
            )
            failures.record(service.name, f"cannot listen on {service.url}: {cause}")
            continue
        serving.append(service)
    async with asyncio.TaskGroup() as tasks:
        for service in serving:
            tasks.create_task(_guarded(service, failures), name=f"serve:{service.name}")
        jobs = [tasks.create_task(job) for job in background]
        try:
            await main
        finally:
            for job in jobs:
                job.cancel()
            for service in serving:
                service.stop()


def plugin_services(
    config: NemesisConfig,
    proxy: Proxy,
    dlq: DeadLetterStore,
    broker: Broker,
    state: StateStore,
) -> list[Service]:
    """Services other packages register (the DLQ viewer) under ``nemesis.services``.

    An entry point, so that ``nemesis`` never imports ``dlq_viewer``; a plugin
    that fails to load is logged and left out, the proxy runs without it.
    Each factory is called with the configuration, the proxy, the DLQ store,
    the broker and the fleet's state store.
    """
    services: list[Service] = []
    for entry in importlib.metadata.entry_points(group="nemesis.services"):
        try:
            factory = entry.load()
        except (ImportError, AttributeError):
            log.exception("service %s could not be loaded", entry.name)
            continue
        service = factory(config, proxy, dlq, broker, state)
        if service is not None:
            services.append(service)
    return services
