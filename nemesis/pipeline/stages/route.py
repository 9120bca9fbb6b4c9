"""``route_by_type``: skip message types switched off without a deploy.

::

    - route_by_type:
        type_from: $metadata.type   # default: the integration's source.type_key in metadata
        skip: [order.test]          # always skipped, besides flags.disabled_types

The integration's ``flags.disabled_types`` change while running: the stage
holds a function returning the current set (never a copy) and asks it per
message. Skips are counted per type in the stage's statistics details.
"""

from __future__ import annotations

from pydantic import Field

from nemesis.pipeline.paths import FieldPath, PathError, Root, getter, parse_path
from nemesis.pipeline.stage import (
    BuildContext,
    ConfigIssue,
    Envelope,
    Stage,
    StageConfig,
    StageConfigError,
)


class RouteByTypeConfig(StageConfig):
    """Where a message's type is read, and types always skipped."""

    type_from: str | None = None
    skip: list[str] = Field(default_factory=list)


def build_route_by_type(config: RouteByTypeConfig, context: BuildContext) -> Stage:
    """Skips messages whose type is disabled now; counts the skips per type."""
    if config.type_from is None:
        path = FieldPath(f"$metadata.{context.type_key}", Root.METADATA, (context.type_key,))
    else:
        try:
            path = parse_path(config.type_from)
        except PathError as exc:
            raise StageConfigError([ConfigIssue(("type_from",), f"bad path: {exc}")]) from None
    disabled = context.disabled_types
    always = frozenset(config.skip)
    # Bounded: only types that are disabled or listed are ever counted.
    skipped: dict[str, int] = {}

    if path.root is Root.METADATA:
        type_key = path.segments[0]

        def process(env: Envelope) -> bool:
            kind = env.message.metadata.get(type_key)
            if kind is None or (kind not in always and kind not in disabled()):
                return True
            skipped[kind] = skipped.get(kind, 0) + 1
            return False

    else:
        read = getter(path)

        def process(env: Envelope) -> bool:
            kind = read(env)
            # Only a string names a type; anything else cannot be disabled.
            if type(kind) is not str or (kind not in always and kind not in disabled()):
                return True
            skipped[kind] = skipped.get(kind, 0) + 1
            return False

    return Stage(process, reads_payload=path.reads_payload, details=lambda: dict(skipped))
