"""``source.start_from`` and ``nemesis offsets`` through the real CLI, beside a real proxy.

Each case runs the proxy in a subprocess on the embedded backend, with its
admin API on a free port and a real handler on loopback; the ``offsets``
commands run as their own processes beside it, as an operator would.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import secrets
import socket
import time

import httpx
import orjson
import pytest

from nemesis.backends import open_dlq
from nemesis.config import load_process_config
from nemesis.dlq import Action
from nemesis.testing import HandlerServer
from tests.conftest import Workspace, integration_yaml, stop_gracefully

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

TOKEN = secrets.token_urlsafe(24)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Space:
    """A workspace whose proxy serves its admin API on a port of its own."""

    def __init__(self, workspace: Workspace, lease_s: float = 10.0) -> None:
        self.workspace = workspace
        self.admin_port = free_port()
        root = workspace.root
        (root / "nemesis.yaml").write_text(
            "backend:\n"
            "  kind: embedded\n"
            f"  path: {workspace.db_path}\n"
            # A seek waits for the reader's next heartbeat (lease_s / 3).
            f"  lease_s: {lease_s}\n"
            f"data_dir: {root}\n"
            "integrations_dir: integrations\n"
            f"admin: {{port: {self.admin_port}, token: {TOKEN}}}\n"
            "viewer: {enabled: false}\n"
        )

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def cli(self, *args: str) -> tuple[int, str, str]:
        done = self.workspace.cli(*args)
        return done.returncode, done.stdout, done.stderr

    def create_topic(self, partitions: int) -> None:
        code, _, err = self.cli("topics", "create", "orders", "--partitions", str(partitions))
        assert code == 0, err

    def publish(self, *ids: str) -> None:
        path = self.workspace.root / "batch.jsonl"
        path.write_bytes(b"".join(orjson.dumps({"id": i}) + b"\n" for i in ids))
        code, out, err = self.cli(
            "publish", "orders", "--file", "batch.jsonl", "--lines", "--key-field", "id"
        )
        assert code == 0, err
        assert f"written {len(ids)} message(s)" in out

    def show(self, flow: str = "main") -> list[dict[str, object]]:
        code, out, err = self.cli("offsets", "show", "loyalty", "--flow", flow, "--json")
        assert code == 0, err
        (found,) = json.loads(out)["flows"]
        partitions: list[dict[str, object]] = found["partitions"]
        return partitions

    async def start(self) -> asyncio.subprocess.Process:
        """``nemesis run``, once the integration's main flow runs."""
        proxy = await self.workspace.start("run")
        async with httpx.AsyncClient(base_url=self.admin_url, timeout=5) as client:
            deadline = time.monotonic() + 60
            while True:
                assert proxy.returncode is None, self.workspace.logs()
                assert time.monotonic() < deadline, self.workspace.logs()
                try:
                    answer = await client.get("/integrations/loyalty")
                    if answer.status_code == 200 and answer.json()["state"] == "running":
                        return proxy
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)

    async def admin(self, action: str) -> None:
        async with httpx.AsyncClient(base_url=self.admin_url, timeout=5) as client:
            answer = await client.post(f"/integrations/loyalty/{action}", headers=AUTH)
            assert answer.status_code == 200, answer.text
            assert answer.json()["paused"] is (action == "pause")


@pytest.fixture
def space(workspace: Workspace) -> Space:
    return Space(workspace)


def ids_of(handler: HandlerServer) -> list[str]:
    return [str(json.loads(e.body)["id"]) for e in handler.ledger if e.done]


def lags(space: Space) -> list[int]:
    return [int(str(p["lag"])) for p in space.show()]


async def until_lags(space: Space, expected: list[int], what: str, timeout_s: float = 60) -> None:
    """Waits until the main flow's lags are ``expected``, then checks the CLI shows them.

    Polled in this process, on the log itself (as ``offsets show`` computes the
    lag): a CLI process per look would cost a Python start-up each.
    """
    broker = await space.workspace.open_broker()

    async def current() -> list[int]:
        description = await broker.admin.describe_topic("orders")
        return [
            p.end_offset - max(p.committed.get("loyalty", p.start_offset), p.start_offset)
            for p in sorted(description.partitions, key=lambda p: p.partition)
        ]

    try:
        deadline = time.monotonic() + timeout_s
        while (found := await current()) != expected:
            assert time.monotonic() < deadline, f"not reached: {what} ({found})"
            await asyncio.sleep(0.1)
    finally:
        await broker.close()
    assert lags(space) == expected, what


