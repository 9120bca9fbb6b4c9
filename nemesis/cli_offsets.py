"""``nemesis offsets show/seek/skip``: an integration's committed offsets, for operators.

``show`` prints, per flow (main, retry tiers, replay) and partition, the
committed offset, the end offset and the lag between them. ``seek`` moves
committed offsets (to earliest, latest, a time or an offset) and ``skip``
moves them past the next N messages: the way out when one message blocks an
ordered integration.

The safety rule. Moving an offset under a reader that is delivering would
redeliver or lose messages unpredictably, so ``seek`` and ``skip`` go ahead
only when one of these holds:

* the admin API (``admin`` in nemesis.yaml, or ``--admin-url``) answers that
  the integration is paused; or
* with ``--force``: that admin API does not run the integration (it does not
  answer, or does not know it) *and* the broker reports no live reader of
  any flow being changed (the process is verifiably down).

Anything else is refused: an integration that runs unpaused (``--force``
does not override that), live readers that no admin API answered for, or an
admin API that cannot be asked and no ``--force``. Each change is written to
the audit log (the DLQ store's, shown by the viewer) with who, what, and the
offsets before and after.
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from nemesis.broker.port import Broker, PartitionInfo, Seek
from nemesis.cli_dlq import DlqContext
from nemesis.dlq.port import Action
from nemesis.errors import NemesisError, TopicNotFound

if TYPE_CHECKING:
    from nemesis.config.models import IntegrationConfig, NemesisConfig
    from nemesis.runtime.retries import FlowSpec

ADMIN_TIMEOUT_S = 5.0
TO_HELP = (
    "earliest, latest, an offset (one partition: with --partition), a time with its zone"
    " (2026-12-01T09:00:00Z) or a duration back from now (--to=-1h: with '=', as it starts"
    " with a dash)"
)


def add_offsets_commands(
    offsets: argparse.ArgumentParser,
    config_option: Callable[[argparse.ArgumentParser], None],
    context: DlqContext,
) -> None:
    """Builds ``offsets`` and its actions on the command's parser."""
    offsets.set_defaults(offsets_context=context)
    actions = offsets.add_subparsers(title="offsets commands", metavar="ACTION", required=True)

    show = actions.add_parser("show", help="committed offset, end offset and lag per partition")
    config_option(show)
    show.add_argument("integration", help="the integration whose offsets to show")
    show.add_argument("--flow", help="one flow (main, retry-N, replay); default: all")
    show.add_argument("--json", action="store_true", help="one JSON document")
    show.set_defaults(handler=cmd_show)

    seek = actions.add_parser("seek", help="move committed offsets (paused or stopped only)")
    config_option(seek)
    seek.add_argument(
        "integration", help="the integration to move (paused, or stopped with --force)"
    )
    seek.add_argument("--to", required=True, help=TO_HELP)
    _change_options(seek)
    seek.set_defaults(handler=cmd_seek)

    skip = actions.add_parser("skip", help="pass over the next N messages (paused or stopped only)")
    config_option(skip)
    skip.add_argument(
        "integration", help="the integration to move (paused, or stopped with --force)"
    )
    skip.add_argument("--count", type=int, required=True, help="messages to skip per partition")
    _change_options(skip)
    skip.set_defaults(handler=cmd_skip)


def _change_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--partition", type=int, help="one partition (default: every one)")
    parser.add_argument("--flow", default="main", help="main (default), retry-N or replay")
    parser.add_argument("--actor", help="who acts, for the audit log (default: $USER)")
    parser.add_argument(
        "--admin-url", help="the admin API to ask whether it is paused (default: from the config)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="go ahead without a paused admin API, if no reader of the integration is alive",
    )


# --- show ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FlowOffsets:
    """One flow's partitions as ``show`` prints them; ``partitions`` None: no topic yet."""

    flow: FlowSpec
    partitions: Sequence[PartitionInfo] | None
    written_at: Mapping[int, float]  # partition -> write time of the next message to deliver


def cmd_show(args: argparse.Namespace) -> int:
    context: DlqContext = args.offsets_context
    config = context.load_config(args)
    integration = _integration(config, args.integration)
    flows = _flows(integration, args.flow)

    async def run() -> int:
        broker = await context.open_broker(config)
        try:
            found = [await _flow_offsets(broker, flow) for flow in flows]
        finally:
            await broker.close()
        if args.json:
            document = {"integration": integration.name, "flows": [_flow_json(f) for f in found]}
            sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            for offsets in found:
                _print_flow(offsets)
        return 0

    return context.run_async(run())


async def _flow_offsets(broker: Broker, flow: FlowSpec) -> FlowOffsets:
    try:
        described = await broker.admin.describe_topic(flow.topic)
    except TopicNotFound:
        return FlowOffsets(flow, None, {})
    partitions = list(described.partitions)
    pending = {
        p.partition: _committed(p, flow.consumer)
        for p in partitions
        if _committed(p, flow.consumer) < p.end_offset
    }
    written = await broker.admin.write_times(flow.topic, pending) if pending else {}
    return FlowOffsets(flow, partitions, written)


