"""Stages and the compiled Pipeline: results, stage by stage, statistics, metrics, the registry."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import generate_latest

from nemesis.broker.port import Message
from nemesis.config.document import YamlDocument
from nemesis.metrics import Metrics
from nemesis.pipeline import (
    AUTO_DECODE,
    BuildContext,
    Envelope,
    Pipeline,
    PipelineResult,
    Stage,
    StageConfig,
    StageRegistry,
    StageType,
    Verdict,
    compile_stages,
    default_registry,
)
from nemesis.pipeline.compiled import StageMark
from nemesis.pipeline.compiler import metrics_meters
from tests.conftest import order_descriptor_set


def build(
    stages: list[Any],
    *,
    registry: StageRegistry | None = None,
    disabled: Collection[str] | None = None,
    holder: list[Collection[str]] | None = None,
    base_dir: Path | None = None,
    metrics: Metrics | None = None,
) -> Pipeline:
    cell = holder if holder is not None else [frozenset(disabled or ())]
    context = BuildContext(base_dir or Path(), "type", lambda: cell[0])
    document = YamlDocument("test.yaml", data={"stages": stages})
    pipeline, problems = compile_stages(
        document,
        ("stages",),
        registry=registry or default_registry(),
        context=context,
        name="test",
        **({"meters": metrics_meters(metrics, "orders")} if metrics else {}),
    )
    assert not problems, problems
    assert pipeline is not None
    return pipeline


def msg(
    payload: Any = None,
    *,
    raw: bytes | None = None,
    metadata: Mapping[str, str] | None = None,
    key: str | None = None,
) -> Message:
    value = raw if raw is not None else orjson.dumps(payload)
    return Message("orders", 0, 1, value, key=key, metadata=metadata or {})


def output(result: PipelineResult) -> Any:
    assert result.verdict is Verdict.PASS, result
    assert result.payload is not None
    return orjson.loads(result.payload)


# --- the Pipeline ------------------------------------------------------------------


def test_an_unchanged_message_is_delivered_as_its_own_bytes() -> None:
    pipeline = build([{"filter": {"match": {"city": "msk"}}}])
    message = msg(raw=b'{"city":  "msk", "spacing": "kept"}')
    result = pipeline.process(message)
    assert result.verdict is Verdict.PASS
    assert result.payload is message.value  # not re-encoded
    assert result.content_type is None


def test_a_changed_document_is_encoded_again_as_json() -> None:
    pipeline = build([{"transform": {"set": {"seen": True}}}])
    result = pipeline.process(msg({"city": "msk"}))
    assert output(result) == {"city": "msk", "seen": True}
    assert result.content_type == "application/json"


def test_the_empty_pipeline_passes_everything_untouched() -> None:
    pipeline = Pipeline.empty("none")
    message = msg(raw=b"\x00 not json")
    result = pipeline.process(message)
    assert (result.verdict, result.payload) == (Verdict.PASS, message.value)
    assert result.payload is message.value
    assert pipeline.is_empty
    assert pipeline.statistics().stages == ()


def test_filtered_results_name_the_stage() -> None:
    pipeline = build(
        [
            {"filter": {"name": "cities", "match": {"city": ["msk", "spb"]}}},
            {"filter": {"match": {"amount": {"gt": 1000}}}},
        ]
    )
    assert pipeline.process(msg({"city": "kzn", "amount": 5000})).stage == "cities"
    assert pipeline.process(msg({"city": "msk", "amount": 5})).stage == "1-filter"
    assert pipeline.labels == (AUTO_DECODE, "cities", "1-filter")


def test_undecodable_payloads_are_dead_letters_without_the_payload_in_the_error() -> None:
    pipeline = build([{"filter": {"match": {"city": "msk"}}}])
    result = pipeline.process(msg(raw=b'{"card": "4111 1111 1111 1111", oops'))
    assert result.verdict is Verdict.DEAD
    assert (result.reason, result.stage) == ("decode_error", AUTO_DECODE)
    assert result.error is not None
    assert "4111" not in result.error
    assert "not valid JSON" in result.error


def test_a_stage_bug_is_a_dead_letter_whose_text_keeps_only_the_exception_class() -> None:
    class BrokenConfig(StageConfig):
        pass

    def broken(config: BrokenConfig, context: BuildContext) -> Stage:
        def process(env: Envelope) -> bool:
            raise KeyError(env.document["secret"])

        return Stage(process, reads_payload=True)

    registry = default_registry().copy()
    registry.register(StageType("broken", BrokenConfig, broken))
    pipeline = build([{"broken": None}], registry=registry)
    result = pipeline.process(msg({"secret": "p@ssw0rd"}))
    assert (result.verdict, result.reason, result.stage) == (
        Verdict.DEAD,
        "pipeline_error",
        "0-broken",
    )
    assert result.error == "0-broken: unexpected KeyError"


def test_a_document_json_cannot_hold_is_a_dead_letter_not_a_crash() -> None:
    class HugeConfig(StageConfig):
        pass

    def huge(config: HugeConfig, context: BuildContext) -> Stage:
        def process(env: Envelope) -> bool:
            env.document = {"n": 2**70}
            env.changed = True
            return True

        return Stage(process, reads_payload=True)

    registry = default_registry().copy()
    registry.register(StageType("huge", HugeConfig, huge))
    result = build([{"huge": {}}], registry=registry).process(msg({}))
    assert (result.verdict, result.reason, result.stage) == (
        Verdict.DEAD,
        "pipeline_error",
        "0-huge",
    )
    assert result.error == "cannot encode the result as JSON: Integer exceeds 64-bit range"


def test_metadata_only_stages_run_before_the_payload_is_parsed() -> None:
    pipeline = build(
        [
            {"route_by_type": None},
            {"filter": {"match": {"$metadata.source": "web"}}},
            {"filter": {"match": {"city": "msk"}}},
        ],
        disabled=["order.test"],
    )
    assert pipeline.labels == ("0-route_by_type", "1-filter", AUTO_DECODE, "2-filter")
    garbage = b"\xff\xfe not json at all"
    skipped = pipeline.process(msg(raw=garbage, metadata={"type": "order.test"}))
    assert (skipped.verdict, skipped.stage) == (Verdict.FILTERED, "0-route_by_type")
    other_source = pipeline.process(msg(raw=garbage, metadata={"source": "mobile"}))
    assert other_source.stage == "1-filter"
    [_, _, decode, _] = pipeline.statistics().stages
    assert decode.processed == 0


def test_statistics_count_every_stage() -> None:
    pipeline = build([{"filter": {"name": "cities", "match": {"city": "msk"}}}])
    started = time.perf_counter()
    for city in ["msk", "spb", "kzn", "msk"]:
        pipeline.process(msg({"city": city}))
    pipeline.process(msg(raw=b"nope"))
    took_s = time.perf_counter() - started
    decode, cities = pipeline.statistics().stages
    assert (decode.stage, decode.type, decode.passed, decode.failed) == (
        AUTO_DECODE,
        "decode",
        4,
        1,
    )
    assert (cities.stage, cities.type) == ("cities", "filter")
    assert (cities.passed, cities.filtered, cities.failed, cities.processed) == (2, 2, 0, 4)
    assert cities.filtered_share == 0.5
    assert 0 < cities.mean_duration_s * cities.processed <= took_s  # measured, in the run


def test_stage_metrics_are_exported_on_the_metrics_registry() -> None:
    metrics = Metrics()
    pipeline = build([{"filter": {"name": "cities", "match": {"city": "msk"}}}], metrics=metrics)
    for city in ["msk", "spb", "kzn", "ekb"]:
        pipeline.process(msg({"city": city}))
    text = generate_latest(metrics.registry).decode()
    labels = 'integration="orders",outcome="filtered",stage="cities"'
    assert f"nemesis_stage_messages_total{{{labels}}} 3.0" in text
    assert (
        'nemesis_stage_messages_total{integration="orders",outcome="passed",stage="cities"} 1.0'
        in text
    )
    assert 'nemesis_stage_duration_seconds_count{integration="orders",stage="cities"} 4.0' in text
    inf_bucket = '{integration="orders",le="+Inf",stage="auto-decode"} 4.0'
    assert f"nemesis_stage_duration_seconds_bucket{inf_bucket}" in text
    # A pipeline built again (a reload) keeps counting on the same series.
    again = build([{"filter": {"name": "cities", "match": {"city": "msk"}}}], metrics=metrics)
    again.process(msg({"city": "kzn"}))
    assert (
        f"nemesis_stage_messages_total{{{labels}}} 4.0"
        in generate_latest(metrics.registry).decode()
    )
    metrics.forget_stages("orders")
    assert "stage=" not in generate_latest(metrics.registry).decode()


# --- transform -----------------------------------------------------------------------

EVENT = {
    "id": 7,
    "customer": {"id": "c-1", "phone": "+7 900", "name": "Иван"},
    "order": {"city": "msk", "amount": 10, "items": [{"sku": "a"}]},
}


def test_transform_keeps_drops_renames_and_sets_in_that_order() -> None:
    pipeline = build(
        [
            {
                "transform": {
                    "keep": ["id", "customer", "order.city", "order.missing"],
                    "drop": ["customer.phone"],
                    "rename": {"customer.name": "name", "id": "order.id"},
                    "set_from": {"customer_id": "customer.id", "event": "$metadata.type"},
                    "set": {"schema": 2, "tags": ["a"]},
                }
            }
        ]
    )
    result = pipeline.process(msg(EVENT, metadata={"type": "order.paid"}))
    assert output(result) == {
        "customer": {"id": "c-1"},
        "order": {"city": "msk", "id": 7},
        "name": "Иван",
        "customer_id": "c-1",
        "event": "order.paid",
        "schema": 2,
        "tags": ["a"],
    }


def test_set_from_reads_the_message_as_it_came_in_and_skips_what_is_missing() -> None:
    pipeline = build(
        [
            {
                "transform": {
                    "keep": ["id"],
                    "set_from": {"city": "order.city", "key": "$key", "x": "nope"},
                }
            }
        ]
    )
    assert output(pipeline.process(msg(EVENT, key="k-7"))) == {"id": 7, "city": "msk", "key": "k-7"}


def test_set_values_are_not_shared_between_messages() -> None:
    pipeline = build(
        [{"transform": {"set": {"tags": ["a"]}}}, {"transform": {"set": {"tags.extra": 1}}}]
    )
    result = pipeline.process(msg({}))
    assert result.verdict is Verdict.DEAD  # tags is a list: cannot set a field in it
    assert result.reason == "type_error"
    assert output(build([{"transform": {"set": {"tags": {"a": 1}}}}]).process(msg({}))) == {
        "tags": {"a": 1}
    }


def test_transform_of_a_payload_that_is_not_an_object() -> None:
    pipeline = build([{"transform": {"set": {"a": 1}}}])
    result = pipeline.process(msg([1, 2]))
    assert (result.verdict, result.reason) == (Verdict.DEAD, "type_error")
    assert result.error == "transform: the payload is an array, not an object"
    dropping = build([{"transform": {"set": {"a": 1}, "on_error": "drop"}}])
    assert dropping.process(msg("text")).verdict is Verdict.FILTERED


def test_a_transform_that_changes_nothing_keeps_the_original_bytes() -> None:
    pipeline = build([{"transform": {"drop": ["absent"], "rename": {"nope": "x"}}}])
    message = msg(raw=b'{"a":  1}')
    assert pipeline.process(message).payload is message.value


# --- cdc ---------------------------------------------------------------------------------


def cdc(**config: Any) -> Pipeline:
    return build([{"cdc": {"key_columns": ["id", "city"], **config}}])


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        # UPDATES mode: the changed columns.
        (
            {"key": [1, "msk"], "update": {"status": "paid"}},
            {"id": 1, "city": "msk", "status": "paid"},
        ),
        # NEW_IMAGE: the whole row.
        (
            {"key": [1, "msk"], "update": {}, "newImage": {"status": "paid", "amount": 5}},
            {"id": 1, "city": "msk", "status": "paid", "amount": 5},
        ),
        # KEYS_ONLY and virtual timestamps.
        ({"key": [2, "spb"], "update": {}, "ts": [1, 2]}, {"id": 2, "city": "spb"}),
    ],
)
def test_cdc_unwraps_changefeed_records(record: dict[str, Any], expected: dict[str, Any]) -> None:
    assert output(cdc().process(msg(record))) == expected


def test_cdc_skips_deletes_unless_asked_and_can_say_what_happened() -> None:
    erase = {"key": [1, "msk"], "erase": {}, "oldImage": {"status": "paid"}}
    assert cdc().process(msg(erase)).verdict is Verdict.FILTERED
    delivered = cdc(deletes="deliver", op_field="_op").process(msg(erase))
    assert output(delivered) == {"id": 1, "city": "msk", "status": "paid", "_op": "delete"}
    update = {"key": [1, "msk"], "update": {}, "newImage": {"s": 2}, "oldImage": {"s": 1}}
    both = cdc(op_field="_op", old_image_field="_old").process(msg(update))
    assert output(both) == {"id": 1, "city": "msk", "s": 2, "_op": "upsert", "_old": {"s": 1}}


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ([1, 2], "cdc: not a changefeed record: the payload is an array"),
        ({"key": [1], "update": {}}, "must be a list of 2 values (id, city), got 1 values"),
        ({"key": "1", "update": {}}, "got a string"),
        ({"key": [1, "msk"]}, "cdc: the record has neither update, reset nor erase"),
        ({"key": [1, "msk"], "update": {}, "newImage": [1]}, "the row image is an array"),
    ],
)
def test_cdc_dead_letters_what_is_not_a_changefeed_record(record: Any, error: str) -> None:
    result = cdc().process(msg(record))
    assert (result.verdict, result.reason) == (Verdict.DEAD, "decode_error")
    assert result.error is not None
    assert error in result.error
    assert cdc(on_error="drop").process(msg(record)).verdict is Verdict.FILTERED


def test_cdc_filters_resolved_timestamp_marks() -> None:
    assert cdc().process(msg({"resolved": [1, 2]})).verdict is Verdict.FILTERED


# --- route_by_type --------------------------------------------------------------------------


def test_route_by_type_reads_the_live_flags_on_every_message() -> None:
    holder: list[Collection[str]] = [frozenset()]
    pipeline = build([{"route_by_type": None}], holder=holder)
    created = msg(raw=b"{}", metadata={"type": "order.created"})
    assert pipeline.process(created).verdict is Verdict.PASS
    holder[0] = frozenset({"order.created"})  # flags.disabled_types changed at run time
    assert pipeline.process(created).verdict is Verdict.FILTERED
    assert pipeline.process(created).verdict is Verdict.FILTERED
    holder[0] = frozenset()
    assert pipeline.process(created).verdict is Verdict.PASS
    assert pipeline.process(msg(raw=b"{}")).verdict is Verdict.PASS  # no type: nothing to skip
    [stats] = pipeline.statistics().stages
    assert (stats.passed, stats.filtered) == (3, 2)
    assert stats.details == {"order.created": 2}


def test_route_by_type_can_read_the_type_from_the_payload_and_skip_fixed_types() -> None:
    pipeline = build([{"route_by_type": {"type_from": "meta.kind", "skip": ["test"]}}])
    assert pipeline.process(msg({"meta": {"kind": "test"}})).verdict is Verdict.FILTERED
    assert pipeline.process(msg({"meta": {"kind": "real"}})).verdict is Verdict.PASS
    assert pipeline.process(msg({"meta": {"kind": ["test"]}})).verdict is Verdict.PASS


# --- decode -----------------------------------------------------------------------------------


def test_decode_json_explicitly_and_drop_what_does_not_decode() -> None:
    strict = build([{"decode": {"format": "json"}}, {"filter": {"match": {"a": 1}}}])
    assert strict.labels == ("0-decode", "1-filter")
    assert strict.process(msg(raw=b"[")).reason == "decode_error"
    lenient = build([{"decode": {"on_error": "drop"}}, {"filter": {"match": {"a": 1}}}])
    assert lenient.process(msg(raw=b"[")).verdict is Verdict.FILTERED
    assert lenient.process(msg({"a": 1})).verdict is Verdict.PASS


def test_protobuf_without_the_package_is_a_clear_config_problem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "google.protobuf.descriptor_pb2", None)
    document = YamlDocument(
        "p.yaml",
        data={
            "stages": [
                {"decode": {"format": "protobuf", "descriptor_set": "x.pb", "message_type": "a.B"}}
            ]
        },
    )
    _, problems = compile_stages(
        document, ("stages",), registry=default_registry(), context=BuildContext()
    )
    assert [(p.field, p.message) for p in problems] == [
        (
            "stages[0].decode.format",
            "format: protobuf needs the protobuf package (pip install protobuf)",
        )
    ]


def test_protobuf_payloads_are_decoded_so_filters_work_on_them(tmp_path: Path) -> None:
    descriptors = order_descriptor_set(tmp_path)
    message_factory: Any = pytest.importorskip("google.protobuf.message_factory")
    pool_module: Any = pytest.importorskip("google.protobuf.descriptor_pool")
    descriptor_pb2: Any = pytest.importorskip("google.protobuf.descriptor_pb2")
    pool = pool_module.DescriptorPool()
    for proto in descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes()).file:
        pool.Add(proto)
    order_class = message_factory.GetMessageClass(pool.FindMessageTypeByName("shop.v1.Order"))
    pipeline = build(
        [
            {
                "decode": {
                    "format": "protobuf",
                    "descriptor_set": "orders.pb",
                    "message_type": "shop.v1.Order",
                }
            },
            {"filter": {"match": {"city": "msk", "amount_kop": {"gt": 100_000}}}},
        ],
        base_dir=tmp_path,
    )
    big = order_class(city="msk", amount_kop=150_000).SerializeToString()
    result = pipeline.process(msg(raw=big))
    assert result.verdict is Verdict.PASS
    assert result.payload == big  # unchanged: the original Protobuf bytes
    small = order_class(city="msk", amount_kop=5).SerializeToString()
    assert pipeline.process(msg(raw=small)).verdict is Verdict.FILTERED
    broken = pipeline.process(msg(raw=b"\xff\xff\xff\xff"))
    assert (broken.verdict, broken.reason) == (Verdict.DEAD, "decode_error")
    assert broken.error == "the payload is not a valid shop.v1.Order Protobuf message"


def test_protobuf_config_problems_name_the_field(tmp_path: Path) -> None:
    order_descriptor_set(tmp_path)
    (tmp_path / "junk.pb").write_bytes(b"\xff\xff")
    cases = {
        "missing.pb": ("descriptor_set", "cannot read"),
        "junk.pb": ("descriptor_set", "is not a usable descriptor set"),
    }
    for file, (field, text) in cases.items():
        config = {"format": "protobuf", "descriptor_set": file, "message_type": "shop.v1.Order"}
        problems = _problems([{"decode": config}], tmp_path)
        assert [p.field for p in problems] == [f"stages[0].decode.{field}"]
        assert text in problems[0].message
    config = {"format": "protobuf", "descriptor_set": "orders.pb", "message_type": "shop.Order"}
    [problem] = _problems([{"decode": config}], tmp_path)
    assert problem.message.endswith("(it has: shop.v1.Order)")


def _problems(stages: list[Any], base_dir: Path) -> list[Any]:
    document = YamlDocument("p.yaml", data={"stages": stages})
    _, problems = compile_stages(
        document, ("stages",), registry=default_registry(), context=BuildContext(base_dir)
    )
    return problems


# --- expr -----------------------------------------------------------------------------------


def test_expr_keeps_messages_the_expression_accepts() -> None:
    pytest.importorskip("jmespath")
    pipeline = build([{"expr": {"jmespath": "length(items[?price > `100`]) > `1`"}}])
    assert (
        pipeline.process(msg({"items": [{"price": 150}, {"price": 200}]})).verdict is Verdict.PASS
    )
    assert pipeline.process(msg({"items": [{"price": 150}]})).verdict is Verdict.FILTERED
    # A function given the wrong type: no match, or a dead letter without the value.
    assert pipeline.process(msg({"items": "secret"})).verdict is Verdict.FILTERED
    strict = build([{"expr": {"jmespath": "length(items) > `0`", "on_error": "dead_letter"}}])
    result = strict.process(msg({"items": 12345}))
    assert (result.verdict, result.reason) == (Verdict.DEAD, "type_error")
    assert result.error is not None
    assert "12345" not in result.error


def test_expr_over_the_whole_message_and_jmespath_truthiness() -> None:
    pytest.importorskip("jmespath")
    pipeline = build(
        [{"expr": {"jmespath": "metadata.type == 'a' && payload.n", "input": "message"}}]
    )
    assert (
        pipeline.process(msg({"n": 0}, metadata={"type": "a"})).verdict is Verdict.PASS
    )  # 0 is true
    assert pipeline.process(msg({"n": []}, metadata={"type": "a"})).verdict is Verdict.FILTERED
    assert pipeline.process(msg({"n": 1}, metadata={"type": "b"})).verdict is Verdict.FILTERED


def test_expr_problems_at_load_time(monkeypatch: pytest.MonkeyPatch) -> None:
    if "jmespath" in sys.modules or _importable("jmespath"):
        [problem] = _problems([{"expr": {"jmespath": "a ||| b"}}], Path())
        assert problem.field == "stages[0].expr.jmespath"
        assert problem.message.startswith("invalid JMESPath expression")
    monkeypatch.setitem(sys.modules, "jmespath", None)
    [problem] = _problems([{"expr": {"jmespath": "a"}}], Path())
    assert problem.message == "the expr stage needs the jmespath package (pip install jmespath)"


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


# --- the registry ---------------------------------------------------------------------------


def test_registries_are_values_tests_can_copy_or_start_empty() -> None:
    first, second = default_registry(), default_registry()
    assert first is not second
    assert first.names() == ["cdc", "decode", "expr", "filter", "route_by_type", "transform"]
    copy = first.copy()

    class NoopConfig(StageConfig):
        pass

    copy.register(StageType("noop", NoopConfig, lambda config, context: Stage(lambda env: True)))
    assert "noop" in copy
    assert "noop" not in first
    with pytest.raises(ValueError, match="already registered"):
        copy.register(
            StageType("noop", NoopConfig, lambda config, context: Stage(lambda env: True))
        )
    empty = StageRegistry()
    document = YamlDocument("p.yaml", data={"stages": [{"filter": {"match": {"a": 1}}}]})
    _, problems = compile_stages(document, ("stages",), registry=empty, context=BuildContext())
    assert [p.message for p in problems] == [
        "unknown stage type 'filter' (no stage types are registered)"
    ]


def test_marks_name_each_stage_that_ran_in_order_with_its_own_outcome() -> None:
    pipeline = build(
        [
            {"transform": {"name": "trim", "drop": ["card"]}},
            {"filter": {"name": "big", "match": {"amount": {"gt": 100}}}},
            {"transform": {"name": "same", "drop": ["absent"]}},
        ]
    )
    marks: list[StageMark] = []
    result = pipeline.process(msg({"amount": 500, "card": "4111"}), marks)
    # A stage after one that changed the document changed nothing itself...
    assert [(m.stage, m.outcome) for m in marks] == [
        (AUTO_DECODE, "passed"),
        ("trim", "transformed"),
        ("big", "passed"),
        ("same", "passed"),
    ]
    assert all(m.started <= m.ended for m in marks)
    assert all(a.ended <= b.started for a, b in itertools.pairwise(marks))
    # ...and the document is still encoded again, as without marks.
    assert result == pipeline.process(msg({"amount": 500, "card": "4111"}))
    assert result.payload is not None
    assert orjson.loads(result.payload) == {"amount": 500}
    marks.clear()
    assert pipeline.process(msg({"amount": 5}), marks).verdict is Verdict.FILTERED
    assert [(m.stage, m.outcome) for m in marks][-1] == ("big", "filtered")
    marks.clear()
    refused = pipeline.process(Message("orders", 0, 1, b"{"), marks)
    assert (refused.verdict, refused.stage) == (Verdict.DEAD, AUTO_DECODE)
    assert [(m.stage, m.outcome) for m in marks] == [(AUTO_DECODE, "error")]