async def test_start_from_latest_delivers_only_what_was_published_after_it_started(
    space: Space,
) -> None:
    space.create_topic(2)
    space.publish(*(f"old-{n}" for n in range(6)))
    async with HandlerServer() as handler:
        space.workspace.write_integration(
            "loyalty",
            integration_yaml("loyalty", handler.url, extra="").replace(
                "consumer: loyalty}", "consumer: loyalty, start_from: latest}"
            ),
        )
        proxy = await space.start()
        # The readers took their partitions at the end: nothing is left to deliver.
        await until_lags(space, [0, 0], "the main flow starts at the end")
        space.publish(*(f"new-{n}" for n in range(4)))
        await handler.ledger.wait_for(4, timeout_s=60)
        await until_lags(space, [0, 0], "everything new committed")
        assert await stop_gracefully(proxy) == 0, space.workspace.logs()
    # At least once: a redelivery may repeat one, but nothing older comes.
    assert set(ids_of(handler)) == {f"new-{n}" for n in range(4)}


async def test_start_from_a_time_starts_at_the_first_message_at_or_after_it(
    space: Space,
) -> None:
    space.create_topic(1)
    space.publish("a-0", "a-1", "a-2")
    at = datetime.datetime.now(datetime.UTC)
    await asyncio.sleep(0.05)  # apart from the first batch in the broker's write time
    space.publish("b-0", "b-1")
    stamp = at.isoformat().replace("+00:00", "Z")
    async with HandlerServer() as handler:
        space.workspace.write_integration(
            "loyalty",
            integration_yaml("loyalty", handler.url).replace(
                "consumer: loyalty}", f"consumer: loyalty, start_from: '{stamp}'}}"
            ),
        )
        proxy = await space.start()
        await handler.ledger.wait_for(2, timeout_s=60)
        await until_lags(space, [0], "everything after the time committed")
        assert await stop_gracefully(proxy) == 0, space.workspace.logs()
    assert set(ids_of(handler)) == {"b-0", "b-1"}


def test_a_start_from_that_is_not_one_names_the_file_and_field(space: Space) -> None:
    space.workspace.write_integration(
        "loyalty",
        integration_yaml("loyalty", "http://127.0.0.1:9/").replace(
            "consumer: loyalty}", "consumer: loyalty, start_from: '2026-12-01T09:00:00'}"
        ),
    )
    code, out, err = space.cli("validate")
    assert code != 0
    text = out + err
    assert "loyalty.yaml" in text
    assert "start_from" in text
    assert "has no zone" in text


async def test_show_prints_committed_end_and_lag_per_partition(space: Space) -> None:
    space.create_topic(2)
    space.publish(*(f"first-{n}" for n in range(10)))
    async with HandlerServer() as handler:
        space.workspace.write_integration("loyalty", integration_yaml("loyalty", handler.url))
        proxy = await space.start()
        await handler.ledger.wait_for(10, timeout_s=60)
        await until_lags(space, [0, 0], "the first ten committed")
        assert await stop_gracefully(proxy) == 0, space.workspace.logs()
    committed = {p["partition"]: p["committed"] for p in space.show()}
    space.publish(*(f"later-{n}" for n in range(7)))

    shown = space.show()
    ends = {p["partition"]: p["end"] for p in shown}
    assert sum(int(str(e)) for e in ends.values()) == 17
    for p in shown:
        assert p["committed"] == committed[p["partition"]]
        assert p["lag"] == int(str(p["end"])) - int(str(p["committed"]))
        # The next message's write time is shown where there is one.
        assert (p["next_written_at"] is None) == (p["lag"] == 0)
    assert sum(int(str(p["lag"])) for p in shown) == 7

    code, out, err = space.cli("offsets", "show", "loyalty")
    assert code == 0, err
    assert "flow main: topic orders, consumer loyalty" in out
    for p in shown:
        assert f"{p['partition']:>9} {p['committed']:>12} {p['end']:>12} {p['lag']:>10}" in out
    # Retry tiers and replay are listed too, with their own consumers.
    assert "flow replay: topic nemesis.replay.loyalty, consumer nemesis.internal.loyalty" in out


async def test_seek_and_skip_are_refused_while_it_runs_unpaused_even_with_force(
    space: Space,
) -> None:
    space.create_topic(1)
    space.publish("m-0", "m-1")
    async with HandlerServer() as handler:
        space.workspace.write_integration("loyalty", integration_yaml("loyalty", handler.url))
        proxy = await space.start()
        await handler.ledger.wait_for(2, timeout_s=60)
        await until_lags(space, [0], "both committed")
        for command in (
            ("offsets", "seek", "loyalty", "--to", "earliest"),
            ("offsets", "skip", "loyalty", "--count", "1", "--force"),
        ):
            code, out, err = space.cli(*command)
            assert code == 1, out
            assert "is not paused" in err
            assert "pause it first" in err
        assert [p["committed"] for p in space.show()] == [2]
        assert await stop_gracefully(proxy) == 0, space.workspace.logs()

    # Stopped: the admin API does not answer and no reader is alive; --force is needed.
    code, _, err = space.cli("offsets", "seek", "loyalty", "--to", "earliest")
    assert code == 1
    assert "did not answer" in err
    assert "--force" in err
    code, out, err = space.cli("offsets", "seek", "loyalty", "--to", "earliest", "--force")
    assert code == 0, err
    assert "partition 0: 2 -> 0 (-2)" in out
    assert [p["committed"] for p in space.show()] == [0]


