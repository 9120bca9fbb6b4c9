"""Process logging: text for a terminal, JSON lines for a log pipeline (``log_format``).

A record names where it happened with coordinates passed as ``extra``
(``integration``, ``flow``, ``topic``, ``partition``, ``offset``, ...), most
simply through a logger bound once per component::

    log = bind(logging.getLogger(__name__), integration="orders", flow="main")
    log.warning("commit failed", extra={"topic": "orders", "partition": 3, "offset": 41})

One handler on the root logger writes every record, other libraries' (aiokafka,
ydb, uvicorn, grpc, Python's warnings) included, in the configured format.
Nemesis' own loggers (``nemesis.*``, ``dlq_viewer.*``) log at the level asked
for (``--log-level``); every other library at ``library_log_level``, warnings
and above by default, so that a quiet run stays quiet.

The JSON formatter writes only the coordinates listed in ``COORDINATES``:
anything else passed as ``extra`` (a payload, a header with a secret) is
never written, so a careless call site cannot leak message contents into the
logs. The text formatter keeps the classic one-line shape; the coordinates
there are in the message text itself.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, MutableMapping
from typing import Any, Final, Literal, TextIO

LogFormat = Literal["text", "json"]

# Bounded, payload-free fields a record may carry into a JSON line.
COORDINATES: Final = (
    "integration",
    "flow",
    "topic",
    "partition",
    "offset",
    "event_id",
    "trace_id",
    "attempt",
    "stage",
    "outcome",
    "status",
    "tier",
    "file",
    "field",
    "action",  # an audited change (nemesis.admin.audit): what, and who made it
    "who",
    "reason",
)

# The loggers that follow --log-level; every other one follows library_log_level.
OWN_LOGGERS: Final = ("nemesis", "dlq_viewer")

TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Marks the handler this module installs: configuring again replaces it, never doubles lines.
_HANDLER_MARK: Final = "_nemesis_handler"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, coordinates, traceback."""

    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "ts": _iso_time(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = record.__dict__
        for name in COORDINATES:
            value = fields.get(name)
            if value is not None:
                document[name] = value
        if record.exc_info:
            document["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            document["stack"] = self.formatStack(record.stack_info)
        import orjson  # here: `nemesis --help` and text logs never load it

        return orjson.dumps(document, default=str).decode()


class BoundLogger(logging.LoggerAdapter[logging.Logger]):
    """A logger that adds fixed coordinates to every record, merged with the call's ``extra``."""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        extra = kwargs.get("extra")
        bound: Mapping[str, object] = self.extra or {}
        kwargs["extra"] = {**bound, **extra} if extra else dict(bound)
        return msg, kwargs


def bind(logger: logging.Logger, **coordinates: object) -> BoundLogger:
    """``logger`` with ``coordinates`` on every record it makes."""
    return BoundLogger(logger, coordinates)


def configure_logging(
    level: str = "info",
    log_format: LogFormat = "text",
    stream: TextIO | None = None,
    library_level: str = "warning",
) -> None:
    """Sends Nemesis' records at ``level`` and above, and other libraries' at
    ``library_level`` and above, to ``stream`` (stderr) in the chosen format."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    formatter: logging.Formatter = (
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(getattr(logging, library_level.upper()))
    for name in OWN_LOGGERS:
        logging.getLogger(name).setLevel(getattr(logging, level.upper()))
    # Python's warnings (a library's DeprecationWarning at run time) as records too: a
    # line written to stderr past the handler would break a JSON log.
    logging.captureWarnings(True)
    # Servers started beside the proxy log through the root handler; a line per HTTP
    # request (a scrape every few seconds) would drown the proxy's own records.
    logging.getLogger("uvicorn.access").disabled = True
    for name in ("uvicorn", "uvicorn.error"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers.clear()
        uvicorn_logger.propagate = True
    # The reload that follows a change says what changed; "1 change detected" says nothing.
    logging.getLogger("watchfiles").setLevel(logging.WARNING)


def say(text: str, stream: TextIO | None = None, level: int = logging.INFO) -> None:
    """A command's words to its user on stderr: one JSON record when the log is JSON.

    Text stays text (a person reads it); with ``log_format: json`` the words go
    through the one handler as a record of ``nemesis.cli``, whatever the level
    filters say, so that every line on stderr parses.
    """
    handler = next(
        (
            h
            for h in logging.getLogger().handlers
            if getattr(h, _HANDLER_MARK, False) and isinstance(h.formatter, JsonFormatter)
        ),
        None,
    )
    if handler is None:
        print(text, file=stream or sys.stderr)
        return
    handler.handle(logging.LogRecord("nemesis.cli", level, __file__, 0, text, None, None))


def _iso_time(created: float) -> str:
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"
