"""The ``nemesis`` command line (docs/design.md, section 4)."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from nemesis import __version__
from nemesis.errors import ConfigError, NemesisError
from nemesis.logs import configure_logging, say
from nemesis.terminal import inert

# Each command imports what it uses when it runs: `nemesis validate` in a pull request
# and `nemesis --help` must not pay for the admin API, the brokers' SDKs or the proxy.
if TYPE_CHECKING:
    from nemesis.admin.server import Service, ServiceFailures
    from nemesis.broker.port import Broker, OutgoingMessage
    from nemesis.cli_dlq import DlqContext
    from nemesis.config.models import NemesisConfig
    from nemesis.dlq import DeadLetterStore
    from nemesis.fleet.member import FleetMember
    from nemesis.runtime.app import Proxy
    from nemesis.runtime.reload import ConfigReloader

log = logging.getLogger("nemesis")

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    # Nemesis uses no pydantic plugin, and discovering them scans every installed
    # distribution's metadata (about a third of `nemesis validate`'s start-up). An
    # operator who wants plugins sets the variable to something else.
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    from_the_shell = argv is None
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not hasattr(args, "handler"):
        parser.print_help()
        return EXIT_USAGE
    _configure_logging(getattr(args, "log_level", "info"))
    if not faulthandler.is_enabled():
        # A signal SQLite cannot turn into an error (SIGBUS on a WAL index cut under
        # the embedded log, docs/design.md) ends the process with the stack of every
        # thread on stderr, not silently. A stderr without a file descriptor (main()
        # called with it captured) goes without.
        with contextlib.suppress(AttributeError, OSError, RuntimeError, ValueError):
            faulthandler.enable()
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        code = handler(args)
    except ConfigError as exc:
        from nemesis.config.loader import format_problems

        say(format_problems(exc.problems), sys.stderr, logging.ERROR)
        return EXIT_INVALID
    except NemesisError as exc:
        say(f"nemesis: {inert(str(exc), multiline=True)}", sys.stderr, logging.ERROR)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`nemesis dlq list | head`): what is left unwritten has
        # nowhere to go. Python's own flush at exit would raise again, so stdout points
        # at /dev/null from here; 141 is a shell's code for a death by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    if from_the_shell and getattr(args, "freeze_heap_at_exit", False):
        # The interpreter's last garbage collections walk every object the models and
        # the YAML left (a tenth of `nemesis validate`'s run); the process ends here,
        # so frozen objects are still released, only no longer searched for cycles.
        gc.freeze()
    return code


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The command line; given ``argv``, only the command it names is built in full.

    Every command is listed with its help (``nemesis --help``, a misspelt command's
    error), but only the one being run gets its options and actions: building them
    all costs more start-up than ``nemesis validate`` in a pull request should pay.
    Without ``argv`` (the tests of every option's help) every command is built.
    """
    parser = argparse.ArgumentParser(
        prog="nemesis",
        description="Reads topics and pushes every message to the handler of the team that "
        "registered an integration.",
    )
    parser.add_argument("--version", action="version", version=f"nemesis {__version__}")
    _log_level_option(parser, default="info")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    named = None if argv is None else _command_named(argv)
    for name, help_text, build in _COMMANDS:
        command = commands.add_parser(name, help=help_text)
        if argv is None or name == named:
            build(command)
    _log_level_everywhere(parser)
    return parser


def _command_named(argv: Sequence[str]) -> str | None:
    """The command word in ``argv``: the first that is neither an option nor its value."""
    words = iter(argv)
    for word in words:
        if word == "--log-level":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _build_run(run: argparse.ArgumentParser) -> None:
    run.description = (
        "Runs the proxy for every integration, with the admin API and the DLQ"
        " viewer beside it. If the admin API cannot listen on its address, nothing could"
        " report health or readiness: run exits 1 naming the address and the cause. If the"
        " viewer cannot, deliveries go on, the error is logged and /readyz answers 503 with"
        " the reason."
    )
    _config_option(run)
    run.set_defaults(handler=cmd_run)


