"""Schemathesis over the admin API's OpenAPI: generated requests never get a 500.

The proxy and the admin API run for real in a thread with its own event loop
(two integrations on the embedded broker, a handler on loopback, uvicorn on a
free port), and schemathesis calls it over HTTP. Requests carry the token, so
the generated changes reach the running proxy (worker counts up to 4096,
pauses, rate limits, reloads); the auth refusals have their own tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
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

from nemesis.admin import UvicornService, create_admin_app, serve_beside
from nemesis.broker.embedded import open_embedded
from nemesis.config.loader import load_integrations
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.runtime.app import Proxy
from nemesis.runtime.reload import ConfigReloader
from nemesis.testing import HandlerServer
from tests.operability import AUTH, FAST, TOKEN, integration_yaml, publish
from tests.threaded import ServedInThread


class _ServedProxy(ServedInThread):
    """A proxy with its admin API in a thread of its own; ``url`` once it listens."""

    what = "the admin API"

    async def _serve(self) -> None:
        broker = await open_embedded(EmbeddedBackendConfig(path=str(self.root / "log.db")))
        try:
            async with HandlerServer() as handler:
                handler.delay(0.001)
                await publish(broker, 200, consumers=["alpha", "beta"])
                directory = self.root / "integrations"
                directory.mkdir()
                for name in ("alpha", "beta"):
                    (directory / f"{name}.yaml").write_text(integration_yaml(name, handler.url))
                integrations, problems = load_integrations(directory)
                assert not problems, problems
                proxy = Proxy(
                    broker,
                    integrations,
                    integration_files={n: directory / f"{n}.yaml" for n in integrations},
                    runner_options=FAST,
                )
                reloader = ConfigReloader(proxy, directory, watch=False)
                app = create_admin_app(proxy, token=TOKEN, reloader=reloader)
                service = UvicornService(app, host="127.0.0.1", port=0, name="admin API")
                service.bind()
                self.ready(service.url, proxy.stop)
                await serve_beside(proxy.run(), [service])
        finally:
            await broker.close()


@pytest.fixture(scope="module")
def admin_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _ServedProxy(tmp_path_factory.mktemp("admin-openapi")) as served:
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
def test_admin_api_never_answers_with_a_server_error(admin_url: str, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{admin_url}/openapi.json")
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # the schema of every route is valid
        operations.append(result.ok())
    assert len(operations) >= 12  # every route of nemesis.admin.app is in the schema
    for operation in operations:
        takes_input = any(
            len(parameters) for parameters in (operation.path_parameters, operation.query)
        ) or bool(list(operation.body))
        if mode is GenerationMode.NEGATIVE and not takes_input:
            continue  # nothing to get wrong in GET /healthz

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=25,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def call(case: schemathesis.Case[Any]) -> None:
            case.call_and_validate(base_url=admin_url, headers=AUTH, timeout=30, checks=CHECKS)

        call()


def test_changes_declare_the_bearer_token_and_their_refusals(admin_url: str) -> None:
    spec = httpx.get(f"{admin_url}/openapi.json", timeout=30).json()
    scheme = spec["components"]["securitySchemes"]["adminToken"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    error = {"$ref": "#/components/schemas/ErrorMessage"}
    changes = 0
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            where = f"{method.upper()} {path}"
            if path in ("/healthz", "/readyz"):
                assert "security" not in operation, where  # probes need no credential
                continue
            # Reads take a team's token too (open only while no team identity is configured).
            changes += method != "get"
            assert operation["security"] == [{"adminToken": []}], where
            for code in ("401", "403"):
                body = operation["responses"][code]["content"]["application/json"]["schema"]
                assert body == error, where
    assert changes >= 6
