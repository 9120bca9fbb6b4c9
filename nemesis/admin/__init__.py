"""The admin API: health, readiness, ``/metrics``, live status and live re-tuning.

* ``app``: the FastAPI app over a running ``Proxy`` (``create_admin_app``).
* ``schemas``: its request and response bodies (the OpenAPI schema).
* ``status``: from the proxy's snapshot to those bodies.
* ``server``: uvicorn beside the proxy in its event loop (``serve_beside``).
"""

from nemesis.admin.app import create_admin_app
from nemesis.admin.server import Service, UvicornService, serve_beside

__all__ = ["Service", "UvicornService", "create_admin_app", "serve_beside"]