def _build_validate(validate: argparse.ArgumentParser) -> None:
    validate.description = (
        "Validates integration, pipeline and process YAML as `nemesis run` loads"
        " it, reporting every problem of every file (file:line: field: message). Exit 1 on"
        " any problem, and when no integration or pipeline file is found (a wrong folder"
        " is not 'all valid')."
    )
    validate.add_argument(
        "paths",
        nargs="*",
        type=Path,
        help="files or directories (default: integrations/ and pipelines/)",
    )
    validate.add_argument(
        "--format",
        choices=["text", "github"],
        default="text",
        help="text lines (file:line: field: message) or GitHub annotations (default: text)",
    )
    validate.add_argument(
        "--require-env",
        action="store_true",
        help="an unset ${VAR} without a default is an error, as `nemesis run` treats it."
        " Without it (a pull request's CI has no production secrets) it is a warning that"
        " does not change the exit code",
    )
    validate.add_argument(
        "--online",
        action="store_true",
        help="also ask the process file's backend (read-only credentials are enough) that each"
        " source topic exists and each consumer name is free or already the integration's,"
        " and check that owners are teams auth: names (docs/limits.md, 'Online checks')",
    )
    validate.set_defaults(handler=cmd_validate, freeze_heap_at_exit=True)


def _build_publish(publish: argparse.ArgumentParser) -> None:
    _config_option(publish)
    publish.add_argument("topic", help="the topic to write to")
    publish.add_argument("data", nargs="?", help="the payload (default: --file, else stdin)")
    publish.add_argument("--file", type=Path, help="read the payload from a file ('-' for stdin)")
    publish.add_argument(
        "--lines", action="store_true", help="every line of the input is one message (JSON lines)"
    )
    publish.add_argument("--key", help="message key (chooses the partition)")
    publish.add_argument("--partition", type=int, help="write to this partition")
    publish.add_argument(
        "--header", action="append", default=[], metavar="K=V", help="metadata pair (repeatable)"
    )
    publish.add_argument(
        "--key-field", help="with --lines: take each message's key from this top-level JSON field"
    )
    publish.add_argument("--batch", type=int, default=500, help="messages per write (default 500)")
    publish.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long each batch may wait for the broker's acknowledgement, leader elections"
        " included (default 120, as Kafka's delivery.timeout.ms)",
    )
    publish.set_defaults(handler=cmd_publish)


def _build_topics(topics: argparse.ArgumentParser) -> None:
    topic_commands = topics.add_subparsers(title="topic commands", metavar="ACTION", required=True)
    create = topic_commands.add_parser("create", help="create a topic")
    _config_option(create)
    create.add_argument("name", help="the topic's name")
    create.add_argument(
        "--partitions", type=int, default=None, help="partitions (default: the backend's)"
    )
    create.add_argument("--retention", help="e.g. 7d, 12h (default: the backend's)")
    create.add_argument(
        "--consumer", action="append", default=[], help="register a consumer (repeatable)"
    )
    create.add_argument(
        "--exist-ok", action="store_true", help="succeed when the topic already exists"
    )
    create.set_defaults(handler=cmd_topics_create)
    listing = topic_commands.add_parser("list", help="list topics")
    _config_option(listing)
    listing.set_defaults(handler=cmd_topics_list)
    describe = topic_commands.add_parser("describe", help="partitions, offsets and consumer lag")
    _config_option(describe)
    describe.add_argument("name", help="the topic's name")
    describe.add_argument("--json", action="store_true", help="print JSON instead of a table")
    describe.set_defaults(handler=cmd_topics_describe)


def _build_test_pipelines(tests: argparse.ArgumentParser) -> None:
    _config_option(tests)
    tests.add_argument("paths", nargs="*", type=Path, help="pipeline or test files, or folders")
    tests.add_argument("--sample", type=Path, help="JSON lines of real messages for a dry run")
    tests.add_argument("--pipeline", type=Path, help="with --sample: the pipeline file to run")
    tests.set_defaults(handler=cmd_test_pipelines)


def _stores() -> DlqContext:
    from nemesis.cli_dlq import DlqContext

    return DlqContext(
        load_config=_process_config,
        run_async=run_async,
        open_dlq=open_dlq,
        open_broker=open_broker,
    )


def _build_dlq(dlq: argparse.ArgumentParser) -> None:
    from nemesis.cli_dlq import add_dlq_commands

    add_dlq_commands(dlq, _config_option, _stores())


def _build_offsets(offsets: argparse.ArgumentParser) -> None:
    from nemesis.cli_offsets import add_offsets_commands

    add_offsets_commands(offsets, _config_option, _stores())


