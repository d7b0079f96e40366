"""The router's HTTP/1.1 connections: uvicorn's httptools protocol, with GET /health answered in it.

**`GET /health` answered in the protocol.** Through ASGI a probe costs an ASGI task, Channels'
routing, the consumer's receive loop and a handler task: several passes of an event loop that
at c400 also relays thousands of token events a second, so the probe waited behind them (the
issue measured p90 94 ms and one answer after 4 s). Here a whole `GET /health HTTP/1.1` request
that arrives between two requests of its connection is answered from the pool's state in the
same callback that read it: one pass of the loop, no task. The pool's state comes from the
health-check thread, so nothing here waits on a worker. Anything else (another method, a query,
a body, pipelined requests, a router whose workers were never checked yet) goes the usual way.

The keep-alive timeout itself (ROUTER_KEEPALIVE_S, platform/gunicorn.conf.py) is longer than the
idle expiry of common clients (httpx 5 s, aiohttp 15 s) and load balancers (60 s), so that a client
never reuses a connection the router is closing at the same moment.

Used by the router's gunicorn worker class, `RouterUvicornWorker`.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from gunicorn.arbiter import Arbiter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn_worker import UvicornWorker

from inference.gateway.acceptor_protocol import DateHeader, Probe, Verdict, classify, response

if TYPE_CHECKING:
    from inference.gateway.service import RouterService

logger = logging.getLogger(__name__)

_DATE = DateHeader()


def health_report() -> dict[str, Any] | None:
    """The body of GET /health from the router's state; None when it cannot be answered without
    waiting (the router cannot be built, or an endpoint has not been checked yet)."""
    from inference.gateway.service import get_router  # Django settings: only once serving
    from inference.router import RouterError

    try:
        service = get_router()
    except RouterError:
        return None
    if any(endpoint.last_health_at is None for endpoint in service.pool.all_endpoints()):
        return None  # the ASGI path checks them first, so that `ready` is never a default
    return health_body(service)


def snapshot_health() -> dict[str, Any] | None:
    """GET /health's body for the acceptor's snapshot (any thread): None until the router was built
    by a request and every endpoint was checked (until then a router process answers probes)."""
    from inference.gateway.service import built_router  # Django settings: only once serving

    service = built_router()
    if service is None or any(e.last_health_at is None for e in service.pool.all_endpoints()):
        return None
    return health_body(service)


def health_body(service: RouterService) -> dict[str, Any]:
    """GET /health's answer: the router is up; `ready` and each worker's health as last checked."""
    pool = service.pool

    def brief(role: str) -> list[dict[str, Any]]:
        return [
            {"url": e.url, "healthy": e.healthy, "inflight": e.inflight, "last_error": e.last_error}
            for e in pool.endpoints(role)
        ]

    admission = service.client.admission
    return {
        "status": "healthy",
        "ready": pool.ready(),
        "policy": pool.policy_name,
        "inflight": service.client.inflight,
        "queued": admission.queued,
        "decode_slots": admission.capacity(),
        "prefill": brief("prefill"),
        "decode": brief("decode"),
    }


class RouterHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, answering GET /health itself.

    A connection handed over by the router's acceptor (inference/gateway/handoff.py) comes with the
    bytes the acceptor read of it (`pre_read`), fed to the parser as the connection's first data.
    One that comes without any (its client was silent) gets the keep-alive timeout at once, so that
    a client that never sends a request does not hold the connection forever.
    """

    pre_read: bytes | None = None  # None: accepted by this process itself

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        """uvicorn's, then the handed-over bytes (before anything the transport reads itself)."""
        super().connection_made(transport)
        pre_read, self.pre_read = self.pre_read, None
        if pre_read:
            self.data_received(pre_read)
        elif pre_read is not None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        """A lone `GET`/`HEAD /health` between requests (the acceptor's rule: acceptor_protocol.classify)
        is answered here; everything else as uvicorn does."""
        if (self.cycle is None or self.cycle.response_complete) and not self.pipeline:
            verdict, probe = classify(data)
            if verdict is Verdict.PROBE and probe is not None and self._answer_health(probe):
                return
        super().data_received(data)

    def _answer_health(self, probe: Probe) -> bool:
        try:
            report = health_report()
        except Exception:  # noqa: BLE001  the ASGI path answers (and logs) whatever went wrong here
            logger.debug("fast /health failed; answering through ASGI", exc_info=True)
            return False
        if report is None:
            return False
        self._unset_keepalive_if_required()
        self.transport.write(response(200, report, probe, _DATE.value(time.time())))
        self.server_state.total_requests += 1
        if probe.close:
            self.transport.close()
        else:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)
        return True


class RouterUvicornWorker(UvicornWorker):  # type: ignore[misc]
    """The router's gunicorn worker: uvicorn with `RouterHttpProtocol`, served by `RouterServer`
    (linked to the router's acceptor when there is one)."""

    CONFIG_KWARGS: dict[str, Any] = {"loop": "auto", "http": "inference.gateway.http_protocol:RouterHttpProtocol"}

    async def _serve(self) -> None:
        """uvicorn_worker's `_serve` with the router's server class."""
        from inference.gateway.handoff import RouterServer

        self.config.app = self.wsgi
        server = RouterServer(config=self.config)
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
