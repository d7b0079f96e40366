"""The router's acceptor: owns the listening socket, answers health probes, hands every other
connection to a router process.

Why: a `GET /health` answered by a router process waits for that process's event loop, which at
c400 on shared CPUs is behind hundreds of callbacks (p99 200-570 ms, single answers after 5-9 s,
docs/benchmarks.md). The acceptor is a separate, mostly idle process, so the kernel runs it as soon
as a probe arrives, whatever the router processes are doing.

Each new connection is read until its first bytes tell (acceptor_protocol.classify): a whole `GET`
or `HEAD /health` is answered here from the router processes' last snapshots; anything else is sent
with the bytes read so far to a router process over its control socket (SCM_RIGHTS), which serves
it as if it had accepted it (inference/gateway/handoff.py). Keep-alive connections then stay with
that process. Nothing here blocks: every read is non-blocking and bounded (`HEAD_LIMIT` bytes,
`head_wait_s`), so a silent or slow client never delays anyone else.

Router processes connect to the control socket when they start serving and push a snapshot every
`SNAPSHOT_INTERVAL_S` from a thread of their own (not their event loop). A process whose snapshot
is older than `stale_s` (stopped, wedged) is not given connections and does not count as ready; with
none fresh, probes get 503 and other connections wait (at most `handoff_wait_s`, then 503).
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from inference.gateway.acceptor_protocol import (
    CONNECTION,
    HEAD_LIMIT,
    QUIT,
    QUIT_ACK,
    RECEIVED,
    RECORD_LIMIT,
    SNAPSHOT,
    SNAPSHOT_LIMIT,
    DateHeader,
    Probe,
    Verdict,
    classify,
    response,
)

logger = logging.getLogger(__name__)

_ACCEPTS_PER_PASS = 128  # bounded work per readiness callback, so probes and hand-overs interleave
_BACKLOG = 32  # hand-overs queued for one router process before the next one is preferred
_ERROR_CLOSE = Probe(head_only=False, close=True)


@dataclass(eq=False)
class RouterLink:
    """One router process's control connection, as the acceptor sees it."""

    sock: socket.socket
    registered_at: float
    pid: int | None = None
    health: dict[str, Any] | None = None
    loop_lag_s: float = 0.0
    snapshot_at: float | None = None
    leaving: bool = False
    oversized: bool = False  # it sent a record too large to read (logged once)
    outbox: collections.deque[tuple[bytes, socket.socket | None]] = field(default_factory=collections.deque)
    # Sent but not yet confirmed received: the acceptor's copies, handed again if the process dies.
    unconfirmed: collections.deque[tuple[bytes, socket.socket]] = field(default_factory=collections.deque)

    def fresh(self, now: float, stale_s: float) -> bool:
        """Whether its last snapshot is recent enough to trust (and to give it connections)."""
        return self.snapshot_at is not None and now - self.snapshot_at <= stale_s


@dataclass(eq=False)
class _Pending:
    """A new connection whose first bytes are being read, or one waiting for a router process."""

    sock: socket.socket
    data: bytes = b""
    timer: asyncio.TimerHandle | None = None


