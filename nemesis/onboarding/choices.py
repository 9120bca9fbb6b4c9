"""The onboarding commands' choices and defaults: what ``nemesis --help`` shows of them.

Kept apart from ``templates``, ``schema`` and ``probe`` (which define their
work with these names) so that building the CLI's parser loads no models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final, Literal, get_args

HandlerLang = Literal["python-fastapi", "python-grpc", "go-http", "typescript-node", "java-http"]
HANDLER_LANGS: Final[tuple[HandlerLang, ...]] = get_args(HandlerLang)
# Every HTTP template serves where `nemesis new integration` points by default, and clear of
# the ports `nemesis run` takes on a laptop (8080 for the DLQ viewer, 8081 for the admin API).
DEFAULT_PORTS: Final[Mapping[HandlerLang, int]] = {
    "python-fastapi": 8000,
    "python-grpc": 50051,
    "go-http": 8000,
    "typescript-node": 8000,
    "java-http": 8000,
}
DEFAULT_URLS: Final[Mapping[HandlerLang, str]] = {
    lang: f"grpc://127.0.0.1:{port}"
    if lang.endswith("-grpc")
    else f"http://127.0.0.1:{port}/events"
    for lang, port in DEFAULT_PORTS.items()
}

SchemaKind = Literal["integration", "pipeline", "pipeline-test", "process"]
SCHEMA_KINDS: Final[tuple[SchemaKind, ...]] = get_args(SchemaKind)

# What `nemesis check-handler` sends when no --data is given.
DEFAULT_DATA: Final = b'{"nemesis_probe": true}'
