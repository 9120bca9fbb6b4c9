"""Transports as plug-ins: a URL scheme maps to a transport kind, its settings and its factory.

A target's URL scheme picks its kind (``http`` for http:// and https://,
``grpc`` for grpc:// and grpcs://). The kinds live in a ``Transports``
registry: ``default_transports()`` makes a fresh one with the built-in kinds;
tests copy it and register fakes, or start from an empty ``Transports()``.
Everything that says which targets exist is derived from the registry, not
listed again elsewhere:

- the schemes ``target.url`` may start with, and the error naming them
  (``Transports.url_problem``, read by ``nemesis.config.models``);
- ``target.transport``'s choices: the clients a kind offers (``clients``);
- which schemes are plain text, so ``target.tls`` is refused on them;
- the JSON Schema's pattern for ``target.url`` and its rules per scheme
  (``TransportKind.schema``, read by ``nemesis.onboarding.schema``);
- the transport the proxy, ``nemesis validate`` and ``nemesis check-handler``
  make (``Transports.open``, ``Transports.check``).

A kind's factory checks everything it reads when the transport is made
(``ConfigError`` naming the field): the URL, the headers, the signing secrets
in the environment, the TLS files. ``Transports.preflight`` runs the checks
that read the host (secrets, TLS files) when the proxy takes an integration,
so that a missing secret refuses the file at once; ``Transports.files`` names
the files a reload watches (a renewed certificate restarts the integration).

Adding a transport (say one for ``ws://`` and ``wss://``):

1. One module, ``nemesis/delivery/ws.py``, holding the ``Transport``
   (``nemesis.delivery.port``): it turns the handler's answer into a
   ``DeliveryResult`` with ``nemesis.delivery.contract``, and raises
   ``ConfigError`` (``config_problem``) for a target it cannot use.
2. One registration here: a factory that imports that module in its body
   (a process that does not use the kind never loads its client library),
   ``WS = TransportKind("ws", "ws", "wss", open_ws)``, and
   ``registry.register(WS)`` in ``default_transports``.

This module sits below the configuration, which imports it for the schemes
and choices: it reads a target through the ``Target`` protocol, and a
factory imports ``TargetConfig`` and its implementation in its body.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Protocol

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.errors import ConfigError

if TYPE_CHECKING:
    from nemesis.delivery.port import Transport


class Target(Protocol):
    """What the registry reads of a target (``TargetConfig`` has it).

    A protocol, so that the kinds need not import the configuration that
    imports them for its schemes and choices.
    """

    @property
    def url(self) -> str: ...

    @property
    def scheme(self) -> str: ...

    @property
    def transport(self) -> str: ...


class TransportFactory(Protocol):
    """Makes the transport of one integration's target; raises ``ConfigError``.

    ``max_connections`` bounds its pool (waiting for a free connection counts
    against ``target.timeout_s``).
    """

    def __call__(
        self, target: Target, *, integration: str, max_connections: int, clock: Clock
    ) -> Transport: ...


# Runs what the factory checks of the URL and the headers, opening nothing and
# reading neither the environment nor files: ``nemesis validate``'s check.
TargetCheck = Callable[[Target, str], None]


def signing_and_tls(target: Target, where: str) -> None:
    """Reads what a transport reads of the host: the signing secrets, the TLS files.

    A ``ConfigError`` (file ``where``) names the unset variable or the file
    that does not load. Both built-in kinds read these.
    """
    from nemesis.config.models import TargetConfig
    from nemesis.delivery.signing import secrets_from_environment
    from nemesis.delivery.tls import ssl_context

    assert isinstance(target, TargetConfig)  # the configuration's
    if target.signing is not None:
        secrets_from_environment(target.signing, os.environ, where=where)
    if target.tls is not None:
        ssl_context(target.tls, where=where)


def tls_files_of(target: Target) -> list[Path]:
    """The files ``target.tls`` names, as given."""
    from nemesis.config.models import TargetConfig
    from nemesis.delivery.tls import tls_files

    assert isinstance(target, TargetConfig)
    return tls_files(target.tls)


@dataclass(frozen=True)
class TransportKind:
    """A transport: its name, URL schemes, factory and what ``validate`` checks.

    ``name`` is what its results' ``DeliveryResult.protocol`` says. ``scheme``
    is its plain-text URL scheme, ``tls_scheme`` its TLS one (either may be
    None). ``clients``: the implementations ``target.transport`` chooses
    between, the first the default (a kind with one leaves it empty and
    ignores the field). ``check`` defaults to making the transport, which
    opens no connection. ``schema``: JSON Schema that applies to a target of
    its schemes (``properties`` of ``target``), for editors. ``url_form``:
    its URLs in words, for the schema's description. ``preflight``: what its
    factory reads of the host (secrets, files), checked when the proxy takes
    the integration; ``files``: the files it reads, which a reload watches.
    """

    name: str
    scheme: str | None
    tls_scheme: str | None
    open: TransportFactory
    check: TargetCheck | None = None
    clients: tuple[str, ...] = ()
    schema: Callable[[], dict[str, Any]] | None = None
    url_form: str = ""
    preflight: Callable[[Target, str], None] = signing_and_tls
    files: Callable[[Target], list[Path]] = tls_files_of

    @property
    def schemes(self) -> tuple[str, ...]:
        return tuple(s for s in (self.scheme, self.tls_scheme) if s is not None)


@dataclass
class Transports:
    """Transport kinds by name, found by URL scheme; the first registered is the default."""

    kinds: dict[str, TransportKind] = field(default_factory=dict)

    def copy(self) -> Transports:
        return Transports(dict(self.kinds))

    def register(self, kind: TransportKind) -> None:
        self.kinds[kind.name] = kind

    def kind_for(self, scheme: str) -> TransportKind | None:
        """The kind whose URLs start with ``scheme://``; None when none does."""
        return next((k for k in self.kinds.values() if scheme in k.schemes), None)

    # --- what the configuration is derived from ---------------------------------------

    def schemes(self) -> list[str]:
        """Every URL scheme a target may have, in the order the kinds were registered."""
        return [scheme for kind in self.kinds.values() for scheme in kind.schemes]

    def plain_schemes(self) -> list[str]:
        """The plain-text schemes: ``target.tls`` does not apply to them."""
        return [k.scheme for k in self.kinds.values() if k.scheme is not None]

    def tls_schemes(self) -> list[str]:
        return [k.tls_scheme for k in self.kinds.values() if k.tls_scheme is not None]

    def clients(self) -> tuple[str, ...]:
        """``target.transport``'s choices, the default first (every kind's, in order)."""
        found: list[str] = []
        for kind in self.kinds.values():
            found += [c for c in kind.clients if c not in found]
        return tuple(found)

    def scheme_pattern(self) -> str:
        """A regular expression alternative matching any registered scheme, longest first."""
        schemes = sorted(self.schemes(), key=len, reverse=True)
        return "(" + "|".join(re.escape(s) for s in schemes) + ")"

    def url_problem(self, url: str) -> str | None:
        """Why ``url`` is no target URL of a registered scheme naming a host; None if it is."""
        if re.match(rf"^{self.scheme_pattern()}://[^/\s]+", url):
            return None
        schemes = _listed((f"{s}://" for s in self.schemes()), "or")
        return f"must start with {schemes} and name a host"

    def tls_problem(self, scheme: str) -> str | None:
        """Why ``target.tls`` cannot apply to a ``scheme://`` URL; None if it can."""
        kind = self.kind_for(scheme)
        if kind is None or scheme != kind.scheme:
            return None
        instead = f"use {kind.tls_scheme}://, or remove tls" if kind.tls_scheme else "remove tls"
        tls = _listed((f"{s}://" for s in self.tls_schemes()), "and")
        return f"{scheme}:// is plain text: TLS settings apply to {tls} targets ({instead})"

    # --- making transports ---------------------------------------------------------------

    def open(
        self,
        target: Target,
        *,
        integration: str,
        max_connections: int,
        clock: Clock = SYSTEM_CLOCK,
    ) -> Transport:
        """The transport of ``target``'s kind; ``ConfigError`` when it refuses the target."""
        kind = self._kind_of(target, integration)
        return kind.open(
            target, integration=integration, max_connections=max_connections, clock=clock
        )

    def check(self, target: Target, integration: str) -> None:
        """What making the transport checks of the URL and headers, opening nothing.

        ``nemesis validate`` runs it on a target without its signing and TLS
        settings: those are read on the host that runs the integration.
        """
        kind = self._kind_of(target, integration)
        if kind.check is not None:
            kind.check(target, integration)
            return
        kind.open(target, integration=integration, max_connections=1, clock=SYSTEM_CLOCK)

    def preflight(self, target: Target, *, where: str) -> None:
        """What the factory of ``target``'s kind reads of the host, checked now (``preflight``).

        The proxy runs it when it takes an integration, so that a secret unset
        or a TLS file that does not load refuses the file (named ``where``) at
        once; the factory reads them again when it makes the transport. A
        target no kind serves is not checked: it waits, with that reason.
        """
        kind = self.kind_for(target.scheme)
        if kind is not None:
            kind.preflight(target, where)

    def files(self, target: Target) -> list[Path]:
        """The files the transport of ``target`` reads, as given (a change restarts it)."""
        kind = self.kind_for(target.scheme)
        return [] if kind is None else kind.files(target)

    def _kind_of(self, target: Target, integration: str) -> TransportKind:
        kind = self.kind_for(target.scheme)
        if kind is None:
            from nemesis.delivery.port import config_problem

            message = f"no transport for {target.scheme}:// targets"
            raise ConfigError([config_problem(integration, "target.url", message)])
        return kind