class Acceptor:
    """Accepts on `listener`, registers router processes on `control`; runs on the current loop."""

    def __init__(self, listener: socket.socket, control: socket.socket, *, head_wait_s: float = 1.0,
                 stale_s: float = 2.0, handoff_wait_s: float = 30.0) -> None:
        self.listener = listener
        self.control = control
        self.head_wait_s = head_wait_s
        self.stale_s = stale_s
        self.handoff_wait_s = handoff_wait_s
        self.links: dict[int, RouterLink] = {}
        self.probes_answered = 0
        self._reading: dict[int, _Pending] = {}
        self._waiting: collections.deque[_Pending] = collections.deque()
        self._turn = 0
        self._date = DateHeader()
        self._loop = asyncio.get_running_loop()
        # Every control record is read into this one buffer (a snapshot may be up to SNAPSHOT_LIMIT; a
        # buffer per recv of that size would be allocated for every receipt too).
        self._records = bytearray(max(RECORD_LIMIT, SNAPSHOT_LIMIT) + 1)

    def start(self) -> None:
        """Start accepting connections and router processes."""
        for sock in (self.listener, self.control):
            sock.setblocking(False)
        self._loop.add_reader(self.listener.fileno(), self._accept)
        self._loop.add_reader(self.control.fileno(), self._register)

    def stop_listening(self) -> None:
        """Close the listening socket (new connections are refused at once); accepted ones go on."""
        if self.listener.fileno() >= 0:
            self._loop.remove_reader(self.listener.fileno())
            self.listener.close()

    def close(self) -> None:
        """Close everything (the process is ending)."""
        self.stop_listening()
        for pending in [*self._reading.values(), *self._waiting]:
            self._forget(pending)
        for link in list(self.links.values()):
            self._unlink(link, redispatch=False)
        if self.control.fileno() >= 0:
            self._loop.remove_reader(self.control.fileno())
            self.control.close()

    # ----------------------------------------------------------------------------- health

    def health_answer(self) -> tuple[int, dict[str, Any]] | None:
        """GET /health's status and body from the snapshots; None: a router process should answer
        (it is fresh but has not checked its workers yet, and checks them first)."""
        now = time.monotonic()
        fresh = [link for link in self.links.values() if link.fresh(now, self.stale_s)]
        known = [link for link in fresh if link.health is not None]
        if known:
            latest = max(known, key=lambda link: link.snapshot_at or 0.0)
            body = dict(latest.health or {})
            body["ready"] = any((link.health or {}).get("ready") is True for link in known)
            for key in ("inflight", "queued"):  # each process's own counts add up
                body[key] = sum(int((link.health or {}).get(key) or 0) for link in known)
            body["router_processes"] = len(self.links)
            body["snapshot_age_s"] = round(now - (latest.snapshot_at or now), 3)
            # How long ago a router process's event loop last ran its 0.1 s tick: how far behind it is.
            body["loop_lag_s"] = max(link.loop_lag_s for link in known)
            return 200, body
        if fresh:
            return None
        if self.links:
            last = max(link.snapshot_at or link.registered_at for link in self.links.values())
            reason = f"no router process has reported for {now - last:.1f}s (stopped or overloaded)"
        else:
            reason = "no router process is serving (starting or restarting)"
        return 503, {"status": "unavailable", "ready": False, "router_processes": len(self.links), "reason": reason}

    # ------------------------------------------------------------------------- connections

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_PASS):
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: pause accepting instead of spinning on it
                logger.warning("accept failed (%s); pausing for 0.1 s", exc)
                self._loop.remove_reader(self.listener.fileno())
                self._loop.call_later(0.1, self._resume_accepting)
                return
            sock.setblocking(False)
            pending = _Pending(sock)
            if self._read(pending):  # with TCP_DEFER_ACCEPT its first bytes are there: done in one pass
                continue
            self._reading[sock.fileno()] = pending
            self._loop.add_reader(sock.fileno(), self._read, pending)
            pending.timer = self._loop.call_later(self.head_wait_s, self._head_timeout, pending)

    def _resume_accepting(self) -> None:
        if self.listener.fileno() >= 0:
            self._loop.add_reader(self.listener.fileno(), self._accept)

    def _read(self, pending: _Pending) -> bool:
        """Read what the client sent; True once the connection is dealt with (answered, handed over
        or gone), False while more of its head is awaited."""
        try:
            chunk = pending.sock.recv(HEAD_LIMIT - len(pending.data))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            chunk = b""
        if not chunk:  # the client left (or reset) before its request was complete
            self._forget(pending)
            return True
        pending.data += chunk
        verdict, probe = classify(pending.data)
        if verdict is Verdict.MORE:
            return False
        self._stop_reading(pending)
        if probe is None or not self._answer(pending, probe):
            self._dispatch(pending)
        return True

    def _head_timeout(self, pending: _Pending) -> None:
        """A client that has not sent a whole head in `head_wait_s`: a router process takes it over
        with what it sent (as if it had accepted it), so it waits there, not here."""
        pending.timer = None
        self._stop_reading(pending)
        self._dispatch(pending)

    def _stop_reading(self, pending: _Pending) -> None:
        self._reading.pop(pending.sock.fileno(), None)
        self._loop.remove_reader(pending.sock.fileno())
        if pending.timer is not None:
            pending.timer.cancel()
            pending.timer = None

    def _forget(self, pending: _Pending) -> None:
        if pending.sock.fileno() >= 0:
            self._stop_reading(pending)
            pending.sock.close()
        if pending.timer is not None:
            pending.timer.cancel()

    def _answer(self, pending: _Pending, probe: Probe) -> bool:
        """Answer a probe here; False when a router process should (see `health_answer`)."""
        answer = self.health_answer()
        if answer is None:
            return False
        payload = response(answer[0], answer[1], probe, self._date.value(time.time()))
        try:
            sent = pending.sock.send(payload)
        except OSError:
            sent = -1
        self.probes_answered += 1
        if sent != len(payload) or probe.close:  # a client that does not read its answers is dropped
            pending.sock.close()
            return True
        nxt = _Pending(pending.sock)  # keep-alive: its next request is read like a new connection's
        self._reading[nxt.sock.fileno()] = nxt
        self._loop.add_reader(nxt.sock.fileno(), self._read, nxt)
        nxt.timer = self._loop.call_later(self.head_wait_s, self._head_timeout, nxt)
        return True

    def _dispatch(self, pending: _Pending) -> None:
        """Hand the connection to a router process, or let it wait for one."""
        link = self._choose()
        if link is None:
            self._waiting.append(pending)
            pending.timer = self._loop.call_later(self.handoff_wait_s, self._handoff_timeout, pending)
            return
        self._send(link, CONNECTION + pending.data, pending.sock)

    def _choose(self) -> RouterLink | None:
        """Round-robin over the fresh router processes, skipping one with a backlog of hand-overs."""
        now = time.monotonic()
        ready = [link for link in self.links.values() if not link.leaving and link.fresh(now, self.stale_s)]
        if not ready:
            return None
        self._turn += 1
        start = self._turn % len(ready)
        for link in ready[start:] + ready[:start]:
            if len(link.outbox) < _BACKLOG:
                return link
        return min(ready, key=lambda link: len(link.outbox))

    def _handoff_timeout(self, pending: _Pending) -> None:
        pending.timer = None
        if pending in self._waiting:
            self._waiting.remove(pending)
        body = {"error": {"message": f"no router process took the connection within {self.handoff_wait_s:g}s",
                          "type": "unavailable"}}
        try:
            pending.sock.send(response(503, body, _ERROR_CLOSE, self._date.value(time.time())))
        except OSError:
            pass
        pending.sock.close()

    def _flush_waiting(self) -> None:
        while self._waiting and self._choose() is not None:
            pending = self._waiting.popleft()
            if pending.timer is not None:
                pending.timer.cancel()
                pending.timer = None
            self._dispatch(pending)

    # --------------------------------------------------------------------- router processes

    def _register(self) -> None:
        while True:
            try:
                sock, _ = self.control.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("router process could not connect: %s", exc)
                return
            sock.setblocking(False)
            link = RouterLink(sock, registered_at=time.monotonic())
            self.links[sock.fileno()] = link
            self._loop.add_reader(sock.fileno(), self._on_control, link)

    def _on_control(self, link: RouterLink) -> None:
        buffer = self._records
        for _ in range(16):
            try:
                size = link.sock.recv_into(buffer)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                size = 0
            if not size:
                self._unlink(link, redispatch=True)
                return
            if size == len(buffer):  # a record past SNAPSHOT_LIMIT, cut short: a sender of another version
                if not link.oversized:
                    logger.warning("router process %s sent a control record over %d bytes; ignored",
                                   link.pid, SNAPSHOT_LIMIT)
                link.oversized = True
                continue
            record = bytes(buffer[:size])
            tag = record[:1]
            if tag == SNAPSHOT:
                self._snapshot(link, record[1:])
            elif tag == RECEIVED:
                self._confirmed(link, record[1:])
            elif tag == QUIT:
                link.leaving = True
                self._send(link, QUIT_ACK, None)

    def _snapshot(self, link: RouterLink, payload: bytes) -> None:
        try:
            snapshot = json.loads(payload)
        except ValueError:
            logger.warning("router process %s sent a snapshot that is not JSON; ignored", link.pid)
            return
        first = link.pid is None
        link.pid = snapshot.get("pid")
        health = snapshot.get("health")
        link.health = health if isinstance(health, dict) else None
        lag = snapshot.get("loop_lag_s")
        link.loop_lag_s = float(lag) if isinstance(lag, (int, float)) else 0.0
        link.snapshot_at = time.monotonic()
        if first:
            logger.info("router process %s serving", link.pid)
        self._flush_waiting()

    def _confirmed(self, link: RouterLink, count: bytes) -> None:
        try:
            n = int(count)
        except ValueError:
            logger.warning("router process %s sent a bad receipt %r; ignored", link.pid, count[:20])
            return
        for _ in range(min(n, len(link.unconfirmed))):
            link.unconfirmed.popleft()[1].close()

    def _send(self, link: RouterLink, record: bytes, sock: socket.socket | None) -> None:
        if not link.outbox:
            outcome = self._try_send(link, record, sock)
            if outcome != "busy":
                if outcome == "dead":
                    link.outbox.append((record, sock))
                    self._unlink(link, redispatch=True)
                return
            self._loop.add_writer(link.sock.fileno(), self._flush, link)
        link.outbox.append((record, sock))

    def _try_send(self, link: RouterLink, record: bytes, sock: socket.socket | None) -> str:
        try:
            if sock is None:
                link.sock.send(record)
            else:
                socket.send_fds(link.sock, [record], [sock.fileno()])
        except (BlockingIOError, InterruptedError):
            return "busy"
        except OSError:
            return "dead"
        if sock is not None:
            link.unconfirmed.append((record, sock))  # closed once the process says it received it
        return "sent"

    def _flush(self, link: RouterLink) -> None:
        while link.outbox:
            record, sock = link.outbox[0]
            outcome = self._try_send(link, record, sock)
            if outcome == "busy":
                return
            if outcome == "dead":
                self._unlink(link, redispatch=True)
                return
            link.outbox.popleft()
        self._loop.remove_writer(link.sock.fileno())

    def _unlink(self, link: RouterLink, *, redispatch: bool) -> None:
        """The router process left (or died): forget it; connections not yet sent to it go elsewhere."""
        fd = link.sock.fileno()
        if self.links.pop(fd, None) is None:
            return
        self._loop.remove_reader(fd)
        self._loop.remove_writer(fd)
        link.sock.close()
        if not link.leaving and link.pid is not None:  # (a link that never reported: another acceptor's check)
            logger.warning("router process %s gone", link.pid)
        # Sent but never received (still in the dead process's queue), then never sent: in order.
        unsent = [*link.unconfirmed, *link.outbox]
        link.unconfirmed, link.outbox = collections.deque(), collections.deque()
        if unsent and redispatch:
            logger.warning("handing %d connection(s) of router process %s to another one", len(unsent), link.pid)
        for record, sock in unsent:
            if sock is None:
                continue
            if redispatch:
                self._dispatch(_Pending(sock, record[len(CONNECTION):]))
            else:
                sock.close()
