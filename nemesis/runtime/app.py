"""The proxy process: one supervised runner per integration over one broker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from nemesis.broker.port import Broker, ConsumerSpec
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import IntegrationConfig, TargetConfig
from nemesis.delivery.http import http_transport
from nemesis.delivery.port import Transport
from nemesis.errors import ConfigError, NemesisError, TopicNotFound
from nemesis.metrics import Metrics
from nemesis.pipeline import Pipeline, build_integration_pipeline
from nemesis.runtime.runner import IntegrationRunner, RunnerOptions

log = logging.getLogger(__name__)

TransportFactory = Callable[[TargetConfig, str, int], Transport]


def _http(target: TargetConfig, integration: str, max_connections: int) -> Transport:
    return http_transport(target, integration=integration, max_connections=max_connections)


# URL scheme -> transport factory. Tests and embedders pass their own mapping.
DEFAULT_TRANSPORTS: Mapping[str, TransportFactory] = {"http": _http, "https": _http}


@dataclass(frozen=True, slots=True)
class SupervisorOptions:
    restart_delay_s: float = 1.0
    max_restart_delay_s: float = 30.0
    topic_wait_s: float = 5.0


class Proxy:
    """Runs every integration until ``stop()``; restarts one that fails, alone."""

    def __init__(
        self,
        broker: Broker,
        integrations: Mapping[str, IntegrationConfig],
        *,
        pipelines_dir: Path | str = "pipelines",
        integration_files: Mapping[str, Path] | None = None,
        metrics: Metrics | None = None,
        transports: Mapping[str, TransportFactory] = DEFAULT_TRANSPORTS,
        clock: Clock = SYSTEM_CLOCK,
        runner_options: RunnerOptions = RunnerOptions(),
        supervisor_options: SupervisorOptions = SupervisorOptions(),
    ) -> None:
        self.broker = broker
        self.metrics = metrics or Metrics()
        self._integrations = dict(integrations)
        self._transports = transports
        self._clock = clock
        self._runner_options = runner_options
        self._supervisor = supervisor_options
        self._runners: dict[str, IntegrationRunner] = {}
        self._stopping = asyncio.Event()
        self._pipelines: dict[str, Pipeline] = {}
        for name, config in list(self._integrations.items()):
            try:
                self._pipelines[name] = build_integration_pipeline(
                    config,
                    pipelines_dir=pipelines_dir,
                    disabled_types=self._disabled_types(name),
                    metrics=self.metrics,
                    integration_file=(integration_files or {}).get(name),
                )
            except ConfigError as exc:
                for problem in exc.problems:
                    # A configuration problem, not a crash: no traceback.
                    log.error("%s (integration %s not started)", problem, name)  # noqa: TRY400
                del self._integrations[name]

    @property
    def integrations(self) -> Mapping[str, IntegrationConfig]:
        return self._integrations

    def _disabled_types(self, name: str) -> Callable[[], Collection[str]]:
        """A live view of an integration's flags.disabled_types (they change at run time)."""

        def current() -> Collection[str]:
            config = self._integrations.get(name)
            return () if config is None else config.flags.disabled_types

        return current

    @property
    def runners(self) -> Mapping[str, IntegrationRunner]:
        return self._runners

    def stop(self) -> None:
        """Drains and stops every integration; ``run()`` returns when all have."""
        self._stopping.set()
        for runner in self._runners.values():
            runner.stop()

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            for config in self._integrations.values():
                tasks.create_task(self._supervise(config), name=f"supervise:{config.name}")

    async def _supervise(self, config: IntegrationConfig) -> None:
        """Keeps one integration running: waits for its topic, restarts it after a failure."""
        delay_s = self._supervisor.restart_delay_s
        while not self._stopping.is_set():
            try:
                await self._prepare_source(config)
            except TopicNotFound:
                log.error(  # noqa: TRY400 - an expected state, not a failure with a traceback
                    "integration %s: topic %r does not exist; create it "
                    "(nemesis topics create %s --partitions N); checking again in %.0fs",
                    config.name,
                    config.source.topic,
                    config.source.topic,
                    self._supervisor.topic_wait_s,
                )
                await self._sleep_unless_stopping(self._supervisor.topic_wait_s)
                continue
            try:
                runner = self._make_runner(config)
                self._runners[config.name] = runner
                if self._stopping.is_set():
                    runner.stop()
                await runner.run()
            except* Exception as group:
                for exc in group.exceptions:
                    log.error(  # noqa: TRY400 - exc_info names the member of the group
                        "integration %s failed; restarting in %.1fs",
                        config.name,
                        delay_s,
                        exc_info=exc,
                    )
            else:
                return
            await self._sleep_unless_stopping(delay_s)
            delay_s = min(delay_s * 2, self._supervisor.max_restart_delay_s)

    async def _prepare_source(self, config: IntegrationConfig) -> None:
        await self.broker.admin.add_consumer(
            config.source.topic, ConsumerSpec(config.source.consumer)
        )

    def _make_runner(self, config: IntegrationConfig) -> IntegrationRunner:
        factory = self._transports.get(config.target.scheme)
        if factory is None:
            raise NemesisError(
                f"integration {config.name}: no transport for {config.target.scheme}://"
            )
        transport = factory(config.target, config.name, config.delivery.workers)
        return IntegrationRunner(
            config,
            self.broker,
            transport,
            pipeline=self._pipelines[config.name],
            metrics=self.metrics,
            clock=self._clock,
            options=self._runner_options,
        )

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        except TimeoutError:
            return
