"""Sizing counts the rate that reaches the handler, not the rate written to the topic."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nemesis.runtime.sizing import LiveSizing


def size(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nemesis", "size", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    "load", [["--rps", "11000", "--handler-rps", "2000"], ["--rps", "10000", "--pass-rate", "0.2"]]
)
def test_nemesis_size_sizes_for_what_the_filter_passes(load: list[str]) -> None:
    sized = size("--latency-ms", "50", *load)
    assert sized.returncode == 0, sized.stderr
    assert "  workers: 150\n" in sized.stdout
    assert "the pipeline passes 2000/s to the handler" in sized.stdout


def test_nemesis_size_without_a_filter_sizes_for_the_written_rate() -> None:
    sized = size("--rps", "11000", "--latency-ms", "50")
    assert "  workers: 825\n" in sized.stdout


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--pass-rate", "1.5"], "between 0 and 1"),
        (["--pass-rate", "0.5", "--handler-rps", "10"], "not allowed with argument"),
    ],
)
def test_nemesis_size_refuses_a_share_that_is_not_one(args: list[str], error: str) -> None:
    sized = size("--rps", "100", "--latency-ms", "50", *args)
    assert sized.returncode == 2
    assert error in sized.stderr


def test_live_sizing_uses_the_share_the_pipeline_passed() -> None:
    sizing = LiveSizing()
    # 60 s of 11,000 messages/s written and read, 2,000/s passed, 50 ms per delivery.
    for second in range(61):
        sizing.sample(
            float(second),
            attempted=2000 * second,
            requests=2000 * second,
            request_seconds=0.05 * 2000 * second,
            produced=11_000 * second,
            read=11_000 * second,
        )
    estimate = sizing.estimate()
    assert estimate is not None
    assert estimate.pass_ratio == pytest.approx(2000 / 11_000)
    assert estimate.sizing.workers == 150


def test_live_sizing_still_sizes_for_a_backlog_the_pipeline_passes_whole() -> None:
    """Delivering 1,000/s of 3,000 written (all passing): sized for the 3,000."""
    sizing = LiveSizing()
    for second in range(11):
        sizing.sample(
            float(second),
            attempted=1000 * second,
            requests=1000 * second,
            request_seconds=0.05 * 1000 * second,
            produced=3000 * second,
            read=1000 * second,
        )
    estimate = sizing.estimate()
    assert estimate is not None
    assert estimate.sizing.workers == 225