def _committed(info: PartitionInfo, consumer: str) -> int:
    return max(info.committed.get(consumer, info.start_offset), info.start_offset)


def _flow_json(offsets: FlowOffsets) -> dict[str, Any]:
    flow = offsets.flow
    document: dict[str, Any] = {"flow": flow.name, "topic": flow.topic, "consumer": flow.consumer}
    if offsets.partitions is None:
        document["partitions"] = None
        return document
    document["partitions"] = [
        {
            "partition": p.partition,
            "start": p.start_offset,
            "committed": _committed(p, flow.consumer),
            "end": p.end_offset,
            "lag": p.end_offset - _committed(p, flow.consumer),
            "next_written_at": offsets.written_at.get(p.partition),
        }
        for p in offsets.partitions
    ]
    return document


def _print_flow(offsets: FlowOffsets) -> None:
    flow = offsets.flow
    print(f"flow {flow.name}: topic {flow.topic}, consumer {flow.consumer}")
    if offsets.partitions is None:
        print("  (no topic yet: nothing was written to it)")
        return
    print(f"  {'partition':>9} {'committed':>12} {'end':>12} {'lag':>10}  next message written")
    for p in offsets.partitions:
        committed = _committed(p, flow.consumer)
        written = offsets.written_at.get(p.partition)
        when = "-" if written is None else _utc(written)
        print(
            f"  {p.partition:>9} {committed:>12} {p.end_offset:>12}"
            f" {p.end_offset - committed:>10}  {when}"
        )


