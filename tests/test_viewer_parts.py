"""The DLQ viewer's parts alone: rendering, filters, hashes, auth config, jobs, the server."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from dlq_viewer import render
from dlq_viewer.actions import BulkJob, BulkJobs, JobsBusy, JobState
from dlq_viewer.auth import LoginThrottle, MemoryLoginStore
from dlq_viewer.filters import ListFilter
from dlq_viewer.passwords import hash_password, hash_token, new_token, verify_password
from dlq_viewer.server import ViewerStartError, bound_port, serve_viewer, viewer_server
from dlq_viewer.testing import STANDARD_ACCESS, eventually, integration, letter, viewer_env
from nemesis.config.models import AuthConfig, NemesisConfig
from nemesis.dlq import Action, DeadLetterFilter, Reason, Status, TimeBucket, open_sqlite_dlq
from nemesis.dlq.requeue import ActionResult
from nemesis.errors import InvalidQuery
from nemesis.testing.clock import FakeClock

REPO = Path(__file__).resolve().parent.parent

# --- rendering -----------------------------------------------------------------------------


def test_reveal_escapes_html_and_marks_invisible_characters() -> None:
    shown = str(render.reveal('<img src=x onerror="alert(1)">\u202etxt.exe a\u200bb\x07'))
    assert "<img" not in shown
    assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in shown
    assert 'data-cp="U+202E"' in shown
    assert "RIGHT-TO-LEFT OVERRIDE" in shown
    assert 'data-cp="U+200B"' in shown
    assert 'data-cp="U+0007"' in shown
    assert render.hidden_characters("a\u202eb\u200bc\nd\te") == 2
    assert str(render.reveal("plain\ttext\n")) == "plain\ttext\n"


def test_payload_views() -> None:
    json_view = render.payload_view(b'{"b": 1, "a": [1, 2], "big": 123456789012345678901234567890}')
    assert json_view.kind == "json"
    assert '"big": 123456789012345678901234567890' in json_view.text  # no float rounding
    assert json_view.text.index('"b"') < json_view.text.index('"a"')  # key order kept
    assert render.payload_view("plain text, ünïcode".encode()).kind == "text"
    binary = render.payload_view(bytes(range(40)))
    assert binary.kind == "binary"
    assert binary.text.startswith("00000000  00 01 02")
    assert render.payload_view(b"").kind == "empty"
    deep = render.payload_view(b"[" * 100_000 + b"]" * 100_000)
    assert deep.kind in ("text", "binary")  # too deep for a parser: shown raw, never a crash
    big = render.payload_view(b'["' + b"x" * (render.MAX_SHOWN_CHARS + 10) + b'"]')
    assert big.cut
    assert len(big.text) == render.MAX_SHOWN_CHARS


def test_a_decoder_that_fails_falls_back_with_a_note() -> None:
    def refuse(payload: bytes) -> object:
        raise ValueError("not a valid shop.v1.Order message")

    view = render.payload_view(b'{"a": 1}', decoder=refuse, decoder_label="Protobuf shop.v1.Order")
    assert view.kind == "json"
    assert view.note == "Protobuf shop.v1.Order failed: not a valid shop.v1.Order message"


def test_bar_chart_scales_to_a_round_ceiling() -> None:
    buckets = [TimeBucket(3600.0 * i, count) for i, count in enumerate([0, 3, 17, 1])]
    chart = render.bar_chart(buckets, 3600.0)
    assert chart.peak == 17
    assert chart.total == 21
    assert [tick.label for tick in chart.y_ticks] == ["0", "10", "20"]
    heights = [bar.height for bar in chart.bars]
    assert heights[0] == 0
    assert heights[3] >= 2
    assert heights[2] == max(heights)
    assert all(bar.x + bar.width <= chart.plot_left + chart.plot_width + 0.01 for bar in chart.bars)


def test_human_durations() -> None:
    assert [render.duration(s) for s in (5, 90, 3 * 3600 + 600, 86400 * 2.4)] == [
        "5 s",
        "2 min",
        "3 h 10 min",
        "2 days",
    ]
    assert render.ago(1000.0, 1010.0) == "just now"
    assert render.ago(None, 0.0) == "—"


# --- filters -------------------------------------------------------------------------------


def test_a_form_becomes_a_scoped_store_filter() -> None:
    form = ListFilter.from_params(
        {"integration": "orders-a", "reason": "http_4xx", "http_status": "422", "range": "1h"}
    )
    where = form.to_filter(frozenset({"orders-a", "orders-b"}), now=10_000.0)
    assert where.integrations == frozenset({"orders-a"})
    assert (where.reason, where.status, where.http_status) == (Reason.HTTP_4XX, Status.DEAD, 422)
    assert (where.since, where.until) == (10_000.0 - 3600, None)
    outside = ListFilter(integration="orders-c").to_filter(frozenset({"orders-a"}), now=0.0)
    assert outside.matches_nothing
    assert ListFilter(status="any").to_filter(None, 0.0).status is None


def test_frozen_filters_end_at_the_confirmation() -> None:
    confirmed = 1_800_000_000.0
    form = ListFilter(status="any", range="24h")
    frozen = form.frozen_at(confirmed)
    where = frozen.to_filter(None, now=confirmed + 600)  # applied later: the confirmed window
    assert (where.status, where.since, where.until) == (Status.DEAD, confirmed - 86400, confirmed)
    assert ListFilter.from_params(frozen.params()) == frozen


@pytest.mark.parametrize(
    "params",
    [
        {"reason": "nope"},
        {"status": "gone"},
        {"http_status": "4o4"},
        {"range": "1y"},
        {"range": "custom", "since": "tomorrow"},
        {"integration": "Not A Name"},
        {"q": "x" * 301},
        {"q": "nul\x00"},
        {"group": "xyz"},
    ],
)
def test_malformed_forms_are_invalid_queries(params: dict[str, str]) -> None:
    with pytest.raises(InvalidQuery):
        ListFilter.from_params(params).to_filter(None, now=0.0)


# --- hashes and the auth section -----------------------------------------------------------------


def test_password_hashes_verify_and_differ_by_salt() -> None:
    first = hash_password("correct horse", n=2**14)
    assert first != hash_password("correct horse", n=2**14)
    assert verify_password("correct horse", first)
    assert not verify_password("correct hors", first)
    assert not verify_password("correct horse", "scrypt$garbage")
    assert not verify_password("x" * 5000, first)
    token = new_token()
    assert token.startswith("nmsv_")
    assert hash_token(token).startswith("sha256$")


async def test_login_throttle_slows_a_key_down_and_never_locks_it() -> None:
    clock = FakeClock()
    throttle = LoginThrottle(
        MemoryLoginStore(), clock, free_failures=3, first_delay_s=1, max_delay_s=8
    )
    for _ in range(3):
        await throttle.failed("alice")
        assert await throttle.retry_after_s("alice") == 0
    await throttle.failed("alice")
    assert await throttle.retry_after_s("alice") == 1
    assert await throttle.retry_after_s("bob") == 0  # others are not affected
    waits = []
    for _ in range(6):  # a try after each wait fails again
        wait = await throttle.retry_after_s("alice")
        waits.append(wait)
        clock.advance(wait)
        assert await throttle.retry_after_s("alice") == 0  # after the wait, a try is allowed
        await throttle.failed("alice")
    assert waits == [1, 2, 4, 8, 8, 8]  # doubling, then capped: a bounded wait, not a lockout
    await throttle.succeeded("alice")
    assert await throttle.retry_after_s("alice") == 0


async def test_login_throttle_forgets_a_quiet_key() -> None:
    clock = FakeClock()
    throttle = LoginThrottle(
        MemoryLoginStore(), clock, free_failures=1, max_delay_s=8, forget_after_s=60
    )
    for _ in range(5):
        await throttle.failed("alice")
    assert await throttle.retry_after_s("alice") == 8
    clock.advance(60)
    await throttle.failed("alice")  # counted from zero again: the first failure is free
    assert await throttle.retry_after_s("alice") == 0


def test_the_auth_section_refuses_plaintext_and_weak_secrets() -> None:
    person_hash = hash_password("pw", n=2**14)
    good = {"session_secret": "s" * 40, "users": [{"name": "a", "password_hash": person_hash}]}
    assert AuthConfig.model_validate(good).users[0].name == "a"
    refused: list[dict[str, object]] = [
        {"users": [{"name": "a", "password_hash": "hunter2"}]},
        {"users": [{"name": "a", "password_hash": person_hash.replace("$16384$", "$1024$")}]},
        {"session_secret": "short"},
        {"tokens": [{"name": "bot", "token_hash": "plain-token"}]},
        {"users": [{"name": "a", "password_hash": person_hash}] * 2},
        {"trusted_header": {"trusted_proxies": []}},
        {"trusted_header": {"trusted_proxies": ["not-an-address"]}},
        {"unknown": True},
    ]
    for bad in refused:
        with pytest.raises(ValidationError):
            AuthConfig.model_validate(bad)
    # ${NEMESIS_SESSION_SECRET:-} with the variable unset: a per-process secret.
    assert AuthConfig.model_validate({"session_secret": ""}).session_secret is None
    assert NemesisConfig().auth == AuthConfig()


@pytest.mark.slow
def test_hash_password_command_prints_a_usable_hash() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dlq_viewer.hash_password"],
        input="s3cret-pass\n",
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    )
    line = done.stdout.strip()
    assert line.startswith("password_hash: scrypt$")
    stored = line.removeprefix("password_hash: ")
    assert verify_password("s3cret-pass", stored)
    AuthConfig.model_validate({"users": [{"name": "x", "password_hash": stored}]})
    token = subprocess.run(
        [sys.executable, "-m", "dlq_viewer.hash_password", "--token"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
        check=True,
    ).stdout
    assert "token_hash: sha256$" in token


# --- bulk jobs -----------------------------------------------------------------------------------


class StuckRequeuer:
    """A requeue path that waits until released (a slow broker)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls = 0

    async def __call__(
        self, ids: Collection[str], *, by: str, allowed: frozenset[str] | None, description: str
    ) -> ActionResult:
        self.calls += 1
        await self.release.wait()
        return ActionResult(Action.REQUEUE, 0, {})


