"""The proxy process: every integration's flows, supervised, over one broker.

An integration runs up to three kinds of flow (``nemesis.runtime.retries``):
its main flow from the source topic, one flow per retry tier, and a replay
flow for messages requeued from the DLQ. They share the integration's
transport, pipeline, circuit breaker and rate limits; each flow has its own
runner, restarted alone if it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from nemesis.broker.port import Broker, ConsumerSpec, TopicWriter
from nemesis.clock import SYSTEM_CLOCK, Clock
from nemesis.config.models import IntegrationConfig, TargetConfig
from nemesis.delivery.http import http_transport
from nemesis.delivery.port import Transport
from nemesis.dlq import DeadLetterStore
from nemesis.errors import ConfigError, NemesisError, TopicNotFound
from nemesis.metrics import Metrics
from nemesis.pipeline import Pipeline, build_integration_pipeline
from nemesis.resilience.breaker import CircuitBreaker, bind_breaker_metrics
from nemesis.resilience.limits import FlowLimits, wait_recorder
from nemesis.runtime.retries import FlowSpec, TieredSettler, flows_of, tier_topic
from nemesis.runtime.runner import IntegrationRunner, RunnerOptions
from nemesis.runtime.settle import RetryInPlace, Settler

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
    internal_partitions: int = 4  # of the retry tier and replay topics Nemesis creates


@dataclass
class IntegrationGroup:
    """The running parts of one integration, shared by its flows."""

    config: IntegrationConfig
    pipeline: Pipeline
    breaker: CircuitBreaker
    limits: FlowLimits
    transport: Transport | None = None
    tier_writers: list[TopicWriter] = field(default_factory=list)
    runners: dict[str, IntegrationRunner] = field(default_factory=dict)
    setup: asyncio.Lock = field(default_factory=asyncio.Lock)


class Proxy:
    """Runs every integration until ``stop()``; restarts a flow that fails, alone."""

    def __init__(
        self,
        broker: Broker,
        integrations: Mapping[str, IntegrationConfig],
        *,
        dlq: DeadLetterStore | None = None,
        pipelines_dir: Path | str = "pipelines",
        integration_files: Mapping[str, Path] | None = None,
        metrics: Metrics | None = None,
        transports: Mapping[str, TransportFactory] = DEFAULT_TRANSPORTS,
        clock: Clock = SYSTEM_CLOCK,
        runner_options: RunnerOptions = RunnerOptions(),
        supervisor_options: SupervisorOptions = SupervisorOptions(),
    ) -> None:
        self.broker = broker
        self.dlq = dlq
        self.metrics = metrics or Metrics()
        self._integrations = dict(integrations)
        self._transports = transports
        self._clock = clock
        self._runner_options = runner_options
        self._supervisor = supervisor_options
        self._stopping = asyncio.Event()
        self._groups: dict[str, IntegrationGroup] = {}
        for name, config in list(self._integrations.items()):
            try:
                pipeline = build_integration_pipeline(
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
                continue
            breaker = CircuitBreaker(config.breaker, clock=clock, name=name)
            bind_breaker_metrics(breaker, self.metrics)
            limits = FlowLimits(
                config.rate_limits, clock=clock, on_wait=wait_recorder(self.metrics, name)
            )
            self._groups[name] = IntegrationGroup(config, pipeline, breaker, limits)

    @property
    def integrations(self) -> Mapping[str, IntegrationConfig]:
        return self._integrations

    @property
    def groups(self) -> Mapping[str, IntegrationGroup]:
        return self._groups

    @property
    def runners(self) -> Mapping[str, IntegrationRunner]:
        """The main-flow runner of every integration that has started."""
        return {
            name: group.runners["main"]
            for name, group in self._groups.items()
            if "main" in group.runners
        }

    def _disabled_types(self, name: str) -> Callable[[], Collection[str]]:
        """A live view of an integration's flags.disabled_types (they change at run time)."""

        def current() -> Collection[str]:
            config = self._integrations.get(name)
            return () if config is None else config.flags.disabled_types

        return current

    def stop(self) -> None:
        """Drains and stops every flow; ``run()`` returns when all have."""
        self._stopping.set()
        for group in self._groups.values():
            for runner in group.runners.values():
                runner.stop()

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tasks:
                for group in self._groups.values():
                    tasks.create_task(
                        self._run_group(group), name=f"integration:{group.config.name}"
                    )
        finally:
            for group in self._groups.values():
                await self._close_group(group)

    async def _run_group(self, group: IntegrationGroup) -> None:
        config = group.config
        factory = self._transports.get(config.target.scheme)
        if factory is None:
            log.error(
                "integration %s: no transport for %s:// targets; not started",
                config.name,
                config.target.scheme,
            )
            return
        group.transport = factory(config.target, config.name, config.delivery.workers)
        flows = flows_of(config) if self.dlq is not None else flows_of(config)[:1]
        async with asyncio.TaskGroup() as tasks:
            for flow in flows:
                tasks.create_task(self._supervise(group, flow), name=f"{config.name}:{flow.name}")

    async def _close_group(self, group: IntegrationGroup) -> None:
        for writer in group.tier_writers:
            with contextlib.suppress(NemesisError):
                await writer.close()
        group.tier_writers.clear()
        if group.transport is not None:
            await group.transport.close()
            group.transport = None

    async def _supervise(self, group: IntegrationGroup, flow: FlowSpec) -> None:
        """Keeps one flow running: waits for its topic, restarts it after a failure."""
        config = group.config
        delay_s = self._supervisor.restart_delay_s
        while not self._stopping.is_set():
            try:
                await self._prepare_flow(group, flow)
            except TopicNotFound:
                log.error(  # noqa: TRY400 - an expected state, not a failure with a traceback
                    "integration %s: topic %r does not exist; create it "
                    "(nemesis topics create %s --partitions N); checking again in %.0fs",
                    config.name,
                    flow.topic,
                    flow.topic,
                    self._supervisor.topic_wait_s,
                )
                await self._sleep_unless_stopping(self._supervisor.topic_wait_s)
                continue
            try:
                runner = self._make_runner(group, flow)
                group.runners[flow.name] = runner
                if self._stopping.is_set():
                    runner.stop()
                await runner.run()
            except* Exception as failures:
                for exc in failures.exceptions:
                    log.error(  # noqa: TRY400 - exc_info names the member of the group
                        "integration %s, flow %s failed; restarting in %.1fs",
                        config.name,
                        flow.name,
                        delay_s,
                        exc_info=exc,
                    )
            else:
                return
            await self._sleep_unless_stopping(delay_s)
            delay_s = min(delay_s * 2, self._supervisor.max_restart_delay_s)

    async def _prepare_flow(self, group: IntegrationGroup, flow: FlowSpec) -> None:
        """Registers the consumer; creates the retry tier and replay topics Nemesis owns."""
        admin = self.broker.admin
        if flow.name != "main":
            await admin.create_topic(
                flow.topic,
                partitions=self._supervisor.internal_partitions,
                consumers=[ConsumerSpec(flow.consumer)],
                exist_ok=True,
            )
        await admin.add_consumer(flow.topic, ConsumerSpec(flow.consumer))
        if self.dlq is None or group.config.delivery.ordering != "none":
            return
        async with group.setup:  # the flows start together; one opens the tier writers
            if group.tier_writers:
                return
            for tier in range(1, len(group.config.retry.tiers) + 1):
                topic = tier_topic(group.config.name, tier)
                await admin.create_topic(
                    topic,
                    partitions=self._supervisor.internal_partitions,
                    consumers=[ConsumerSpec(group.config.name)],
                    exist_ok=True,
                )
                group.tier_writers.append(await self.broker.writer(topic))

    def _make_runner(self, group: IntegrationGroup, flow: FlowSpec) -> IntegrationRunner:
        assert group.transport is not None
        return IntegrationRunner(
            group.config,
            self.broker,
            group.transport,
            flow=flow,
            settler=self._settler(group, flow),
            pipeline=group.pipeline,
            breaker=group.breaker,
            limits=group.limits,
            metrics=self.metrics,
            clock=self._clock,
            options=self._runner_options,
            owns_transport=False,
        )

    def _settler(self, group: IntegrationGroup, flow: FlowSpec) -> Settler:
        config = group.config
        if self.dlq is None:
            return RetryInPlace(config.name, config.retry.tiers)
        return TieredSettler(
            config,
            flow,
            tier_writers=group.tier_writers,
            dlq=self.dlq,
            clock=self._clock,
            breaker=group.breaker,
            metrics=self.metrics,
        )

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        try:
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        except TimeoutError:
            return
