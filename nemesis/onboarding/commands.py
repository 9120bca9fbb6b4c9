"""``nemesis new``, ``nemesis check-handler`` and ``nemesis schema``: the onboarding commands.

``nemesis.cli`` builds them with the ``add_*_command`` functions; the work is
done by ``templates``, ``probe`` and ``schema`` in this package.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from nemesis.errors import NemesisError
from nemesis.onboarding.choices import (
    DEFAULT_DATA,
    DEFAULT_PORTS,
    DEFAULT_URLS,
    HANDLER_LANGS,
    SCHEMA_KINDS,
)

# The work is imported by the command that does it (building the parser loads no models).
if TYPE_CHECKING:
    from nemesis.onboarding.probe import ProbeOptions

AsyncRunner = Callable[[Coroutine[Any, Any, int]], int]

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1


def add_new_command(new: argparse.ArgumentParser) -> None:
    """Builds ``new handler`` and ``new integration`` on the command's parser."""
    kinds = new.add_subparsers(title="what to create", metavar="KIND", required=True)

    handler = kinds.add_parser("handler", help="a runnable handler project with tests")
    handler.add_argument("directory", type=Path, help="where to write it (new or empty)")
    handler.add_argument(
        "--lang",
        choices=HANDLER_LANGS,
        default="python-fastapi",
        help="the handler's language and framework (default: %(default)s)",
    )
    handler.add_argument("--force", action="store_true", help="write into a non-empty folder")
    handler.set_defaults(handler=cmd_new_handler)

    integration = kinds.add_parser("integration", help="a commented integration YAML")
    integration.add_argument("name", help="lowercase, dashes: <topic>-to-<team>")
    integration.add_argument("--topic", help="default: the part of NAME before -to-")
    integration.add_argument("--consumer", help="default: NAME")
    integration.add_argument(
        "--url", default=DEFAULT_URLS["python-fastapi"], help="the handler (default: %(default)s)"
    )
    integration.add_argument(
        "--owner",
        action="append",
        default=[],
        help="owning team, repeatable (default: team-<the part of NAME after -to->)",
    )
    integration.add_argument("--pipeline", help="a pipeline from pipelines/")
    integration.add_argument(
        "--dir", type=Path, default=Path("integrations"), help="default: %(default)s"
    )
    integration.add_argument("--force", action="store_true", help="overwrite the file")
    integration.set_defaults(handler=cmd_new_integration)


def add_check_handler_command(check: argparse.ArgumentParser, run_async: AsyncRunner) -> None:
    """Builds ``check-handler`` on the command's parser."""
    check.add_argument("url", nargs="?", help="http(s)://... or grpc(s)://host:port")
    check.add_argument(
        "--integration", type=Path, help="take the URL, timeout, headers and batch size from it"
    )
    check.add_argument("--timeout-s", type=float, default=None, help="default 5")
    check.add_argument("--batch", type=int, default=None, help="probe a batch of N events")
    check.add_argument("--type", default="nemesis.probe", help="ce-type of the probes")
    check.add_argument("--data", help=f"a realistic payload (default: {DEFAULT_DATA.decode()})")
    check.add_argument("--data-file", type=Path, help="the payload from a file")
    check.add_argument(
        "--content-type", default="application/json", help="of the probes (default: %(default)s)"
    )
    check.add_argument(
        "--header", action="append", default=[], metavar="K=V", help="request header, repeatable"
    )
    check.add_argument("--slow-ms", type=float, default=1000.0, help="warn above this latency")
    check.add_argument(
        "--signing-secret-env",
        action="append",
        default=None,
        metavar="VAR",
        help="sign the probes with the secret in VAR (twice: both secrets of a rotation)"
        " and check that the handler refuses unsigned and stale requests",
    )
    check.add_argument("--json", action="store_true", help="the report as JSON")
    check.set_defaults(handler=functools.partial(cmd_check_handler, run_async=run_async))


def add_schema_command(schema: argparse.ArgumentParser) -> None:
    """Builds ``schema`` on the command's parser."""
    schema.add_argument(
        "kind",
        nargs="?",
        choices=SCHEMA_KINDS,
        default="integration",
        help="which file kind (default: %(default)s)",
    )
    schema.add_argument("-o", "--output", type=Path, help="write to a file instead of stdout")
    schema.set_defaults(handler=cmd_schema)


# What to run in a new handler project, per language: (command, what it does).
_NEXT_STEPS: Final[Mapping[str, tuple[tuple[str, str], ...]]] = {
    "python-fastapi": (
        ("make install", "or: pip install -r requirements.txt"),
        ("make test", "the handler's own contract tests"),
        ("export NEMESIS_SIGNING_DISABLED=true", "unsigned, to try it (or NEMESIS_SIGNING_SECRET)"),
        ("make run", "serves on 127.0.0.1:{port}"),
    ),
    "python-grpc": (
        ("make install", "or: pip install -r requirements.txt"),
        ("make proto", "generate the gRPC code"),
        ("make test", "the handler's own contract tests"),
        ("export NEMESIS_SIGNING_DISABLED=true", "unsigned, to try it (or NEMESIS_SIGNING_SECRET)"),
        ("make run", "serves on 127.0.0.1:{port}"),
    ),
    "go-http": (
        ("make test", "go vet and go test: the contract and the signing vectors"),
        ("export NEMESIS_SIGNING_DISABLED=true", "unsigned, to try it (or NEMESIS_SIGNING_SECRET)"),
        ("make run", "go build, then serves on 127.0.0.1:{port}"),
    ),
    "typescript-node": (
        ("npm install", "standardwebhooks, and typescript and @types/node for the build"),
        ("npm test", "tsc, then node --test: the contract and the signing vectors"),
        ("export NEMESIS_SIGNING_DISABLED=true", "unsigned, to try it (or NEMESIS_SIGNING_SECRET)"),
        ("npm start", "serves on 127.0.0.1:{port}"),
    ),
    "java-http": (
        ("./build.sh", "Maven copies the Standard Webhooks jar to lib/, javac, then the tests"),
        ("export NEMESIS_SIGNING_DISABLED=true", "unsigned, to try it (or NEMESIS_SIGNING_SECRET)"),
        (
            "java -cp 'build/classes:lib/*' {java_package}.Server",
            "serves on 127.0.0.1:{port}",
        ),
    ),
}
# The file a team edits in each template, and the function in it.
_LOGIC: Final[Mapping[str, str]] = {
    "handler.py": "handle",
    "handler.go": "Handle",
    "handler.ts": "handle",
    "Handler.java": "handle",
}