def _build_queues(queues: argparse.ArgumentParser) -> None:
    from nemesis.cli_queues import add_queue_commands

    add_queue_commands(queues, _config_option, _process_config)


def _build_ctl(ctl: argparse.ArgumentParser) -> None:
    from nemesis.cli_ctl import add_ctl_commands

    add_ctl_commands(ctl, _config_option)


# --- onboarding: new, check-handler, schema (nemesis.onboarding.commands) ----------


def _build_new(new: argparse.ArgumentParser) -> None:
    from nemesis.onboarding.commands import add_new_command

    add_new_command(new)


def _build_check_handler(check: argparse.ArgumentParser) -> None:
    from nemesis.onboarding.commands import add_check_handler_command

    add_check_handler_command(check, run_async)


def _build_schema(schema: argparse.ArgumentParser) -> None:
    from nemesis.onboarding.commands import add_schema_command

    add_schema_command(schema)


def _build_fleet(fleet: argparse.ArgumentParser) -> None:
    fleet_commands = fleet.add_subparsers(title="fleet commands", metavar="ACTION", required=True)
    fleet_status = fleet_commands.add_parser(
        "status", help="members, who runs which integration, and the live overrides"
    )
    _config_option(fleet_status)
    fleet_status.add_argument("--json", action="store_true", help="print JSON")
    fleet_status.set_defaults(handler=cmd_fleet_status)


def _build_size(size: argparse.ArgumentParser) -> None:
    size.add_argument(
        "--rps",
        type=float,
        required=True,
        help="messages per second written to the source topic",
    )
    size.add_argument(
        "--latency-ms", type=float, required=True, help="the handler's time per delivery"
    )
    size.add_argument("--batch-size", type=int, default=1, help="messages per request")
    size.add_argument("--headroom", type=float, default=None, help="factor (default 1.5)")
    passing = size.add_mutually_exclusive_group()
    passing.add_argument(
        "--pass-rate",
        type=float,
        default=None,
        metavar="SHARE",
        help="the share of messages the pipeline passes to the handler, 0-1 (default 1)",
    )
    passing.add_argument(
        "--handler-rps",
        type=float,
        default=None,
        help="messages per second that reach the handler, after the pipeline's filtering",
    )
    size.set_defaults(handler=cmd_size)


def _build_init(init: argparse.ArgumentParser) -> None:
    _config_option(init)
    init.add_argument(
        "--create-sources", action="store_true", help="also create missing source topics"
    )
    init.add_argument("--partitions", type=int, default=4, help="for topics it creates")
    init.set_defaults(handler=cmd_init)


def _build_demo(demo: argparse.ArgumentParser) -> None:
    demo.add_argument(
        "--dir", type=Path, default=Path("demo-data"), help="where the demo keeps its data"
    )
    demo.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    demo.add_argument("--rate", type=float, default=50.0, help="sample orders per second")
    demo.add_argument(
        "--viewer-port", type=int, default=8080, help="the DLQ viewer's port (0: any free one)"
    )
    demo.add_argument("--kafka", metavar="HOST:PORT", help="use this Kafka broker, not embedded")
    demo.add_argument(
        "--no-idempotence", action="store_true", help="for a Kafka broker without InitProducerId"
    )
    demo.set_defaults(handler=cmd_demo)


# Every command in the order `nemesis --help` lists them: (name, help, builder).
_COMMANDS: list[tuple[str, str, Callable[[argparse.ArgumentParser], None]]] = [
    ("run", "run the proxy for every integration", _build_run),
    ("validate", "validate integration and process YAML (exit 1 on any error)", _build_validate),
    ("publish", "write messages to a topic", _build_publish),
    ("topics", "topic admin on the configured backend", _build_topics),
    ("queues", "the queues that queue sources (sqs) read: describe", _build_queues),
    (
        "test-pipelines",
        "run pipeline YAML tests; with --sample, per-stage shares",
        _build_test_pipelines,
    ),
    ("dlq", "the dead-letter store: list, show, requeue, discard", _build_dlq),
    ("offsets", "an integration's committed offsets: show, seek, skip", _build_offsets),
    (
        "ctl",
        "pause, resume, re-tune and flag your integrations through the admin API",
        _build_ctl,
    ),
    ("new", "start a handler project or an integration file", _build_new),
    (
        "check-handler",
        "probe a handler: does it follow the contract? (exit 1 if not)",
        _build_check_handler,
    ),
    ("schema", "JSON Schema of a YAML file kind, for editors", _build_schema),
    ("fleet", "the replicas sharing this configuration", _build_fleet),
    ("size", "workers N = R x T with headroom, and the buffer it implies", _build_size),
    (
        "init",
        "create the topics, consumers and DLQ storage a configuration needs",
        _build_init,
    ),
    ("demo", "the whole thing on the embedded backend, in one minute", _build_demo),
]


