"""A record batch aiokafka cannot decode: which partition, which batch, what it had taken.

aiokafka decodes a partition's fetched batches lazily, inside ``getmany``.
A batch it cannot decode (a codec id it does not know, a codec whose
library is missing, compressed bytes that do not decompress, a CRC that
does not match) raises out of ``getmany`` whatever its partition, and
raises again at every call, since the partition's position stays before
it: one such batch would stop every partition of the reader. The failure
says neither the partition nor the batch, and the call loses what it had
taken out of the client's buffer before the bad batch: records of other
partitions, and the bad partition's records ahead of the batch.

``undecodable`` finds all three in the frames of the failure's traceback
(the client's record iterator, its ``getall`` and ``fetched_records``), so
the reader can hand those records out and stall the one partition. The
frames are aiokafka's internals: tests pin them against the installed
client, and a failure they do not match is ``None`` here (the reader then
fails, as any broker error does, and its flow restarts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any


@dataclass(frozen=True, slots=True)
class Undecodable:
    """The batch a ``getmany`` failed on, and the records the failed call had taken already."""

    topic: str
    partition: int
    offset: int  # the batch's first offset
    next_offset: int  # the offset after its last record (from the batch header)
    written_at: float | None  # the batch's newest record time (from its header), Unix seconds
    error: BaseException
    # Records the call took out of the client's buffer (positions moved past them): by
    # partition number, the failing partition's ones ahead of the batch included.
    taken: Mapping[int, Sequence[Any]]


def undecodable(exc: BaseException) -> Undecodable | None:
    """The batch ``exc`` (raised by ``getmany``) failed to decode; None for any other failure."""
    tb: TracebackType | None = exc.__traceback__
    culprit: Any = None
    batch: Any = None
    ahead: list[Any] = []
    drained: Mapping[Any, Sequence[Any]] = {}
    while tb is not None:
        frame = tb.tb_frame
        name = frame.f_code.co_name
        local = frame.f_locals
        if name == "fetched_records" and isinstance(local.get("drained"), dict):
            drained = local["drained"]
        elif name == "getall" and isinstance(local.get("ret_list"), list):
            ahead = local["ret_list"]
        elif name == "_unpack_records" and "next_batch" in local and "tp" in local:
            culprit, batch = local["tp"], local["next_batch"]
        tb = tb.tb_next
    if culprit is None or batch is None:
        return None
    try:
        offset, next_offset = int(batch.base_offset), int(batch.next_offset)
        topic, partition = str(culprit.topic), int(culprit.partition)
        newest = int(getattr(batch, "max_timestamp", -1) or -1)
    except (AttributeError, TypeError, ValueError):
        return None
    taken: dict[int, list[Any]] = {
        tp.partition: list(records) for tp, records in drained.items() if tp.topic == topic
    }
    if ahead:
        taken.setdefault(partition, []).extend(ahead)
    written_at = newest / 1000 if newest > 0 else None
    return Undecodable(topic, partition, offset, next_offset, written_at, exc, taken)
