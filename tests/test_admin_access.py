"""The admin API's authorization matrix: every route x every identity, over real HTTP.

The proxy runs two integrations owned by two teams on the embedded broker;
the admin API serves on loopback (uvicorn) with team tokens, platform
credentials, a metrics token and a trusted SSO proxy configured. Each
request's status is compared with an oracle written here from the rules of
``nemesis.admin.access`` (not from its code): a bypass is a 2xx where the
oracle refuses, and any other mismatch fails too. Another team's
integration must answer exactly as one that does not exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import httpx
import pytest

from nemesis.admin import UvicornService, create_admin_app, schemas
from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config.models import AuthConfig, EmbeddedBackendConfig
from nemesis.config.passwords import hash_token
from nemesis.dlq import Action, open_sqlite_dlq
from nemesis.dlq.sqlite import SqliteDeadLetterStore
from nemesis.runtime.app import Proxy
from nemesis.runtime.reload import ConfigReloader
from nemesis.testing import HandlerServer
from tests.operability import (
    FAST,
    integration,
    integration_yaml,
    publish,
    running,
    wait_until_true,
)

PLATFORM_TOKEN = "platform-token-0123456789abcdef"
METRICS_TOKEN = "metrics-token-0123456789abcdef"
TOKENS = {
    "alpha": "nmsv_team-alpha-token-0123456789",
    "beta": "nmsv_team-beta-token-0123456789",
    "both": "nmsv_alpha-and-gamma-token-012345",
    "admin": "nmsv_admin-flag-token-0123456789",
    "ops": "nmsv_ops-team-token-0123456789ab",
}


def auth_config() -> AuthConfig:
    return AuthConfig.model_validate(
        {
            "admin_teams": ["team-platform"],
            "tokens": [
                {
                    "name": "ci-alpha",
                    "token_hash": hash_token(TOKENS["alpha"]),
                    "teams": ["team-alpha"],
                },
                {
                    "name": "ci-beta",
                    "token_hash": hash_token(TOKENS["beta"]),
                    "teams": ["team-beta"],
                },
                {
                    "name": "ci-both",
                    "token_hash": hash_token(TOKENS["both"]),
                    "teams": ["team-alpha", "team-gamma"],
                },
                {"name": "root", "token_hash": hash_token(TOKENS["admin"]), "admin": True},
                {
                    "name": "ops",
                    "token_hash": hash_token(TOKENS["ops"]),
                    "teams": ["team-platform"],
                },
            ],
            "trusted_header": {"trusted_proxies": ["127.0.0.1/32"]},
        }
    )


@dataclass(frozen=True)
class Who:
    """An identity as the test sends it, and what the oracle grants it."""

    name: str
    headers: dict[str, str]
    teams: frozenset[str] = frozenset()
    platform: bool = False
    kind: str = "team"  # team | anonymous | wrong | scraper
    source: str = "127.0.0.1"  # the client's address (the SSO proxy is 127.0.0.1)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


IDENTITIES = [
    Who("anonymous", {}, kind="anonymous"),
    Who("wrong token", bearer("nmsv_not-a-token-of-anyone-000000"), kind="wrong"),
    Who("basic scheme", {"authorization": "Basic YWRtaW46YWRtaW4="}, kind="wrong"),
    Who("empty bearer", {"authorization": "Bearer"}, kind="wrong"),
    Who("long token", bearer("x" * 5000), kind="wrong"),
    Who("hash as token", bearer(hash_token(TOKENS["alpha"])), kind="wrong"),
    Who("metrics token", bearer(METRICS_TOKEN), kind="scraper"),
    Who("team alpha", bearer(TOKENS["alpha"]), frozenset({"team-alpha"})),
    Who("team beta", bearer(TOKENS["beta"]), frozenset({"team-beta"})),
    Who("alpha and gamma", bearer(TOKENS["both"]), frozenset({"team-alpha", "team-gamma"})),
    Who("admin token (auth)", bearer(TOKENS["admin"]), platform=True),
    Who("admin team member", bearer(TOKENS["ops"]), platform=True),
    Who("admin.token", bearer(PLATFORM_TOKEN), platform=True),
    Who(
        "sso alpha",
        {"x-forwarded-user": "ann", "x-forwarded-groups": "team-alpha"},
        frozenset({"team-alpha"}),
    ),
    Who(
        "sso platform",
        {"x-forwarded-user": "bob", "x-forwarded-groups": "team-platform"},
        platform=True,
    ),
    Who("sso, no teams", {"x-forwarded-user": "eve"}),
    # The same headers from an address that is not the SSO proxy: nobody.
    Who(
        "sso from elsewhere",
        {"x-forwarded-user": "mallory", "x-forwarded-groups": "team-platform,team-alpha"},
        kind="anonymous",
        source="127.0.0.2",
    ),
]


@dataclass(frozen=True)
class Call:
    method: str
    path: str  # an OpenAPI path; {name} is filled per target
    kind: str  # health | metrics | read | change | platform_read | platform_change | open
    body: Any = None
    query: str = ""


CALLS = [
    Call("GET", "/healthz", "health"),
    Call("GET", "/readyz", "health"),
    Call("GET", "/metrics", "metrics"),
    Call("GET", "/integrations", "read"),
    Call("GET", "/integrations/{name}", "read"),
    Call("PATCH", "/integrations/{name}", "change", {"delivery": {"workers": 3}}),
    Call("POST", "/integrations/{name}/pause", "change"),
    Call("POST", "/integrations/{name}/resume", "change"),
    Call("DELETE", "/integrations/{name}/overrides/{field}", "change"),
    Call("DELETE", "/integrations/{name}/overrides", "change"),
    Call("GET", "/integrations/{name}/offsets", "read"),
    Call("POST", "/integrations/{name}/offsets/skip", "skip", {"count": 1}),
    Call("GET", "/fleet", "read"),
    Call("GET", "/config", "platform_read"),
    Call("POST", "/config/reload", "platform_change"),
    Call("GET", "/sizing", "read", query="?rps=100&latency_ms=20"),
    Call("GET", "/audit", "read"),
]
TARGETS = ("alpha", "beta", "missing")
OWNERS = {"alpha": "team-alpha", "beta": "team-beta"}


def as_configured(who: Who, *, platform_token: bool, metrics_token: bool) -> Who:
    """``who`` as the configuration sees it: a token nobody configured proves nobody."""
    if (who.kind == "scraper" and not metrics_token) or (
        who.name == "admin.token" and not platform_token
    ):
        return Who(who.name, who.headers, kind="wrong")
    return who


def expected(call: Call, who: Who, target: str | None) -> int:
    """The oracle: the status the rules of the access table give."""
    if call.kind == "health":
        return 200
    if call.kind == "metrics":
        if who.kind == "scraper" or who.platform:
            return 200
        return 403 if who.kind in ("wrong", "team") else 401
    if who.kind == "anonymous":
        return 401
    if who.kind in ("wrong", "scraper"):
        return 403
    if call.kind in ("platform_read", "platform_change"):
        return 200 if who.platform else 403
    owned = target is not None and (who.platform or OWNERS.get(target, "") in who.teams)
    if call.kind == "skip" and target != "missing" and owned:
        return 409  # allowed, and refused for what it is: the integration is not paused
    if target is None:
        # Not about one integration; /fleet answers 404 without a fleet, for every identity.
        return 404 if call.path == "/fleet" else 200
    if who.platform or OWNERS.get(target) in who.teams:
        return 404 if target == "missing" else 200
    return 404


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


@pytest.fixture
async def audit_store(tmp_path: Path) -> AsyncIterator[SqliteDeadLetterStore]:
    store = await open_sqlite_dlq(tmp_path / "dlq.db")
    yield store
    await store.close()


@contextlib.asynccontextmanager
async def served(app: Any) -> AsyncIterator[str]:
    """The app on a free loopback port (uvicorn, as ``nemesis run`` serves it); its URL."""
    service = UvicornService(app, host="127.0.0.1", port=0, name="admin", proxy_headers=False)
    service.bind()
    task = asyncio.create_task(service.serve())
    try:
        await wait_until_true(lambda: service.started)
        yield service.url
    finally:
        service.stop()
        await task


@contextlib.asynccontextmanager
async def clients(url: str) -> AsyncIterator[Callable[[Who], httpx.AsyncClient]]:
    """One HTTP client per source address."""
    by_source: dict[str, httpx.AsyncClient] = {}
    async with contextlib.AsyncExitStack() as stack:
        for source in ("127.0.0.1", "127.0.0.2"):
            transport = httpx.AsyncHTTPTransport(local_address=source)
            client = httpx.AsyncClient(base_url=url, transport=transport, timeout=30)
            by_source[source] = await stack.enter_async_context(client)
        yield lambda who: by_source[who.source]


@contextlib.asynccontextmanager
async def team_proxy(
    broker: EmbeddedBroker, tmp_path: Path, audit: SqliteDeadLetterStore | None, **options: Any
) -> AsyncIterator[tuple[Proxy, str]]:
    await publish(broker, 10, consumers=list(OWNERS))
    async with HandlerServer() as handler:
        directory = tmp_path / "integrations"
        directory.mkdir(exist_ok=True)
        files = {}
        for name in OWNERS:
            files[name] = directory / f"{name}.yaml"
            files[name].write_text(integration_yaml(name, handler.url))
        proxy = Proxy(
            broker,
            {name: integration(name, handler.url) for name in OWNERS},
            integration_files=files,
            runner_options=FAST,
        )
        reloader = ConfigReloader(proxy, directory, watch=False)
        app = create_admin_app(proxy, reloader=reloader, audit=audit, **options)
        async with running(proxy), served(app) as url:
            yield proxy, url


def path_of(call: Call, target: str | None) -> str:
    path = call.path.replace("{field}", "delivery.workers")
    if target is not None:
        path = path.replace("{name}", target)
    return path + call.query


@pytest.mark.parametrize(
    ("platform_token", "metrics_token"),
    [(True, True), (False, False)],
    ids=["with-admin-and-metrics-tokens", "team-tokens-only"],
)
async def test_every_route_and_identity_gets_what_the_table_allows(
    broker: EmbeddedBroker,
    tmp_path: Path,
    audit_store: SqliteDeadLetterStore,
    platform_token: bool,
    metrics_token: bool,
) -> None:
    options: dict[str, Any] = {"auth": auth_config()}
    if platform_token:
        options["token"] = PLATFORM_TOKEN
    if metrics_token:
        options["metrics_token"] = METRICS_TOKEN
    async with (
        team_proxy(broker, tmp_path, audit_store, **options) as (_proxy, url),
        clients(url) as client_for,
    ):
        spec = (await client_for(IDENTITIES[0]).get("/openapi.json")).json()
        documented = {
            (method.upper(), path) for path, ops in spec["paths"].items() for method in ops
        }
        assert documented == {(c.method, c.path) for c in CALLS}, "a route is not in the matrix"
        sent = 0
        mismatches: list[str] = []
        bypasses: list[str] = []
        missing_bodies: dict[str, Any] = {}
        for call in CALLS:
            targets = TARGETS if "{name}" in call.path else (None,)
            for who in IDENTITIES:
                for target in targets:
                    answer = await client_for(who).request(
                        call.method,
                        path_of(call, target),
                        headers=who.headers,
                        json=call.body,
                    )
                    sent += 1
                    seen_as = as_configured(
                        who, platform_token=platform_token, metrics_token=metrics_token
                    )
                    want = expected(call, seen_as, target)
                    where = f"{call.method} {path_of(call, target)} as {who.name}"
                    if answer.status_code != want:
                        mismatches.append(f"{where}: {answer.status_code}, expected {want}")
                        if answer.is_success:
                            bypasses.append(where)
                    if answer.status_code == 404 and target is not None:
                        body = answer.json()["detail"].replace(repr(target), "NAME")
                        missing_bodies.setdefault(body, where)
                    # No answer, whatever it is, lacks the headers.
                    assert answer.headers["x-content-type-options"] == "nosniff", where
                    assert answer.headers["x-frame-options"] == "DENY", where
                    assert "default-src 'none'" in answer.headers["content-security-policy"]
        assert bypasses == []
        assert mismatches == []
        # Another team's integration and one that does not exist: the same words.
        assert len(missing_bodies) == 1, missing_bodies
        assert sent > 400
        logging.getLogger(__name__).info("authorization matrix: %d requests", sent)

        # Lists show each identity its own integrations, no more.
        async def names(who: Who, path: str, key: str) -> list[str]:
            answer = await client_for(who).get(path, headers=who.headers)
            return sorted(item["name"] for item in answer.json()[key])

        by_name = {who.name: who for who in IDENTITIES}
        assert await names(by_name["team alpha"], "/integrations", "integrations") == ["alpha"]
        assert await names(by_name["team beta"], "/integrations", "integrations") == ["beta"]
        assert await names(by_name["sso, no teams"], "/integrations", "integrations") == []
        assert await names(by_name["admin token (auth)"], "/integrations", "integrations") == [
            "alpha",
            "beta",
        ]


async def test_without_teams_the_api_reads_as_before(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """No ``auth:`` identities: reads open, changes for ``admin.token``, /metrics open."""
    async with (
        team_proxy(broker, tmp_path, None, token=PLATFORM_TOKEN) as (proxy, url),
        httpx.AsyncClient(base_url=url, timeout=30) as admin,
    ):
        for path in (
            "/integrations",
            "/integrations/beta",
            "/config",
            "/metrics",
            "/sizing?rps=1&latency_ms=1",
        ):
            assert (await admin.get(path)).status_code == 200, path
            # A stale token on a read is ignored, as it always was.
            assert (
                await admin.get(path, headers=bearer("stale-token-00000000"))
            ).status_code == 200
        assert (await admin.post("/integrations/beta/pause")).status_code == 401
        wrong = await admin.post("/integrations/beta/pause", headers=bearer("nope"))
        assert wrong.status_code == 403
        assert not proxy.integrations["beta"].paused
        done = await admin.post("/integrations/beta/pause", headers=bearer(PLATFORM_TOKEN))
        assert done.status_code == 200
        assert proxy.integrations["beta"].paused


async def test_a_team_pauses_and_retunes_its_own_integration_and_the_audit_log_says_who(
    broker: EmbeddedBroker,
    tmp_path: Path,
    audit_store: SqliteDeadLetterStore,
    caplog: pytest.LogCaptureFixture,
) -> None:
    options = {"token": PLATFORM_TOKEN, "auth": auth_config()}
    caplog.set_level(logging.INFO, logger="nemesis.admin.audit")
    async with (
        team_proxy(broker, tmp_path, audit_store, **options) as (proxy, url),
        httpx.AsyncClient(base_url=url, timeout=30) as admin,
    ):
        alpha, beta = bearer(TOKENS["alpha"]), bearer(TOKENS["beta"])
        paused = await admin.post("/integrations/alpha/pause", headers=alpha)
        assert paused.status_code == 200, paused.text
        assert proxy.integrations["alpha"].paused
        tuned = await admin.patch(
            "/integrations/alpha", headers=alpha, json={"delivery": {"workers": 5}}
        )
        assert tuned.status_code == 200, tuned.text
        assert proxy.integrations["alpha"].delivery.workers == 5
        refused = await admin.post("/integrations/alpha/resume", headers=beta)
        assert refused.status_code == 404
        assert proxy.integrations["alpha"].paused
        await admin.post("/config/reload", headers=bearer(PLATFORM_TOKEN))

        lines = [r.getMessage() for r in caplog.records if r.name == "nemesis.admin.audit"]
        assert any("pause by ci-alpha (API token) on alpha" in line for line in lines), lines
        assert any(
            "tune by ci-alpha (API token) on alpha: delivery.workers=5" in line for line in lines
        )
        assert not any("resume" in line for line in lines)

        own = (await admin.get("/audit", headers=alpha)).json()["entries"]
        assert [(e["action"], e["who"], e["integrations"]) for e in own] == [
            ("tune", "ci-alpha (API token)", ["alpha"]),
            ("pause", "ci-alpha (API token)", ["alpha"]),
        ]
        assert all(e["at"] > 0 for e in own)
        assert (await admin.get("/audit", headers=beta)).json()["entries"] == []
        every = (await admin.get("/audit", headers=bearer(PLATFORM_TOKEN))).json()["entries"]
        assert [e["action"] for e in every] == ["reload", "tune", "pause"]
        assert every[0]["who"] == "platform (admin.token)"
        # The audit log is the DLQ store's: the viewer reads the same entries.
        stored = await audit_store.actions()
        assert [r.action.value for r in stored.rows] == ["reload", "tune", "pause"]


async def test_an_sso_change_from_another_site_is_refused(
    broker: EmbeddedBroker, tmp_path: Path
) -> None:
    async with (
        team_proxy(broker, tmp_path, None, auth=auth_config()) as (proxy, url),
        httpx.AsyncClient(base_url=url, timeout=30) as admin,
    ):
        sso = {"x-forwarded-user": "ann", "x-forwarded-groups": "team-alpha"}
        for marker in (
            {"sec-fetch-site": "cross-site"},
            {"sec-fetch-site": "same-site"},
            {"origin": "http://evil.example"},
            {"origin": "null"},
        ):
            answer = await admin.post("/integrations/alpha/pause", headers={**sso, **marker})
            assert answer.status_code == 403, marker
        assert not proxy.integrations["alpha"].paused
        same = await admin.post(
            "/integrations/alpha/pause",
            headers={**sso, "origin": url, "sec-fetch-site": "same-origin"},
        )
        assert same.status_code == 200, same.text


JSON = {"content-type": "application/json"}
BAD_INPUTS = [
    ("GET", "/integrations/UPPER", None, {}),
    ("GET", "/integrations/" + "a" * 300, None, {}),
    ("GET", "/integrations/%00", None, {}),
    ("PATCH", "/integrations/alpha", "not json", JSON),
    ("PATCH", "/integrations/alpha", "[1,2]", JSON),
    (
        "PATCH",
        "/integrations/alpha",
        '{"delivery": {"workers": 1e400}}',
        JSON,
    ),
    ("DELETE", "/integrations/alpha/overrides/nope", None, {}),
    ("GET", "/audit?cursor=garbage", None, {}),
    ("GET", "/audit?limit=0", None, {}),
    ("GET", "/audit?limit=100000", None, {}),
    ("GET", "/sizing?rps=-1&latency_ms=1", None, {}),
    ("GET", "/sizing?rps=nan&latency_ms=1", None, {}),
    ("GET", "/integrations", None, {"x-forwarded-user": "\x7f" * 10}),
    ("GET", "/integrations", None, {"x-forwarded-user": "a" * 4000}),
    ("GET", "/integrations", None, {"x-forwarded-user": "ann", "x-forwarded-groups": "," * 500}),
    ("GET", "/integrations", None, {"authorization": "Bearer a b c"}),
    ("GET", "/integrations", None, {"authorization": "bearer"}),
]


@pytest.mark.parametrize("platform", [True, False], ids=["platform", "team"])
async def test_bad_input_never_gets_a_500(
    broker: EmbeddedBroker, tmp_path: Path, audit_store: SqliteDeadLetterStore, platform: bool
) -> None:
    options = {"token": PLATFORM_TOKEN, "auth": auth_config()}
    token = PLATFORM_TOKEN if platform else TOKENS["alpha"]
    async with (
        team_proxy(broker, tmp_path, audit_store, **options) as (_, url),
        httpx.AsyncClient(base_url=url, timeout=30) as admin,
    ):
        for method, path, body, headers in BAD_INPUTS:
            sent = {"authorization": f"Bearer {token}", **headers}
            answer = await admin.request(method, path, content=body, headers=sent)
            assert answer.status_code < 500, (method, path, headers, answer.text)
            if not headers or headers == JSON:  # the odd headers alone refuse nothing
                assert answer.status_code >= 400, (method, path, headers)


def test_the_audit_schema_names_every_action_of_the_audit_log() -> None:
    assert set(get_args(schemas.AuditAction)) == {action.value for action in Action}


async def test_operations_are_named_for_what_they_do_and_the_schema_has_no_const(
    broker: EmbeddedBroker,
) -> None:
    """Client generators (openapi-python-client) refuse ``const``; names come from the code."""
    spec = create_admin_app(Proxy(broker, {})).openapi()
    ids = {
        (method.upper(), path): operation["operationId"]
        for path, operations in spec["paths"].items()
        for method, operation in operations.items()
    }
    assert ids[("GET", "/integrations")] == "list_integrations"
    assert ids[("POST", "/integrations/{name}/pause")] == "pause"
    assert ids[("GET", "/audit")] == "audit_log"
    assert len(set(ids.values())) == len(ids)
    assert not [i for i in ids.values() if i.endswith(("_get", "_post", "_patch", "_delete"))]

    def keys(node: Any) -> set[str]:
        if isinstance(node, dict):
            return set(node).union(*(keys(value) for value in node.values()))
        if isinstance(node, list):
            return set().union(*(keys(value) for value in node))
        return set()

    assert "const" not in keys(spec)
    replicas = spec["components"]["schemas"]["FleetPlacement"]["properties"]["replicas"]
    assert {"type": "string", "enum": ["all"]} in replicas["anyOf"]
