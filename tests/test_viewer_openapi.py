"""Schemathesis over the viewer's JSON API: generated requests never get a 500.

The viewer runs for real (a SQLite store with dead letters, the embedded
broker, uvicorn on a free port) in a thread with its own event loop, and
schemathesis calls it over HTTP with an admin's API token, so generated
requeues, discards and bulk jobs reach the store. Every answer must be one
the OpenAPI document declares, with the body it declares.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.core.result import Ok
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from dlq_viewer.server import bound_port, viewer_server
from dlq_viewer.testing import STANDARD_ACCESS, integration, letter, viewer_env
from tests.threaded import ServedInThread

_, BOT_ROOT = STANDARD_ACCESS.clients
AUTH = {"Authorization": f"Bearer {BOT_ROOT.token}"}
INTEGRATIONS = {
    "orders-a": integration("orders-a", ["team-a"]),
    "orders-b": integration("orders-b", ["team-b"]),
}


class _ServedViewer(ServedInThread):
    """The viewer in a thread of its own; ``url`` once it listens."""

    what = "the viewer"

    async def _serve(self) -> None:
        async with viewer_env(self.root, integrations=INTEGRATIONS, lifespan=False) as env:
            await env.store.put(
                [letter("orders-a", n) for n in range(30)]
                + [letter("orders-b", n) for n in range(30)]
            )
            server = viewer_server(env.app, "127.0.0.1", 0)
            serving = asyncio.ensure_future(server.serve())
            while not server.started:
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.01)
            self.ready(f"http://127.0.0.1:{bound_port(server)}", server.stop)
            await serving


@pytest.fixture(scope="module")
def viewer_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _ServedViewer(tmp_path_factory.mktemp("viewer-openapi")) as served:
        yield served.url


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


# A few hundred real requests per mode: minutes on a loaded host, not a hang.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_viewer_api_never_answers_with_a_server_error(
    viewer_url: str, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(f"{viewer_url}/api/openapi.json")
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # the schema of every route is valid
        operations.append(result.ok())
    assert len(operations) >= 14  # every route of dlq_viewer.api is in the schema
    for operation in operations:
        takes_input = any(
            len(parameters) for parameters in (operation.path_parameters, operation.query)
        ) or bool(list(operation.body))
        if mode is GenerationMode.NEGATIVE and not takes_input:
            continue  # nothing to get wrong in GET /api/me

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=15,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def call(case: schemathesis.Case[Any]) -> None:
            case.call_and_validate(base_url=viewer_url, headers=AUTH, timeout=30, checks=CHECKS)

        call()
