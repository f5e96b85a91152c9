"""The HTTP API: every route in one table, and the thin handlers it names.

Handlers take (services, request) and return JSON-able data or a Reply.
They raise localrt.errors exceptions; they never build error responses.
If you add a route, also document it in README.rst (and its CLI command in
man/localrt.1); its request schema goes in schemas/.
"""

from __future__ import annotations

import threading

from localrt import __version__
from localrt.app import Reply, Request, Services
from localrt.errors import Conflict
from localrt.routing import Route


def healthz(services: Services, request: Request):
    """Liveness: answers without touching any engine."""
    return {"status": "ok", "version": __version__}


def get_configs(services: Services, request: Request):
    """Spec row 1: the whole Config."""
    return services.config.get()


def patch_configs(services: Services, request: Request):
    """Spec row 2: change only the given fields."""
    config = services.config.update(request.body)
    return {"config": config, "message": "Configuration updated successfully"}


def stop_server(services: Services, request: Request):
    """Stop the server gracefully, once this reply has been sent."""
    if services.shutdown is None:
        raise Conflict("This server was not started by `localrt start` and cannot stop itself")
    shutdown = services.shutdown
    return Reply({"message": "Server is shutting down"},
                 after=lambda: threading.Thread(target=shutdown, daemon=True).start())


ROUTES = (
    Route("GET", "/healthz", healthz),
    Route("GET", "/v1/configs", get_configs),
    Route("PATCH", "/v1/configs", patch_configs, "config-update.json"),
    Route("DELETE", "/v1/system", stop_server),
)
