"""The postgres DLQ store beyond the contract: shared by replicas, its configuration, its errors.

Real parts only: the PostgreSQL server the session starts
(``tests/postgres_server.py``), the real CLI in a subprocess with the
embedded broker, a real ``HandlerServer``. The contract cases every store
passes are in ``tests/test_dlq_store.py``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from urllib.parse import unquote, urlsplit

import asyncpg
import pytest
import yaml
from pydantic import ValidationError

from nemesis.backends.postgres import (
    PostgresConnectionConfig,
    PostgresDlqConfig,
    PostgresStateConfig,
)
from nemesis.config import load_process_config
from nemesis.config.interpolation import expand
from nemesis.config.models import NemesisConfig
from nemesis.dlq import Action, DeadLetterFilter, PageRequest, Status
from nemesis.dlq import postgres as dlq_postgres
from nemesis.dlq.postgres import open_postgres_dlq
from nemesis.errors import ConfigError, DlqError, DlqTimeout
from nemesis.postgres import describe, open_pool
from nemesis.testing import HandlerServer, LedgerEntry
from tests.conftest import REPO, Workspace, integration_yaml, stop_gracefully
from tests.postgres_server import PostgresServer, make_certificate
from tests.test_dlq_store import START, FakeClock, all_pages_after, letter

DAY = 86400.0


def _config(dsn: str, **fields: object) -> PostgresDlqConfig:
    return PostgresDlqConfig.model_validate({"dsn": dsn, **fields})


def _closed_port() -> int:
    """A port on 127.0.0.1 where nothing listens (free a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _with_password(dsn: str, password: str) -> str:
    url = urlsplit(dsn)
    return url._replace(netloc=f"{url.username}:{password}@{url.hostname}:{url.port}").geturl()


# --- replicas sharing one database --------------------------------------------------------


async def test_replicas_share_one_dlq_and_race_safely(postgres_dsn: str) -> None:
    clock = FakeClock()
    one = await open_postgres_dlq(_config(postgres_dsn), clock=clock)
    two = await open_postgres_dlq(_config(postgres_dsn), clock=clock)
    try:
        # The same message dead-lettered by two replicas at once: one row, both failures.
        first, second = letter(1, at=clock.time()), letter(1, attempts=2, at=clock.time() + 1)
        await asyncio.gather(*(one.put([first]) for _ in range(3)), two.put([second]))
        row = await two.get(first.id)
        assert row is not None
        assert sorted([row.attempts, *(p.attempts for p in row.history)]) == [1, 2]
        # Both requeue it at once: one of them changes it.
        changed = await asyncio.gather(
            one.mark_requeued([first.id], by="replica-1"),
            two.mark_requeued([first.id], by="replica-2"),
        )
        assert sorted(changed) == [0, 1]
        row = await one.get(first.id)
        assert row is not None
        assert (row.status, row.requeue_count) == (Status.REQUEUED, 1)
        # The audit log is one log, whoever writes it.
        await one.record_action(
            who="alice", action=Action.REQUEUE, integrations=["a"], count=1, description="x"
        )
        assert [r.who for r in (await two.actions()).rows] == ["alice"]
    finally:
        await one.close()
        await two.close()


async def test_retention_deletes_in_batches_and_zero_keeps_everything(
    postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nemesis.dlq.core as dlq_core

    monkeypatch.setattr(dlq_core, "DELETE_BATCH", 3)
    clock = FakeClock()
    kept = await open_postgres_dlq(
        _config(postgres_dsn, retention=0, table_prefix="kept_"), clock=clock
    )
    store = await open_postgres_dlq(_config(postgres_dsn, retention="1d"), clock=clock)
    try:
        for target in (store, kept):
            await target.put([letter(n, at=clock.time() - 2 * DAY) for n in range(10)])
            await target.put([letter(100, at=clock.time())])
        assert await store.enforce_retention() == 10
        assert [r.source_offset for r in (await store.query(DeadLetterFilter())).rows] == [100]
        assert [g.count for g in await store.groups(DeadLetterFilter())] == [1]
        assert await kept.enforce_retention() == 0
        assert await kept.count(DeadLetterFilter()) == 11
    finally:
        await store.close()
        await kept.close()


async def test_a_newer_schema_is_refused_and_an_open_store_is_only_read(postgres_dsn: str) -> None:
    store = await open_postgres_dlq(_config(postgres_dsn))
    await store.close()
    again = await open_postgres_dlq(_config(postgres_dsn))  # the tables exist: nothing to create
    await again.close()
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute("UPDATE nemesis_dlq_meta SET value = '99' WHERE key = 'schema_version'")
    finally:
        await conn.close()
    with pytest.raises(DlqError, match="schema version 99 is newer"):
        await open_postgres_dlq(_config(postgres_dsn))


async def test_a_role_without_the_right_to_create_tables_runs_on_tables_init_made(
    postgres_dsn: str,
) -> None:
    # As a deployment may do it: `nemesis init` as the owner, the replicas as a role with DML only.
    owner = await asyncpg.connect(postgres_dsn)
    role = f"replica_{uuid.uuid4().hex[:8]}"
    try:
        store = await open_postgres_dlq(_config(postgres_dsn))  # creates the tables
        await store.close()
        await owner.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'replica-pw'")
        await owner.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}"
        )
        url = urlsplit(postgres_dsn)
        dsn = url._replace(netloc=f"{role}:replica-pw@{url.hostname}:{url.port}").geturl()
        replica = await open_postgres_dlq(_config(dsn))
        try:
            await replica.put([letter(1)])
            assert (
                await replica.mark_requeued(await replica.select_ids(DeadLetterFilter(), 5), by="r")
                == 1
            )
            await replica.record_action(
                who="r", action=Action.REQUEUE, integrations=["a"], count=1, description="d"
            )
            assert await replica.enforce_retention(now=1e12) == 1
        finally:
            await replica.close()
        assert not await owner.fetchval("SELECT has_schema_privilege($1, 'public', 'CREATE')", role)
    finally:
        await owner.close()