def cmd_new_handler(args: argparse.Namespace) -> int:
    from nemesis.onboarding.templates import new_handler

    """``nemesis new handler``."""
    directory: Path = args.directory
    written = new_handler(directory, args.lang, force=args.force)
    for path in written:
        print(f"wrote {path}")
    logic = next(path for path in written if path.name in _LOGIC)
    java_package = (
        logic.parent.relative_to(directory / "src/main/java") if logic.suffix == ".java" else None
    )
    values = {"port": DEFAULT_PORTS[args.lang], "java_package": str(java_package).replace("/", ".")}
    steps = [
        (command.format(**values), note.format(**values))
        for command, note in _NEXT_STEPS[args.lang]
    ]
    width = max(len(command) for command, _ in steps)
    lines = [f"  {command:<{width}}  # {note}" for command, note in steps]
    print(
        f"\nnext, in {directory}:\n"
        + "\n".join(lines)
        + f"\n  nemesis check-handler {DEFAULT_URLS[args.lang]}\n"
        f"then write your logic in {logic.relative_to(directory)} ({_LOGIC[logic.name]})."
    )
    return EXIT_OK


def cmd_new_integration(args: argparse.Namespace) -> int:
    from nemesis.onboarding.templates import IntegrationSpec, new_integration

    """``nemesis new integration``."""
    spec = IntegrationSpec(
        name=args.name,
        topic=args.topic,
        consumer=args.consumer,
        url=args.url,
        owners=tuple(args.owner),
        pipeline=args.pipeline,
    )
    path = new_integration(spec, args.dir, force=args.force)
    print(f"wrote {path}\nnext: nemesis validate, then open a pull request")
    return EXIT_OK


def cmd_check_handler(args: argparse.Namespace, run_async: AsyncRunner) -> int:
    """``nemesis check-handler``: exit 0 when the handler follows the contract, else 1."""
    return run_async(_check(_probe_options(args), as_json=args.json))


async def _check(options: ProbeOptions, *, as_json: bool) -> int:
    from nemesis.onboarding.probe import check_handler

    report = await check_handler(options)
    print(json.dumps(report.as_dict(), indent=2) if as_json else report.format())
    return EXIT_OK if report.passed else EXIT_FAILED


def cmd_schema(args: argparse.Namespace) -> int:
    from nemesis.onboarding.schema import json_schema

    """``nemesis schema``."""
    text = json.dumps(json_schema(args.kind), indent=2) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
        print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


def _probe_options(args: argparse.Namespace) -> ProbeOptions:
    from nemesis.config.loader import load_integration_file
    from nemesis.onboarding.probe import ProbeOptions

    url: str | None = args.url
    timeout_s, batch, headers = 5.0, 0, {}
    signing_env: tuple[str, ...] = ()
    if args.integration is not None:
        # Loaded like `nemesis run` loads it: ${VAR} headers need their variables.
        config = load_integration_file(args.integration)
        url = url or config.target.url
        timeout_s = config.target.timeout_s
        batch = config.delivery.batch.size
        headers = dict(config.target.headers)
        if config.target.signing is not None:
            signing_env = tuple(config.target.signing.secrets_env)
    if url is None:
        raise NemesisError("check-handler needs a URL or --integration FILE")
    for pair in args.header:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise NemesisError(f"--header {pair!r}: expected NAME=VALUE")
        headers[name] = value
    if args.data is not None and args.data_file is not None:
        raise NemesisError("give --data or --data-file, not both")
    if args.data_file is not None:
        try:
            data = args.data_file.read_bytes()
        except OSError as exc:
            raise NemesisError(f"{args.data_file}: {exc.strerror or exc}") from exc
    else:
        data = DEFAULT_DATA if args.data is None else args.data.encode()
    options = ProbeOptions(
        url=url,
        timeout_s=args.timeout_s if args.timeout_s is not None else timeout_s,
        batch_size=args.batch if args.batch is not None else batch,
        data=data,
        content_type=args.content_type,
        event_type=args.type,
        headers=headers,
        slow_ms=args.slow_ms,
        signing_secrets_env=(
            signing_env if args.signing_secret_env is None else tuple(args.signing_secret_env)
        ),
    )
    _check_target(options)
    return options


def _check_target(options: ProbeOptions) -> None:
    from pydantic import ValidationError

    from nemesis.config.models import TargetConfig

    signing = None
    if options.signing_secrets_env:
        signing = {"secrets_env": list(options.signing_secrets_env)}
    try:
        TargetConfig.model_validate(
            {
                "url": options.url,
                "timeout_s": options.timeout_s,
                "headers": dict(options.headers),
                "signing": signing,
            }
        )
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise NemesisError(f"check-handler: {problems}") from exc
    for name in options.signing_secrets_env:
        if not os.environ.get(name):
            raise NemesisError(
                f"--signing-secret-env {name}: the variable is unset or empty;"
                " export the handler's signing secret in it"
            )
