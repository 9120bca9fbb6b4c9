"""``nemesis queues describe``: a queue source's queue, as ``topics describe`` shows a topic.

A queue is not on the process's backend: it is found through the
integration that reads it (by the integration's name or the queue's), whose
``source:`` says where it is; credentials come from the AWS chain as for
``nemesis run``. Only GetQueueUrl and GetQueueAttributes are called.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from nemesis.errors import NemesisError

if TYPE_CHECKING:
    from nemesis.backends.sqs import SqsSourceConfig
    from nemesis.config.models import NemesisConfig


def add_queue_commands(
    queues: argparse.ArgumentParser,
    config_option: Callable[[argparse.ArgumentParser], None],
    process_config: Callable[[argparse.Namespace], NemesisConfig],
) -> None:
    """``queues describe``."""
    commands = queues.add_subparsers(title="queue commands", metavar="ACTION", required=True)
    describe = commands.add_parser(
        "describe", help="a queue source's URL, kind, counts, visibility and redrive policy"
    )
    config_option(describe)
    describe.add_argument("name", help="the integration that reads the queue, or the queue's name")
    describe.add_argument("--json", action="store_true", help="print JSON instead of lines")

    def run(args: argparse.Namespace) -> int:
        return cmd_queues_describe(args, process_config(args))

    describe.set_defaults(handler=run)


def queue_source(config: NemesisConfig, name: str) -> tuple[str, SqsSourceConfig]:
    """The integration reading queue ``name`` (or named ``name``) and its source."""
    from nemesis.backends.sqs import SqsSourceConfig
    from nemesis.config import load_integrations

    integrations, _problems = load_integrations(Path(config.integrations_dir))
    queues = {
        integration: source
        for integration, loaded in sorted(integrations.items())
        if isinstance(source := loaded.source, SqsSourceConfig)
    }
    if name in queues:
        return name, queues[name]
    for integration, source in queues.items():
        if source.queue_label == name:
            return integration, source
    known = ", ".join(f"{i} ({s.queue_label})" for i, s in queues.items()) or "none"
    raise NemesisError(
        f"no integration in {config.integrations_dir} reads a queue named {name}, and none of"
        f" that name has a queue source (integrations with one: {known})"
    )


def cmd_queues_describe(args: argparse.Namespace, config: NemesisConfig) -> int:
    from nemesis.cli import EXIT_OK, run_async

    integration, source = queue_source(config, args.name)
    try:
        from nemesis.broker.sqs import describe_queue, format_description
    except ImportError as exc:
        raise NemesisError(
            f"integration {integration}: describing its queue needs aiobotocore:"
            " pip install 'nemesis[sqs]'"
        ) from exc

    async def describe() -> int:
        description = await describe_queue(source)
        if args.json:
            document = {"integration": integration, **description.as_dict()}
            sys.stdout.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
        else:
            sys.stdout.write(format_description(description, integration))
        return EXIT_OK

    return run_async(describe())
