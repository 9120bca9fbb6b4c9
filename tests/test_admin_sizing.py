"""`nemesis size` and the live sizing figure."""

from __future__ import annotations

import pytest

from nemesis.cli import main
from nemesis.runtime.sizing import MAX_WORKERS, LiveSizing, size_for


def test_workers_are_rate_times_latency_with_headroom() -> None:
    figure = size_for(2000, 0.08)
    assert figure.in_flight == pytest.approx(160)
    assert (figure.workers, figure.buffer) == (240, 480)
    batched = size_for(2000, 0.08, batch_size=10)
    assert (batched.workers, batched.buffer) == (24, 480)
    assert size_for(0, 0.1).workers == 1
    capped = size_for(1_000_000, 1.0)
    assert capped.capped
    assert capped.workers == MAX_WORKERS
    with pytest.raises(ValueError, match="headroom"):
        size_for(10, 0.1, headroom=0.5)


def test_the_command_prints_the_figure_and_the_yaml(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["size", "--rps", "500", "--latency-ms", "40", "--headroom", "2"]) == 0
    out = capsys.readouterr().out
    assert "R x T = 20 messages" in out
    assert "  workers: 40" in out
    assert "  buffer: 100" in out
    assert main(["size", "--rps", "500", "--latency-ms", "-4"]) == 2


def test_the_live_figure_uses_the_faster_of_demand_and_deliveries() -> None:
    live = LiveSizing(window_s=60)
    assert live.estimate() is None
    live.sample(0.0, attempted=0, requests=0, request_seconds=0.0, produced=0)
    live.sample(10.0, attempted=1000, requests=1000, request_seconds=50.0, produced=4000)
    estimate = live.estimate()
    assert estimate is not None
    assert estimate.delivered_rps == 100
    assert estimate.produced_rps == 400
    # 400 messages/s at 50 ms: 20 in flight, 30 workers with headroom.
    assert estimate.sizing.workers == 30
    live.sample(20.0, attempted=5, requests=5, request_seconds=0.1, produced=4100)  # restarted
    assert live.estimate() is None