def _listed(names: Iterable[str], last: str) -> str:
    """``a``, ``a or b``, ``a, b or c`` (``last`` the word before the last)."""
    listed = list(names)
    if len(listed) <= 1:
        return "".join(listed)
    return f"{', '.join(listed[:-1])} {last} {listed[-1]}"


# --- http:// and https:// -------------------------------------------------------------


def _h1(target: Target, *, integration: str, max_connections: int, clock: Clock) -> Transport:
    from nemesis.config.models import TargetConfig
    from nemesis.delivery.h1 import H1Transport

    assert isinstance(target, TargetConfig)  # the configuration's
    return H1Transport(
        target, integration=integration, max_connections=max_connections, clock=clock
    )


def _aiohttp(target: Target, *, integration: str, max_connections: int, clock: Clock) -> Transport:
    # aiohttp is loaded by the targets that choose it, not by `nemesis validate` of the others.
    from nemesis.config.models import TargetConfig
    from nemesis.delivery.http import HttpTransport

    assert isinstance(target, TargetConfig)
    return HttpTransport(
        target, integration=integration, max_connections=max_connections, clock=clock
    )


# target.transport -> the HTTP client that makes it. ``h1`` (``nemesis.delivery.h1``, the
# default) is Nemesis' own HTTP/1.1 client, built for one small POST per message;
# ``aiohttp`` (``nemesis.delivery.http``) is the general client library it replaced, kept
# selectable and as the benchmark's reference. Both honour the same handler contract.
HTTP_CLIENTS: Final[Mapping[str, TransportFactory]] = {"h1": _h1, "aiohttp": _aiohttp}


