"""The YDB backend: admin, readers and writers over one SDK driver."""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence

from ydb import TopicClientAsyncIO, TopicReaderAsyncIO
from ydb.aio.driver import Driver

from nemesis.broker.port import EARLIEST, StartFrom
from nemesis.broker.ydb.admin import (
    ListDirectory,
    MakeDirectory,
    YdbAdmin,
    scheme_lister,
    scheme_maker,
)
from nemesis.broker.ydb.connection import open_driver
from nemesis.broker.ydb.reader import YdbReader, open_sdk_reader
from nemesis.broker.ydb.writer import YdbWriter, default_producer_id
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import YdbBackendConfig
from nemesis.errors import TopicNotFound

logger = logging.getLogger(__name__)


class YdbBroker:
    """YDB topics through the official SDK (see ``nemesis/broker/ydb/README.md``)."""

    def __init__(
        self,
        driver: Driver,
        config: YdbBackendConfig,
        *,
        owns_driver: bool = True,
        clock: Clock = SYSTEM_CLOCK,
        topics: TopicClientAsyncIO | None = None,
        list_directory: ListDirectory | None = None,
        make_directory: MakeDirectory | None = None,
    ) -> None:
        self.driver = driver
        self.config = config
        self._owns_driver = owns_driver
        self._clock = clock
        self._topics = topics if topics is not None else driver.topic_client
        self._admin = YdbAdmin(
            self._topics,
            list_directory if list_directory is not None else scheme_lister(driver),
            make_directory=make_directory if make_directory is not None else scheme_maker(driver),
            database=config.database,
            directory=config.directory,
            default_retention_s=config.retention,
            timeout_s=config.request_timeout_s,
        )
        self._readers: list[YdbReader] = []
        self._writers: list[YdbWriter] = []
        self._closed = False

    @property
    def admin(self) -> YdbAdmin:
        return self._admin

    @property
    def topics(self) -> TopicClientAsyncIO:
        """The SDK topic client."""
        return self._topics

    async def reader(
        self, topic: str | Sequence[str], consumer: str, *, start_from: StartFrom = EARLIEST
    ) -> YdbReader:
        """A reader of ``topic`` as ``consumer``; YDB assigns it its share of partitions.

        Several topics: one SDK reader over all of them; each partition
        session's topic is found from the path the server names.

        ``start_from`` other than ``earliest`` (a reader of one topic only)
        becomes the read session's ``read_from`` (``latest``: now), and only
        while the consumer has committed nothing on any partition: YDB applies
        ``read_from`` as a filter on every read, which must not skip what a
        seek put back. An SDK reader opened again by this reader (a spilled
        pause's resume) keeps that same time while some partition has still
        committed nothing, so that partition keeps its start; once every
        partition has committed, it reads without one.
        """
        self._check_open()
        names = [topic] if isinstance(topic, str) else list(dict.fromkeys(topic))
        if not names:
            raise ValueError("a reader needs at least one topic")
        for name in names:
            if consumer not in await self._admin.consumers(name):
                raise TopicNotFound(f"topic {name} has no consumer {consumer}")
        paths = [self._admin.path(name) for name in names]
        buffer_bytes = self.config.reader_buffer_bytes
        read_from: datetime.datetime | None = None
        if start_from.kind != "earliest" and len(names) != 1:
            raise ValueError("start_from applies to a reader of one topic")
        if start_from.kind != "earliest" and not any(
            (await self._admin.committed(names[0], consumer)).values()
        ):
            at = self._clock.time() if start_from.at is None else start_from.at
            read_from = datetime.datetime.fromtimestamp(at, datetime.UTC)

        def open_sdk(since: datetime.datetime | None) -> TopicReaderAsyncIO:
            return open_sdk_reader(
                self._topics,
                paths[0] if len(paths) == 1 else paths,
                consumer,
                buffer_bytes,
                since,
            )

        async def reopen_sdk() -> TopicReaderAsyncIO:
            nonlocal read_from
            if read_from is not None:
                committed = await self._admin.committed(names[0], consumer)
                if committed and all(committed.values()):
                    read_from = None  # every partition has its own start now
            return open_sdk(read_from)

        reader = YdbReader(
            lambda: open_sdk(read_from),
            reopen_sdk=reopen_sdk,
            topic=", ".join(names),
            consumer=consumer,
            stash_limit=self.config.pause_stash_messages,
            stash_bytes=self.config.pause_stash_bytes,
            commit_timeout_s=self.config.request_timeout_s,
            topics=names,
        )
        self._readers = [r for r in self._readers if not r.closed]
        self._readers.append(reader)
        return reader

    async def writer(self, topic: str, producer_id: str | None = None) -> YdbWriter:
        """A writer for ``topic``; give a stable ``producer_id`` where de-duplication matters."""
        self._check_open()
        partitions = await self._admin.partitions(topic)
        writer = YdbWriter(
            self._topics,
            topic=topic,
            path=self._admin.path(topic),
            producer_id=producer_id or default_producer_id(),
            partitions=partitions,
            open_timeout_s=self.config.connect_timeout_s,
            clock=self._clock,
        )
        self._writers = [w for w in self._writers if not w.closed]
        self._writers.append(writer)
        return writer

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the broker is closed")

    async def close(self, timeout_s: float = 5.0) -> None:
        """Closes readers and writers, then the driver if this broker opened it."""
        if self._closed:
            return
        self._closed = True
        for reader in self._readers:
            await reader.close(timeout_s)
        for writer in self._writers:
            await writer.close(timeout_s)
        self._readers.clear()
        self._writers.clear()
        if self._owns_driver:
            await self.driver.stop(timeout=max(1, round(timeout_s)))


async def open_ydb(config: YdbBackendConfig, *, clock: Clock = SYSTEM_CLOCK) -> YdbBroker:
    """Connects to YDB (BrokerError if it cannot within ``connect_timeout_s``)."""
    driver = await open_driver(config)
    return YdbBroker(driver, config, clock=clock)