def _utc(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


# --- seek and skip -------------------------------------------------------------------


def cmd_seek(args: argparse.Namespace) -> int:
    from nemesis.config.models import start_from_at

    target = args.to.strip()
    if target.isdigit():
        if args.partition is None:
            raise NemesisError("offsets seek --to <offset> moves one partition: add --partition")
    else:
        try:
            start_from_at(target, 0.0)
        except ValueError as exc:
            raise NemesisError(f"--to: {exc}") from None
    return _change(args, Action.SEEK, f"seek --to {target}", _seek_target(target))


def cmd_skip(args: argparse.Namespace) -> int:
    if args.count < 1:
        raise NemesisError("--count must be at least 1")
    count: int = args.count

    async def target(_broker: Broker, _flow: FlowSpec, info: PartitionInfo, consumer: str) -> int:
        return _committed(info, consumer) + count

    return _change(args, Action.SKIP, f"skip --count {count}", target)


Target = Callable[[Broker, "FlowSpec", PartitionInfo, str], Any]


def _seek_target(target: str) -> Target:
    async def offset_of(broker: Broker, flow: FlowSpec, info: PartitionInfo, consumer: str) -> int:
        if target == "earliest":
            return info.start_offset
        if target == "latest":
            return info.end_offset
        if target.isdigit():
            return int(target)
        from nemesis.config.models import start_from_at

        at = start_from_at(target, time.time()).at
        assert at is not None  # neither earliest nor latest: a time
        return (await broker.admin.offsets_for_time(flow.topic, at))[info.partition]

    return offset_of


def _change(args: argparse.Namespace, action: Action, what: str, target: Target) -> int:
    context: DlqContext = args.offsets_context
    config = context.load_config(args)
    integration = _integration(config, args.integration)
    (flow,) = _flows(integration, args.flow)
    actor = args.actor or _os_user()

    async def run() -> int:
        broker = await context.open_broker(config)
        try:
            try:
                described = await broker.admin.describe_topic(flow.topic)
            except TopicNotFound:
                raise NemesisError(f"flow {flow.name}: topic {flow.topic} does not exist") from None
            partitions = [
                p
                for p in described.partitions
                if args.partition is None or p.partition == args.partition
            ]
            if flow.consumer not in described.consumers:
                raise NemesisError(
                    f"topic {flow.topic} has no consumer {flow.consumer} yet: `nemesis init`"
                    " registers it (so does the integration's first run)"
                )
            if not partitions:
                raise NemesisError(
                    f"topic {flow.topic} has no partition {args.partition}"
                    f" (it has {len(described.partitions)})"
                )
            why = await _check_safe(config, integration, broker, args.admin_url, args.force)
            print(f"{integration.name}: {why}")
            offsets = {
                p.partition: await target(broker, flow, p, flow.consumer) for p in partitions
            }
            print(f"flow {flow.name}: topic {flow.topic}, consumer {flow.consumer}")
            moves: list[Seek] = []
            try:
                for partition, offset in offsets.items():
                    move = await broker.admin.seek(flow.topic, flow.consumer, partition, offset)
                    moves.append(move)
                    delta = move.after - move.before
                    print(
                        f"  partition {move.partition}: {move.before} -> {move.after} ({delta:+d})",
                        flush=True,
                    )
            finally:
                # What moved is audited even when a later partition failed.
                if moves:
                    await _audit(
                        context, config, actor, action, integration.name, flow, what, moves
                    )
        finally:
            await broker.close()
        return 0

    return context.run_async(run())


async def _audit(
    context: DlqContext,
    config: NemesisConfig,
    actor: str,
    action: Action,
    integration: str,
    flow: FlowSpec,
    what: str,
    moves: Sequence[Seek],
) -> None:
    moved = "; ".join(f"p{m.partition} {m.before}->{m.after}" for m in moves)
    description = (
        f"offsets {what}: flow {flow.name}, topic {flow.topic}, consumer {flow.consumer}: {moved}"
    )
    store = await context.open_dlq(config)
    try:
        await store.record_action(
            who=actor,
            action=action,
            integrations=[integration],
            count=sum(abs(m.after - m.before) for m in moves),
            description=description,
        )
    finally:
        await store.close()
    print(f"audit log: {actor} {description}")


# --- the safety rule (see the module docstring) -------------------------------------


async def _check_safe(
    config: NemesisConfig,
    integration: IntegrationConfig,
    broker: Broker,
    admin_url: str | None,
    force: bool,
) -> str:
    """Why changing the offsets is safe now, or NemesisError saying why it is not."""
    from nemesis.runtime.retries import flows_of

    name = integration.name
    url = admin_url or _admin_url(config)
    state = "the admin API is disabled in the config"
    if url is not None:
        state = await _ask_admin(url, name, config)
        if state == "paused":
            return f"paused (the admin API at {url} says so)"
        if state.startswith("runs"):
            raise NemesisError(
                f"integration {name} {state} (the admin API at {url}): pause it first"
                f" (POST {url}/integrations/{name}/pause) or stop it; --force does not"
                " override a running integration"
            )
    live: list[str] = []
    for flow in flows_of(integration):
        try:
            live += await broker.admin.live_readers(flow.topic, flow.consumer)
        except TopicNotFound:
            continue
    if live:
        raise NemesisError(
            f"integration {name} has live readers ({', '.join(live)}) and {state}:"
            " pause it through the admin API of the process that runs it, or stop that process"
        )
    if not force:
        raise NemesisError(
            f"cannot confirm integration {name} is paused: {state}. No reader of it is"
            " alive; if no process runs it, repeat with --force"
        )
    return "no process runs it (no live reader; --force)"


def _admin_url(config: NemesisConfig) -> str | None:
    admin = config.admin
    if not admin.enabled:
        return None
    host = admin.host
    if host in ("0.0.0.0", "::", ""):  # listening everywhere: ask over loopback
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{admin.port}"


async def _ask_admin(url: str, name: str, config: NemesisConfig) -> str:
    """``paused``, ``runs (state: ...) and is not paused``, or what kept the API from saying."""
    headers = {}
    token = config.admin.token
    if token is not None:
        headers["Authorization"] = f"Bearer {token.get_secret_value()}"
    import aiohttp  # only seek and skip ask the admin API: not paid by every command

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=ADMIN_TIMEOUT_S)) as client,
            client.get(f"{url}/integrations/{name}", headers=headers) as answer,
        ):
            code = answer.status
            body = await answer.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"the admin API at {url} did not answer ({type(exc).__name__})"
    if code == 404:
        return f"the admin API at {url} does not run it"
    if code != 200:
        return f"the admin API at {url} answered {code}"
    try:
        status = orjson.loads(body)
    except orjson.JSONDecodeError:
        return f"the admin API at {url} answered something that is not JSON"
    if not isinstance(status, dict) or not isinstance(status.get("paused"), bool):
        return f"the admin API at {url} answered without a paused state"
    if status["paused"]:
        return "paused"
    return f"runs (state: {status.get('state')}) and is not paused"


# --- helpers ---------------------------------------------------------------------------


def _integration(config: NemesisConfig, name: str) -> IntegrationConfig:
    from nemesis.config import load_integrations

    integrations, problems = load_integrations(Path(config.integrations_dir))
    found = integrations.get(name)
    if found is not None:
        return found
    mentioned = [str(p) for p in problems if name in str(p)]
    detail = f": {'; '.join(mentioned)}" if mentioned else ""
    known = ", ".join(sorted(integrations)) or "none"
    raise NemesisError(
        f"no valid integration {name} in {config.integrations_dir}{detail} (known: {known})"
    )


def _flows(integration: IntegrationConfig, name: str | None) -> list[FlowSpec]:
    from nemesis.runtime.retries import flows_of

    flows = flows_of(integration)
    if name is None:
        return flows
    chosen = [f for f in flows if f.name == name]
    if not chosen:
        names = ", ".join(f.name for f in flows)
        raise NemesisError(f"integration {integration.name} has no flow {name} (it has {names})")
    return chosen


def _os_user() -> str:
    user = os.environ.get("USER")
    if user:
        return user
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "cli"
