"""Payload decoders for the detail page: Protobuf with the integration's schema.

A decoder turns payload bytes into a JSON-like document and raises
``ValueError`` when the bytes do not fit; the page then falls back to text
or hex and says why. Pass them to ``create_app(decoders={integration: ...})``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.message import DecodeError


@dataclass(frozen=True, slots=True)
class ProtobufDecoder:
    """Decodes one Protobuf message type into its proto3 JSON mapping."""

    message_type: str
    _message_class: Any
    _options: dict[str, bool]

    @property
    def label(self) -> str:
        """How the page names the decoded form."""
        return f"Protobuf {self.message_type}"

    def __call__(self, payload: bytes) -> object:
        message = self._message_class()
        try:
            message.ParseFromString(payload)
        except DecodeError:
            raise ValueError(f"not a valid {self.message_type} message") from None
        document: object = json_format.MessageToDict(message, **self._options)  # type: ignore[arg-type]
        return document


def protobuf_decoder(descriptor_set: Path | bytes, message_type: str) -> ProtobufDecoder:
    """A decoder from a descriptor set (``protoc --include_imports --descriptor_set_out``)."""
    data = descriptor_set if isinstance(descriptor_set, bytes) else descriptor_set.read_bytes()
    try:
        file_set = descriptor_pb2.FileDescriptorSet.FromString(data)
        pool = descriptor_pool.DescriptorPool()
        for file_proto in file_set.file:
            pool.Add(file_proto)
        descriptor = pool.FindMessageTypeByName(message_type)
    except (DecodeError, TypeError, KeyError) as exc:
        raise ValueError(f"cannot load {message_type} from the descriptor set: {exc}") from None
    options = {"preserving_proto_field_name": True}
    if "unquote_int64_if_possible" in inspect.signature(json_format.MessageToDict).parameters:
        options["unquote_int64_if_possible"] = True
    return ProtobufDecoder(message_type, message_factory.GetMessageClass(descriptor), options)
