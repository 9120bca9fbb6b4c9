"""``python -m dlq_viewer -c nemesis.yaml``: the viewer alone, without the proxy.

It opens the configured DLQ store, the fleet's state store (where sign-outs
are shared with every replica) and the broker, reads owners from the
integrations directory and serves ``viewer.host:viewer.port`` until SIGINT
or SIGTERM: the same viewer ``nemesis run`` serves, on a host of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from dlq_viewer.server import ViewerStartError, listen, viewer_server
from nemesis.backends import open_backend, open_dlq, open_state
from nemesis.config.loader import DEFAULT_PROCESS_CONFIG, load_process_config
from nemesis.config.models import NemesisConfig
from nemesis.errors import ConfigError, NemesisError
from nemesis.logs import configure_logging

log = logging.getLogger("dlq_viewer")


def main(argv: Sequence[str] | None = None) -> int:
    """Serves the viewer of one configuration; 0 when stopped, 2 on a bad configuration."""
    parser = argparse.ArgumentParser(prog="python -m dlq_viewer", description=__doc__)
    parser.add_argument(
        "-c", "--config", type=Path, default=None, help="process configuration (nemesis.yaml)"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    args = parser.parse_args(argv)
    path: Path | None = args.config
    if path is None and DEFAULT_PROCESS_CONFIG.exists():
        path = DEFAULT_PROCESS_CONFIG
    try:
        config = load_process_config(path)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    configure_logging(
        args.log_level, config.log_format, sys.stderr, library_level=config.library_log_level
    )
    try:
        asyncio.run(_serve(config))
    except (ViewerStartError, NemesisError) as exc:
        print(f"dlq_viewer: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(config: NemesisConfig) -> None:
    from dlq_viewer.service import viewer_app

    async with contextlib.AsyncExitStack() as opened:
        # Each part is closed however the ones after it fail, the last opened first.
        broker = await open_backend(config)
        opened.push_async_callback(broker.close)
        dlq = await open_dlq(config, broker=broker)
        opened.push_async_callback(dlq.close)
        state = await open_state(config)
        opened.push_async_callback(state.close)
        server = viewer_server(
            viewer_app(config, dlq, broker, state), config.viewer.host, config.viewer.port
        )
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, server.stop)
        # Listening before the log names the port (the one a port of 0 got): whoever
        # reads that line and connects at once waits in the backlog, never refused.
        listener = listen(config.viewer.host, config.viewer.port)
        with listener:
            port = listener.getsockname()[1]
            log.info("DLQ viewer on http://%s:%d", config.viewer.host, port)
            await server.serve([listener])


if __name__ == "__main__":
    sys.exit(main())
