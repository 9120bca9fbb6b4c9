"""The ``cdc`` stage on changefeed records exactly as a YDB server writes them.

The records below are the bytes the datashard's JSON serializer writes
(ydb-platform/ydb ``ydb/core/tx/datashard/change_record_cdc_serializer.cpp``,
``TYdbJsonSerializer::SerializeToJson``) for one table in each of the five
modes, with the images ``change_collector_cdc_stream.cpp`` collects:

- the row operation is ``update`` (UPSERT, UPDATE), ``reset`` (REPLACE) or
  ``erase`` (DELETE); in KEYS_ONLY and the image modes its object is empty,
  in UPDATES it holds the columns the statement wrote;
- ``oldImage`` is the row before (absent when there was none), ``newImage``
  the row after (absent after an erase); a REPLACE sets the columns it does
  not name to NULL;
- ``ts`` ([step, tx id]) is there only with virtual timestamps;
- String is base64, Utf8 a string, Uint64 a number, Timestamp ISO 8601.

The table::

    CREATE TABLE orders (order_id Uint64, city Utf8, status Utf8, amount Uint64,
                         note String, paid_at Timestamp, PRIMARY KEY (order_id, city));

holding (1, "msk", "created", 10, "hi", NULL) before each statement.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from nemesis.pipeline import Verdict
from tests.test_pipeline_stages import build, msg, output

MODES = ("KEYS_ONLY", "UPDATES", "NEW_IMAGE", "OLD_IMAGE", "NEW_AND_OLD_IMAGES")
KEY = {"order_id": 1, "city": "msk"}
BEFORE = {"amount": 10, "note": "aGk=", "paid_at": None, "status": "created"}
OLD = '"oldImage":{"amount":10,"note":"aGk=","paid_at":null,"status":"created"}'

# UPSERT INTO orders (order_id, city, status, paid_at)
#     VALUES (1, "msk", "paid", Timestamp("2026-12-02T21:00:00Z"))
PAID_AT = "2026-12-02T21:00:00.000000Z"  # TInstant::ToString of the Timestamp
UPSERT_NEW = {"amount": 10, "note": "aGk=", "paid_at": PAID_AT, "status": "paid"}
UPSERT = {
    "KEYS_ONLY": '{"update":{},"key":[1,"msk"]}',
    "UPDATES": '{"update":{"paid_at":"2026-12-02T21:00:00.000000Z","status":"paid"},'
    '"key":[1,"msk"]}',
    "NEW_IMAGE": '{"update":{},"newImage":{"amount":10,"note":"aGk=",'
    '"paid_at":"2026-12-02T21:00:00.000000Z","status":"paid"},"key":[1,"msk"]}',
    "OLD_IMAGE": '{"update":{},"key":[1,"msk"],' + OLD + "}",
    "NEW_AND_OLD_IMAGES": '{"update":{},"newImage":{"amount":10,"note":"aGk=",'
    '"paid_at":"2026-12-02T21:00:00.000000Z","status":"paid"},"key":[1,"msk"],' + OLD + "}",
}

# REPLACE INTO orders (order_id, city, status, amount) VALUES (1, "msk", "paid", 15)
REPLACE_NEW = {"amount": 15, "note": None, "paid_at": None, "status": "paid"}
REPLACE = {
    "KEYS_ONLY": '{"reset":{},"key":[1,"msk"]}',
    "UPDATES": '{"reset":{"amount":15,"status":"paid"},"key":[1,"msk"]}',
    "NEW_IMAGE": '{"reset":{},"newImage":{"amount":15,"note":null,"paid_at":null,'
    '"status":"paid"},"key":[1,"msk"]}',
    "OLD_IMAGE": '{"reset":{},"key":[1,"msk"],' + OLD + "}",
    "NEW_AND_OLD_IMAGES": '{"reset":{},"newImage":{"amount":15,"note":null,"paid_at":null,'
    '"status":"paid"},"key":[1,"msk"],' + OLD + "}",
}

# DELETE FROM orders WHERE order_id = 1 AND city = "msk"
ERASE = {
    "KEYS_ONLY": '{"erase":{},"key":[1,"msk"]}',
    "UPDATES": '{"erase":{},"key":[1,"msk"]}',
    "NEW_IMAGE": '{"erase":{},"key":[1,"msk"]}',
    "OLD_IMAGE": '{"erase":{},"key":[1,"msk"],' + OLD + "}",
    "NEW_AND_OLD_IMAGES": '{"erase":{},"key":[1,"msk"],' + OLD + "}",
}

# What each mode's record says of the row after an upsert and after a replace.
UPSERT_ROW = {
    "KEYS_ONLY": KEY,
    "UPDATES": {**KEY, "paid_at": PAID_AT, "status": "paid"},
    "NEW_IMAGE": {**KEY, **UPSERT_NEW},
    "OLD_IMAGE": KEY,
    "NEW_AND_OLD_IMAGES": {**KEY, **UPSERT_NEW},
}
REPLACE_ROW = {
    "KEYS_ONLY": KEY,
    "UPDATES": {**KEY, "amount": 15, "status": "paid"},
    "NEW_IMAGE": {**KEY, **REPLACE_NEW},
    "OLD_IMAGE": KEY,
    "NEW_AND_OLD_IMAGES": {**KEY, **REPLACE_NEW},
}
HAS_OLD = {"OLD_IMAGE", "NEW_AND_OLD_IMAGES"}


def with_timestamps(record: str, virtual_timestamps: bool) -> bytes:
    """The record as written with ``VIRTUAL_TIMESTAMPS = TRUE``: ``"ts"`` last."""
    if virtual_timestamps:
        record = record[:-1] + ',"ts":[1718000000000,281474976710657]}'
    return record.encode()


def cdc(**config: Any) -> Any:
    return build([{"cdc": {"key_columns": ["order_id", "city"], "op_field": "_op", **config}}])


def test_the_records_are_json_objects_of_the_servers_shape() -> None:
    for table in (UPSERT, REPLACE, ERASE):
        assert set(table) == set(MODES)
        for mode, record in table.items():
            parsed = orjson.loads(record)
            assert parsed["key"] == [1, "msk"]
            assert ("oldImage" in parsed) == (mode in HAS_OLD)


@pytest.mark.parametrize("virtual_timestamps", [False, True], ids=["plain", "ts"])
@pytest.mark.parametrize("mode", MODES)
def test_a_replace_is_an_upsert_in_every_mode(mode: str, virtual_timestamps: bool) -> None:
    raw = with_timestamps(REPLACE[mode], virtual_timestamps)
    result = cdc(old_image_field="_old").process(msg(raw=raw))
    assert result.verdict is Verdict.PASS, result.error
    expected = {**REPLACE_ROW[mode], "_op": "upsert"}
    if mode in HAS_OLD:
        expected["_old"] = BEFORE
    assert output(result) == expected


@pytest.mark.parametrize("virtual_timestamps", [False, True], ids=["plain", "ts"])
@pytest.mark.parametrize("mode", MODES)
def test_an_upsert_in_every_mode(mode: str, virtual_timestamps: bool) -> None:
    raw = with_timestamps(UPSERT[mode], virtual_timestamps)
    assert output(cdc().process(msg(raw=raw))) == {**UPSERT_ROW[mode], "_op": "upsert"}


@pytest.mark.parametrize("virtual_timestamps", [False, True], ids=["plain", "ts"])
@pytest.mark.parametrize("mode", MODES)
def test_an_erase_in_every_mode(mode: str, virtual_timestamps: bool) -> None:
    raw = with_timestamps(ERASE[mode], virtual_timestamps)
    assert cdc().process(msg(raw=raw)).verdict is Verdict.FILTERED
    delivered = output(cdc(deletes="deliver").process(msg(raw=raw)))
    assert delivered == {**KEY, **(BEFORE if mode in HAS_OLD else {}), "_op": "delete"}


def test_a_replace_of_a_row_that_was_not_there_has_no_old_image() -> None:
    # OLD_IMAGE: the collector's old state is Absent, so no "oldImage" is written.
    raw = with_timestamps('{"reset":{},"key":[2,"spb"]}', virtual_timestamps=True)
    result = cdc(old_image_field="_old").process(msg(raw=raw))
    assert output(result) == {"order_id": 2, "city": "spb", "_op": "upsert"}


def test_a_resolved_timestamp_mark_is_not_a_change() -> None:
    # TYdbJsonSerializer writes a heartbeat as {"resolved":[step,txId]} alone.
    raw = b'{"resolved":[1718000000000,18446744073709551615]}'
    assert cdc().process(msg(raw=raw)).verdict is Verdict.FILTERED