async def test_bulk_jobs_are_bounded_and_refuse_when_full(tmp_path: Path) -> None:
    store = await open_sqlite_dlq(tmp_path / "dlq.db")
    try:
        await store.put([letter("orders-a", n) for n in range(3)])
        requeuer = StuckRequeuer()
        async with BulkJobs(store, requeuer, max_running=1, max_unfinished=2) as jobs:

            def submit() -> BulkJob:
                return jobs.submit(
                    Action.REQUEUE,
                    DeadLetterFilter(),
                    actor="alice",
                    owner="alice",
                    scope=None,
                    description="everything",
                    expected=3,
                )

            first = submit()
            second = submit()
            with pytest.raises(JobsBusy):
                submit()
            await asyncio.sleep(0.2)
            assert (first.state, second.state) == (JobState.RUNNING, JobState.QUEUED)
            assert requeuer.calls == 1  # one at a time
            requeuer.release.set()  # the rest of its rounds return at once
            jobs.stop(second.id)
            await eventually(lambda: first.finished and second.finished, what="both jobs")
        assert first.state is JobState.DONE  # its rounds moved nothing: it gave up
        assert second.state is JobState.CANCELLED
    finally:
        await store.close()


@pytest.mark.slow
async def test_too_many_bulk_actions_answer_429(tmp_path: Path) -> None:
    async with viewer_env(
        tmp_path,
        integrations={"orders-a": integration("orders-a", ["team-a"])},
        bulk_pause_s=5.0,
        bulk_round_size=1,
    ) as env:
        await env.store.put([letter("orders-a", n) for n in range(30)])
        headers = {"authorization": f"Bearer {STANDARD_ACCESS.clients[1].token}"}
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=env.app), base_url="http://viewer.test"
        ) as client:
            codes = [
                (
                    await client.post("/api/jobs", json={"action": "requeue"}, headers=headers)
                ).status_code
                for _ in range(21)
            ]
            for job in (await client.get("/api/jobs", headers=headers)).json():
                await client.post(f"/api/jobs/{job['id']}/stop", headers=headers)
    assert codes == [202] * 20 + [429]


# --- the server ----------------------------------------------------------------------------------


async def test_the_server_starts_answers_and_stops(tmp_path: Path) -> None:
    async with viewer_env(tmp_path, integrations={}) as env:
        server = viewer_server(env.app, "127.0.0.1", 0)
        task = asyncio.create_task(server.serve())
        try:
            await eventually(lambda: server.started, what="the server")
            async with httpx.AsyncClient() as client:
                answer = await client.get(f"http://127.0.0.1:{bound_port(server)}/healthz")
            assert answer.text == "ok\n"
        finally:
            server.stop()
            await task


async def test_a_taken_port_is_an_error_not_an_exit(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with viewer_env(tmp_path, integrations={}) as env:
            stop = asyncio.Event()
            with pytest.raises(ViewerStartError):
                await serve_viewer(env.app, "127.0.0.1", port, stop=stop)
