"""``nemesis dlq list/show/requeue/discard``: the dead-letter store from a terminal."""

from __future__ import annotations

import argparse
import base64
import getpass
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nemesis.broker.port import is_text_key, key_bytes
from nemesis.dlq.port import (
    MAX_PAGE_ROWS,
    DeadLetterFilter,
    DeadLetterRow,
    DeadLetterStore,
    PageRequest,
    Reason,
    Status,
    shown_key,
)
from nemesis.errors import NemesisError
from nemesis.logs import say
from nemesis.terminal import inert, inert_json

if TYPE_CHECKING:
    from nemesis.broker.port import Broker
    from nemesis.config.models import NemesisConfig
    from nemesis.dlq.requeue import ActionResult

ConfigLoader = Callable[[argparse.Namespace], "NemesisConfig"]
Runner = Callable[[Coroutine[Any, Any, int]], int]


def add_dlq_commands(
    dlq: argparse.ArgumentParser,
    config_option: Callable[[argparse.ArgumentParser], None],
    context: DlqContext,
) -> None:
    """Builds ``dlq`` and its actions on the command's parser."""
    dlq.set_defaults(dlq_context=context)
    actions = dlq.add_subparsers(title="dlq commands", metavar="ACTION", required=True)

    listing = actions.add_parser("list", help="dead letters, newest first")
    config_option(listing)
    _filter_options(listing)
    listing.add_argument("--limit", type=int, default=50, help=f"rows (max {MAX_PAGE_ROWS})")
    listing.add_argument("--json", action="store_true", help="JSON lines")
    listing.set_defaults(handler=cmd_list)

    show = actions.add_parser("show", help="one dead letter with its whole payload")
    config_option(show)
    show.add_argument("id", help="the dead letter's id (see `dlq list`)")
    show.add_argument("--json", action="store_true", help="print the row as JSON")
    show.set_defaults(handler=cmd_show)

    for name, handler, verb in (
        ("requeue", cmd_requeue, "send back to their integration (replay path)"),
        ("discard", cmd_discard, "mark as discarded"),
    ):
        action = actions.add_parser(name, help=f"{verb}: ids, or --all-matching a filter")
        config_option(action)
        action.add_argument("ids", nargs="*", help="row ids (see `dlq list`)")
        action.add_argument(
            "--all-matching", action="store_true", help="every dead row the filter matches"
        )
        _filter_options(action)
        action.add_argument("--by", default=None, help="who acts (default: the OS user)")
        action.add_argument("--yes", action="store_true", help="do not ask for confirmation")
        action.set_defaults(handler=handler)


def _filter_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--integration", action="append", default=[], help="repeatable")
    parser.add_argument(
        "--reason", choices=[r.value for r in Reason], help="why the message was dead-lettered"
    )
    parser.add_argument(
        "--status", choices=[s.value for s in Status], help="where the row stands now"
    )
    parser.add_argument("--http-status", type=int, help="the handler's last HTTP status")
    parser.add_argument("--text", help="inside the payload or the error text")
    parser.add_argument("--since", help="newer than this long ago: 15m, 2h, 7d")
    parser.add_argument("--group", help="a failure signature (one group)")


def _filter(args: argparse.Namespace, *, default_status: Status | None = None) -> DeadLetterFilter:
    from nemesis.config.models import parse_duration

    since = None
    if args.since:
        try:
            since = time.time() - parse_duration(args.since)
        except ValueError as exc:
            raise NemesisError(f"--since: {exc}") from exc
    status = args.status or default_status
    return DeadLetterFilter(
        integrations=frozenset(args.integration) if args.integration else None,
        reason=Reason(args.reason) if args.reason else None,
        status=Status(status) if status else None,
        http_status=args.http_status,
        signature=args.group,
        since=since,
        text=args.text,
    )


@dataclass(frozen=True, slots=True)
class DlqContext:
    """What the dlq commands need from the main CLI (it owns config loading and uvloop)."""

    load_config: ConfigLoader
    run_async: Runner
    open_dlq: Callable[[NemesisConfig], Coroutine[Any, Any, DeadLetterStore]]
    open_broker: Callable[[NemesisConfig], Coroutine[Any, Any, Broker]]


def _with_store(
    args: argparse.Namespace, work: Callable[[DeadLetterStore], Coroutine[Any, Any, int]]
) -> int:
    context: DlqContext = args.dlq_context
    config = context.load_config(args)

    async def run() -> int:
        store = await context.open_dlq(config)
        try:
            return await work(store)
        finally:
            await store.close()

    return context.run_async(run())


def cmd_list(args: argparse.Namespace) -> int:
    if not 1 <= args.limit <= MAX_PAGE_ROWS:
        raise NemesisError(f"--limit must be between 1 and {MAX_PAGE_ROWS}")
    where = _filter(args)

    async def work(store: DeadLetterStore) -> int:
        page = await store.query(where, PageRequest(limit=args.limit))
        total = await store.count(where)
        for row in page.rows:
            if args.json:
                sys.stdout.write(_json_line(_row_json(row)))
            else:
                print(inert(_row_line(row)))
        if not args.json:
            say(f"{len(page.rows)} of {total} shown", sys.stderr)
        return 0

    return _with_store(args, work)


