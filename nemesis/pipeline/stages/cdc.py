"""``cdc``: unwrap a YDB changefeed record (JSON format) into the row it describes.

A changefeed record (any mode: UPDATES, NEW_IMAGE, OLD_IMAGE,
NEW_AND_OLD_IMAGES, KEYS_ONLY), as the server's datashard writes it
(``change_record_cdc_serializer.cpp`` in ydb-platform/ydb)::

    {"key": [42, "msk"], "update": {...}, "newImage": {...}, "oldImage": {...}, "ts": [...]}
    {"key": [42, "msk"], "reset": {...}, "newImage": {...}, "oldImage": {...}, "ts": [...]}
    {"key": [42, "msk"], "erase": {}, "oldImage": {...}}
    {"resolved": [step, tx_id]}           a resolved-timestamp mark, not a change

``update`` is an UPSERT or UPDATE, ``reset`` a REPLACE (or an INSERT
written as one); both become an upsert. In UPDATES mode they carry the
columns the statement wrote (empty in the image modes, which carry the image
instead): after a REPLACE the columns it did not name are NULL on the table
but absent from its UPDATES record, so a handler that merges rows should
read the image modes.

becomes the row: the key columns by name, then the new image (or, in
UPDATES mode, the changed columns)::

    - cdc:
        key_columns: [order_id, city]   # the primary key, in order
        deletes: skip                   # or deliver: the key and the old image, if any
        op_field: _op                   # optional: add "upsert" or "delete" under this name
        old_image_field: _old           # optional: add the old image (NEW_AND_OLD_IMAGES)

Resolved-timestamp marks are filtered out. A payload that is not a
changefeed record is dead-lettered as a decode_error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from nemesis.pipeline.paths import json_kind
from nemesis.pipeline.stage import (
    DECODE_ERROR,
    BuildContext,
    Envelope,
    Stage,
    StageConfig,
    StageFailure,
    dropping_failures,
)


class CdcConfig(StageConfig):
    """How a changefeed record becomes a row."""

    key_columns: Annotated[list[str], Field(min_length=1)]
    deletes: Literal["skip", "deliver"] = "skip"
    op_field: str | None = None
    old_image_field: str | None = None
    on_error: Literal["dead_letter", "drop"] = "dead_letter"


def build_cdc(config: CdcConfig, context: BuildContext) -> Stage:
    """Unwraps records into rows; deletes are skipped unless configured."""
    columns = tuple(config.key_columns)
    width = len(columns)
    deliver_deletes = config.deletes == "deliver"
    op_field = config.op_field
    old_field = config.old_image_field

    def process(env: Envelope) -> bool:
        record = env.document
        if type(record) is not dict:
            raise StageFailure(
                DECODE_ERROR, f"cdc: not a changefeed record: the payload is {json_kind(record)}"
            )
        key = record.get("key")
        if key is None and "resolved" in record:
            return False
        if type(key) is not list or len(key) != width:
            got = f"{len(key)} values" if type(key) is list else json_kind(key)
            raise StageFailure(
                DECODE_ERROR,
                f"cdc: the record's key must be a list of {width} values"
                f" ({', '.join(columns)}), got {got}",
            )
        row: dict[str, Any] = dict(zip(columns, key, strict=True))
        if "erase" in record:
            if not deliver_deletes:
                return False
            op = "delete"
            image = record.get("oldImage")
        elif "update" in record or "reset" in record:
            op = "upsert"
            image = record.get("newImage")
            if image is None:
                image = record["update"] if "update" in record else record["reset"]
        else:
            raise StageFailure(DECODE_ERROR, "cdc: the record has neither update, reset nor erase")
        if image is not None:
            if type(image) is not dict:
                raise StageFailure(
                    DECODE_ERROR, f"cdc: the row image is {json_kind(image)}, not an object"
                )
            row.update(image)
        if op_field is not None:
            row[op_field] = op
        if old_field is not None and op == "upsert" and "oldImage" in record:
            row[old_field] = record["oldImage"]
        env.document = row
        env.changed = True
        return True

    stage_process = process if config.on_error == "dead_letter" else dropping_failures(process)
    return Stage(stage_process, reads_payload=True)