async def test_skip_while_paused_passes_over_exactly_the_poison_message(
    workspace: Workspace,
) -> None:
    # Long enough that the reader's next heartbeat comes after the resume unless
    # the skip waits for it: the paused reader must not read on from where it stopped.
    space = Space(workspace, lease_s=60)
    space.create_topic(1)
    space.publish("m-0")
    async with HandlerServer() as handler:
        space.workspace.write_integration(
            "loyalty",
            integration_yaml("loyalty", handler.url, extra="").replace(
                "delivery: {workers: 32, buffer: 1000}",
                "delivery: {workers: 4, buffer: 100, ordering: partition}",
            ),
        )
        proxy = await space.start()
        await handler.ledger.wait_for(1, timeout_s=60)
        await until_lags(space, [0], "m-0 committed")
        await space.admin("pause")
        space.publish("poison", "m-1")
        assert lags(space) == [2]

        code, out, err = space.cli("offsets", "skip", "loyalty", "--count", "1", "--actor", "alice")
        assert code == 0, err
        assert "paused (the admin API" in out
        assert "partition 0: 1 -> 2 (+1)" in out
        assert lags(space) == [1]

        await space.admin("resume")
        await handler.ledger.wait_for(2, timeout_s=60)
        await until_lags(space, [0], "m-1 committed")
        assert await stop_gracefully(proxy) == 0, space.workspace.logs()
    assert set(ids_of(handler)) == {"m-0", "m-1"}
    assert all(json.loads(e.body)["id"] != "poison" for e in handler.ledger)

    config = load_process_config(space.workspace.root / "nemesis.yaml")
    store = await open_dlq(config)
    try:
        entries = (await store.actions()).rows
    finally:
        await store.close()
    # The pause and the resume through the admin API are in the same audit log, newest first.
    assert [e.action for e in entries] == [Action.RESUME, Action.SKIP, Action.PAUSE]
    entry = entries[1]
    assert (entry.who, entry.action, entry.integrations, entry.count) == (
        "alice",
        Action.SKIP,
        ("loyalty",),
        1,
    )
    assert entry.description == (
        "offsets skip --count 1: flow main, topic orders, consumer loyalty: p0 1->2"
    )


def test_seek_names_what_it_cannot_take(space: Space) -> None:
    space.workspace.write_integration("loyalty", integration_yaml("loyalty", "http://127.0.0.1:9/"))
    code, _, err = space.cli("offsets", "seek", "loyalty", "--to", "tomorrow")
    assert code == 1
    assert "--to: expected earliest, latest" in err
    code, _, err = space.cli("offsets", "seek", "loyalty", "--to", "12")
    assert code == 1
    assert "add --partition" in err
    code, _, err = space.cli("offsets", "skip", "billing", "--count", "1")
    assert code == 1
    assert "no valid integration billing" in err


def test_seek_to_a_time_or_an_offset_when_nothing_runs(space: Space) -> None:
    space.workspace.write_integration("loyalty", integration_yaml("loyalty", "http://127.0.0.1:9/"))
    space.create_topic(1)
    space.publish("a-0", "a-1")
    at = datetime.datetime.now(datetime.UTC)
    time.sleep(0.05)  # apart from the first batch in the broker's write time
    space.publish("b-0")
    stamp = at.isoformat().replace("+00:00", "Z")

    code, _, err = space.cli("offsets", "seek", "loyalty", f"--to={stamp}", "--force")
    assert code == 1
    assert "topic orders has no consumer loyalty yet: `nemesis init` registers it" in err
    code, _, err = space.cli("init")
    assert code == 0, err
    code, out, err = space.cli("offsets", "seek", "loyalty", f"--to={stamp}", "--force")
    assert code == 0, err
    assert "no process runs it (no live reader; --force)" in out
    assert "partition 0: 0 -> 2 (+2)" in out
    code, out, err = space.cli(
        "offsets", "seek", "loyalty", "--to", "1", "--partition", "0", "--force"
    )
    assert code == 0, err
    assert "partition 0: 2 -> 1 (-1)" in out
    code, out, err = space.cli("offsets", "seek", "loyalty", "--to=-1h", "--force")
    assert code == 0, err
    assert "partition 0: 1 -> 0 (-1)" in out
    assert [p["committed"] for p in space.show()] == [0]
