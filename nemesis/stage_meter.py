"""The pipeline's own counters: plain numbers, read by ``nemesis.metrics`` at scrape time.

Apart from ``nemesis.metrics`` so that compiling a pipeline (``nemesis validate``)
does not load prometheus_client.
"""

from __future__ import annotations

# Pipeline stages take microseconds, not the milliseconds of a delivery.
STAGE_BUCKETS_S = (
    0.000001,
    0.0000025,
    0.000005,
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.005,
    0.025,
    0.1,
)


class StageMeter:
    """Counts and times one pipeline stage of one integration with plain numbers.

    The pipeline's hot path updates these attributes directly: a
    prometheus_client child costs about 1 us per ``inc`` and 2 us per
    ``observe`` (a lock each), more than a compiled filter takes. The
    ``nemesis_stage_*`` families are built from meters at scrape time.
    ``buckets[i]`` counts durations up to ``STAGE_BUCKETS_S[i]`` (the last
    one: above every bound); they are not cumulative. Every message leaving
    the stage is timed once, so the buckets also count the messages: passed
    is what was neither filtered nor failed (one increment less per message).
    """

    __slots__ = ("buckets", "failed", "filtered", "seconds")

    def __init__(self) -> None:
        self.filtered = 0
        self.failed = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(STAGE_BUCKETS_S) + 1)

    @property
    def processed(self) -> int:
        return sum(self.buckets)

    @property
    def passed(self) -> int:
        return self.processed - self.filtered - self.failed
