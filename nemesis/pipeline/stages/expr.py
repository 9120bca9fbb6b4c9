"""``expr``: the escape hatch, a JMESPath expression for what patterns cannot say.

::

    - expr:
        jmespath: "length(items[?price > `100`]) > `2`"
        input: payload              # or message: {payload, key, topic, partition, offset, metadata}

The message is kept when the result is true in JMESPath's sense (not false,
null, "", [] or {}). JMESPath is interpreted per message: about 100x the
cost of a compiled pattern (tests/bench/pipeline.py prints it), so use a pattern
where one can say it. Needs the ``jmespath`` package, imported only when a
pipeline uses this stage.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

from nemesis.pipeline.stage import (
    TYPE_ERROR,
    BuildContext,
    ConfigIssue,
    Envelope,
    Stage,
    StageConfig,
    StageConfigError,
    StageFailure,
)


class ExprConfig(StageConfig):
    """A JMESPath expression; messages for which it is false are filtered out."""

    jmespath: str
    input: Literal["payload", "message"] = "payload"
    # An expression that fails on a message (a function given the wrong type): no match, or DLQ.
    on_error: Literal["no_match", "dead_letter"] = "no_match"


def _falsy(result: object) -> bool:
    # JMESPath truthiness: 0 is true, empty strings and collections are false.
    return result is None or result is False or (type(result) in (str, list, dict) and not result)


def build_expr(config: ExprConfig, context: BuildContext) -> Stage:
    """Compiles the expression once; it is evaluated per message."""
    try:
        # Imported by name: an optional dependency without type stubs.
        jmespath: Any = importlib.import_module("jmespath")
    except ImportError:
        raise StageConfigError(
            [
                ConfigIssue(
                    ("jmespath",),
                    "the expr stage needs the jmespath package (pip install jmespath)",
                )
            ]
        ) from None
    error_type: type[Exception] = jmespath.exceptions.JMESPathError
    try:
        expression = jmespath.compile(config.jmespath)
    except error_type as exc:
        raise StageConfigError(
            [ConfigIssue(("jmespath",), f"invalid JMESPath expression: {exc}")]
        ) from None
    search = expression.search
    whole_message = config.input == "message"
    fail = config.on_error == "dead_letter"

    def process(env: Envelope) -> bool:
        data = env.document
        if whole_message:
            message = env.message
            data = {
                "payload": data,
                "key": message.key,
                "topic": message.topic,
                "partition": message.partition,
                "offset": message.offset,
                "metadata": dict(message.metadata),
            }
        try:
            result = search(data)
        except error_type as exc:
            if fail:
                # JMESPath's type errors name the function and the types, not the values.
                raise StageFailure(TYPE_ERROR, f"expr: {type(exc).__name__}") from None
            return False
        return not _falsy(result)

    return Stage(process, reads_payload=True)