_LOG_LEVELS = ["debug", "info", "warning", "error"]


def _log_level_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level",
        default=default,
        choices=_LOG_LEVELS,
        help="what goes to stderr (default: info); before or after the command",
    )


def _log_level_everywhere(parser: argparse.ArgumentParser) -> None:
    """``--log-level`` after any command too (``nemesis run --log-level debug``).

    A subcommand's copy defaults to SUPPRESS, so a level given before the
    command is not reset by the subcommand's parser.
    """
    for action in parser._actions:  # argparse offers no public walk
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                if "--log-level" not in sub._option_string_actions:
                    _log_level_option(sub, default=argparse.SUPPRESS)
                _log_level_everywhere(sub)


def _config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-c",
        "--config",
        type=Path,
        default=None,
        help="process configuration (default: ./nemesis.yaml if present)",
    )


def _configure_logging(level: str) -> None:
    configure_logging(level, "text", sys.stderr)


def _process_config(args: argparse.Namespace) -> NemesisConfig:
    """The process configuration; from here on every log line is in its ``log_format``."""
    from nemesis.config.loader import load_process_config

    path: Path | None = args.config
    if path is None and Path("nemesis.yaml").exists():
        path = Path("nemesis.yaml")
    config = load_process_config(path)
    configure_logging(
        getattr(args, "log_level", "info"),
        config.log_format,
        sys.stderr,
        library_level=config.library_log_level,
    )
    return config


def run_async(main: Coroutine[Any, Any, int]) -> int:
    """Runs the coroutine on uvloop when it is installed (measured faster), else asyncio."""
    import asyncio

    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        result: int = runner.run(main)
        return result


async def open_broker(config: NemesisConfig) -> Broker:
    """The configured backend (embedded or ydb)."""
    from nemesis import backends

    return await backends.open_backend(config)


async def open_dlq(config: NemesisConfig, broker: Broker | None = None) -> DeadLetterStore:
    """The configured dead-letter store; a YDB store shares the broker's driver."""
    from nemesis import backends

    return await backends.open_dlq(config, broker=broker)


# --- run --------------------------------------------------------------------------


class _StopLatch:
    """SIGINT and SIGTERM as a stop request, from the first line of ``run`` on.

    A signal that lands while the proxy is still starting (loading, opening
    the broker, joining the fleet) is kept and honoured once the proxy exists,
    so an early SIGTERM ends the process cleanly instead of killing it.
    """

    def __init__(self) -> None:
        self.requested = False
        self._target: Callable[[], None] | None = None

    def __call__(self, *_: object) -> None:
        self.requested = True
        if self._target is not None:
            self._target()

    def forward_to(self, target: Callable[[], None]) -> None:
        self._target = target
        if self.requested:
            target()


