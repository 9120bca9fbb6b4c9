"""``decode``: turn the payload bytes into a document later stages read.

::

    - decode: {format: json}
    - decode:
        format: protobuf
        descriptor_set: protos/orders.pb     # protoc --include_imports --descriptor_set_out=...
        message_type: shop.v1.Order

A pipeline whose stages read the payload without a decode stage gets a JSON
decode before the first of them. A payload that does not decode is
dead-lettered with reason ``decode_error`` (or dropped: ``on_error: drop``).

Protobuf messages become the proto3 JSON mapping (field names as in the
.proto file; 64-bit integers as numbers where the protobuf package can).
An unchanged message is delivered as the original bytes. Protobuf needs the
``protobuf`` package, imported only when a pipeline uses it; the descriptor
set path is relative to the pipeline file.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Literal

import orjson

from nemesis.pipeline.stage import (
    DECODE_ERROR,
    BuildContext,
    ConfigIssue,
    Envelope,
    Stage,
    StageConfig,
    StageConfigError,
    StageFailure,
    StageFunction,
    dropping_failures,
)


class DecodeConfig(StageConfig):
    """The payload format, and for Protobuf where its schema is."""

    format: Literal["json", "protobuf"] = "json"
    descriptor_set: str | None = None
    message_type: str | None = None
    on_error: Literal["dead_letter", "drop"] = "dead_letter"


def decode_json(env: Envelope) -> bool:
    """Parses the payload as JSON (the stage the compiler adds when none is configured)."""
    try:
        env.document = orjson.loads(env.message.value)
    except orjson.JSONDecodeError as exc:
        # orjson's message gives the position, never the text.
        raise StageFailure(DECODE_ERROR, f"the payload is not valid JSON: {exc}") from None
    return True


def build_decode(config: DecodeConfig, context: BuildContext) -> Stage:
    """A JSON or Protobuf decoder; Protobuf schemas are loaded once, here."""
    if config.format == "json":
        stray = [name for name in ("descriptor_set", "message_type") if getattr(config, name)]
        if stray:
            raise StageConfigError(
                [ConfigIssue((name,), "only used with format: protobuf") for name in stray]
            )
        process: StageFunction = decode_json
    else:
        process = _protobuf_decoder(config, context)
    if config.on_error == "drop":
        process = dropping_failures(process)
    return Stage(process, decodes=True)


def _protobuf_decoder(config: DecodeConfig, context: BuildContext) -> StageFunction:
    issues = [
        ConfigIssue((name,), "required with format: protobuf")
        for name in ("descriptor_set", "message_type")
        if not getattr(config, name)
    ]
    if issues or config.descriptor_set is None or config.message_type is None:
        raise StageConfigError(issues)
    try:
        # Imported by name: an optional dependency, needed only by pipelines that use it.
        descriptor_pb2: Any = importlib.import_module("google.protobuf.descriptor_pb2")
        descriptor_pool: Any = importlib.import_module("google.protobuf.descriptor_pool")
        message_factory: Any = importlib.import_module("google.protobuf.message_factory")
        json_format: Any = importlib.import_module("google.protobuf.json_format")
        message_module: Any = importlib.import_module("google.protobuf.message")
    except ImportError:
        raise StageConfigError(
            [
                ConfigIssue(
                    ("format",),
                    "format: protobuf needs the protobuf package (pip install protobuf)",
                )
            ]
        ) from None
    decode_error: type[Exception] = message_module.DecodeError
    path = context.base_dir / config.descriptor_set
    try:
        data = context.read(path)
    except OSError as exc:
        raise StageConfigError(
            [ConfigIssue(("descriptor_set",), f"cannot read {path}: {exc.strerror or exc}")]
        ) from None
    try:
        file_set = descriptor_pb2.FileDescriptorSet.FromString(data)
        pool = descriptor_pool.DescriptorPool()
        for file_proto in file_set.file:
            pool.Add(file_proto)
    except (decode_error, TypeError, ValueError, KeyError) as exc:
        raise StageConfigError(
            [
                ConfigIssue(
                    ("descriptor_set",),
                    f"{path} is not a usable descriptor set ({type(exc).__name__}); make one with"
                    " protoc --include_imports --descriptor_set_out=FILE",
                )
            ]
        ) from None
    name = config.message_type
    try:
        descriptor = pool.FindMessageTypeByName(name)
    except KeyError:
        known = sorted(
            f"{file_proto.package}.{message.name}".lstrip(".")
            for file_proto in file_set.file
            for message in file_proto.message_type
        )
        raise StageConfigError(
            [
                ConfigIssue(
                    ("message_type",),
                    f"no message type {name!r} in {path} (it has: {', '.join(known) or 'none'})",
                )
            ]
        ) from None
    message_class = message_factory.GetMessageClass(descriptor)
    to_dict = json_format.MessageToDict
    options: dict[str, bool] = {"preserving_proto_field_name": True}
    # Proto3 JSON quotes 64-bit integers; filters compare numbers, so they are turned
    # back into numbers: by protobuf itself where it can, else by walking the descriptor.
    native = "unquote_int64_if_possible" in inspect.signature(to_dict).parameters
    if native:
        options["unquote_int64_if_possible"] = True

    def process(env: Envelope) -> bool:
        message = message_class()
        try:
            message.ParseFromString(env.message.value)
        except decode_error:
            raise StageFailure(
                DECODE_ERROR, f"the payload is not a valid {name} Protobuf message"
            ) from None
        document = to_dict(message, **options)
        if not native:
            _unquote_int64(document, descriptor)
        env.document = document
        return True

    return process


_INT64_TYPES = frozenset({3, 4, 6, 16, 18})  # INT64, UINT64, FIXED64, SFIXED64, SINT64


def _unquote_int64(document: dict[str, Any], descriptor: Any) -> None:
    """Turns the quoted 64-bit integers of a MessageToDict result back into numbers."""
    for field in descriptor.fields:
        value = document.get(field.name)
        if value is None:
            continue
        if field.message_type is not None:
            if field.message_type.GetOptions().map_entry:
                value_field = field.message_type.fields_by_name["value"]
                if value_field.message_type is not None:
                    for item in value.values():
                        _unquote_int64(item, value_field.message_type)
                elif value_field.type in _INT64_TYPES:
                    document[field.name] = {k: _as_int(v) for k, v in value.items()}
            elif isinstance(value, list):
                for item in value:
                    if isinstance(item, dict):
                        _unquote_int64(item, field.message_type)
            elif isinstance(value, dict):
                _unquote_int64(value, field.message_type)
        elif field.type in _INT64_TYPES:
            document[field.name] = (
                [_as_int(v) for v in value] if isinstance(value, list) else _as_int(value)
            )


def _as_int(value: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return value