def open_http(target: Target, *, integration: str, max_connections: int, clock: Clock) -> Transport:
    """The HTTP client ``target.transport`` names."""
    factory = HTTP_CLIENTS[target.transport]
    return factory(target, integration=integration, max_connections=max_connections, clock=clock)


def check_http(target: Target, integration: str) -> None:
    if target.transport == "h1":
        # Nemesis' own client checks without being built: validating loads no event loop.
        from nemesis.config.models import TargetConfig
        from nemesis.delivery.http_common import check_http_target

        assert isinstance(target, TargetConfig)
        check_http_target(target, integration)
        return
    open_http(target, integration=integration, max_connections=1, clock=SYSTEM_CLOCK)


def http_schema() -> dict[str, Any]:
    """The HTTP transports' header checks (``nemesis.delivery.http_common``), as JSON Schema."""
    from nemesis.delivery.contract import SIGNING_HEADERS
    from nemesis.delivery.http_common import RESERVED_HEADERS, UNSAFE_VALUE_PATTERN

    names = (*sorted(RESERVED_HEADERS), *sorted(SIGNING_HEADERS))
    return {
        "headers": {
            "propertyNames": not_named(("ce-",), names),
            "additionalProperties": {"type": "string", "not": {"pattern": UNSAFE_VALUE_PATTERN}},
        }
    }