def cmd_run(args: argparse.Namespace) -> int:
    latch = _StopLatch()
    # Until the event loop takes the signals over in _run: before it, Python's own
    # handlers would end the process (SIGTERM) or raise KeyboardInterrupt (SIGINT).
    previous = {sig: signal.signal(sig, latch) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        config = _process_config(args)
        return run_async(_run(config, latch, _process_file(args)))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


async def _run(
    config: NemesisConfig, latch: _StopLatch | None = None, config_file: Path | None = None
) -> int:
    latch = latch or _StopLatch()
    with _stop_on_signals(latch):
        return await _run_proxy(config, latch, config_file)


def _process_file(args: argparse.Namespace) -> Path | None:
    """The process configuration file ``_process_config`` reads (None: the defaults)."""
    path: Path | None = args.config
    if path is None and Path("nemesis.yaml").exists():
        path = Path("nemesis.yaml")
    return path


async def _run_proxy(
    config: NemesisConfig, latch: _StopLatch, config_file: Path | None = None
) -> int:
    from nemesis import backends
    from nemesis.admin.server import ServiceFailures, plugin_services, serve_beside
    from nemesis.config.limits import Caps, within_caps
    from nemesis.config.loader import load_integrations
    from nemesis.config.problems import sort_problems
    from nemesis.fleet.member import FleetMember, FleetOptions
    from nemesis.heap import settle_heap
    from nemesis.metrics import Metrics
    from nemesis.runtime.app import Proxy, SupervisorOptions
    from nemesis.runtime.housekeeping import enforce_dlq_retention
    from nemesis.runtime.reload import ConfigReloader
    from nemesis.runtime.reports import StatusReporter
    from nemesis.runtime.runner import RunnerOptions
    from nemesis.runtime.tracing import delivery_tracing

    integrations, problems = load_integrations(Path(config.integrations_dir))
    directory = Path(config.integrations_dir)
    files = {name: _integration_file(directory, name) for name in integrations}
    # An integration over the platform's caps is refused like an invalid file.
    caps = Caps.of(config, config_file)
    integrations, over_caps = within_caps(caps, integrations, files)
    problems = sort_problems([*problems, *over_caps])
    for problem in problems:
        log.error("%s (integration not started)", problem)
    if not integrations:
        log.error("no valid integration in %s; nothing to run", config.integrations_dir)
        return EXIT_INVALID
    files = {name: files[name] for name in integrations}
    async with contextlib.AsyncExitStack() as opened:
        # Each part is closed however the ones after it fail (a DLQ that does not open,
        # a proxy that does not build), the last opened first.
        tracing = delivery_tracing(config.tracing, config.backend.kind)
        if tracing is not None:
            opened.callback(tracing.shutdown)  # exports the spans still buffered
        broker = await open_broker(config)
        opened.push_async_callback(broker.close)
        dlq = await open_dlq(config, broker)
        opened.push_async_callback(dlq.close)
        state = await backends.open_state(config)
        opened.push_async_callback(state.close)
        proxy = Proxy(
            broker,
            integrations,
            dlq=dlq,
            pipelines_dir=config.pipelines_dir,
            integration_files={name: path for name, path in files.items() if path is not None},
            metrics=Metrics(process=True),
            runner_options=RunnerOptions(shutdown_grace_s=config.shutdown_grace_s, tracing=tracing),
            supervisor_options=SupervisorOptions(lag_refresh_s=config.metrics.lag_refresh_s),
        )
        fleet = FleetMember(
            state,
            proxy,
            options=FleetOptions(
                lease_s=config.state.lease_s,
                poll_s=config.state.poll_s,
                handover_wait_s=config.shutdown_grace_s + config.state.lease_s,
            ),
            metrics=proxy.metrics,
            caps=caps,
        )
        reloader = ConfigReloader(
            proxy,
            directory,
            watch=config.reload.watch,
            debounce_ms=config.reload.debounce_ms,
            force_polling=config.reload.force_polling,
            initial_problems=problems,
            caps=caps,
        )
        if latch.requested:
            log.info("stopped while starting: nothing was read")
            return EXIT_OK
        latch.forward_to(proxy.stop)
        with _on_signal(signal.SIGHUP, reloader.request):
            await fleet.join()
            here = fleet.statistics().running
            log.info(
                "member %s of the fleet at %s; runs %d of %d integrations here: %s",
                fleet.member_id,
                state.location,
                len(here),
                len(integrations),
                ", ".join(here) or "none yet",
            )
            failures = ServiceFailures()
            services = [
                *_side_services(config, proxy, reloader, failures, fleet, dlq),
                *plugin_services(config, proxy, dlq, broker, state),
            ]
            settle_heap()
            await serve_beside(
                proxy.run(),
                services,
                [
                    reloader.run(),
                    enforce_dlq_retention(dlq),
                    fleet.run(),
                    StatusReporter(proxy, state, fleet.member_id).run(),
                ],
                required=[ADMIN_API],
                failures=failures,
            )
    return EXIT_OK


ADMIN_API = "admin API"


def _side_services(
    config: NemesisConfig,
    proxy: Proxy,
    reloader: ConfigReloader,
    failures: ServiceFailures,
    fleet: FleetMember,
    dlq: DeadLetterStore,
) -> list[Service]:
    """What serves beside the proxy, in its event loop: the admin API (the viewer joins here).

    The admin API is required: if it cannot listen, ``nemesis run`` exits 1 (nothing
    could report readiness). Another service that cannot listen is logged as an error
    and makes ``/readyz`` answer 503 (``failures``), while deliveries go on.
    """
    from nemesis.admin import UvicornService, create_admin_app

    services: list[Service] = []
    if config.admin.enabled:
        token, metrics_token = config.admin.token, config.admin.metrics_token
        auth = config.auth
        if config.admin.host not in ("127.0.0.1", "::1", "localhost") and not (
            auth.users or auth.tokens or auth.trusted_header
        ):
            log.warning(
                "the admin API listens on %s with no team identity in auth: anyone who reaches"
                " it reads every integration (docs/admin-access.md: give each team a token)",
                config.admin.host,
            )
        app = create_admin_app(
            proxy,
            token=None if token is None else token.get_secret_value(),
            auth=config.auth,
            metrics_token=None if metrics_token is None else metrics_token.get_secret_value(),
            audit=dlq,
            reloader=reloader,
            services=failures,
            fleet=fleet,
            caps=reloader.caps,
        )
        services.append(
            UvicornService(
                app,
                host=config.admin.host,
                port=config.admin.port,
                name=ADMIN_API,
                # The TCP peer, not a forwarded address: auth.trusted_header trusts peers.
                proxy_headers=False,
            )
        )
    return services


@contextlib.contextmanager
def _on_signal(signum: signal.Signals, act: Callable[[], None]) -> Iterator[None]:
    """Calls ``act`` on the signal (SIGHUP: reload the integrations) while in the block."""
    import asyncio

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signum, act)
    try:
        yield
    finally:
        loop.remove_signal_handler(signum)


