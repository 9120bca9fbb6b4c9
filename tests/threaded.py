"""A server under test on an event loop of its own, in a thread, for synchronous tests.

Schemathesis calls its target over HTTP from plain functions; the server it calls runs
here: ``__enter__`` returns once ``_serve`` has called ``ready`` with the URL it listens
on, ``__exit__`` stops it and waits for the thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Self


class ServedInThread:
    """Subclasses implement ``_serve``: start the server, call ``ready``, serve until stopped."""

    what = "the server"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = ""
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._stop: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._main, name=f"{self.what} under test")

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(30) or self.error is not None:
            raise RuntimeError(f"{self.what} did not start") from self.error
        return self

    def __exit__(self, *_: object) -> None:
        if self._stop is not None:
            self._stop()
        self._thread.join(60)
        assert not self._thread.is_alive(), f"{self.what} did not stop"

    def ready(self, url: str, stop: Callable[[], None]) -> None:
        """Called by ``_serve`` on its loop once it listens; ``stop`` runs on that loop."""
        loop = asyncio.get_running_loop()
        self.url = url

        def stop_there() -> None:
            loop.call_soon_threadsafe(stop)

        self._stop = stop_there
        self._ready.set()

    async def _serve(self) -> None:
        raise NotImplementedError

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:
            self.error = exc
            self._ready.set()
            raise