def cmd_show(args: argparse.Namespace) -> int:
    async def work(store: DeadLetterStore) -> int:
        row = await store.get(args.id)
        if row is None:
            raise NemesisError(f"no dead letter {args.id}")
        if args.json:
            sys.stdout.write(_json_line(_row_json(row), indent=True))
            return 0
        # Payloads, errors and metadata come from other systems: nothing in them may
        # act on the terminal (ESC sequences, bidi overrides), see nemesis.terminal.
        for name, value in _row_json(row).items():
            if name != "payload":
                print(f"{name:>18}: {inert(str(value))}")
        print("           payload:")
        print(inert(_payload_text(row.payload), multiline=True))
        return 0

    return _with_store(args, work)


def cmd_requeue(args: argparse.Namespace) -> int:
    return _act(args, "requeue")


def cmd_discard(args: argparse.Namespace) -> int:
    return _act(args, "discard")


def _act(args: argparse.Namespace, action: str) -> int:
    from nemesis.dlq.requeue import discard, matching_ids, requeue

    if bool(args.ids) == bool(args.all_matching):
        raise NemesisError(f"dlq {action}: give row ids, or --all-matching with a filter")
    by = args.by or _os_user()
    context: DlqContext = args.dlq_context
    config = context.load_config(args)

    async def run() -> int:
        store = await context.open_dlq(config)
        try:
            ids = list(args.ids)
            description = f"{len(ids)} selected"
            if args.all_matching:
                where = _filter(args, default_status=Status.DEAD)
                ids = list(await matching_ids(store, where))
                description = f"all matching {_describe(args)}"
            if not ids:
                print("nothing to do: no dead rows selected")
                return 0
            if not args.yes and not _confirm(f"{action} {len(ids)} dead letter(s)?"):
                print("cancelled")
                return 1
            if action == "requeue":
                broker = await context.open_broker(config)
                try:
                    result = await requeue(store, broker, ids, by=by, description=description)
                finally:
                    await broker.close()
            else:
                result = await discard(store, ids, by=by, description=description)
        finally:
            await store.close()
        print(_summary(result))
        return 0

    return context.run_async(run())


def _summary(result: ActionResult) -> str:
    verb = "requeued" if result.action.value == "requeue" else "discarded"
    parts = ", ".join(f"{name}: {count}" for name, count in sorted(result.by_integration.items()))
    summary = f"{verb} {result.count} dead letter(s)" + (f" ({parts})" if parts else "")
    if result.payload_cut:
        summary += (
            f"; {result.payload_cut} left dead: their payload was stored cut"
            " (over 16 MiB), so it cannot be replayed"
        )
    return summary


def _describe(args: argparse.Namespace) -> str:
    pairs = [
        f"{name}={value}"
        for name, value in (
            ("integration", ",".join(args.integration)),
            ("reason", args.reason),
            ("http_status", args.http_status),
            ("text", args.text),
            ("since", args.since),
            ("group", args.group),
        )
        if value
    ]
    return "(" + (" ".join(pairs) or "no filter") + ")"


def _confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        raise NemesisError(f"{question} Add --yes to confirm without a terminal")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


def _os_user() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli"


def _row_line(row: DeadLetterRow) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.dead_lettered_at))
    status = "" if row.http_status is None else f" {row.http_status}"
    return (
        f"{row.id}  {when}  {row.integration:<24} {row.status.value:<9} "
        f"{row.reason.value}{status}  {_one_line(row.error, 80)}"
    )


def _row_json(row: DeadLetterRow) -> dict[str, Any]:
    document: dict[str, Any] = {
        "id": row.id,
        "integration": row.integration,
        "event_id": row.event_id,
        "status": row.status.value,
        "reason": row.reason.value,
        "http_status": row.http_status,
        "error": row.error,
        "signature": row.signature,
        "attempts": row.attempts,
        "first_failure_at": row.first_failure_at,
        "dead_lettered_at": row.dead_lettered_at,
        "requeue_count": row.requeue_count,
        "last_action": None if row.last_action is None else row.last_action.value,
        "last_action_by": row.last_action_by,
        "last_action_at": row.last_action_at,
        "source": f"{row.source_topic}/{row.source_partition}@{row.source_offset}",
        "key": shown_key(row.key),
        "stage": row.stage,
        "metadata": dict(row.metadata),
        "payload_size": row.payload_size,
    }
    document["payload"] = _payload_text(row.payload)
    if row.key is not None and not is_text_key(row.key):
        document["key_base64"] = base64.b64encode(key_bytes(row.key)).decode("ascii")
    if row.headers:
        # The record's headers as written: [name, base64 of the value, or null].
        document["headers"] = [
            [name, None if value is None else base64.b64encode(value).decode("ascii")]
            for name, value in row.headers
        ]
    if row.tombstone:
        document["tombstone"] = True
    if row.payload_truncated:
        # A list's preview; shown in full, a payload stored cut (past 16 MiB).
        document["payload_truncated"] = True
    return document


def _json_line(document: dict[str, Any], *, indent: bool = False) -> str:
    import orjson  # here, not at the top: every other command's start-up would pay for it

    text = orjson.dumps(document, option=orjson.OPT_INDENT_2 if indent else None).decode()
    return inert_json(text) + "\n"


def _payload_text(payload: bytes) -> str:
    import orjson

    try:
        return orjson.dumps(orjson.loads(payload), option=orjson.OPT_INDENT_2).decode()
    except orjson.JSONDecodeError:
        pass
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        return payload.hex(" ", 16)


def _one_line(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
