"""The DLQ viewer's pages and JSON API through httpx: lists, filters, paging, detail, actions, jobs.

Real parts: the DLQ (a SQLite file in tmp_path, and the tests that take the
``env`` fixture again on the PostgreSQL server the session starts), the
embedded log in tmp_path, the replay requeue path of ``nemesis.dlq.requeue``,
the app with its lifespan.
Security (sign-in, CSRF, team scopes, hostile input) is in test_viewer_security.py.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from google.protobuf import descriptor_pb2

from dlq_viewer.auth import SESSION_COOKIE
from dlq_viewer.decoders import protobuf_decoder
from dlq_viewer.testing import (
    STANDARD_ACCESS,
    ViewerEnv,
    integration,
    letter,
    sign_in,
    viewer_env,
)
from nemesis.dlq import DeadLetterFilter, Reason, Status
from nemesis.topology import replay_topic
from tests.test_dlq_store import STORES

ALICE, BOB, ROOT = STANDARD_ACCESS.people
BOT_A, BOT_ROOT = STANDARD_ACCESS.clients
INTEGRATIONS = {
    "orders-a": integration("orders-a", ["team-a"], rate_limits={"replay": 25}),
    "orders-b": integration("orders-b", ["team-b"]),
}


@pytest.fixture(params=sorted(set(STORES) - {"ydb-fake"}))
async def env(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[ViewerEnv]:
    """The viewer on each store a deployment runs here: the SQLite file, and PostgreSQL."""
    async with viewer_env(
        tmp_path,
        integrations=INTEGRATIONS,
        bulk_round_size=7,
        open_store=STORES[request.param](request),
    ) as opened:
        yield opened


@pytest.fixture
async def client(env: ViewerEnv) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=env.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://viewer.test") as opened:
        yield opened


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


async def fill(env: ViewerEnv) -> None:
    """30 letters of orders-a (422s, a few 409s, spread over two hours), 5 of orders-b."""
    # Now, not at import: the page's time filters count back from the moment of the request.
    now = time.time()
    letters = [
        letter(
            "orders-a",
            n,
            at=now - n * 240,
            http_status=409 if n % 10 == 0 else 422,
            error=f"409 conflict: order {n} settled" if n % 10 == 0 else None,
        )
        for n in range(30)
    ]
    letters += [
        letter("orders-b", n, at=now - n * 60, reason=Reason.RETRIES_EXHAUSTED, http_status=503)
        for n in range(5)
    ]
    await env.store.put(letters)


def ids_on(page: str) -> list[str]:
    return re.findall(r'name="ids" value="([0-9a-f]{32})"', page)


async def test_every_page_renders_for_a_signed_in_user(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await fill(env)
    await sign_in(client, ALICE)
    first = ids_on((await client.get("/messages")).text)[0]
    for path in (
        "/",
        "/?range=7d",
        "/?range=30d",
        "/messages",
        "/messages?status=any&range=1h",
        "/messages?range=custom&since=2020-01-01T00:00&until=2200-01-01",
        "/groups",
        "/groups?reason=http_4xx",
        "/audit",
        f"/messages/{first}",
        "/actions/confirm?action=requeue&integration=orders-a",
    ):
        answer = await client.get(path)
        assert answer.status_code == 200, path
        assert answer.headers["content-type"].startswith("text/html")
        assert "alice" in answer.text


async def test_list_counts_filters_and_keyset_pages(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await fill(env)
    await sign_in(client, ROOT)
    page = await client.get("/messages?limit=25")
    assert re.search(r'id="match-count">35<', page.text)
    seen = ids_on(page.text)
    next_link = re.search(r'href="/messages\?([^"]+)" id="next-page"', page.text)
    assert next_link is not None
    page = await client.get("/messages?" + next_link.group(1).replace("&amp;", "&"))
    seen += ids_on(page.text)
    assert len(seen) == len(set(seen)) == 35
    assert 'id="next-page"' not in page.text

    only_409 = await client.get("/messages?integration=orders-a&http_status=409")
    assert len(ids_on(only_409.text)) == 3
    assert re.search(r'id="match-count">3<', only_409.text)
    last_half_hour = await client.get("/messages?integration=orders-a&range=15m")
    assert len(ids_on(last_half_hour.text)) == 4  # n = 0..3 died within 15 minutes
    reason = await client.get("/messages?reason=retries_exhausted")
    assert len(ids_on(reason.text)) == 5


async def test_large_counts_come_after_the_page(tmp_path: Path) -> None:
    async with viewer_env(tmp_path, integrations=INTEGRATIONS, count_cap=20) as env:
        await fill(env)
        transport = httpx.ASGITransport(app=env.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://viewer.test") as client:
            await sign_in(client, ROOT)
            page = await client.get("/messages?status=any")
            shown = re.search(r'data-count-url="([^"]+)">([^<]+)<', page.text)
            assert shown is not None
            assert shown.group(2) == "20+"
            counted = await client.get(shown.group(1).replace("&amp;", "&"))
            assert counted.json() == {"count": 35}
            small = await client.get("/messages?integration=orders-b")
            assert re.search(r'id="match-count">5<', small.text)


async def test_text_search_finds_payload_and_error_text(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await fill(env)
    await sign_in(client, ROOT)
    by_payload = await client.get("/messages?q=ord-17%22")
    assert len(ids_on(by_payload.text)) == 1
    # The count of a text search comes afterwards, from the API.
    count_url = re.search(r'data-count-url="([^"]+)"', by_payload.text)
    assert count_url is not None
    counted = await client.get(count_url.group(1).replace("&amp;", "&"))
    assert counted.json() == {"count": 1}
    by_error = await client.get("/messages?q=CONFLICT")  # ASCII case-insensitive
    assert len(ids_on(by_error.text)) == 3


async def test_detail_shows_payload_metadata_source_and_history(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await env.store.put(
        [letter("orders-a", 1, metadata={"type": "order.created", "trace": "t-1"}, key="cust-9")]
    )
    # The same message failing again keeps its row and moves the first failure to history.
    await env.store.put([letter("orders-a", 1, http_status=400, error="400 bad amount")])
    await sign_in(client, ALICE)
    (row_id,) = ids_on((await client.get("/messages")).text)
    page = (await client.get(f"/messages/{row_id}")).text
    assert "400 bad amount" in page
    assert "Earlier failures" in page
    assert "missing field `city`" in page
    assert "&#34;order_id&#34;: &#34;ord-1&#34;" in page or "&quot;order_id&quot;" in page
    assert "trace" in page
    assert "t-1" in page
    assert "cust-9" in page
    assert "orders · partition 0 · offset 1" in page


async def test_detail_shows_the_trace_a_requeue_continues(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    await env.store.put(
        [
            letter(
                "orders-a",
                1,
                metadata={
                    "nemesis-traceparent": f"00-{trace_id}-00f067aa0ba902b7-01",
                    "nemesis-last-span": f"00-{trace_id}-b7ad6b7169203331-01",
                },
            ),
            letter("orders-a", 2, metadata={"traceparent": "00-not-a-trace"}),
        ]
    )
    await sign_in(client, ALICE)
    pages = [
        (await client.get(f"/messages/{i}")).text
        for i in ids_on((await client.get("/messages")).text)
    ]
    shown = [re.findall(r'<code id="trace-id">([0-9a-f]{32})</code>', page) for page in pages]
    assert sorted(shown) == [[], [trace_id]]
    assert "started by Nemesis" in "".join(pages)
    # The span a requeue's attempts link to: the attempt that dead-lettered it.
    spans = [re.findall(r'<code id="last-span">([0-9a-f]{16})</code>', page) for page in pages]
    assert sorted(spans) == [[], ["b7ad6b7169203331"]]


async def test_detail_decodes_protobuf_with_the_integration_schema(tmp_path: Path) -> None:
    file_proto = descriptor_pb2.FileDescriptorProto(name="shop.proto", package="shop.v1")
    message = file_proto.message_type.add(name="Order")
    message.field.add(
        name="order_id", number=1, type=descriptor_pb2.FieldDescriptorProto.TYPE_STRING
    )
    message.field.add(name="amount", number=2, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64)
    descriptor_set = descriptor_pb2.FileDescriptorSet(file=[file_proto]).SerializeToString()
    decoder = protobuf_decoder(descriptor_set, "shop.v1.Order")
    # order_id = "ord-7" (field 1, length 5), amount = 1234 (field 2, varint).
    payload = b"\x0a\x05ord-7\x10\xd2\x09"
    async with viewer_env(
        tmp_path, integrations=INTEGRATIONS, decoders={"orders-a": decoder}
    ) as env:
        await env.store.put([letter("orders-a", 1, payload=payload)])
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=env.app), base_url="http://viewer.test"
        ) as client:
            await sign_in(client, ALICE)
            (row_id,) = ids_on((await client.get("/messages")).text)
            page = (await client.get(f"/messages/{row_id}")).text
    assert "Protobuf shop.v1.Order" in page
    assert "&#34;order_id&#34;: &#34;ord-7&#34;" in page
    # int64 is a JSON string in proto3's mapping unless the protobuf release can keep numbers.
    assert re.search(r"&#34;amount&#34;: (&#34;)?1234", page)


async def test_binary_payload_is_a_hex_dump_and_downloads_as_an_attachment(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    payload = bytes(range(256))
    await env.store.put([letter("orders-a", 1, payload=payload)])
    await sign_in(client, ALICE)
    (row_id,) = ids_on((await client.get("/messages")).text)
    page = (await client.get(f"/messages/{row_id}")).text
    assert "binary (hex)" in page
    assert "00000000  00 01 02 03" in page
    download = await client.get(f"/messages/{row_id}/payload")
    assert download.status_code == 200
    assert download.content == payload
    assert download.headers["content-type"] == "application/octet-stream"
    assert download.headers["content-disposition"].startswith("attachment;")
    assert "sandbox" in download.headers["content-security-policy"]


async def test_requeue_one_message_goes_to_its_replay_topic(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await fill(env)
    csrf = await sign_in(client, ALICE)
    row_id = ids_on((await client.get("/messages")).text)[0]
    answer = await client.post(f"/messages/{row_id}/requeue", data={"csrf_token": csrf})
    assert answer.status_code == 303
    assert answer.headers["location"] == f"/messages/{row_id}"
    page = (await client.get(f"/messages/{row_id}")).text
    assert "Requeued to orders-a&#39;s replay flow." in page
    row = await env.store.get(row_id)
    assert row is not None
    assert row.status is Status.REQUEUED
    assert row.last_action_by == "alice"
    described = await env.broker.admin.describe_topic(replay_topic("orders-a"))
    assert sum(p.end_offset - p.start_offset for p in described.partitions) == 1
    again = await client.post(f"/messages/{row_id}/requeue", data={"csrf_token": csrf})
    assert "not dead any more" in (await client.get(again.headers["location"])).text


async def test_selected_rows_are_discarded_and_audited(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await fill(env)
    csrf = await sign_in(client, ALICE)
    chosen = ids_on((await client.get("/messages")).text)[:3]
    answer = await client.post(
        "/actions/selected",
        data={"csrf_token": csrf, "action": "discard", "ids": chosen, "return_to": "/messages"},
    )
    assert answer.status_code == 303
    assert answer.headers["location"] == "/messages"
    assert "Discarded 3 messages." in (await client.get("/messages")).text
    rows = await env.store.get_many(chosen)
    assert {row.status for row in rows} == {Status.DISCARDED}
    audit = (await client.get("/audit")).text
    assert "3 selected on a list page" in audit
    assert "discard" in audit


async def test_bulk_requeue_runs_in_rounds_and_leaves_later_failures_alone(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await fill(env)
    csrf = await sign_in(client, ALICE)
    confirm = await client.get("/actions/confirm?action=requeue&integration=orders-a")
    assert "Requeue 30 messages?" in confirm.text
    assert "25.0 messages per second" in confirm.text  # the integration's replay rate
    form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', confirm.text))
    assert form["csrf_token"] == csrf
    assert form["expected"] == "30"
    # A failure after the confirmation is not part of what was counted.
    await env.store.put([letter("orders-a", 500, at=time.time() + 1)])
    started = await client.post("/actions/bulk", data=form)
    assert started.status_code == 303
    job_path = started.headers["location"]
    job = await wait_for_job(client, job_path)
    assert (job["state"], job["done"], job["expected"]) == ("done", 30, 30)
    assert job["rounds"] == 5  # rounds of 7: 7, 7, 7, 7, 2
    late = await env.store.query(DeadLetterFilter(status=Status.DEAD, text="ord-500"))
    assert len(late.rows) == 1
    assert await env.store.count(DeadLetterFilter(status=Status.REQUEUED)) == 30
    described = await env.broker.admin.describe_topic(replay_topic("orders-a"))
    assert sum(p.end_offset - p.start_offset for p in described.partitions) == 30
    entries = (await env.store.actions()).rows
    assert len(entries) == 5
    assert sum(entry.count for entry in entries) == 30
    assert all(f"bulk job {job['id']}" in entry.description for entry in entries)
    page = (await client.get(job_path)).text
    assert "done" in page
    assert "Everything dead that matches" in page


async def wait_for_job(client: httpx.AsyncClient, job_path: str) -> dict[str, object]:
    async with asyncio.timeout(20):
        while True:
            job: dict[str, object] = (await client.get("/api" + job_path)).json()
            if job["finished"]:
                return job
            await asyncio.sleep(0.05)


async def test_bulk_discard_of_a_group(env: ViewerEnv, client: httpx.AsyncClient) -> None:
    await fill(env)
    csrf = await sign_in(client, ROOT)
    groups = (await client.get("/groups")).text
    signatures = re.findall(r'data-signature="([0-9a-f]{16})"', groups)
    conflict = next(
        s for s in signatures if "409 conflict" in groups.split(f'data-signature="{s}"')[1][:800]
    )
    confirm = await client.get(f"/actions/confirm?action=discard&group={conflict}")
    assert "Discard 3 messages?" in confirm.text
    form = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)"', confirm.text))
    assert form["csrf_token"] == csrf
    job = await wait_for_job(
        client, (await client.post("/actions/bulk", data=form)).headers["location"]
    )
    assert job["done"] == 3
    assert await env.store.count(DeadLetterFilter(status=Status.DISCARDED)) == 3
    assert await env.store.count(DeadLetterFilter(status=Status.DEAD)) == 32


async def test_api_lists_reads_and_acts_with_a_token(
    env: ViewerEnv, client: httpx.AsyncClient
) -> None:
    await fill(env)
    headers = bearer(BOT_A.token)
    me = (await client.get("/api/me", headers=headers)).json()
    assert me == {
        "name": "bot-a",
        "teams": ["team-a"],
        "admin": False,
        "method": "token",
        "integrations": ["orders-a"],
    }
    first = (await client.get("/api/messages?limit=10&http_status=422", headers=headers)).json()
    assert len(first["rows"]) == 10
    assert first["next_cursor"]
    assert {row["integration"] for row in first["rows"]} == {"orders-a"}
    second = (
        await client.get(
            "/api/messages",
            params={"limit": 100, "http_status": 422, "cursor": first["next_cursor"]},
            headers=headers,
        )
    ).json()
    assert len(first["rows"]) + len(second["rows"]) == 27
    assert second["next_cursor"] is None
    one = (await client.get(f"/api/messages/{first['rows'][0]['id']}", headers=headers)).json()
    assert one["payload_text"].startswith('{"order_id"')
    assert one["metadata"] == {"type": "order.created"}
    count = await client.get("/api/messages/count?status=dead", headers=headers)
    assert count.json() == {"count": 30}
    groups = (await client.get("/api/groups", headers=headers)).json()
    assert [group["count"] for group in groups] == [27, 3]
    stats = (await client.get("/api/stats?bucket_s=3600&buckets=3", headers=headers)).json()
    assert stats["total"] == 30
    assert len(stats["buckets"]) == 3
    moved = await client.post(
        "/api/requeue", json={"ids": [first["rows"][0]["id"]]}, headers=headers
    )
    assert moved.json() == {"action": "requeue", "count": 1, "by_integration": {"orders-a": 1}}
    started = await client.post(
        "/api/jobs",
        json={"action": "discard", "filter": {"http_status": 409}},
        headers=headers,
    )
    assert started.status_code == 202
    job = await wait_for_job_api(client, started.json()["id"], headers)
    assert job["done"] == 3
    assert job["actor"] == "bot-a (API token)"
    audit = (await client.get("/api/audit", headers=headers)).json()
    assert [(row["action"], row["count"]) for row in audit["rows"]] == [
        ("discard", 3),
        ("requeue", 1),
    ]


async def wait_for_job_api(
    client: httpx.AsyncClient, job_id: str, headers: dict[str, str]
) -> dict[str, object]:
    async with asyncio.timeout(20):
        while True:
            job: dict[str, object] = (
                await client.get(f"/api/jobs/{job_id}", headers=headers)
            ).json()
            if job["finished"]:
                return job
            await asyncio.sleep(0.05)


async def test_openapi_describes_the_json_api(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/api/openapi.json")).json()
    paths = set(spec["paths"])
    assert {
        "/api/me",
        "/api/messages",
        "/api/messages/count",
        "/api/messages/{message_id}",
        "/api/groups",
        "/api/stats",
        "/api/requeue",
        "/api/discard",
        "/api/jobs",
        "/api/jobs/{job}",
        "/api/audit",
    } <= paths
    assert not any(not path.startswith("/api/") for path in paths)  # pages stay out of it


async def test_openapi_declares_how_to_authenticate_and_how_requests_fail(
    client: httpx.AsyncClient,
) -> None:
    spec = (await client.get("/api/openapi.json")).json()
    schemes = spec["components"]["securitySchemes"]
    assert schemes["bearerToken"] == {**schemes["bearerToken"], "type": "http", "scheme": "bearer"}
    assert schemes["sessionCookie"]["in"] == "cookie"
    assert schemes["sessionCookie"]["name"] == SESSION_COOKIE
    assert schemes["csrfToken"]["in"] == "header"
    assert schemes["csrfToken"]["name"] == "X-CSRF-Token"
    assert spec["components"]["schemas"]["ErrorOut"]["required"] == ["detail"]
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            where = f"{method.upper()} {path}"
            changes = method != "get"
            csrf: dict[str, list[str]] = (
                {"sessionCookie": [], "csrfToken": []} if changes else {"sessionCookie": []}
            )
            assert operation["security"] == [{"bearerToken": []}, csrf], where
            responses = operation["responses"]
            error = {"$ref": "#/components/schemas/ErrorOut"}
            assert responses["401"]["content"]["application/json"]["schema"] == error, where
            if changes:
                assert {"400", "403", "413", "422"} <= set(responses), where
    assert "429" in spec["paths"]["/api/jobs"]["post"]["responses"]
    assert "404" in spec["paths"]["/api/messages/{message_id}"]["get"]["responses"]
    assert "400" in spec["paths"]["/api/messages"]["get"]["responses"]


async def test_a_stopped_job_is_cancelled_between_rounds(tmp_path: Path) -> None:
    async with viewer_env(
        tmp_path, integrations=INTEGRATIONS, bulk_round_size=2, bulk_pause_s=0.2
    ) as env:
        await env.store.put([letter("orders-a", n) for n in range(20)])
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=env.app), base_url="http://viewer.test"
        ) as client:
            headers = bearer(BOT_A.token)
            started = (
                await client.post("/api/jobs", json={"action": "requeue"}, headers=headers)
            ).json()
            await asyncio.sleep(0.3)
            stopped = await client.post(f"/api/jobs/{started['id']}/stop", headers=headers)
            assert stopped.status_code == 200
            job = await wait_for_job_api(client, started["id"], headers)
    assert job["state"] == "cancelled"
    assert 0 < int(str(job["done"])) < 20
