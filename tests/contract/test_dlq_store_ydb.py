"""The DLQ store contract on YDB: the cases of ``tests/test_dlq_store.py``, run again here.

The cases are written once, in ``tests/test_dlq_store.py``, over its
``store`` fixture (they run there on the sqlite store). Every case that
takes ``store`` is collected here too, with a ``store`` that is the YDB
store in a directory of its own, so a case added there runs on YDB without
being written twice. Without ``NEMESIS_YDB_ENDPOINT`` they are reported as
skipped, with the reason.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator

import pytest

from nemesis.config.models import YdbBackendConfig, YdbDlqConfig
from nemesis.dlq import DeadLetterStore
from nemesis.dlq.ydb import open_ydb_dlq
from tests import test_dlq_store as cases
from tests.contract.conftest import drop_everything, needs_ydb, ydb_config

pytestmark = pytest.mark.timeout(120)

CONTRACT_CASES = {
    name: case
    for name, case in vars(cases).items()
    if name.startswith("test_") and "store" in inspect.signature(case).parameters
}
globals().update(CONTRACT_CASES)


@pytest.fixture
def clock() -> cases.FakeClock:
    return cases.FakeClock()


@pytest.fixture(params=[pytest.param("ydb", marks=needs_ydb)])
async def store(
    request: pytest.FixtureRequest, clock: cases.FakeClock
) -> AsyncIterator[DeadLetterStore]:
    config = ydb_config(request.node.name)
    assert isinstance(config.dlq, YdbDlqConfig)
    assert isinstance(config.backend, YdbBackendConfig)
    opened = await open_ydb_dlq(config.dlq, connection=config.backend, clock=clock)
    try:
        yield opened
    finally:
        await opened.close()
        await drop_everything(config)


def test_the_contract_cases_are_collected() -> None:
    assert len(CONTRACT_CASES) >= 15
