"""The HTTP transports an ``http(s)://`` target can use, chosen by ``target.transport``.

``h1`` (``nemesis.delivery.h1``, the default) is Nemesis' own HTTP/1.1 client,
built for one small POST per message; ``aiohttp`` (``nemesis.delivery.http``)
is the general client library it replaced, kept selectable and as the
benchmark's reference. Both take the same arguments and honour the same
handler contract.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Protocol

from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import TargetConfig
from nemesis.delivery.h1 import H1Transport
from nemesis.delivery.port import Transport


class HttpTransportFactory(Protocol):
    """Makes the transport of one integration's http(s) target."""

    def __call__(
        self, target: TargetConfig, *, integration: str, max_connections: int, clock: Clock
    ) -> Transport: ...


def _aiohttp(
    target: TargetConfig, *, integration: str, max_connections: int, clock: Clock
) -> Transport:
    # aiohttp is loaded by the targets that choose it, not by `nemesis validate` of the others.
    from nemesis.delivery.http import HttpTransport

    return HttpTransport(
        target, integration=integration, max_connections=max_connections, clock=clock
    )


# target.transport -> what makes it. Tests and embedders pass their own.
HTTP_TRANSPORTS: Final[Mapping[str, HttpTransportFactory]] = {
    "h1": H1Transport,
    "aiohttp": _aiohttp,
}


def http_transport_for(
    target: TargetConfig,
    *,
    integration: str,
    max_connections: int,
    clock: Clock = SYSTEM_CLOCK,
    transports: Mapping[str, HttpTransportFactory] = HTTP_TRANSPORTS,
) -> Transport:
    """The transport ``target.transport`` names; ``max_connections`` bounds its pool.

    Waiting for a free connection counts against ``target.timeout_s``, so
    ``max_connections`` should be at least the number of concurrent deliveries.
    """
    factory = transports[target.transport]
    return factory(target, integration=integration, max_connections=max_connections, clock=clock)
