"""``filter``: keep the messages that match a content pattern (see ``nemesis.pipeline.patterns``).

::

    - filter:
        name: big-orders            # optional label
        on_error: no_match          # or dead_letter: a wrong type goes to the DLQ
        match:
          order.city: [msk, spb]
          order.amount: {gt: 1000}
          $metadata.type: order.created
"""

from __future__ import annotations

from typing import Any, Literal, cast

from nemesis.pipeline.patterns import PatternError, compile_pattern
from nemesis.pipeline.stage import (
    BuildContext,
    ConfigIssue,
    Stage,
    StageConfig,
    StageConfigError,
    StageFunction,
)


class FilterConfig(StageConfig):
    """A content pattern; messages that do not match it are filtered out."""

    match: dict[Any, Any]
    # A field of the wrong type for an operator: no match, or dead-letter (type_error).
    on_error: Literal["no_match", "dead_letter"] = "no_match"


def build_filter(config: FilterConfig, context: BuildContext) -> Stage:
    """Compiles the pattern once; the stage is the generated function itself."""
    try:
        compiled = compile_pattern(config.match, on_type_error=config.on_error, label="filter")
    except PatternError as exc:
        raise StageConfigError(
            [ConfigIssue(("match", *issue.path), issue.message) for issue in exc.issues]
        ) from None
    # The generated function returns exactly True or False.
    process = cast(StageFunction, compiled.match_envelope)
    return Stage(process, reads_payload=compiled.reads_payload)
