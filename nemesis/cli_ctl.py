"""``nemesis ctl``: a team's control of its own integrations, through the admin API.

Every command is one or two calls of the admin API with the caller's token
(``$NEMESIS_TOKEN``, or ``--token-file``; never an argument, which other
users of the machine would see in the process list). The API decides what
the token may do: a team's token reaches its own integrations, and another
team's answers as one that does not exist.

::

    nemesis ctl status [NAME]              state, lag, live values
    nemesis ctl pause NAME / resume NAME
    nemesis ctl set NAME delivery.workers=16 rate_limits.main=200
    nemesis ctl flag NAME --disable order.test [--enable order.old]
    nemesis ctl reset NAME [FIELD]         back to the YAML
    nemesis ctl offsets NAME               committed offsets and lag per partition
    nemesis ctl skip NAME --count N        past a message that blocks (paused only)
    nemesis ctl audit [--limit N]          who changed what

The admin API's address: ``--url``, else ``$NEMESIS_ADMIN_URL``, else the
``admin`` section of the configuration (``-c``), else ``http://127.0.0.1:8081``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from nemesis.errors import NemesisError
from nemesis.terminal import inert

if TYPE_CHECKING:
    import urllib.error

TOKEN_ENV: Final = "NEMESIS_TOKEN"
URL_ENV: Final = "NEMESIS_ADMIN_URL"
DEFAULT_URL: Final = "http://127.0.0.1:8081"
TIMEOUT_S: Final = 30.0
# The live fields ``set`` takes, as PATCH spells them (``nemesis.admin.schemas``): the
# same as ``nemesis.config.overrides.LIVE_FIELDS`` (tests/test_cli_ctl.py checks), listed
# again so that the command line does not load the configuration models to build ``ctl``.
SETTABLE: Final = (
    "delivery.workers",
    "delivery.buffer",
    "delivery.batch.size",
    "delivery.batch.max_wait_ms",
    "rate_limits.main",
    "rate_limits.retry",
    "rate_limits.replay",
    "flags.disabled_types",
    "paused",
)


def add_ctl_commands(
    ctl: argparse.ArgumentParser, config_option: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Builds ``ctl`` and its actions on the command's parser."""
    actions = ctl.add_subparsers(title="ctl commands", metavar="ACTION", required=True)

    def action(name: str, help_text: str, handler: Callable[[argparse.Namespace], int]) -> Any:
        parser = actions.add_parser(name, help=help_text)
        config_option(parser)
        parser.add_argument("--url", help=f"the admin API (default: ${URL_ENV}, or -c's admin)")
        parser.add_argument(
            "--token-file", type=Path, help=f"a file holding the token (default: ${TOKEN_ENV})"
        )
        parser.set_defaults(handler=handler)
        return parser

    status = action("status", "your integrations' state, lag and live values", cmd_status)
    status.add_argument("integration", nargs="?", help="one integration (default: all yours)")
    status.add_argument("--json", action="store_true", help="the API's JSON as it answered")
    for verb, help_text in (("pause", "stop reading"), ("resume", "read again")):
        switch = action(verb, help_text, cmd_pause_resume)
        switch.add_argument("integration", help="one of your team's integrations")
        switch.set_defaults(verb=verb)
    tune = action("set", "live values over the YAML (FIELD=VALUE ...)", cmd_set)
    tune.add_argument("integration", help="one of your team's integrations")
    tune.add_argument(
        "assignments", nargs="+", metavar="FIELD=VALUE", help=f"one of {', '.join(SETTABLE)}"
    )
    flag = action("flag", "message types acknowledged without delivery", cmd_flag)
    flag.add_argument("integration", help="one of your team's integrations")
    flag.add_argument(
        "--disable", action="append", default=[], metavar="TYPE", help="acknowledge TYPE unsent"
    )
    flag.add_argument(
        "--enable", action="append", default=[], metavar="TYPE", help="deliver TYPE again"
    )
    reset = action("reset", "back to the YAML: every live field, or one", cmd_reset)
    reset.add_argument("integration", help="one of your team's integrations")
    reset.add_argument("field", nargs="?", choices=SETTABLE, help="one field (default: all)")
    offsets = action("offsets", "committed offset, end offset and lag per partition", cmd_offsets)
    offsets.add_argument("integration", help="one of your team's integrations")
    skip = action("skip", "pass over the next N messages of a paused integration", cmd_skip)
    skip.add_argument("integration", help="one of your team's integrations (paused)")
    skip.add_argument("--count", type=int, required=True, help="messages to pass over")
    skip.add_argument("--flow", default="main", help="main (default), retry-N or replay")
    skip.add_argument("--partition", type=int, help="one partition (default: every one)")
    audit = action("audit", "who changed what, newest first", cmd_audit)
    audit.add_argument("--limit", type=int, default=20, help="entries shown (default: 20)")


