"""``nemesis run``'s own resources: what it opens is closed, however it fails to start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from nemesis import cli
from nemesis.config.models import NemesisConfig
from nemesis.errors import DlqError

INTEGRATION = """\
name: orders-to-loyalty
owners: [team-loyalty]
source: {topic: orders, consumer: loyalty}
target: {url: "http://127.0.0.1:9/events"}
"""


async def test_a_dlq_that_does_not_open_leaves_no_broker_open(tmp_path: Path) -> None:
    integrations = tmp_path / "integrations"
    integrations.mkdir()
    (integrations / "orders-to-loyalty.yaml").write_text(INTEGRATION)
    data = tmp_path / "data"
    (data / "dlq.db").mkdir(parents=True)  # a directory where the DLQ's file should be
    config = NemesisConfig.model_validate(
        {
            "data_dir": str(data),
            "integrations_dir": str(integrations),
            "pipelines_dir": str(tmp_path / "pipelines"),
        }
    )
    with pytest.raises(DlqError, match="unable to open"):
        await cli._run(config)
    # The broker that opened before the DLQ failed is closed: its housekeeping stopped
    # and its write-ahead log folded back into the file.
    left = [t for t in asyncio.all_tasks() if t.get_name().startswith("nemesis-housekeeping")]
    assert left == []
    assert (data / "nemesis.db").exists()
    assert not (data / "nemesis.db-wal").exists()