async def test_text_search_reads_the_payload_bytes_by_token(postgres_dsn: str) -> None:
    # encode(payload, 'escape') writes byte 0xC1 as \301: "301" must not find it.
    store = await open_postgres_dlq(_config(postgres_dsn))
    try:
        await store.put([letter(1, payload=b"\xc1 \\path Stra\xc3\x9fe \x00 END", error="e")])

        async def found(text: str) -> bool:
            return bool((await store.query(DeadLetterFilter(text=text))).rows)

        assert not await found("301")
        assert await found("\\PATH")
        assert await found("straße")
        assert await found("end")
        assert not await found("\\\\")
    finally:
        await store.close()


async def test_text_search_stops_at_its_scan_bound_and_resumes(
    postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dlq_postgres, "TEXT_SCAN_ROWS", 10)
    store = await open_postgres_dlq(_config(postgres_dsn))
    try:
        needles = {3, 25, 26, 47}
        await store.put(
            [
                letter(n, payload=b"needle" if n in needles else b"hay", at=START + n)
                for n in range(50)
            ]
        )
        where = DeadLetterFilter(text="needle")
        first = await store.query(where, PageRequest(limit=50))
        assert [row.source_offset for row in first.rows] == [47]  # rows 49..40 examined
        assert first.next_cursor is not None
        rows = [*first.rows, *await all_pages_after(store, where, first.next_cursor)]
        assert [row.source_offset for row in rows] == [47, 26, 25, 3]
        assert await store.count(where) == 4  # counting is not bounded
        assert len(await store.select_ids(where, 100)) == 4
    finally:
        await store.close()


# --- configuration and errors --------------------------------------------------------------


def test_the_config_takes_a_dsn_or_fields_and_never_prints_the_password() -> None:
    secret = "s3cret-Pa55"
    config = _config(f"postgresql://app:{secret}@db.example.net:6432/events")
    assert config.location(".") == "postgres:db.example.net:6432/events public.nemesis_dlq_*"
    assert secret not in repr(config) + str(config.model_dump())
    fields = PostgresDlqConfig(host="db", user="app", password=secret, database="events")
    assert fields.address() == "db:5432/events"
    assert secret not in repr(fields)
    for bad in (
        {"dsn": f"mysql://app:{secret}@db/x"},
        {"dsn": f"postgresql://app:{secret}@db:notaport/x"},
        {"dsn": f"postgresql://app:{secret}@db/x", "password": secret},
        {},
        {"host": "db", "sslmode": "verify-full"},
        {"host": "db", "schema_name": "Robert'); DROP TABLE x;--"},
    ):
        with pytest.raises(ValidationError) as caught:
            PostgresDlqConfig.model_validate(bad)
        assert secret not in str(caught.value)


