"""The built-in stages: one module each, a config model and a factory."""

from __future__ import annotations

from typing import Any

from nemesis.pipeline.registry import StageType
from nemesis.pipeline.stages.cdc import CdcConfig, build_cdc
from nemesis.pipeline.stages.decode import DecodeConfig, build_decode, decode_json
from nemesis.pipeline.stages.expr import ExprConfig, build_expr
from nemesis.pipeline.stages.filter import FilterConfig, build_filter
from nemesis.pipeline.stages.route import RouteByTypeConfig, build_route_by_type
from nemesis.pipeline.stages.transform import TransformConfig, build_transform

__all__ = [
    "CdcConfig",
    "DecodeConfig",
    "ExprConfig",
    "FilterConfig",
    "RouteByTypeConfig",
    "TransformConfig",
    "builtin_stage_types",
    "decode_json",
]


def builtin_stage_types() -> list[StageType[Any]]:
    """The stage types every default registry starts with."""
    return [
        StageType("decode", DecodeConfig, build_decode, "parse JSON or Protobuf payloads"),
        StageType("filter", FilterConfig, build_filter, "keep messages matching a pattern"),
        StageType("expr", ExprConfig, build_expr, "keep messages a JMESPath expression accepts"),
        StageType("transform", TransformConfig, build_transform, "keep/drop/rename/set fields"),
        StageType(
            "route_by_type", RouteByTypeConfig, build_route_by_type, "skip disabled message types"
        ),
        StageType("cdc", CdcConfig, build_cdc, "unwrap YDB changefeed records"),
    ]
