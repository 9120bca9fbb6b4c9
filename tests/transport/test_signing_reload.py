"""A secret rotated while the proxy runs: the file changes, the integration restarts, re-signs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nemesis.broker.embedded import EmbeddedBroker, open_embedded
from nemesis.config.loader import load_integrations
from nemesis.config.models import EmbeddedBackendConfig
from nemesis.delivery import signing
from nemesis.runtime.app import Proxy
from nemesis.runtime.reload import ConfigReloader
from nemesis.testing import HandlerServer, LedgerEntry
from tests.operability import FAST, committed, publish, running, wait_until_true

OLD, NEW = b"orders-hook-old-1f0a", b"orders-hook-new-8c3d"


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[EmbeddedBroker]:
    opened = await open_embedded(EmbeddedBackendConfig(path=str(tmp_path / "log.db")))
    yield opened
    await opened.close()


def signed_yaml(url: str, secrets_env: str) -> str:
    return (
        "name: loyalty\nowners: [team-loyalty]\n"
        "source: {topic: orders, consumer: loyalty}\n"
        f"target: {{url: '{url}', timeout_s: 5, signing: {{secrets_env: {secrets_env}}}}}\n"
        "delivery: {workers: 4, buffer: 100}\n"
        "retry: {tiers: [100ms, 200ms, 400ms, 800ms, 2s]}\n"
    )


async def test_a_rotation_by_file_reload_never_refuses_a_delivery(
    broker: EmbeddedBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOOK_SECRET", OLD.decode())
    monkeypatch.delenv("HOOK_SECRET_NEXT", raising=False)
    handler_secrets = [OLD]  # what the handler holds; the test changes it

    def refused(entry: LedgerEntry) -> bool:
        try:
            signing.verify_http(entry.headers.items(), entry.body, handler_secrets, now=time.time())
        except signing.SignatureError:
            return True
        return False

    directory = tmp_path / "integrations"
    directory.mkdir()
    file = directory / "loyalty.yaml"
    async with HandlerServer() as handler:
        handler.when(refused, status=401)
        file.write_text(signed_yaml(handler.url, "[HOOK_SECRET]"))
        integrations, _ = load_integrations(directory)
        proxy = Proxy(
            broker,
            integrations,
            integration_files={"loyalty": file},
            runner_options=FAST,
        )
        reloader = ConfigReloader(proxy, directory, watch=False)
        await publish(broker, 10, consumers=["loyalty"])
        async with running(proxy):
            await wait_until_true(lambda: len(handler.ledger.done_ids()) == 10, timeout_s=30)

            # A variable the process does not have: the running integration keeps going.
            file.write_text(signed_yaml(handler.url, "[HOOK_SECRET_NEXT, HOOK_SECRET]"))
            report = await reloader.reload("api")
            assert report.kept == ["loyalty"]
            [problem] = report.problems
            assert (problem.field, str(file)) == ("target.signing.secrets_env.0", problem.file)
            assert "HOOK_SECRET_NEXT is unset or empty" in problem.message

            # 1. Nemesis holds both secrets; the handler still has only the old one.
            monkeypatch.setenv("HOOK_SECRET_NEXT", NEW.decode())
            report = await reloader.reload("api")
            assert list(report.restarted) == ["loyalty"]
            await publish(broker, 10, start=10)
            await wait_until_true(lambda: len(handler.ledger.done_ids()) == 20, timeout_s=30)
            # 2. The handler takes the new one only.
            handler_secrets[:] = [NEW]
            await publish(broker, 10, start=20)
            await wait_until_true(lambda: len(handler.ledger.done_ids()) == 30, timeout_s=30)
            # 3. Nemesis drops the old one.
            file.write_text(signed_yaml(handler.url, "[HOOK_SECRET_NEXT]"))
            assert list((await reloader.reload("api")).restarted) == ["loyalty"]
            await publish(broker, 10, start=30)
            await wait_until_true(lambda: len(handler.ledger.done_ids()) == 40, timeout_s=30)
            for _ in range(600):  # commits follow the deliveries
                if await committed(broker, "loyalty") == 40:
                    break
                await asyncio.sleep(0.05)
            assert await committed(broker, "loyalty") == 40

    signatures = [entry.headers["webhook-signature"] for entry in handler.ledger.entries]
    assert [header.count("v1,") for header in signatures] == [1] * 10 + [2] * 20 + [1] * 10
    assert [entry.status for entry in handler.ledger.entries] == [200] * 40  # none refused