def test_a_bad_dsn_in_the_file_is_reported_at_its_field_without_the_password(
    tmp_path: Path,
) -> None:
    path = tmp_path / "nemesis.yaml"
    path.write_text("dlq:\n  kind: postgres\n  dsn: ${PG_DSN}\n")
    with pytest.raises(ConfigError) as caught:
        load_process_config(path, env={"PG_DSN": "postgresql://app:hunter22@db:x/events"})
    text = str(caught.value)
    assert "dlq.postgres.dsn" in text or "dlq.dsn" in text, text
    assert "hunter22" not in text


async def test_the_fields_reach_the_database_as_a_dsn_does(postgres_dsn: str) -> None:
    url = urlsplit(postgres_dsn)
    fields = PostgresDlqConfig(
        host=url.hostname,
        port=url.port or 5432,
        database=url.path.lstrip("/"),
        user=url.username,
        password=unquote(url.password or ""),
        schema_name="by_fields",
        table_prefix="",
    )
    store = await open_postgres_dlq(fields)
    try:
        await store.put([letter(1)])
    finally:
        await store.close()
    conn = await asyncpg.connect(postgres_dsn)
    try:
        assert await conn.fetchval("SELECT count(*) FROM by_fields.letters") == 1
    finally:
        await conn.close()


async def test_a_wrong_password_and_a_server_down_are_clear_errors(postgres_dsn: str) -> None:
    wrong = _with_password(postgres_dsn, "not-the-password")
    with pytest.raises(DlqError) as refused:
        await open_postgres_dlq(_config(wrong))
    host = urlsplit(postgres_dsn)
    assert f"the PostgreSQL DLQ at 127.0.0.1:{host.port}/" in str(refused.value)
    assert "password authentication failed" in str(refused.value)
    assert "not-the-password" not in str(refused.value)
    port = _closed_port()
    down = f"postgresql://app:pw-{port}@127.0.0.1:{port}/events"
    with pytest.raises(DlqError) as unreachable:
        await open_postgres_dlq(_config(down, connect_timeout_s=5))
    assert f"the PostgreSQL DLQ at 127.0.0.1:{port}/events: connect:" in str(unreachable.value)
    assert f"pw-{port}" not in str(unreachable.value)


def _postgres_config(workspace: Workspace, extra: str = "") -> None:
    workspace.write_config(
        "dlq:\n  kind: postgres\n  dsn: ${NEMESIS_TEST_PG_DSN}\n  connect_timeout_s: 5\n" + extra
    )


