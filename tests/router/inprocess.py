"""The router app served in the test's own event loop (aiohttp's ``TestServer``, a real
loopback socket): for tests of answers, statuses and the router's state, which need no
router process of their own."""

from __future__ import annotations

from typing import Any, NamedTuple

from aiohttp.test_utils import TestServer

from router.app import Router, create_app
from router.config import RouterConfig
from tests.support.processes import free_port

MODEL = "m"


class ServedRouter(NamedTuple):
    """A router and the URL it answers on (``url`` as a router process has one)."""

    router: Router
    url: str


async def serve_router(config: dict[str, Any], servers: list[TestServer]) -> ServedRouter:
    """Start the router of ``config``; its server joins ``servers`` (the caller closes them,
    which runs the app's ``cleanup_ctx``)."""
    router = Router(RouterConfig.model_validate(config))
    server = TestServer(create_app(router), host="127.0.0.1")
    await server.start_server()
    servers.append(server)
    return ServedRouter(router, f"http://127.0.0.1:{server.port}")


def layout(urls: list[str], **sections: dict[str, Any]) -> dict[str, Any]:
    """A router config for engines ``e0``, ``e1``... at ``urls``; the conductor is an unused
    port unless given."""
    config: dict[str, Any] = {
        "conductor": {"address": f"http://127.0.0.1:{free_port()}", "query_timeout_seconds": 0.2},
        "prefill": {
            "config": {"modelname": MODEL, "block_size": 4},
            "instances": [
                {"instance_id": f"e{n}", "http_endpoint": url} for n, url in enumerate(urls)
            ],
        },
        "routing": {"policy": "round_robin"},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config
