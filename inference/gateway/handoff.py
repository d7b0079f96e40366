"""A router process's side of the acceptor (inference/gateway/acceptor.py): connections handed over,
health snapshots pushed.

`RouterServer` is uvicorn's server plus, when ROUTER_ACCEPTOR_SOCKET names the acceptor's control
socket (`python -m inference.launch_router` sets it), an `AcceptorLink`:

- connections arrive as descriptors with the bytes the acceptor already read; each becomes a
  transport of this loop (`loop.connect_accepted_socket`) with the router's HTTP protocol, which
  is fed those bytes first (`RouterHttpProtocol.pre_read`), so it serves them as if it had accepted
  the connection itself; keep-alive requests then stay here;
- a daemon thread sends a snapshot (GET /health's body, or null while the workers were never
  checked) every `SNAPSHOT_INTERVAL_S`: a thread, not the event loop, so that a loop busy with
  generation does not make the router look dead; a stopped or wedged process does;
- on a graceful stop it says `Q` and serves what the acceptor had already sent until the answer
  `q`, so a reload loses no connection; if the acceptor dies, this process stops too (no orphan).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import orjson
from uvicorn.server import Server

from inference.gateway.acceptor_protocol import (
    ACCEPTOR_ENV,
    CONNECTION,
    QUIT,
    QUIT_ACK,
    RECEIVED,
    RECORD_LIMIT,
    SNAPSHOT_INTERVAL_S,
    snapshot_record,
)
from inference.router.daemon import DaemonTask

logger = logging.getLogger(__name__)

_LEAVE_TIMEOUT_S = 2.0


class _Snapshots(DaemonTask):
    """Sends `snapshot()` to the acceptor every SNAPSHOT_INTERVAL_S until stopped."""

    def __init__(self, sock: socket.socket, snapshot: Callable[[], dict[str, Any]]) -> None:
        super().__init__("router-acceptor-snapshots")
        self._sock = sock
        self._snapshot = snapshot

    def send_now(self) -> None:
        """One snapshot from the calling thread (the first one, at registration)."""
        try:
            self._sock.send(snapshot_record(self._snapshot(), orjson.dumps))
        except (BlockingIOError, InterruptedError):
            pass  # the acceptor is behind: the next one goes in SNAPSHOT_INTERVAL_S
        except Exception:  # noqa: BLE001  a state read raced the loop, or the link is closing: next tick
            logger.debug("acceptor snapshot failed", exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(SNAPSHOT_INTERVAL_S):
            self.send_now()


class AcceptorLink:
    """This process's control connection to the acceptor."""

    def __init__(self, path: str, new_protocol: Callable[[bytes], asyncio.Protocol],
                 snapshot: Callable[[], dict[str, Any]], on_lost: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._new_protocol = new_protocol
        self._on_lost = on_lost
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.connect(path)
        self._sock.setblocking(False)
        self._snapshots = _Snapshots(self._sock, snapshot)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._left: asyncio.Future[None] | None = None
        self._unreported = 0  # connections received and not yet confirmed to the acceptor
        self.handed = 0

    def open(self) -> None:
        """Register with the acceptor (first snapshot) and start taking connections."""
        self._snapshots.send_now()
        self._loop.add_reader(self._sock.fileno(), self._readable)
        self._snapshots.start()

    async def leave(self) -> None:
        """Ask for no more connections, serve those already sent, then close (bounded)."""
        if self._sock.fileno() < 0:
            return
        self._left = self._loop.create_future()
        with contextlib.suppress(OSError):
            self._sock.send(QUIT)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._left, _LEAVE_TIMEOUT_S)
        self.close()

    def close(self) -> None:
        """Stop the snapshots and close the control connection."""
        self._snapshots.stop(timeout_s=1.0)
        if self._sock.fileno() >= 0:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()

    def _readable(self) -> None:
        try:
            while self._sock.fileno() >= 0:
                try:
                    record, fds, _, _ = socket.recv_fds(self._sock, RECORD_LIMIT, 1)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError:
                    record, fds = b"", []
                if not record:
                    self._lost()
                    return
                if record[:1] == QUIT_ACK and self._left is not None and not self._left.done():
                    self._left.set_result(None)
                elif record[:1] == CONNECTION and fds:
                    self._serve(fds[0], record[len(CONNECTION):])
                    self._unreported += 1
                else:
                    for fd in fds:
                        os.close(fd)
        finally:
            self._confirm()

    def _confirm(self) -> None:
        """Tell the acceptor how many connections arrived (before this loop reads any of them)."""
        if not self._unreported or self._sock.fileno() < 0:
            return
        try:
            self._sock.send(RECEIVED + b"%d" % self._unreported)
        except (BlockingIOError, InterruptedError):
            self._loop.call_later(0.01, self._confirm)  # the acceptor is behind: a receipt is never lost
            return
        except OSError:
            return  # the acceptor is gone
        self._unreported = 0

    def _serve(self, fd: int, pre_read: bytes) -> None:
        sock = socket.socket(fileno=fd)
        sock.setblocking(False)
        protocol = self._new_protocol(pre_read)
        task = self._loop.create_task(self._loop.connect_accepted_socket(lambda: protocol, sock))
        self._tasks.add(task)
        task.add_done_callback(self._served)
        self.handed += 1

    def _served(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("a handed-over connection could not be served: %s", task.exception())

    def _lost(self) -> None:
        if self._left is not None:  # leaving anyway: EOF is as good as the answer
            if not self._left.done():
                self._left.set_result(None)
            return
        logger.error("the router's acceptor is gone: stopping this router process")
        self.close()
        self._on_lost()


class RouterServer(Server):
    """uvicorn's server, linked to the router's acceptor when ROUTER_ACCEPTOR_SOCKET is set."""

    link: AcceptorLink | None = None
    last_tick: float = 0.0

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, then register with the acceptor (the app is loaded: ready to serve)."""
        await super().startup(sockets=sockets)
        path = os.environ.get(ACCEPTOR_ENV)
        if not path or not self.started or self.should_exit:
            return
        self.last_tick = time.monotonic()
        self.link = AcceptorLink(path, self._protocol, self._snapshot, self._acceptor_lost)
        self.link.open()

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s), noting when the loop last ran it (the snapshot's loop lag)."""
        self.last_tick = time.monotonic()
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """Leave the acceptor first (no new connections; those already sent are served), then
        uvicorn's graceful shutdown of every connection, handed-over ones included."""
        if self.link is not None:
            await self.link.leave()
        await super().shutdown(sockets=sockets)

    def _protocol(self, pre_read: bytes) -> asyncio.Protocol:
        protocol = self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state,
        )
        # RouterHttpProtocol (http_protocol.py) feeds these bytes in connection_made.
        protocol.pre_read = pre_read  # type: ignore[attr-defined]
        return protocol

    def _snapshot(self) -> dict[str, Any]:
        from inference.gateway.http_protocol import snapshot_health  # imports Django's settings

        return {"pid": os.getpid(), "health": snapshot_health(),
                "loop_lag_s": round(time.monotonic() - self.last_tick, 3),
                "connections": len(self.server_state.connections)}

    def _acceptor_lost(self) -> None:
        self.should_exit = True
