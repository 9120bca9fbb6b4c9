"""The ``ydb`` broker backend: YDB topics through the official async SDK.

``open_ydb`` is the factory. ``YdbBroker`` owns one SDK driver and opens
admins, readers and writers over it; ``nemesis.dlq.ydb`` can share the
driver. How the port maps onto YDB (sessions, commits, pausing, writes),
and what was and was not run against a real server: ``README.md`` here.
"""

from nemesis.broker.ydb.admin import YdbAdmin
from nemesis.broker.ydb.broker import YdbBroker, open_ydb
from nemesis.broker.ydb.connection import credentials, driver_config, open_driver
from nemesis.broker.ydb.mapping import KEY_ITEM, YdbSession
from nemesis.broker.ydb.reader import ReaderStatistics, YdbReader
from nemesis.broker.ydb.writer import YdbWriter

__all__ = [
    "KEY_ITEM",
    "ReaderStatistics",
    "YdbAdmin",
    "YdbBroker",
    "YdbReader",
    "YdbSession",
    "YdbWriter",
    "credentials",
    "driver_config",
    "open_driver",
    "open_ydb",
]