def _integration_file(directory: Path, name: str) -> Path | None:
    for suffix in (".yaml", ".yml"):
        if (path := directory / f"{name}{suffix}").exists():
            return path
    return None


@contextlib.contextmanager
def _stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    import asyncio

    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop)
    try:
        yield
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


# --- fleet ------------------------------------------------------------------------


def cmd_fleet_status(args: argparse.Namespace) -> int:
    import time

    import orjson  # here: `nemesis validate` and `--help` never need it

    from nemesis import backends
    from nemesis.config.loader import load_integrations
    from nemesis.fleet.status import as_json, describe, fleet_status

    config = _process_config(args)
    integrations, problems = load_integrations(Path(config.integrations_dir))
    for problem in problems:
        log.warning("%s (left out of the placement)", problem)

    async def status() -> int:
        store = await backends.open_state(config)
        try:
            view = await store.view()
        finally:
            await store.close()
        replicas = {name: integration.replicas for name, integration in integrations.items()}
        figure = fleet_status(view, replicas, now=time.time(), location=store.location)
        if args.json:
            sys.stdout.write(orjson.dumps(as_json(figure), option=orjson.OPT_INDENT_2).decode())
            sys.stdout.write("\n")
        else:
            print(describe(figure))
        return EXIT_OK

    return run_async(status())


# --- size -------------------------------------------------------------------------


