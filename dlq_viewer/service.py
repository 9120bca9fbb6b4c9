"""The viewer as a service of ``nemesis run``, found through an entry point.

``nemesis`` never imports ``dlq_viewer``: the CLI looks up the
``nemesis.services`` entry points (pyproject.toml names this function) and
serves what they return beside the proxy. The viewer takes nothing from the
running proxy but the store and the broker it opened: owners come from the
configuration's integrations directory, requeues go through
``nemesis.dlq.requeue``, sign-outs are shared through the fleet's state
store. So it shows the same whether it runs inside ``nemesis run`` or alone
(``python -m dlq_viewer``), on one replica or many.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from dlq_viewer.actions import replay_requeuer
from dlq_viewer.app import create_app
from dlq_viewer.auth import SharedLoginStore, SharedSessionRevocations
from dlq_viewer.owners import ConfiguredIntegrations
from nemesis.broker.port import Broker
from nemesis.config.models import NemesisConfig
from nemesis.dlq import DeadLetterStore

if TYPE_CHECKING:
    from fastapi import FastAPI

    from nemesis.admin.server import UvicornService
    from nemesis.fleet.port import StateStore
    from nemesis.runtime.app import Proxy


def viewer_app(
    config: NemesisConfig, dlq: DeadLetterStore, broker: Broker, state: StateStore
) -> FastAPI:
    """The viewer over ``dlq`` and ``broker``, with the owners of every configured integration.

    Sign-outs, failed sign-ins and spent sign-in forms go to the fleet's
    ``state`` store, so every replica (and every viewer of this configuration)
    refuses a signed-out cookie, slows a guesser alike, and takes a form once;
    the team console reads the replicas' reports and writes live overrides there.
    """
    return create_app(
        dlq,
        integrations=ConfiguredIntegrations(Path(config.integrations_dir)),
        auth=config.auth,
        requeue=replay_requeuer(dlq, broker),
        trusted_proxies=config.viewer.trusted_proxies,
        session_revocations=SharedSessionRevocations(state),
        login_store=SharedLoginStore(state),
        state=state,
    )


def nemesis_service(
    config: NemesisConfig, proxy: Proxy, dlq: DeadLetterStore, broker: Broker, state: StateStore
) -> UvicornService | None:
    """The DLQ viewer on ``config.viewer``, or None when it is disabled."""
    if not config.viewer.enabled:
        return None
    from nemesis.admin.server import UvicornService  # what nemesis run serves services with

    return UvicornService(
        viewer_app(config, dlq, broker, state),
        host=config.viewer.host,
        port=config.viewer.port,
        name="DLQ viewer",
        lifespan="on",
        proxy_headers=False,
    )
