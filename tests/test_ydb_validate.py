"""``nemesis validate`` refuses consumer names a YDB server refuses, where the backend is YDB.

The server's ``AddReadRuleToConfig`` (ydb-platform/ydb
``ydb/services/lib/actors/pq_schema_actor.cpp``) answers BAD_REQUEST
"consumer '...' has illegal symbols" to a consumer name with ``/`` or ``|``;
the admin fake (``tests/test_ydb_admin.py``) answers the same. The real CLI
runs in a subprocess on a repository with a ``nemesis.yaml`` of each kind.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest
from ydb import TopicClientAsyncIO

from nemesis.backends.ydb import YdbBackendConfig
from nemesis.broker.port import ConsumerSpec
from nemesis.broker.ydb import YdbAdmin
from nemesis.errors import BrokerError
from tests.test_ydb_admin import TopicService

YDB = (
    "backend:\n  kind: ydb\n  endpoint: grpc://localhost:2136\n  database: /local\n"
    "dlq:\n  kind: ydb\nstate:\n  kind: ydb\n"
)
EMBEDDED = "backend:\n  kind: embedded\n"
INTEGRATION = (
    "name: orders-to-crm\n"
    "owners: [team-crm]\n"
    "source:\n"
    "  topic: orders\n"
    "  consumer: crm/orders\n"
    "target:\n"
    "  url: 'http://crm.svc/events'\n"
)


def validate(root: Path, process: str) -> subprocess.CompletedProcess[str]:
    (root / "nemesis.yaml").write_text(process + "integrations_dir: integrations\n")
    (root / "integrations").mkdir(exist_ok=True)
    (root / "integrations" / "orders-to-crm.yaml").write_text(INTEGRATION)
    return subprocess.run(
        [sys.executable, "-m", "nemesis", "validate", "nemesis.yaml", "integrations"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_validate_refuses_a_slash_in_a_consumer_name_on_ydb(tmp_path: Path) -> None:
    result = validate(tmp_path, YDB)
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        "integrations/orders-to-crm.yaml:5: source.consumer: YDB refuses '/' in a consumer"
        " name ('crm/orders')"
    ) in result.stdout
    assert "(backend ydb in nemesis.yaml)" in result.stdout


def test_validate_takes_it_where_the_backend_does(tmp_path: Path) -> None:
    result = validate(tmp_path, EMBEDDED)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_ydb_backend_names_both_characters_the_server_refuses() -> None:
    config = YdbBackendConfig(endpoint="grpc://localhost:2136", database="/local")
    assert config.consumer_name_problem("crm.orders-v2_x") is None
    problem = config.consumer_name_problem("a|b/c")
    assert problem is not None
    assert "'/' and '|'" in problem


async def test_the_servers_refusal_reaches_the_caller_naming_the_consumer() -> None:
    service = TopicService()
    admin = YdbAdmin(
        cast(TopicClientAsyncIO, service),
        service.list_directory,
        make_directory=service.make_directory,
        database="/local",
        directory="",
        default_retention_s=0,
        timeout_s=1.0,
    )
    await admin.create_topic("orders", partitions=1)
    with pytest.raises(BrokerError, match=r"add consumer crm/orders to orders: .*illegal symbols"):
        await admin.add_consumer("orders", ConsumerSpec("crm/orders"))