def cmd_size(args: argparse.Namespace) -> int:
    from nemesis.runtime.sizing import DEFAULT_HEADROOM, describe, handler_rate, size_for

    headroom = DEFAULT_HEADROOM if args.headroom is None else args.headroom
    try:
        rps = handler_rate(args.rps, pass_rate=args.pass_rate, handler_rps=args.handler_rps)
        latency_s = args.latency_ms / 1000
        figure = size_for(rps, latency_s, batch_size=args.batch_size, headroom=headroom)
    except ValueError as exc:
        print(f"nemesis size: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if rps != args.rps:
        print(
            f"written:   {args.rps:g} messages/s; the pipeline passes {rps:g}/s to the handler"
            " (filtered messages need no worker)"
        )
    print(describe(figure))
    return EXIT_OK


# --- init -------------------------------------------------------------------------


def cmd_init(args: argparse.Namespace) -> int:
    from nemesis.config.loader import format_problems, load_integrations
    from nemesis.runtime.init import init_backend

    config = _process_config(args)
    loaded = load_integrations(Path(config.integrations_dir))
    if loaded.problems:
        print(format_problems(loaded.problems), file=sys.stderr)
        return EXIT_INVALID

    async def init() -> int:
        report = await init_backend(
            config,
            loaded.integrations,
            create_sources=args.create_sources,
            partitions=args.partitions,
        )
        for line in report.lines():
            print(line)
        return EXIT_OK if report.ok else EXIT_INVALID

    return run_async(init())


# --- validate ---------------------------------------------------------------------


def cmd_validate(args: argparse.Namespace) -> int:
    """Exit 1 on any problem, and when there is nothing to validate (a wrong folder)."""
    from nemesis.config.limits import CapsChecker
    from nemesis.config.loader import check_paths, format_problems
    from nemesis.config.problems import count_problems
    from nemesis.onboarding import IntegrationRulesChecker
    from nemesis.pipeline import PipelineChecker

    paths: list[Path] = args.paths or [
        p for p in (Path("integrations"), Path("pipelines")) if p.exists()
    ]
    pipelines_dirs = [p for p in paths if p.is_dir() and p.name == "pipelines"] or [
        Path("pipelines")
    ]
    report = check_paths(
        paths,
        require_env=args.require_env,
        checkers=[
            PipelineChecker(pipelines_dirs=pipelines_dirs),
            IntegrationRulesChecker(paths),
            CapsChecker(),
            *_online_checkers(args.online),
        ],
    )
    if report.warnings:
        print(format_problems(report.warnings, style=args.format, severity="warning"))
    if report.problems:
        print(format_problems(report.problems, style=args.format))
        print(f"{count_problems(report.problems)} problem(s) found", file=sys.stderr)
        return EXIT_INVALID
    if report.files == 0:
        where = ", ".join(map(str, paths)) or "integrations/ or pipelines/ (neither exists)"
        print(f"no integration or pipeline files found in {where}", file=sys.stderr)
        return EXIT_INVALID
    warned = f" ({count_problems(report.warnings)} warning(s))" if report.warnings else ""
    print(f"all valid{warned}")
    print(f"{report.files} file(s) checked", file=sys.stderr)
    return EXIT_OK


def _online_checkers(online: bool) -> list[Any]:
    if not online:
        return []
    from nemesis.onboarding.online import OnlineChecker

    return [OnlineChecker()]


# --- publish ----------------------------------------------------------------------


def cmd_publish(args: argparse.Namespace) -> int:
    config = _process_config(args)
    metadata = {}
    for pair in args.header:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise NemesisError(f"--header {pair!r}: expected NAME=VALUE")
        metadata[name] = value
    if not args.timeout > 0:
        raise NemesisError(f"--timeout {args.timeout}: expected a number of seconds above 0")
    payloads = _payloads(args, sys.stdin.buffer)
    return run_async(_publish(config, args, metadata, payloads))


def _payloads(args: argparse.Namespace, stdin: Any) -> Iterator[bytes]:
    if args.data is not None:
        source: bytes = args.data.encode()
    elif args.file is not None and str(args.file) != "-":
        source = args.file.read_bytes()
    else:
        source = stdin.read()
    if not args.lines:
        yield source
        return
    for line in source.splitlines():
        if line.strip():
            yield line


async def _publish(
    config: NemesisConfig,
    args: argparse.Namespace,
    metadata: dict[str, str],
    payloads: Iterator[bytes],
) -> int:
    """Writes in batches; a failure says how many messages were written before it.

    A batch is written whole or not at all, so after a failure the input from
    message ``written + duplicates + 1`` on is what to publish again.
    """
    from nemesis.broker.port import OutgoingMessage

    broker = await open_broker(config)
    written = duplicates = 0
    try:
        writer = await broker.writer(args.topic)
        batch: list[OutgoingMessage] = []
        try:
            for payload in payloads:
                key = args.key
                if args.key_field:
                    key = _json_field(payload, args.key_field)
                batch.append(
                    OutgoingMessage(
                        value=payload, key=key, metadata=metadata, partition=args.partition
                    )
                )
                if len(batch) >= args.batch:
                    w, d = await _write(writer, batch, args.timeout)
                    written, duplicates, batch = written + w, duplicates + d, []
            if batch:
                w, d = await _write(writer, batch, args.timeout)
                written, duplicates = written + w, duplicates + d
        except (NemesisError, OSError):
            done = written + duplicates
            say(
                f"nemesis publish: failed after writing {written} message(s) to {args.topic}"
                + (f" ({duplicates} duplicate(s) skipped)" if duplicates else "")
                + f"; the input from message {done + 1} on was not written",
                sys.stderr,
                logging.ERROR,
            )
            raise
        await writer.close()
    finally:
        await broker.close()
    print(
        f"written {written} message(s) to {args.topic}"
        + (f", {duplicates} duplicate(s) skipped" if duplicates else "")
    )
    return EXIT_OK


async def _write(writer: Any, batch: list[OutgoingMessage], timeout_s: float) -> tuple[int, int]:
    from nemesis.broker.port import WriteStatus

    results = await writer.write(batch, timeout_s)
    dup = sum(1 for r in results if r.status is WriteStatus.DUPLICATE)
    return len(results) - dup, dup


def _json_field(payload: bytes, name: str) -> str | None:
    import orjson

    try:
        document = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if isinstance(document, dict) and document.get(name) is not None:
        return str(document[name])
    return None


# --- topics -----------------------------------------------------------------------


def cmd_topics_create(args: argparse.Namespace) -> int:
    from nemesis.broker.port import ConsumerSpec
    from nemesis.config.models import parse_duration

    config = _process_config(args)

    async def create() -> int:
        broker = await open_broker(config)
        try:
            await broker.admin.create_topic(
                args.name,
                partitions=args.partitions or config.backend.default_partitions,
                consumers=[ConsumerSpec(c) for c in args.consumer],
                retention_s=parse_duration(args.retention)
                if args.retention
                else config.backend.retention,
                exist_ok=args.exist_ok,
            )
        finally:
            await broker.close()
        print(f"topic {args.name} ready")
        return EXIT_OK

    return run_async(create())


def cmd_topics_list(args: argparse.Namespace) -> int:
    config = _process_config(args)

    async def listing() -> int:
        broker = await open_broker(config)
        try:
            for name in await broker.admin.list_topics():
                print(name)
        finally:
            await broker.close()
        return EXIT_OK

    return run_async(listing())


def cmd_topics_describe(args: argparse.Namespace) -> int:
    config = _process_config(args)

    async def describe() -> int:
        broker = await open_broker(config)
        try:
            description = await broker.admin.describe_topic(args.name)
        finally:
            await broker.close()
        _print_description(description, args.json, sys.stdout)
        return EXIT_OK

    return run_async(describe())


def _print_description(description: Any, as_json: bool, out: TextIO) -> None:
    import orjson

    if as_json:
        document = {
            "name": description.name,
            "retention_s": description.retention_s,
            "consumers": list(description.consumers),
            "partitions": [
                {
                    "partition": p.partition,
                    "start_offset": p.start_offset,
                    "end_offset": p.end_offset,
                    "last_written_at": p.last_written_at,
                    "committed": dict(p.committed),
                }
                for p in description.partitions
            ],
        }
        out.write(orjson.dumps(document, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    out.write(f"topic {description.name}  retention {description.retention_s}s\n")
    consumers = list(description.consumers)
    header = f"{'partition':>9} {'start':>10} {'end':>10}" + "".join(
        f" {c + ' lag':>16}" for c in consumers
    )
    out.write(header + "\n")
    for p in description.partitions:
        lags = "".join(
            f" {p.end_offset - p.committed.get(c, p.start_offset):>16}" for c in consumers
        )
        out.write(f"{p.partition:>9} {p.start_offset:>10} {p.end_offset:>10}{lags}\n")


# --- pipelines --------------------------------------------------------------------


def cmd_test_pipelines(args: argparse.Namespace) -> int:
    from nemesis.pipeline import dry_run_file, run_pipeline_tests

    if args.sample is not None:
        pipeline = args.pipeline or (args.paths[0] if len(args.paths) == 1 else None)
        if pipeline is None or pipeline.is_dir():
            raise NemesisError("--sample needs one pipeline file (--pipeline FILE or one PATH)")
        try:
            report = dry_run_file(pipeline, args.sample)
        except OSError as exc:
            raise NemesisError(f"{args.sample}: {exc.strerror or exc}") from exc
        print(inert(report.format(), multiline=True))  # sample values: anyone's text
        return EXIT_OK
    paths = args.paths or [Path(_process_config(args).pipelines_dir)]
    results = run_pipeline_tests(paths)
    print(inert(results.format(), multiline=True))
    return EXIT_INVALID if results.failed else EXIT_OK


# --- demo -------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from nemesis.demo import run_demo

    return run_async(
        run_demo(
            args.dir,
            duration_s=args.duration,
            rate=args.rate,
            viewer_port=args.viewer_port,
            kafka=args.kafka,
            idempotent_producer=not args.no_idempotence,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
