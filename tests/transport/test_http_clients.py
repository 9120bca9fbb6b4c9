"""Which HTTP transport a target gets: ``target.transport`` picks it, h1 by default."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from nemesis.config.models import TargetConfig
from nemesis.delivery.h1 import H1Transport
from nemesis.delivery.http import HttpTransport
from nemesis.delivery.http_clients import http_transport_for
from nemesis.runtime.app import DEFAULT_TRANSPORTS


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({}, H1Transport),
        ({"transport": "h1"}, H1Transport),
        ({"transport": "aiohttp"}, HttpTransport),
        ({"url": "https://handler.internal/events", "transport": "aiohttp"}, HttpTransport),
        ({"url": "https://handler.internal/events"}, H1Transport),
    ],
)
async def test_target_transport_picks_the_client(settings: dict[str, str], expected: type) -> None:
    target = TargetConfig.model_validate({"url": "http://127.0.0.1:9/", **settings})

    made = http_transport_for(target, integration="orders", max_connections=4)
    runtime = DEFAULT_TRANSPORTS[target.scheme](target, "orders", 4)
    try:
        assert type(made) is expected
        assert type(runtime) is expected
    finally:
        await made.close()
        await runtime.close()


def test_an_unknown_transport_is_refused_at_load() -> None:
    with pytest.raises(ValidationError, match="'h1' or 'aiohttp'"):
        TargetConfig.model_validate({"url": "http://127.0.0.1:9/", "transport": "httpx"})
