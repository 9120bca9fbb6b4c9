"""Metric families: the lock-free loop families export what they counted."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from nemesis.metrics import Metrics, status_class


def test_loop_families_export_counts_and_cumulative_buckets() -> None:
    metrics = Metrics()
    metrics.deliveries.labels("orders", "delivered", "200").inc(3)
    metrics.deliveries.labels("orders", "retry", "503").inc()
    for seconds in (0.0004, 0.002, 0.002, 40.0):
        metrics.delivery_duration.labels("orders", "delivered").observe(seconds)
    metrics.delivery_duration.labels("orders", "retry").observe(5.0)  # a timeout, say
    families = {
        f.name: f
        for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
    }
    deliveries = {
        (s.labels["outcome"], s.labels["status"]): s.value
        for s in families["nemesis_deliveries"].samples
        if s.name == "nemesis_deliveries_total"
    }
    assert deliveries == {("delivered", "200"): 3.0, ("retry", "503"): 1.0}
    buckets = {
        s.labels["le"]: s.value
        for s in families["nemesis_delivery_duration_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["outcome"] == "delivered"
    }
    assert buckets["0.0005"] == 1.0
    assert buckets["0.0025"] == 3.0
    assert buckets["30.0"] == 3.0
    assert buckets["+Inf"] == 4.0
    total = metrics.registry.get_sample_value(
        "nemesis_delivery_duration_seconds_sum", {"integration": "orders", "outcome": "delivered"}
    )
    assert total == pytest.approx(40.0044)
    retried = metrics.registry.get_sample_value(
        "nemesis_delivery_duration_seconds_count", {"integration": "orders", "outcome": "retry"}
    )
    assert retried == 1.0


@pytest.mark.parametrize(
    "values",
    [
        [0.0031, 0.0042, 0.0049],  # one bucket: one update
        [0.0004, 0.003, 0.003, 7.0, 100.0],  # several
        [0.005, 0.005],  # on a bound
        [],
    ],
)
def test_observe_many_counts_as_observing_each(values: list[float]) -> None:
    one_by_one, at_once = (Metrics().delivery_age.labels("it", "main") for _ in range(2))
    for value in values:
        one_by_one.observe(value)
    at_once.observe_many(values)
    assert at_once.counts == one_by_one.counts
    assert at_once.sum == pytest.approx(one_by_one.sum)
    assert sum(at_once.counts) == len(values)


def test_wrong_label_count_is_refused() -> None:
    with pytest.raises(ValueError, match="takes labels"):
        Metrics().deliveries.labels("only-one")


def test_status_labels_stay_bounded() -> None:
    assert {status_class(s) for s in range(100, 600)} <= {
        "200",
        "202",
        "204",
        "400",
        "404",
        "408",
        "409",
        "422",
        "429",
        "500",
        "502",
        "503",
        "504",
        "1xx",
        "2xx",
        "3xx",
        "4xx",
        "5xx",
    }
    assert status_class(None) == "none"
