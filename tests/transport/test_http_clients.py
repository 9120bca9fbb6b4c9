"""Which HTTP transport a target gets (``target.transport``, h1 by default), and what they share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from nemesis.config.models import TargetConfig
from nemesis.delivery.h1 import H1Transport
from nemesis.delivery.http import HttpTransport
from nemesis.errors import ConfigError
from nemesis.transports import default_transports

DELIVERY_DIR = Path(__file__).parents[2] / "nemesis" / "delivery"


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

    made = default_transports().open(target, integration="orders", max_connections=4)
    try:
        assert type(made) is expected
    finally:
        await made.close()


def test_an_unknown_transport_is_refused_at_load() -> None:
    with pytest.raises(ValidationError, match="'h1' or 'aiohttp'"):
        TargetConfig.model_validate({"url": "http://127.0.0.1:9/", "transport": "httpx"})


def test_the_transports_import_no_private_name_from_one_another() -> None:
    """Shared pieces live in public modules (``http_common``), not behind an underscore."""
    private: list[str] = []
    for path in sorted(DELIVERY_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nemesis"):
                private += [
                    f"{path.name}: from {node.module} import {alias.name}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert private == []


@pytest.mark.parametrize("transport", [H1Transport, HttpTransport])
def test_both_transports_refuse_a_header_in_the_same_words(transport: type) -> None:
    target = TargetConfig.model_validate(
        {"url": "http://127.0.0.1:9/", "headers": {"X-Token": "a\r\nX-Injected: 1"}}
    )

    with pytest.raises(ConfigError) as refused:
        transport(target, integration="orders", max_connections=1)

    assert [str(problem) for problem in refused.value.problems] == [
        "integration orders: target.headers.X-Token: control characters in the value"
    ]
