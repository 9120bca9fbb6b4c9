"""The ``embedded`` broker backend: a durable topic log in one SQLite file.

Several processes on one machine may share the file: writers serialize on
SQLite's write lock, and readers of one consumer split the partitions
through leases with expiry and heartbeats (``leases``), rebalancing when a
reader joins, leaves or dies. A writer wakes the readers of its own process
directly (``tail``) and rings those of other processes through a datagram
socket (``bells``); polling the file is the fallback. ``open_embedded`` is
the factory.
"""

from nemesis.broker.embedded.broker import (
    BellStatistics,
    EmbeddedAdmin,
    EmbeddedBroker,
    EmbeddedWriter,
    open_embedded,
)
from nemesis.broker.embedded.leases import fair_share
from nemesis.broker.embedded.reader import (
    EmbeddedReader,
    EmbeddedSession,
    PartitionStatistics,
    ReaderStatistics,
    Wakeups,
)

__all__ = [
    "BellStatistics",
    "EmbeddedAdmin",
    "EmbeddedBroker",
    "EmbeddedReader",
    "EmbeddedSession",
    "EmbeddedWriter",
    "PartitionStatistics",
    "ReaderStatistics",
    "Wakeups",
    "fair_share",
    "open_embedded",
]
