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


def dlq_error(exc: BaseException, what: str) -> DlqError:
    """The DlqError for a failed table call."""
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
