"""The tail cache: what this broker just appended, so its own readers skip the file.

A reader that has caught up waits for the next append. When that append
comes through a writer of the same broker, the rows are already in memory:
handing them over directly saves the round trip to the read thread, which
is most of the in-process write-to-receive latency. Writes from other
processes come with their rows in their ring when they are small (``bells``)
and are added here too; bigger ones ring and are read from the file, and
polling catches a ring that was lost.

The cache only ever holds a *contiguous* run of offsets per partition, the
latest ones this broker wrote: an append that does not continue the run
(another process wrote in between) starts a new run. So whatever it returns
is exactly what the file holds at those offsets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# A row as ``log.read`` fetches it:
# (offset, value, key, metadata JSON, producer_id, seqno, created_at, written_at).
ReadRow = tuple[int, bytes, "str | None", "str | None", "str | None", "int | None", float, float]


def read_row(inserted: Sequence[Any]) -> ReadRow:
    """A row in ``log.append``'s insert layout, as ``log.read`` would fetch it back."""
    return (
        inserted[2],
        inserted[9],
        inserted[7],
        inserted[8],
        inserted[6],
        inserted[5],
        inserted[4],
        inserted[3],
    )


MAX_ROWS_PER_PARTITION = 1024
MAX_BYTES_PER_TOPIC = 8 * 1024 * 1024
MIN_BYTES_PER_PARTITION = 64 * 1024


@dataclass(slots=True, eq=False)
class _Run:
    base: int = 0  # offset of rows[0]
    rows: list[ReadRow] = field(default_factory=list)
    nbytes: int = 0

    def add(self, row: ReadRow) -> None:
        if self.rows and row[0] != self.base + len(self.rows):
            self.rows.clear()
            self.nbytes = 0
        if not self.rows:
            self.base = row[0]
        self.rows.append(row)
        self.nbytes += len(row[1])

    def trim(self, max_rows: int, max_bytes: int) -> None:
        # Cut a quarter at a time so trimming is not a list shift per append.
        while len(self.rows) > max_rows or (self.nbytes > max_bytes and len(self.rows) > 1):
            cut = max(1, len(self.rows) // 4)
            self.nbytes -= sum(len(row[1]) for row in self.rows[:cut])
            del self.rows[:cut]
            self.base += cut


class TailCache:
    """The latest rows this broker appended, per partition, bounded in rows and bytes."""

    def __init__(
        self,
        *,
        max_rows_per_partition: int = MAX_ROWS_PER_PARTITION,
        max_bytes_per_topic: int = MAX_BYTES_PER_TOPIC,
    ) -> None:
        self._max_rows = max_rows_per_partition
        self._max_bytes_per_topic = max_bytes_per_topic
        self._runs: dict[tuple[int, int], _Run] = {}

    def add(self, topic_id: int, partitions: int, inserted: Sequence[tuple[Any, ...]]) -> None:
        """Records committed rows, in the layout ``log.append`` inserted them."""
        max_bytes = max(MIN_BYTES_PER_PARTITION, self._max_bytes_per_topic // partitions)
        touched: set[_Run] = set()
        # Older rows of a big batch would be trimmed away at once: skip them
        # (a partition whose rows are skipped just restarts its run later).
        for row in inserted[-self._max_rows * partitions :]:
            key = (topic_id, row[1])
            run = self._runs.get(key)
            if run is None:
                run = self._runs[key] = _Run()
            run.add(read_row(row))
            touched.add(run)
        for run in touched:
            run.trim(self._max_rows, max_bytes)

    def extend(
        self, topic_id: int, partitions: int, rows: Mapping[int, Sequence[ReadRow]]
    ) -> frozenset[int]:
        """Records rows another process committed (its ring carried them), by partition.

        Returns the partitions whose rows continued the run held for them: a
        reader positioned in such a run finds there exactly what the file
        holds. Rows that start a run (nothing held yet, or a gap: a write
        whose ring carried no rows, or was lost) are kept as well, but the
        reader must read the file for what came before them.
        """
        max_bytes = max(MIN_BYTES_PER_PARTITION, self._max_bytes_per_topic // partitions)
        continued = []
        for partition, page in rows.items():
            if not page:
                continue
            key = (topic_id, partition)
            run = self._runs.get(key)
            if run is None:
                run = self._runs[key] = _Run()
            if run.rows and page[0][0] == run.base + len(run.rows):
                continued.append(partition)
            for row in page[-self._max_rows :]:
                run.add(row)
            run.trim(self._max_rows, max_bytes)
        return frozenset(continued)

    def get(self, topic_id: int, partition: int, position: int, limit: int) -> list[ReadRow]:
        """Up to ``limit`` rows from ``position`` on; empty unless the run holds ``position``."""
        run = self._runs.get((topic_id, partition))
        if run is None:
            return []
        index = position - run.base
        if not 0 <= index < len(run.rows):
            return []
        return run.rows[index : index + limit]

    def forget(self, topic_id: int) -> None:
        """Drops a topic's rows (the topic was dropped, or has no reader here any more)."""
        for key in [k for k in self._runs if k[0] == topic_id]:
            del self._runs[key]
