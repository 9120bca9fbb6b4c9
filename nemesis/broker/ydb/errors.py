"""YDB SDK exceptions translated into Nemesis' error tree, at the backend boundary.

The SDK raises ``ydb.Error`` subclasses named after the server's status
codes, plus ``TimeoutError`` from our own deadlines around its calls (it
retries retriable errors forever, so every call runs under a deadline).
Which Nemesis error each becomes is decided here and nowhere else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from ydb import issues

from nemesis.errors import (
    BrokerAccessDenied,
    BrokerError,
    BrokerTimeout,
    DlqError,
    DlqTimeout,
    TopicExists,
    TopicNotFound,
)

T = TypeVar("T")

# The server answered "no such path" (a topic, a consumer, a table) in one of its two ways.
_MISSING = (issues.SchemeError, issues.NotFound)
_DENIED = (issues.Unauthenticated, issues.Unauthorized)
_TIMED_OUT = (TimeoutError, issues.DeadlineExceed, issues.Timeout)


def broker_error(exc: BaseException, what: str) -> BrokerError:
    """The BrokerError for a failed topic call; ``what`` names the call and its object."""
    text = f"{what}: {_describe(exc)}"
    if isinstance(exc, _TIMED_OUT):
        return BrokerTimeout(text)
    if isinstance(exc, _MISSING):
        return TopicNotFound(text)
    if isinstance(exc, issues.AlreadyExists):
        return TopicExists(text)
    if isinstance(exc, _DENIED):
        return BrokerAccessDenied(text)
    return BrokerError(text)


# What a server answers a transaction that reads a table it wrote before, or writes a
# table with secondary indexes twice, when its "immediate effects" are off
# (ydb-platform/ydb ydb/core/kqp/provider/yql_kikimr_provider.h,
# TKikimrTransactionContextBase::ApplyTableOperations): YDB before 24.1, or the
# table service's enable_kqp_immediate_effects turned off.
_NO_IMMEDIATE_EFFECTS = (
    "in current transaction won't be seen by operation",
    "Multiple modification of table with secondary indexes is not supported",
)
IMMEDIATE_EFFECTS_NEEDED = (
    "this YDB server does not let a transaction read its own writes (immediate effects),"
    " which Nemesis' DLQ and fleet stores need: use YDB 24.1 or newer, with"
    " table_service_config.enable_kqp_immediate_effects left on"
)


def lacks_immediate_effects(exc: BaseException) -> bool:
    """Whether ``exc`` is the server's refusal of a transaction reading its own writes."""
    return isinstance(exc, issues.Error) and any(m in str(exc) for m in _NO_IMMEDIATE_EFFECTS)


def dlq_error(exc: BaseException, what: str) -> DlqError:
    """The DlqError for a failed table call."""
    if lacks_immediate_effects(exc):
        return DlqError(f"{what}: {IMMEDIATE_EFFECTS_NEEDED} (the server said {_describe(exc)})")
    text = f"{what}: {_describe(exc)}"
    if isinstance(exc, _TIMED_OUT):
        return DlqTimeout(text)
    return DlqError(text)


def is_translatable(exc: BaseException) -> bool:
    """Whether ``exc`` is the SDK's (or our deadline's), as opposed to a bug to let through."""
    return isinstance(exc, issues.Error | TimeoutError)


async def topic_call(what: str, call: Awaitable[T], timeout_s: float) -> T:
    """Awaits one SDK topic call under a deadline; its failures come out as BrokerErrors."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except (issues.Error, TimeoutError) as exc:
        raise broker_error(exc, what) from exc


async def table_call(what: str, call: Awaitable[T], timeout_s: float) -> T:
    """Awaits one SDK table call under a deadline; its failures come out as DlqErrors."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except (issues.Error, TimeoutError) as exc:
        raise dlq_error(exc, what) from exc


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError) and not str(exc):
        return "no answer in time"
    return f"{type(exc).__name__}: {exc}"
