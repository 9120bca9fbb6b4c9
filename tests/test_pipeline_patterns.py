"""Filter patterns: every operator, odd data, validation, and property tests against a reference."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from nemesis.broker.port import Message
from nemesis.pipeline import PatternError, StageFailure, compile_pattern
from nemesis.pipeline.patterns import MAX_DEPTH, OnTypeError

ORDER = {
    "id": 7,
    "type": "order.created",
    "paid": True,
    "coupon": None,
    "order": {"city": "msk", "amount": 1500, "items": [{"sku": "tea", "qty": 2}]},
    "tags": ["a", "b"],
}


def message(
    metadata: Mapping[str, str] | None = None, key: str | None = "k-1", topic: str = "orders"
) -> Message:
    return Message(topic, 3, 42, b"", key=key, metadata=metadata or {})


def matches(
    pattern: Any,
    document: Any = ORDER,
    msg: Message | None = None,
    on_type_error: OnTypeError = "no_match",
) -> bool:
    compiled = compile_pattern(pattern, on_type_error=on_type_error)
    result = compiled.match(document, msg or message())
    assert result is True or result is False
    return result


def problems(pattern: Any) -> list[tuple[tuple[Any, ...], str]]:
    with pytest.raises(PatternError) as caught:
        compile_pattern(pattern)
    return [(issue.path, issue.message) for issue in caught.value.issues]


# --- operators ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ({"type": "order.created"}, True),
        ({"type": "order.paid"}, False),
        ({"id": 7}, True),
        ({"id": 7.0}, True),  # JSON numbers: 7 == 7.0
        ({"id": "7"}, False),  # a string is not a number
        ({"paid": True}, True),
        ({"paid": 1}, False),  # true is not 1
        ({"id": True}, False),  # nor is 7 true
        ({"coupon": None}, True),
        ({"paid": None}, False),
        ({"order.city": {"equals": "msk"}}, True),
        ({"order": "msk"}, False),  # an object equals no scalar
    ],
)
def test_equals(pattern: dict[str, Any], expected: bool) -> None:
    assert matches(pattern) is expected


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ({"order.city": ["msk", "spb"]}, True),
        ({"order.city": ["spb", "kzn"]}, False),
        ({"order.city": {"one_of": ["msk", "spb"]}}, True),
        ({"id": [1, 7, "x"]}, True),
        ({"id": [1, 2.5]}, False),
        ({"paid": [1, 0]}, False),  # booleans are not numbers in a set either
        ({"paid": [False, True]}, True),
        ({"coupon": ["x", None]}, True),
        ({"tags": ["a", "b"]}, False),  # an array is none of the values (and does not crash)
        ({"order.city": ["kzn", {"prefix": "ms"}]}, True),  # alternatives may be operators
    ],
)
def test_one_of(pattern: dict[str, Any], expected: bool) -> None:
    assert matches(pattern) is expected


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ({"type": {"prefix": "order."}}, True),
        ({"type": {"prefix": "payment."}}, False),
        ({"type": {"suffix": ".created"}}, True),
        ({"type": {"suffix": ".paid"}}, False),
        ({"type": {"prefix": "order", "suffix": "created"}}, True),
        ({"id": {"prefix": "7"}}, False),  # a number has no prefix
        ({"missing": {"prefix": ""}}, False),
    ],
)
def test_prefix_and_suffix(pattern: dict[str, Any], expected: bool) -> None:
    assert matches(pattern) is expected


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ({"order.amount": {"gt": 1000}}, True),
        ({"order.amount": {"gt": 1500}}, False),
        ({"order.amount": {"gte": 1500}}, True),
        ({"order.amount": {"lt": 1500}}, False),
        ({"order.amount": {"lte": 1500}}, True),
        ({"order.amount": {"gt": 1000, "lt": 2000}}, True),
        ({"order.amount": {"gt": 1500.5, "lte": 2000}}, False),
        ({"order.amount": {"gte": 1499.99, "lte": 1500}}, True),
        ({"paid": {"gte": 0}}, False),  # true is not a number
        ({"coupon": {"gte": 0}}, False),  # nor is null
        ({"type": {"gt": 0}}, False),  # nor a string
        ({"order.amount": [{"lt": 10}, {"gt": 1000}]}, True),
    ],
)
def test_numeric_ranges(pattern: dict[str, Any], expected: bool) -> None:
    assert matches(pattern) is expected


def test_numeric_ranges_on_big_and_fractional_numbers() -> None:
    assert matches({"n": {"gt": 1e18}}, {"n": 10**30})
    assert matches({"n": {"lt": 0.3}}, {"n": 0.1 + 0.1})
    assert not matches({"n": {"lt": -1}}, {"n": -1})


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ({"order.city": {"exists": True}}, True),
        ({"order.town": {"exists": True}}, False),
        ({"order.town": {"exists": False}}, True),
        ({"coupon": {"exists": True}}, True),  # null is there
        ({"coupon": {"exists": False}}, False),
        ({"type.length": {"exists": False}}, True),  # through a string: not there
        ({"order.items.0.sku": {"exists": True}}, True),
        ({"order.items.1.sku": {"exists": True}}, False),
        ({"order.city": [{"exists": False}, "msk"]}, True),  # missing or msk
        ({"order.town": [{"exists": False}, "msk"]}, True),
    ],
)
def test_exists(pattern: dict[str, Any], expected: bool) -> None:
    assert matches(pattern) is expected


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ({"order.city": {"anything_but": "spb"}}, True),
        ({"order.city": {"anything_but": ["spb", "msk"]}}, False),
        ({"id": {"anything_but": [7.0]}}, False),
        ({"paid": {"anything_but": [1]}}, True),  # true is not 1
        ({"tags": {"anything_but": ["a"]}}, True),  # an array is anything but "a"
        ({"order.town": {"anything_but": "spb"}}, False),  # the field must be there
        ({"coupon": {"anything_but": "x"}}, True),
        ({"not": {"order.town": {"anything_but": "spb"}}}, True),  # nested: same rule
        ({"any": [{"order.town": {"anything_but": "spb"}}, {"id": 0}]}, False),
    ],
)
def test_anything_but(pattern: dict[str, Any], expected: bool) -> None:
    assert matches(pattern) is expected


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ({"all": [{"id": 7}, {"paid": True}]}, True),
        ({"all": [{"id": 7}, {"paid": False}]}, False),
        ({"any": [{"id": 8}, {"paid": True}]}, True),
        ({"any": [{"id": 8}, {"paid": False}]}, False),
        ({"not": {"id": 8}}, True),
        ({"not": {"id": 7}}, False),
        ({"not": {"order.town": "x"}}, True),  # not around a missing field
        ({"not": {"order.amount": {"gt": 10}}}, False),
        ({"any": [{"not": {"id": 7}}, {"all": [{"paid": True}, {"not": {"coupon": 1}}]}]}, True),
        ({"id": 7, "any": [{"type": "x"}, {"order.city": "msk"}]}, True),
        ({"$payload.any": {"exists": False}, "any": [{"id": 7}]}, True),
    ],
)
def test_all_any_not(pattern: dict[str, Any], expected: bool) -> None:
    assert matches(pattern) is expected


def test_message_fields_metadata_key_topic_partition_offset() -> None:
    msg = message({"type": "order.created", "source": "web-eu"}, key="order-7")
    assert matches({"$metadata.type": "order.created"}, msg=msg)
    assert matches({"$metadata.source": {"prefix": "web-"}}, msg=msg)
    assert not matches({"$metadata.other": {"exists": True}}, msg=msg)
    assert matches({"$key": {"prefix": "order-"}}, msg=msg)
    assert matches({"$topic": "orders", "$partition": 3, "$offset": {"gte": 42}}, msg=msg)
    assert not matches({"$partition": [0, 1]}, msg=msg)
    # A message without a key has none: only exists: false matches.
    keyless = message(key=None)
    assert matches({"$key": {"exists": False}}, msg=keyless)
    assert not matches({"$key": {"anything_but": "x"}}, msg=keyless)


def test_metadata_names_keep_their_dots() -> None:
    msg = message({"ce.type": "x"})
    assert matches({"$metadata.ce.type": "x"}, msg=msg)


def test_the_whole_payload_can_be_tested() -> None:
    assert matches({"$payload": {"prefix": "hello"}}, "hello world")
    assert matches({"$payload": 5}, 5)
    assert not matches({"$payload": {"exists": False}}, None)  # a JSON null is a payload


@pytest.mark.parametrize("document", [None, 5, "text", [1, 2], [], True, {}])
def test_payloads_that_are_not_objects_match_nothing_and_do_not_crash(document: Any) -> None:
    assert not matches({"order.city": "msk"}, document)
    assert not matches({"order.amount": {"gt": 1}}, document, on_type_error="dead_letter")
    assert matches({"order.city": {"exists": False}}, document)


def test_lists_are_indexed_by_digit_segments_and_objects_by_key() -> None:
    document = {"items": [{"sku": "a"}, {"sku": "b"}], "by_id": {"0": "zero"}}
    assert matches({"items.1.sku": "b"}, document)
    assert not matches({"items.2.sku": "b"}, document)
    assert matches({"by_id.0": "zero"}, document)
    assert matches({"$payload.1": 20}, [10, 20])
    assert not matches({"items.sku": "a"}, document)  # no implicit "any element"


def test_unicode_keys_values_and_prefixes() -> None:
    document = {"город": "Москва", "emoji": "🚀 launch", "tags": {"ключ": "значение"}}
    assert matches({"город": "Москва"}, document)
    assert matches({"город": ["Санкт-Петербург", "Москва"]}, document)
    assert matches({"город": {"prefix": "Мос", "suffix": "ква"}}, document)
    assert matches({"emoji": {"prefix": "🚀"}}, document)
    assert matches({"tags.ключ": {"anything_but": "другое"}}, document)
    assert not matches({"город": "москва"}, document)


def test_escaped_dots_address_keys_with_dots() -> None:
    document = {"a.b": {"c": 1}, "a": {"b": {"c": 2}}}
    assert matches({"a\\.b.c": 1}, document)
    assert matches({"a.b.c": 2}, document)


def test_deep_nesting_in_documents_and_paths() -> None:
    depth = 60
    document: Any = "bottom"
    for _ in range(depth):
        document = {"n": document}
    path = ".".join(["n"] * depth)
    assert matches({path: "bottom"}, document)
    assert matches({path + ".n": {"exists": False}}, document)
    assert not matches({".".join(["n"] * 10): "bottom"}, document)
    # A document deeper than any path is fine too.
    for _ in range(2000):
        document = {"n": document}
    assert not matches({"n.n.x": 1}, document)


def test_deeply_nested_patterns_compile_up_to_the_limit() -> None:
    pattern: dict[str, Any] = {"id": 7}
    for level in range(MAX_DEPTH):
        pattern = {"not": pattern} if level % 2 else {"any": [pattern, {"id": 0}]}
    assert matches(pattern)
    assert problems({"not": pattern})[0][1].startswith("patterns nest at most")


# --- wrong types at run time -----------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "document"),
    [
        ({"order.amount": {"gt": 100}}, {"order": {"amount": "1500"}}),
        ({"order.amount": {"gt": 100}}, {"order": {"amount": None}}),
        ({"order.amount": {"gt": 100}}, {"order": {"amount": True}}),
        ({"order.amount": {"gt": 100}}, {"order": {"amount": [1500]}}),
        ({"type": {"prefix": "order"}}, {"type": 5}),
        ({"type": {"suffix": "x"}}, {"type": {"a": 1}}),
    ],
)
def test_a_wrong_type_does_not_match_or_is_dead_lettered(
    pattern: dict[str, Any], document: dict[str, Any]
) -> None:
    assert not matches(pattern, document)
    with pytest.raises(StageFailure) as caught:
        matches(pattern, document, on_type_error="dead_letter")
    assert caught.value.reason == "type_error"
    # The text names the field and the kinds, never the value.
    assert "must be" in caught.value.text
    assert "1500" not in caught.value.text


def test_dead_letter_mode_does_not_fire_for_missing_fields_or_other_alternatives() -> None:
    strict: OnTypeError = "dead_letter"
    assert not matches({"order.amount": {"gt": 1}}, {"order": {}}, on_type_error=strict)
    assert not matches({"order.amount": {"gt": 1}}, {}, on_type_error=strict)
    # A list that also accepts strings: a string is not a type error.
    assert matches({"v": [{"gt": 10}, "n/a"]}, {"v": "n/a"}, on_type_error=strict)
    assert not matches({"v": [{"gt": 10}, "n/a"]}, {"v": "x"}, on_type_error=strict)
    # Equality accepts any kind of value.
    assert not matches({"v": 5}, {"v": "5"}, on_type_error=strict)
    # An earlier condition that fails stops before a later type error.
    assert not matches({"a": 1, "b": {"gt": 1}}, {"a": 2, "b": "x"}, on_type_error=strict)


def test_dead_letter_mode_fires_inside_not_and_any() -> None:
    with pytest.raises(StageFailure):
        matches({"not": {"v": {"gt": 1}}}, {"v": "x"}, on_type_error="dead_letter")
    with pytest.raises(StageFailure):
        matches({"any": [{"a": 1}, {"v": {"prefix": "x"}}]}, {"v": 2}, on_type_error="dead_letter")
    assert matches({"not": {"v": {"gt": 1}}}, {"v": "x"})  # no_match: not(no match) is a match


# --- validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "path", "message"),
    [
        (
            "city",
            (),
            "expected a mapping of field paths (or all/any/not) to conditions, got a string",
        ),
        ({}, (), "an empty pattern: give at least one condition"),
        ({"a": {"gtt": 1}}, ("a", "gtt"), "unknown operator 'gtt' (did you mean gt?)"),
        ({"a": {"city": 1}}, ("a", "city"), "for a nested field write its dotted path (a.city)"),
        ({"a..b": 1}, ("a..b",), "bad path: empty segment in the path"),
        ({"$nope": 1}, ("$nope",), "bad path: unknown message field '$nope'"),
        ({"$metadata": "x"}, ("$metadata",), "bad path: $metadata needs an item name"),
        ({"$key.x": "x"}, ("$key.x",), "bad path: $key has no fields"),
        ({"a": {"gt": "10"}}, ("a", "gt"), "gt needs a number, got a string"),
        ({"a": {"gt": True}}, ("a", "gt"), "gt needs a number, got a boolean"),
        ({"a": {"gt": math.inf}}, ("a", "gt"), "gt needs a finite number"),
        ({"a": {"prefix": 5}}, ("a", "prefix"), "prefix needs a string, got a number"),
        ({"a": {"exists": "yes"}}, ("a", "exists"), "exists needs true or false, got a string"),
        ({"a": {"one_of": "x"}}, ("a", "one_of"), "one_of takes a list of values, got a string"),
        (
            {"a": {"one_of": [[1]]}},
            ("a", "one_of", 0),
            "expected a string, number, boolean or null, got a list",
        ),
        (
            {"a": {"anything_but": []}},
            ("a", "anything_but"),
            "anything_but needs at least one value",
        ),
        ({"a": []}, ("a",), "an empty list matches nothing"),
        ({"a": {}}, ("a",), "an empty operator mapping"),
        ({"a": {"gt": 5, "lt": 5}}, ("a",), "the range is empty"),
        ({"a": {"gt": 1, "gte": 2}}, ("a",), "gt and gte both bound the same side"),
        ({"a": {"prefix": "x", "gt": 1}}, ("a",), "nothing is both"),
        ({"a": {"exists": False, "prefix": "x"}}, ("a",), "exists: false cannot be combined"),
        (
            {"$metadata.v": 2},
            ("$metadata.v",),
            "$metadata.v is always a string, so a number never equals it (write '2')",
        ),
        (
            {"$metadata.v": {"gt": 2}},
            ("$metadata.v",),
            "is always a string: a number never matches",
        ),
        (
            {"$partition": {"prefix": "1"}},
            ("$partition",),
            "is always a number: a string never matches",
        ),
        ({"any": {"a": 1}}, ("any",), "any takes a non-empty list of patterns"),
        ({"all": [{"a": {"gtt": 1}}]}, ("all", 0, "a", "gtt"), "unknown operator 'gtt'"),
        ({"not": [1]}, ("not",), "expected a mapping of field paths"),
        ({5: "x"}, (5,), "bad path: a path must be a string, not int"),
    ],
)
def test_invalid_patterns_name_the_place_and_the_problem(
    pattern: Any, path: tuple[Any, ...], message: str
) -> None:
    found = problems(pattern)
    assert len(found) == 1, found
    assert found[0][0] == path
    assert message in found[0][1]


def test_every_problem_is_reported_not_only_the_first() -> None:
    found = problems({"a": {"gtt": 1}, "b..c": 1, "c": {"gt": "x"}, "any": [{"d": {"exists": 1}}]})
    assert [path for path, _ in found] == [
        ("a", "gtt"),
        ("b..c",),
        ("c", "gt"),
        ("any", 0, "d", "exists"),
    ]


def test_user_text_never_reaches_the_generated_source() -> None:
    hostile = "'); __import__('os') # {k0} @V@"
    compiled = compile_pattern({hostile: hostile, f"x.{hostile}": {"prefix": hostile}})
    assert "__import__" not in compiled.source
    assert "@V@" not in compiled.source
    assert compiled.match({hostile: hostile, "x": {hostile: hostile + "!"}}, message())


def test_patterns_reading_only_metadata_never_touch_the_payload() -> None:
    compiled = compile_pattern({"$metadata.type": "a", "$key": {"exists": True}})
    assert not compiled.reads_payload
    assert compiled.match(object(), message({"type": "a"}))  # any document: it is not read
    assert compile_pattern({"a": 1}).reads_payload


# --- property: compiled == reference ---------------------------------------------------------

_MISSING = object()
_OPERATORS = (
    "equals",
    "one_of",
    "prefix",
    "suffix",
    "gt",
    "gte",
    "lt",
    "lte",
    "exists",
    "anything_but",
)
_KEYS = ("a", "b", "0", "м")


class _TypeMismatch(Exception):
    pass


def _kind(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return "number"
    return "other"


def _json_equal(left: Any, right: Any) -> bool:
    if isinstance(left, bool) or isinstance(right, bool):
        return left is right
    if _kind(left) == "number" and _kind(right) == "number":
        return bool(left == right)
    if left is None or right is None:
        return left is right
    return isinstance(left, str) and isinstance(right, str) and bool(left == right)


def _ref_value(path: str, document: Any, msg: Message) -> Any:
    if path.startswith("$"):
        head, _, rest = path.partition(".")
        if head == "$metadata":
            return msg.metadata.get(rest, _MISSING)
        if head == "$key":
            return _MISSING if msg.key is None else msg.key
        segments = rest.split(".") if rest else []
    else:
        segments = path.split(".")
    node = document
    for segment in segments:
        if isinstance(node, dict):
            node = node.get(segment, _MISSING)
        elif isinstance(node, list) and segment.isdigit() and int(segment) < len(node):
            node = node[int(segment)]
        else:
            return _MISSING
        if node is _MISSING:
            return _MISSING
    return node


def _ref_operator(operator: str, argument: Any, value: Any) -> bool:
    present = value is not _MISSING
    if operator == "equals":
        return present and _json_equal(value, argument)
    if operator == "one_of":
        return present and any(_json_equal(value, item) for item in argument)
    if operator == "anything_but":
        items = argument if isinstance(argument, list) else [argument]
        return present and not any(_json_equal(value, item) for item in items)
    if operator == "exists":
        return present is argument
    if operator in ("prefix", "suffix"):
        if not isinstance(value, str):
            return False
        return value.startswith(argument) if operator == "prefix" else value.endswith(argument)
    if _kind(value) != "number":
        return False
    comparisons: dict[str, bool] = {
        "gt": value > argument,
        "gte": value >= argument,
        "lt": value < argument,
        "lte": value <= argument,
    }
    return comparisons[operator]


def _required(operators: dict[str, Any]) -> set[str] | None:
    kinds: set[str] | None = None
    for operator in operators:
        need = {"prefix": "string", "suffix": "string"}.get(operator)
        if operator in ("gt", "gte", "lt", "lte"):
            need = "number"
        if need is not None:
            kinds = {need} if kinds is None else kinds & {need}
    return kinds


def _ref_field(condition: Any, value: Any, strict: bool) -> bool:
    alternatives = condition if isinstance(condition, list) else [condition]
    maps = [alt if isinstance(alt, dict) else {"equals": alt} for alt in alternatives]
    needs = [_required(ops) for ops in maps]
    if strict and value is not _MISSING and all(need is not None for need in needs):
        allowed = set().union(*(need for need in needs if need is not None))
        if _kind(value) not in allowed:
            raise _TypeMismatch
    return any(all(_ref_operator(o, a, value) for o, a in ops.items()) for ops in maps)


def _reference(pattern: dict[str, Any], document: Any, msg: Message, strict: bool) -> bool:
    for key, condition in pattern.items():
        if key == "all":
            ok = all(_reference(child, document, msg, strict) for child in condition)
        elif key == "any":
            ok = any(_reference(child, document, msg, strict) for child in condition)
        elif key == "not":
            ok = not _reference(condition, document, msg, strict)
        else:
            ok = _ref_field(condition, _ref_value(key, document, msg), strict)
        if not ok:
            return False
    return True


# Small vocabularies, so that paths often hit values and values often meet
# the pattern's constants (true next to 1, 1.0 next to 1, "a" next to "ab").
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-1, 2),
    st.sampled_from([0.0, 1.0, 2.5]),
    st.sampled_from(["", "a", "ab", "b", "м"]),
)
_objects = st.dictionaries(st.sampled_from(_KEYS), st.deferred(lambda: _values), max_size=4)
_values: st.SearchStrategy[Any] = st.one_of(
    _scalars, _scalars, st.lists(st.deferred(lambda: _values), max_size=2), _objects
)
# Mostly objects at the top, as payloads are; sometimes anything.
_documents = st.one_of(_objects, _objects, _objects, _values)
_payload_paths = st.lists(st.sampled_from(_KEYS), min_size=1, max_size=2).map(".".join)
_paths = st.one_of(
    _payload_paths,
    _payload_paths.map(lambda p: f"$payload.{p}"),
    st.just("$payload"),
)
_short_text = st.sampled_from(["", "a", "ab", "b", "м"])
_numbers = st.one_of(st.integers(-1, 2), st.sampled_from([0.5, 1.0, 2.0]))


def _argument(operator: str) -> st.SearchStrategy[Any]:
    if operator in ("equals",):
        return _scalars
    if operator in ("one_of",):
        return st.lists(_scalars, min_size=1, max_size=3)
    if operator == "anything_but":
        return _scalars | st.lists(_scalars, min_size=1, max_size=3)
    if operator in ("prefix", "suffix"):
        return _short_text
    if operator == "exists":
        return st.booleans()
    return _numbers


@st.composite
def _operator_maps(draw: st.DrawFn) -> dict[str, Any]:
    operators = draw(st.lists(st.sampled_from(_OPERATORS), min_size=1, max_size=3, unique=True))
    return {operator: draw(_argument(operator)) for operator in operators}


_conditions = st.one_of(
    _scalars,
    st.lists(_scalars | _operator_maps(), min_size=1, max_size=3),
    _operator_maps(),
)


def _patterns() -> st.SearchStrategy[dict[str, Any]]:
    fields = st.dictionaries(_paths, _conditions, min_size=1, max_size=3)
    message_fields = st.dictionaries(
        st.sampled_from(["$metadata.t", "$key"]),
        _short_text | st.lists(_short_text, min_size=1, max_size=2) | st.just({"exists": False}),
        max_size=1,
    )
    return st.recursive(
        st.builds(lambda a, b: {**a, **b}, fields, message_fields),
        lambda children: st.one_of(
            st.builds(lambda c: {"not": c}, children),
            st.lists(children, min_size=1, max_size=3).map(lambda c: {"all": c}),
            st.lists(children, min_size=1, max_size=3).map(lambda c: {"any": c}),
            st.builds(lambda c, f: {**f, "any": [c]}, children, fields),
        ),
        max_leaves=6,
    )


_messages = st.builds(
    lambda t, key: Message("t", 0, 0, b"", key=key, metadata={} if t is None else {"t": t}),
    st.none() | _short_text,
    st.none() | _short_text,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(pattern=_patterns(), document=_documents, msg=_messages)
def test_compiled_filter_agrees_with_a_straightforward_reference(
    pattern: dict[str, Any], document: Any, msg: Message
) -> None:
    try:
        lenient = compile_pattern(pattern)
        strict = compile_pattern(pattern, on_type_error="dead_letter")
    except PatternError:
        assume(False)
    assert lenient.match(document, msg) is _reference(pattern, document, msg, strict=False)
    try:
        expected: bool | str = _reference(pattern, document, msg, strict=True)
    except _TypeMismatch:
        expected = "type_error"
    try:
        got: bool | str = strict.match(document, msg) is True
    except StageFailure as failure:
        got = failure.reason
    assert got == expected


_wrappers = st.sampled_from(["plain", "not", "any", "all"])
_dense_numbers = st.sampled_from([0, 1, 2, 1.0])
_dense_values = st.one_of(_dense_numbers, _dense_numbers, _scalars, _values)


@st.composite
def _dense_operator_maps(draw: st.DrawFn) -> dict[str, Any]:
    # Ranges twice as likely: their bounds are where off-by-one bugs live.
    choices = st.sampled_from((*_OPERATORS, "gt", "gte", "lt", "lte"))
    operators = draw(st.lists(choices, min_size=1, max_size=2, unique=True))
    return {
        operator: draw(
            _dense_numbers if operator in ("gt", "gte", "lt", "lte") else _argument(operator)
        )
        for operator in operators
    }


_dense_conditions = st.one_of(
    _dense_operator_maps(),
    _dense_operator_maps(),
    _scalars,
    st.lists(_scalars | _dense_operator_maps(), min_size=1, max_size=2),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(
    condition=_dense_conditions,
    value=_dense_values,
    wrapper=_wrappers,
    present=st.sampled_from([True, True, True, False]),
    strict=st.booleans(),
)
def test_each_condition_agrees_with_the_reference_on_one_field(
    condition: Any, value: Any, wrapper: str, present: bool, strict: bool
) -> None:
    """Denser than the test above: one field, usually there, in every position a field can be."""
    pattern: dict[str, Any] = {"a": condition}
    if wrapper == "not":
        pattern = {"not": pattern}
    elif wrapper in ("any", "all"):
        pattern = {wrapper: [pattern, {"b": {"exists": wrapper == "all"}}]}
    document = {"a": value, "b": 0} if present else {"b": 0}
    try:
        compiled = compile_pattern(pattern, on_type_error="dead_letter" if strict else "no_match")
    except PatternError:
        assume(False)
    msg = message()
    try:
        expected: bool | str = _reference(pattern, document, msg, strict)
    except _TypeMismatch:
        expected = "type_error"
    try:
        got: bool | str = compiled.match(document, msg) is True
    except StageFailure as failure:
        got = failure.reason
    assert got == expected