class AdminClient:
    """The admin API with one token: JSON in, JSON out, refusals as ``NemesisError``."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url.rstrip("/")
        self._token = token

    def call(self, method: str, path: str, body: Any = None) -> Any:
        # Imported here: urllib.request costs `nemesis validate` a sixth of its start-up.
        import urllib.error
        import urllib.request

        headers = {"accept": "application/json"}
        if self._token:
            headers["authorization"] = f"Bearer {self._token}"
        data = None
        if body is not None:
            data = _dumps(body).encode()
            headers["content-type"] = "application/json"
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise NemesisError(f"the admin API refused {method} {path}: {_refusal(exc)}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise NemesisError(f"the admin API at {self.url} did not answer: {reason}") from None
        except json.JSONDecodeError:
            raise NemesisError(f"the admin API at {self.url} answered no JSON") from None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _refusal(exc: urllib.error.HTTPError) -> str:
    try:
        detail = json.loads(exc.read()).get("detail")
    except (json.JSONDecodeError, AttributeError, OSError):
        detail = None
    if isinstance(detail, list):  # a 422: each field and what is wrong with it
        detail = "; ".join(
            f"{'.'.join(str(p) for p in item.get('loc', [])[1:])}: {item.get('msg')}"
            for item in detail
            if isinstance(item, dict)
        )
    hint = {401: f" (set ${TOKEN_ENV} to your team's token)"}.get(exc.code, "")
    return f"{exc.code} {detail or exc.reason}{hint}"


def _client(args: argparse.Namespace) -> AdminClient:
    url = args.url or os.environ.get(URL_ENV)
    if not url:
        url = _configured_url(args.config) or DEFAULT_URL
    if args.token_file is not None:
        try:
            token: str | None = args.token_file.read_text().strip()
        except OSError as exc:
            raise NemesisError(f"cannot read {args.token_file}: {exc.strerror}") from None
    else:
        token = os.environ.get(TOKEN_ENV) or None
    return AdminClient(url, token)


def _configured_url(path: Path | None) -> str | None:
    if path is None and not Path("nemesis.yaml").exists():
        return None
    from nemesis.cli_offsets import _admin_url
    from nemesis.config.loader import load_process_config

    return _admin_url(load_process_config(path or Path("nemesis.yaml")))


def _name(integration: str) -> str:
    return urllib.parse.quote(integration, safe="")


def _print(text: str) -> None:
    # What the API answered is shown as text, never as terminal control sequences.
    print(inert(text))


def _line(status: dict[str, Any]) -> str:
    lag = status.get("lag") or {}
    parts = [
        f"{status.get('name')}: {status.get('state')}",
        "paused" if status.get("paused") else "reading",
    ]
    if isinstance(lag, dict) and lag.get("messages") is not None:
        parts.append(f"lag {lag['messages']}")
    live = [
        f"{s['field']}={_dumps(s['value'])} ({s['source']})"
        for s in status.get("settings", [])
        if isinstance(s, dict) and s.get("source") == "override"
    ]
    if live:
        parts.append("overrides: " + ", ".join(live))
    return "; ".join(parts)


def cmd_status(args: argparse.Namespace) -> int:
    client = _client(args)
    if args.integration:
        found = [client.call("GET", f"/integrations/{_name(args.integration)}")]
    else:
        found = client.call("GET", "/integrations")["integrations"]
    if args.json:
        sys.stdout.write(json.dumps(found, indent=2, ensure_ascii=False) + "\n")
    else:
        for status in found:
            _print(_line(status))
    return 0


def cmd_pause_resume(args: argparse.Namespace) -> int:
    status = _client(args).call("POST", f"/integrations/{_name(args.integration)}/{args.verb}")
    _print(_line(status))
    return 0


def parse_assignment(text: str) -> tuple[str, Any]:
    """``delivery.workers=16`` -> (field, 16): a JSON value, or a list of types for flags."""
    field, sep, raw = text.partition("=")
    if not sep or field not in SETTABLE:
        raise NemesisError(
            f"{text!r}: expected FIELD=VALUE with FIELD one of {', '.join(SETTABLE)}"
        )
    if field == "flags.disabled_types":
        return field, [t.strip() for t in raw.split(",") if t.strip()]
    try:
        return field, json.loads(raw)
    except json.JSONDecodeError:
        raise NemesisError(f"{text!r}: the value is not a number, true, false or null") from None


def patch_body(assignments: list[tuple[str, Any]]) -> dict[str, Any]:
    """Dotted fields as the nested body PATCH takes."""
    body: dict[str, Any] = {}
    for field, value in assignments:
        *sections, last = field.split(".")
        node = body
        for section in sections:
            node = node.setdefault(section, {})
        node[last] = value
    return body


def cmd_set(args: argparse.Namespace) -> int:
    body = patch_body([parse_assignment(text) for text in args.assignments])
    status = _client(args).call("PATCH", f"/integrations/{_name(args.integration)}", body)
    _print(_line(status))
    return 0


def cmd_flag(args: argparse.Namespace) -> int:
    if not args.disable and not args.enable:
        raise NemesisError("say what to flag: --disable TYPE and/or --enable TYPE")
    client = _client(args)
    path = f"/integrations/{_name(args.integration)}"
    current = client.call("GET", path)
    setting = next(
        (s for s in current.get("settings", []) if s.get("field") == "flags.disabled_types"), None
    )
    disabled = list(setting["value"]) if setting and isinstance(setting.get("value"), list) else []
    for kind in args.disable:
        if kind not in disabled:
            disabled.append(kind)
    disabled = [kind for kind in disabled if kind not in set(args.enable)]
    status = client.call("PATCH", path, {"flags": {"disabled_types": disabled}})
    _print(_line(status))
    return 0


def cmd_reset(args: argparse.Namespace) -> int:
    path = f"/integrations/{_name(args.integration)}/overrides"
    if args.field:
        path += f"/{_name(args.field)}"
    _print(_line(_client(args).call("DELETE", path)))
    return 0


def cmd_audit(args: argparse.Namespace) -> int:
    page = _client(args).call("GET", f"/audit?limit={max(1, min(args.limit, 500))}")
    for entry in page["entries"]:
        when = datetime.datetime.fromtimestamp(entry["at"], datetime.UTC).isoformat(
            timespec="seconds"
        )
        names = ", ".join(entry["integrations"]) or "-"
        _print(f"{when} {entry['who']} {entry['action']} {names}: {entry['description']}")
    return 0


def cmd_offsets(args: argparse.Namespace) -> int:
    found = _client(args).call("GET", f"/integrations/{_name(args.integration)}/offsets")
    for flow in found["flows"]:
        _print(f"flow {flow['flow']}: topic {flow['topic']}, consumer {flow['consumer']}")
        if flow["partitions"] is None:
            _print("  (no topic yet: nothing was written to it)")
            continue
        for p in flow["partitions"]:
            _print(
                f"  partition {p['partition']}: committed {p['committed']}, end {p['end']},"
                f" lag {p['lag']}"
            )
    return 0


def cmd_skip(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"flow": args.flow, "count": args.count}
    if args.partition is not None:
        body["partition"] = args.partition
    done = _client(args).call("POST", f"/integrations/{_name(args.integration)}/offsets/skip", body)
    for move in done["moves"]:
        delta = move["after"] - move["before"]
        _print(f"  partition {move['partition']}: {move['before']} -> {move['after']} ({delta:+d})")
    return 0