HTTP: Final = TransportKind(
    "http",
    "http",
    "https",
    open_http,
    check=check_http,
    clients=tuple(HTTP_CLIENTS),
    schema=http_schema,
    url_form="http(s)://host/path",
)


# --- grpc:// and grpcs:// -------------------------------------------------------------


def open_grpc(target: Target, *, integration: str, max_connections: int, clock: Clock) -> Transport:
    # Imported on first use: grpcio and the generated code load only for gRPC targets.
    from nemesis.config.models import TargetConfig
    from nemesis.delivery.grpc import GrpcTransport

    assert isinstance(target, TargetConfig)
    return GrpcTransport(
        target, integration=integration, max_connections=max_connections, clock=clock
    )


# The gRPC transport's checks (``nemesis.delivery.grpc``), as JSON Schema: metadata keys,
# the names gRPC sets itself, printable values, host and port only.
_GRPC_RESERVED: Final = ("content-type", "te", "user-agent", "host")
_GRPC_METADATA_KEY: Final = r"^[0-9A-Za-z_.\-]+$"
_GRPC_UNSAFE_VALUE: Final = r"[^\x20-\x7e]"
GRPC_URL_PATTERN: Final = r"^grpcs?://(\[[^\]/\s]*\]|[^/\s?#:\[\]@]+)(:\d*)?/?$"


def grpc_schema() -> dict[str, Any]:
    from nemesis.delivery.contract import SIGNING_HEADERS

    return {
        "headers": {
            "propertyNames": {
                "allOf": [
                    {"pattern": _GRPC_METADATA_KEY},
                    not_named(("grpc-",), (*_GRPC_RESERVED, *sorted(SIGNING_HEADERS))),
                    {"not": {"pattern": f"{anycase('-bin')}$"}},
                ]
            },
            "additionalProperties": {"type": "string", "not": {"pattern": _GRPC_UNSAFE_VALUE}},
        },
        # A gRPC target is grpc(s)://host:port: the service and methods are fixed.
        "url": {"pattern": GRPC_URL_PATTERN},
    }


GRPC: Final = TransportKind(
    "grpc",
    "grpc",
    "grpcs",
    open_grpc,
    schema=grpc_schema,
    url_form="grpc(s)://host:port",
)


def default_transports() -> Transports:
    """A fresh registry with the built-in kinds."""
    registry = Transports()
    registry.register(HTTP)
    registry.register(GRPC)
    return registry


# --- JSON Schema helpers the kinds' schemas share ---------------------------------------


def anycase(name: str) -> str:
    """A pattern matching ``name`` in any case (JSON Schema patterns have no flags)."""
    return "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else re.escape(c) for c in name)


def not_named(prefixes: tuple[str, ...], names: tuple[str, ...]) -> dict[str, Any]:
    """Property names that neither start with one of ``prefixes`` nor are one of ``names``."""
    alternatives = [anycase(p) for p in prefixes] + [f"{anycase(n)}$" for n in names]
    return {"not": {"pattern": f"^({'|'.join(alternatives)})"}}
