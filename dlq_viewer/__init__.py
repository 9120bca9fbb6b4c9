"""The DLQ web UI: a FastAPI application over nemesis.dlq (never imported by nemesis).

It needs the state store, a broker and the configuration, nothing of the
running proxy: ``nemesis run`` serves it (``dlq_viewer.service``), and
``python -m dlq_viewer -c nemesis.yaml`` serves it alone. Build it with
``create_app`` and serve it with ``serve_viewer`` (or ``viewer_server`` for a
server you stop yourself)::

    app = create_app(
        dlq,
        integrations=ConfiguredIntegrations(Path(config.integrations_dir)),
        auth=config.auth,
        requeue=replay_requeuer(dlq, broker),
        trusted_proxies=config.viewer.trusted_proxies,
    )
    await serve_viewer(app, config.viewer.host, config.viewer.port, stop=stopping)
"""

from dlq_viewer.actions import BulkJob, BulkJobs, JobState, Requeuer, replay_requeuer
from dlq_viewer.app import create_app
from dlq_viewer.auth import (
    Authenticator,
    MemorySessionRevocations,
    SessionRevocations,
)
from dlq_viewer.decoders import ProtobufDecoder, protobuf_decoder
from dlq_viewer.owners import ConfiguredIntegrations
from dlq_viewer.passwords import hash_password, hash_token, new_token, verify_password
from dlq_viewer.server import (
    ViewerServer,
    ViewerStartError,
    bound_port,
    serve_viewer,
    viewer_server,
)
from nemesis.identity import Identity

__all__ = [
    "Authenticator",
    "BulkJob",
    "BulkJobs",
    "ConfiguredIntegrations",
    "Identity",
    "JobState",
    "MemorySessionRevocations",
    "ProtobufDecoder",
    "Requeuer",
    "SessionRevocations",
    "ViewerServer",
    "ViewerStartError",
    "bound_port",
    "create_app",
    "hash_password",
    "hash_token",
    "new_token",
    "protobuf_decoder",
    "replay_requeuer",
    "serve_viewer",
    "verify_password",
    "viewer_server",
]