async def test_the_cli_names_the_store_when_it_cannot_reach_it(
    workspace: Workspace, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = _closed_port()
    monkeypatch.setenv("NEMESIS_TEST_PG_DSN", f"postgresql://app:pw-{port}@127.0.0.1:{port}/x")
    _postgres_config(workspace)
    workspace.write_integration("loyalty", integration_yaml("loyalty", "http://127.0.0.1:1/"))
    created = workspace.cli("topics", "create", "orders", "--partitions", "1")
    assert created.returncode == 0, created.stderr
    for command in (("dlq", "list"), ("run",), ("init",)):
        result = workspace.cli(*command)
        output = result.stdout + result.stderr
        assert result.returncode != 0, (command, output)
        assert f"the PostgreSQL DLQ at 127.0.0.1:{port}/x: connect:" in output, (command, output)
        assert "Traceback" not in output, (command, output)
        assert f"pw-{port}" not in output, (command, output)


# --- the whole path: run, dead-letter, requeue ----------------------------------------------


def _order(entry: LedgerEntry) -> str:
    return str(json.loads(entry.body)["id"])


async def _wait_for_rows(dsn: str, count: int) -> list[str]:
    """Ids of the dead letters, once there are ``count`` (bounded: 60 s)."""
    store = await open_postgres_dlq(_config(dsn))
    try:
        async with asyncio.timeout(60):
            while True:
                rows = (await store.query(DeadLetterFilter(), PageRequest(limit=50))).rows
                if len(rows) >= count:
                    return [row.id for row in rows]
                await asyncio.sleep(0.2)
    finally:
        await store.close()


async def test_run_dead_letters_and_the_cli_requeues_to_that_integration_only(
    workspace: Workspace, postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEMESIS_TEST_PG_DSN", postgres_dsn)
    _postgres_config(workspace)
    created = workspace.cli("topics", "create", "orders", "--partitions", "1")
    assert created.returncode == 0, created.stderr
    orders = workspace.root / "orders.jsonl"
    orders.write_text("".join(json.dumps({"id": f"order-{n}"}) + "\n" for n in range(3)))
    async with HandlerServer() as rejecting, HandlerServer() as other:
        # loyalty rejects order-1 once (a 4xx: dead-lettered at once); audit takes everything.
        rejecting.when(lambda e: _order(e) == "order-1", status=422, body="no city", times=1)
        workspace.write_integration("loyalty", integration_yaml("loyalty", rejecting.url))
        workspace.write_integration("audit", integration_yaml("audit", other.url))
        init = workspace.cli("init")
        assert init.returncode == 0, init.stdout + init.stderr
        assert "postgres:127.0.0.1:" in init.stdout
        published = workspace.cli("publish", "orders", "--file", str(orders), "--lines")
        assert published.returncode == 0, published.stderr
        proxy = await workspace.start("run")
        await rejecting.ledger.wait_until(lambda ledger: ledger.requests >= 3, timeout_s=60)
        await other.ledger.wait_for(3, timeout_s=60)
        [row_id] = await _wait_for_rows(postgres_dsn, 1)

        requeued = workspace.cli("dlq", "requeue", row_id, "--yes", "--by", "alice")
        assert requeued.returncode == 0, requeued.stdout + requeued.stderr
        assert "requeued 1 dead letter(s)" in requeued.stdout
        await rejecting.ledger.wait_for(3, timeout_s=60)  # order-1 is done now
        assert await stop_gracefully(proxy) == 0, workspace.logs()

        arrivals = [_order(e) for e in rejecting.ledger]
        assert sorted(arrivals) == ["order-0", "order-1", "order-1", "order-2"]
        assert sorted(_order(e) for e in other.ledger) == ["order-0", "order-1", "order-2"]

    listed = workspace.cli("dlq", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    [row] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert (row["id"], row["integration"], row["status"]) == (row_id, "loyalty", "requeued")
    store = await open_postgres_dlq(_config(postgres_dsn))
    try:
        [action] = (await store.actions()).rows
        assert (action.who, action.action.value, action.count) == ("alice", "requeue", 1)
    finally:
        await store.close()


# --- TLS ----------------------------------------------------------------------------------


async def _uses_tls(config: PostgresConnectionConfig) -> bool:
    translated = describe(config, "the PostgreSQL DLQ", DlqError, DlqTimeout)
    pool = await open_pool(config, translated)
    try:
        return bool(await pool.fetchval("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"))
    finally:
        await pool.close()


async def test_tls_verifies_the_server_against_the_ca_file(
    postgres_server: PostgresServer, postgres_dsn: str, tmp_path: Path
) -> None:
    def config(**fields: object) -> PostgresConnectionConfig:
        return PostgresConnectionConfig.model_validate({"dsn": postgres_dsn, **fields})

    trusted = str(postgres_server.ca_file)
    assert await _uses_tls(config(sslmode="verify-full", ssl_root_cert=trusted))
    assert await _uses_tls(config(sslmode="require"))
    assert not await _uses_tls(config(sslmode="disable"))
    store = await open_postgres_dlq(
        _config(postgres_dsn, sslmode="verify-full", ssl_root_cert=trusted)
    )
    await store.close()

    stranger, _ = make_certificate(tmp_path, "stranger")
    with pytest.raises(DlqError, match=r"the PostgreSQL DLQ at 127\.0\.0\.1:.*certificate verify"):
        await _uses_tls(config(sslmode="verify-ca", ssl_root_cert=str(stranger)))
    (tmp_path / "garbage.pem").write_text("not a certificate")
    with pytest.raises(DlqError, match=r"ssl_root_cert .*garbage\.pem: .+"):
        await _uses_tls(config(sslmode="verify-full", ssl_root_cert=str(tmp_path / "garbage.pem")))
    with pytest.raises(DlqError, match=r"ssl_root_cert .*missing\.pem: No such file"):
        await _uses_tls(config(sslmode="verify-full", ssl_root_cert=str(tmp_path / "missing.pem")))


async def test_a_statement_past_its_timeout_is_a_dlq_timeout_and_the_store_goes_on(
    postgres_dsn: str,
) -> None:
    store = await open_postgres_dlq(_config(postgres_dsn, statement_timeout_s=0.5))
    blocker = await asyncpg.connect(postgres_dsn)
    try:
        await store.put([letter(1)])
        [row_id] = await store.select_ids(DeadLetterFilter(), 10)
        locked = blocker.transaction()
        await locked.start()
        await blocker.execute("SELECT 1 FROM nemesis_dlq_letters FOR UPDATE")
        with pytest.raises(DlqTimeout, match=r"DLQ at 127\.0\.0\.1:\d+/\w+: mark 1 rows"):
            await store.mark_requeued([row_id], by="alice")
        await locked.rollback()
        assert await store.mark_requeued([row_id], by="alice") == 1
    finally:
        await blocker.close()
        await store.close()


async def test_a_closed_store_says_so(postgres_dsn: str) -> None:
    store = await open_postgres_dlq(_config(postgres_dsn))
    await store.close()
    await store.close()  # twice is fine
    with pytest.raises(
        DlqError, match=r"PostgreSQL DLQ at 127\.0\.0\.1:\d+/\w+: the store is closed"
    ):
        await store.count(DeadLetterFilter())


async def test_close_cuts_a_call_stuck_on_a_lock(
    postgres_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dlq_postgres, "CLOSE_TIMEOUT_S", 0.5)
    store = await open_postgres_dlq(_config(postgres_dsn, statement_timeout_s=600))
    blocker = await asyncpg.connect(postgres_dsn)
    try:
        await store.put([letter(1)])
        [row_id] = await store.select_ids(DeadLetterFilter(), 10)
        locked = blocker.transaction()
        await locked.start()
        await blocker.execute("SELECT 1 FROM nemesis_dlq_letters FOR UPDATE")
        stuck = asyncio.ensure_future(store.mark_requeued([row_id], by="alice"))
        async with asyncio.timeout(30):
            while not await blocker.fetchval(  # noqa: ASYNC110 - the server changes it
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            ):
                await asyncio.sleep(0.05)
        await store.close()  # does not wait for the stuck call
        with pytest.raises(DlqError, match="mark 1 rows requeued"):
            await stuck
        await locked.rollback()
    finally:
        await blocker.close()


async def test_connections_the_server_dropped_are_replaced(
    postgres_server: PostgresServer, postgres_dsn: str
) -> None:
    # As after a failover: every connection of the store is cut from the server's side.
    store = await open_postgres_dlq(_config(postgres_dsn, pool_size=2))
    admin = await postgres_server.admin()
    try:
        await store.put([letter(1)])
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            urlsplit(postgres_dsn).path.lstrip("/"),
        )
        failures: list[DlqError] = []
        counted = None
        for _ in range(3):  # a caller's retries: each dropped connection fails one call
            try:
                counted = await store.count(DeadLetterFilter())
                break
            except DlqError as exc:
                failures.append(exc)
        assert counted == 1
        assert all(type(f) in (DlqError, DlqTimeout) for f in failures)  # not the caller's
        assert all(str(f).startswith("the PostgreSQL DLQ at 127.0.0.1:") for f in failures)
    finally:
        await admin.close()
        await store.close()


def _postgres_block(key: str) -> str:
    """The example's commented-out ``# key:`` block of kind postgres, uncommented."""
    lines = (REPO / "nemesis.example.yaml").read_text().splitlines()
    start = next(
        n
        for n, line in enumerate(lines)
        if line.startswith(f"# {key}:") and lines[n + 1] == "#   kind: postgres"
    )
    block = [f"{key}:"]
    for line in lines[start + 1 :]:
        if not line.startswith("#  "):
            break
        block.append(line[2:])
    return "\n".join(block)


def test_the_example_postgres_blocks_validate_when_uncommented() -> None:
    dsn = "postgresql://app:pw@db.example.net:5432/events"
    env = {"NEMESIS_DLQ_DSN": dsn, "NEMESIS_STATE_DSN": dsn}
    text = _postgres_block("dlq") + "\n" + _postgres_block("state")
    expanded = expand(text, env=env)
    assert (expanded.unset, expanded.malformed) == ((), ())
    config = NemesisConfig.model_validate(yaml.safe_load(expanded.text))
    assert isinstance(config.dlq, PostgresDlqConfig)
    assert isinstance(config.state, PostgresStateConfig)
    assert config.dlq.address() == config.state.address() == "db.example.net:5432/events"


def test_a_process_on_other_kinds_never_loads_the_driver(tmp_path: Path) -> None:
    script = (
        "import asyncio, sys\n"
        "from nemesis.backends import open_backend, open_dlq\n"
        "from nemesis.config.models import NemesisConfig\n"
        f"config = NemesisConfig(data_dir={str(tmp_path)!r})\n"
        "async def main():\n"
        "    broker = await open_backend(config)\n"
        "    store = await open_dlq(config, broker=broker)\n"
        "    await store.close()\n"
        "    await broker.close()\n"
        "asyncio.run(main())\n"
        "import nemesis.cli\n"
        "assert 'asyncpg' not in sys.modules, sorted(m for m in sys.modules if 'asyncpg' in m)\n"
    )
    ran = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert ran.returncode == 0, ran.stderr
