"""The viewer as a service of ``nemesis run``, found through an entry point.

``nemesis`` never imports ``dlq_viewer``: the CLI looks up the
``nemesis.services`` entry points (pyproject.toml names this function) and
serves what they return beside the proxy.
"""

from __future__ import annotations

from dlq_viewer.actions import replay_requeuer
from dlq_viewer.app import create_app
from nemesis.admin.server import UvicornService
from nemesis.broker.port import Broker
from nemesis.config.models import NemesisConfig
from nemesis.dlq import DeadLetterStore
from nemesis.runtime.app import Proxy, SupervisorOptions


def nemesis_service(
    config: NemesisConfig, proxy: Proxy, dlq: DeadLetterStore, broker: Broker
) -> UvicornService | None:
    """The DLQ viewer on ``config.viewer``, or None when it is disabled."""
    if not config.viewer.enabled:
        return None
    app = create_app(
        dlq,
        # Read on every request: a configuration reload changes who owns what at once.
        integrations=proxy.integrations,
        auth=config.auth,
        requeue=replay_requeuer(dlq, broker, partitions=SupervisorOptions().internal_partitions),
    )
    return UvicornService(
        app,
        host=config.viewer.host,
        port=config.viewer.port,
        name="DLQ viewer",
        lifespan="on",
        proxy_headers=False,
    )
