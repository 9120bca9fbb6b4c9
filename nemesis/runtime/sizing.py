"""How many workers an integration needs: ``N = R x T`` with headroom (Little's law).

``R`` messages per second at ``T`` seconds per delivery keep ``R x T``
deliveries in flight on average; workers are concurrent deliveries, so that
is the worker count, raised by a headroom for bursts and slow tails, and
divided by the batch size when each request carries a batch. The buffer
(messages read but not done) must cover every worker's batch in flight plus
one batch per worker waiting, so no worker idles while the intake reads.

The rate that counts is the one that reaches the handler: a pipeline that
passes 2,000 of 11,000 messages a second needs workers for 2,000 (the rest
are filtered in microseconds, without a worker). ``nemesis size`` prints the
figure for a planned load (``--pass-rate`` or ``--handler-rps`` for a
filtering pipeline); ``LiveSizing`` works it out from what a running
integration measures: the demand (the faster of what the integration
finishes and what producers write times the share its pipeline has passed)
and the mean delivery time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Final

DEFAULT_HEADROOM: Final = 1.5
MAX_WORKERS: Final = 4096  # DeliveryConfig.workers' bound
MIN_BUFFER: Final = 100
# How far back the live figure looks, and how much of that it needs first.
WINDOW_S: Final = 60.0
MIN_WINDOW_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class Sizing:
    """Workers and buffer for a load, with the numbers they came from."""

    rps: float
    latency_s: float
    batch_size: int
    headroom: float
    in_flight: float  # R x T: messages in flight on average
    workers: int  # what delivery.workers should be
    buffer: int  # what delivery.buffer should be at least
    capped: bool  # the load needs more than MAX_WORKERS: batch, or split the integration


def size_for(
    rps: float,
    latency_s: float,
    *,
    batch_size: int = 1,
    headroom: float = DEFAULT_HEADROOM,
) -> Sizing:
    """The worker count and buffer for ``rps`` messages per second at ``latency_s`` each."""
    if rps < 0 or latency_s < 0:
        raise ValueError("rate and latency cannot be negative")
    if batch_size < 1:
        raise ValueError("a batch holds at least one message")
    if headroom < 1:
        raise ValueError("headroom is a factor of at least 1")
    in_flight = rps * latency_s
    needed = max(1, math.ceil(in_flight * headroom / batch_size))
    workers = min(needed, MAX_WORKERS)
    buffer = max(MIN_BUFFER, 2 * workers * batch_size)
    return Sizing(
        rps=rps,
        latency_s=latency_s,
        batch_size=batch_size,
        headroom=headroom,
        in_flight=in_flight,
        workers=workers,
        buffer=buffer,
        capped=needed > MAX_WORKERS,
    )


def handler_rate(
    rps: float, *, pass_rate: float | None = None, handler_rps: float | None = None
) -> float:
    """The rate that reaches the handler: given, or the written rate times the share passed."""
    if handler_rps is not None:
        if pass_rate is not None:
            raise ValueError("give the share that passes or the handler's rate, not both")
        if handler_rps < 0:
            raise ValueError("rate and latency cannot be negative")
        return handler_rps
    if pass_rate is None:
        return rps
    if not 0 <= pass_rate <= 1:
        raise ValueError(f"the share that passes is between 0 and 1, not {pass_rate:g}")
    return rps * pass_rate


def describe(sizing: Sizing) -> str:
    """The figure and how it was reached, for a terminal."""
    lines = [
        f"load:      {sizing.rps:g} messages/s at {sizing.latency_s * 1000:g} ms per delivery",
        f"in flight: R x T = {sizing.in_flight:g} messages on average",
        f"workers:   ceil({sizing.in_flight:g} x {sizing.headroom:g} headroom"
        + (f" / batch {sizing.batch_size}" if sizing.batch_size > 1 else "")
        + f") = {sizing.workers}",
        f"buffer:    {sizing.buffer} (2 x workers x batch: one batch in flight and one waiting"
        f" per worker, at least {MIN_BUFFER})",
        "",
        "delivery:",
        f"  workers: {sizing.workers}",
        f"  buffer: {sizing.buffer}",
    ]
    if sizing.batch_size > 1:
        lines.append(f"  batch: {{size: {sizing.batch_size}}}")
    if sizing.capped:
        lines += [
            "",
            f"note: the load needs more than {MAX_WORKERS} workers: deliver in batches"
            " (--batch-size) or make the handler faster.",
        ]
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class _Sample:
    at: float  # monotonic
    attempted: int
    requests: int
    request_seconds: float
    produced: int | None  # the source topic's end offsets summed
    read: int | None  # messages the runner read (before the pipeline)


class LiveSizing:
    """The sizing figure from measurements of one running integration, over a sliding window."""

    def __init__(self, *, window_s: float = WINDOW_S, headroom: float = DEFAULT_HEADROOM) -> None:
        self._window_s = window_s
        self._headroom = headroom
        self._samples: deque[_Sample] = deque()

    def sample(
        self,
        at: float,
        *,
        attempted: int,
        requests: int,
        request_seconds: float,
        produced: int | None,
        read: int | None = None,
    ) -> None:
        """Records the cumulative counters at monotonic time ``at``."""
        samples = self._samples
        if samples and (
            attempted < samples[-1].attempted
            or requests < samples[-1].requests
            or (read is not None and read < (samples[-1].read or 0))
        ):
            samples.clear()  # the runner restarted: its counters began again
        samples.append(_Sample(at, attempted, requests, request_seconds, produced, read))
        while len(samples) > 2 and at - samples[1].at >= self._window_s:
            samples.popleft()

    def estimate(self) -> LiveEstimate | None:
        """The figure, once the window holds enough time and at least one delivery."""
        if len(self._samples) < 2:
            return None
        first, last = self._samples[0], self._samples[-1]
        elapsed = last.at - first.at
        requests = last.requests - first.requests
        if elapsed < MIN_WINDOW_S or requests <= 0:
            return None
        attempted = last.attempted - first.attempted
        delivered_rps = attempted / elapsed
        produced_rps = None
        if first.produced is not None and last.produced is not None:
            produced_rps = max(last.produced - first.produced, 0) / elapsed
        latency_s = (last.request_seconds - first.request_seconds) / requests
        batch = max(1, round(attempted / requests))
        pass_ratio = None
        if first.read is not None and last.read is not None and last.read > first.read:
            # Retries in place count again in ``attempted``: a ratio above 1 is all passing.
            pass_ratio = min(1.0, attempted / (last.read - first.read))
        handler_bound = None if produced_rps is None else produced_rps * (pass_ratio or 1.0)
        demand = max(delivered_rps, handler_bound or 0.0)
        return LiveEstimate(
            delivered_rps=delivered_rps,
            produced_rps=produced_rps,
            pass_ratio=pass_ratio,
            window_s=elapsed,
            sizing=size_for(demand, latency_s, batch_size=batch, headroom=self._headroom),
        )


@dataclass(frozen=True, slots=True)
class LiveEstimate:
    """The measured rates and the sizing they imply."""

    delivered_rps: float  # messages the integration sent to its handler
    produced_rps: float | None  # messages written to its source topic
    pass_ratio: float | None  # of the messages read, the share the pipeline passed
    window_s: float
    sizing: Sizing
