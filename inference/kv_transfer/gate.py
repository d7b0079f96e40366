"""The KV port's listener: authenticate first, allocate later.

Measured before this existed: 70 idle TCP connections that never sent a byte held all 64 transfer
slots (one thread each) for 30 s, and every real transfer was refused. Now one selector thread
accepts every connection, sends the challenge of `auth.py` and reads the answer without blocking;
a connection holds no thread and no transfer slot until its proof has checked out:

- a peer has `handshake_timeout` (1 s) from accept to a valid proof, else it is closed unanswered;
- at most `max_handshakes` unauthenticated connections in all and `max_handshakes_per_peer` per
  peer address; past either, the oldest of that peer (or of the peer holding the most) is closed,
  so an address flooding the port only ever displaces its own connections, and a real sender,
  whose handshake takes one round trip, is not the oldest for long (it retries once if it was);
- authenticated connections take one of `max_connections` slots, at most
  `max_connections_per_peer` per peer address, each served by a thread of its own.

Without the secret a connection never gets past the selector thread, so nobody without it can
exhaust the slots. In open mode (no secret) every proof passes and the limits above are all that
stands between a peer and the slots: bind the KV port to a private address (docs/security.md).
"""
from __future__ import annotations

import collections
import json
import logging
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from inference.kv_transfer.auth import MAX_AUTH_FRAME_BYTES, challenge_frame, check_auth, new_nonce
from inference.kv_transfer.base import KVTransferError

logger = logging.getLogger(__name__)

# Called in a thread of its own with an authenticated, blocking connection; the gate closes the
# connection and frees its slot when it returns.
Serve = Callable[[socket.socket], None]

HANDSHAKE_TIMEOUT_S = 1.0


def _encode(frame: dict[str, object]) -> bytes:
    """One frame of `wire.py`, built for a non-blocking send."""
    payload = json.dumps(frame, separators=(",", ":")).encode()
    return struct.pack("!I", len(payload)) + payload


@dataclass(eq=False)
class _Handshake:
    """An accepted connection that has not proven the secret yet."""

    conn: socket.socket
    peer: str
    nonce: str
    deadline: float
    buf: bytearray = field(default_factory=bytearray)
    size: int | None = None  # the auth frame's length, once its 4-byte prefix arrived


@dataclass
class GateStats:
    """What the gate turned away, for tests and logs."""

    authenticated: int = 0
    bad_secret: int = 0
    timed_out: int = 0
    evicted: int = 0
    busy: int = 0
    malformed: int = 0


class ConnectionGate:
    """Listening socket + handshake selector + transfer slots, in front of a receiver's `serve`."""

    def __init__(
        self,
        serve: Serve,
        *,
        bind_host: str,
        port: int,
        secret: str,
        name: str,
        max_connections: int = 64,
        max_connections_per_peer: int | None = None,
        handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
        max_handshakes: int = 256,
        max_handshakes_per_peer: int = 64,
    ) -> None:
        self._serve = serve
        self.bind_host = bind_host
        self._requested_port = port
        self.secret = secret
        self._name = name
        self._max_connections = max_connections
        # Three quarters by default: one address (say a host running several prefill workers) can
        # never take the last slots from the others.
        self._max_per_peer = max_connections_per_peer or max(1, max_connections * 3 // 4)
        self._handshake_timeout = handshake_timeout
        self._max_handshakes = max_handshakes
        self._max_handshakes_per_peer = max_handshakes_per_peer
        self._handshakes: collections.OrderedDict[_Handshake, None] = collections.OrderedDict()  # oldest first
        self._handshakes_by_peer: collections.Counter[str] = collections.Counter()
        self._active: dict[socket.socket, str] = {}
        self._active_by_peer: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # guards _active*: serving threads release their slot
        self._selector = selectors.DefaultSelector()
        self._sock: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = GateStats()

    # ------------------------------------------------------------------ lifecycle
    @property
    def port(self) -> int:
        """The bound port (known after start())."""
        if self._sock is None:
            raise RuntimeError("receiver not started")
        return int(self._sock.getsockname()[1])

    @property
    def active(self) -> int:
        """Authenticated connections holding a slot now."""
        with self._lock:
            return len(self._active)

    @property
    def handshaking(self) -> int:
        """Connections accepted and not yet authenticated."""
        return len(self._handshakes)

    def start(self) -> None:
        """Bind and listen; the selector thread starts accepting."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.bind_host, self._requested_port))
        except OSError as exc:
            sock.close()
            raise KVTransferError(
                f"cannot listen for KV transfers on {self.bind_host}:{self._requested_port}: {exc}"
            ) from exc
        sock.listen(1024)
        sock.setblocking(False)
        self._sock = sock
        self._wake_r.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name=f"{self._name}-gate", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop accepting: the port is closed when this returns; served connections run on."""
        self._stopped.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def cut_all(self) -> None:
        """Wake every serving thread blocked on its connection (it sees EOF and ends)."""
        with self._lock:
            conns = list(self._active)
        for conn in conns:
            shutdown(conn)

    # ------------------------------------------------------------------ selector thread
    def _run(self) -> None:
        """The selector thread: accept, advance handshakes, expire the slow ones, until stop()."""
        try:
            while not self._stopped.is_set():
                first = next(iter(self._handshakes), None)
                timeout = 0.5 if first is None else min(max(first.deadline - time.monotonic(), 0.0), 0.5)
                for key, _events in self._selector.select(timeout):
                    if key.data == "listen":
                        self._accept_all()
                    elif key.data == "wake":
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                    else:
                        self._advance(key.data)
                self._expire()
        except Exception:  # never leave the port half dead: log, and close it below
            logger.exception("%s: KV gate failed", self._name)
        finally:
            for handshake in list(self._handshakes):
                self._drop(handshake)
            if self._sock is not None:
                self._selector.unregister(self._sock)
                self._sock.close()
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _accept_all(self) -> None:
        """Accept what the listen backlog holds (so it never fills and real senders never wait)."""
        assert self._sock is not None
        # A bounded batch: handshakes already under way get their turn between batches.
        for _ in range(256):
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                logger.warning("%s: accept failed: %s", self._name, exc)
                return
            self._admit(conn, str(addr[0]))

    def _admit(self, conn: socket.socket, peer: str) -> None:
        """Send a fresh connection its challenge and start its clock, making room first if needed."""
        if self._handshakes_by_peer[peer] >= self._max_handshakes_per_peer:
            self._evict(peer)
        elif len(self._handshakes) >= self._max_handshakes:
            heaviest, _count = self._handshakes_by_peer.most_common(1)[0]
            self._evict(heaviest)
        conn.setblocking(False)
        handshake = _Handshake(conn, peer, new_nonce(), time.monotonic() + self._handshake_timeout)
        try:
            # A few dozen bytes into an empty send buffer: never a partial write.
            conn.send(_encode(challenge_frame(handshake.nonce)))
        except OSError:
            conn.close()
            return
        self._handshakes[handshake] = None
        self._handshakes_by_peer[peer] += 1
        self._selector.register(conn, selectors.EVENT_READ, handshake)

    def _evict(self, peer: str) -> None:
        """Close the oldest unauthenticated connection of `peer`."""
        oldest = next(h for h in self._handshakes if h.peer == peer)
        self.stats.evicted += 1
        self._drop(oldest)

    def _expire(self) -> None:
        """Close the connections whose handshake time is up (oldest first: all share one timeout)."""
        now = time.monotonic()
        while self._handshakes:
            oldest = next(iter(self._handshakes))
            if oldest.deadline > now:
                return
            self.stats.timed_out += 1
            self._drop(oldest)

    def _drop(self, handshake: _Handshake) -> None:
        """Forget an unauthenticated connection and close it without a word."""
        self._forget(handshake)
        handshake.conn.close()

    def _forget(self, handshake: _Handshake) -> None:
        """Stop tracking a handshake (it succeeded or is being closed)."""
        if handshake in self._handshakes:
            del self._handshakes[handshake]
            self._handshakes_by_peer[handshake.peer] -= 1
            if self._handshakes_by_peer[handshake.peer] <= 0:
                del self._handshakes_by_peer[handshake.peer]
            self._selector.unregister(handshake.conn)

    def _advance(self, handshake: _Handshake) -> None:
        """Read what the peer sent of its auth frame (never past it), judge it once complete."""
        target = 4 if handshake.size is None else handshake.size
        try:
            data = handshake.conn.recv(target - len(handshake.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(handshake)
            return
        if not data:
            self._drop(handshake)
            return
        handshake.buf += data
        if len(handshake.buf) < target:
            return
        if handshake.size is None:
            (size,) = struct.unpack("!I", handshake.buf)
            if not 0 < size <= MAX_AUTH_FRAME_BYTES:
                self.stats.malformed += 1
                self._refuse(handshake, "malformed authentication frame")
                return
            handshake.size = size
            handshake.buf.clear()
            return
        self._judge(handshake)

    def _judge(self, handshake: _Handshake) -> None:
        """Check the complete auth frame; hand the connection a slot and a thread, or refuse it."""
        try:
            frame = json.loads(handshake.buf)
        except ValueError:
            frame = None
        if not isinstance(frame, dict):
            self.stats.malformed += 1
            self._refuse(handshake, "malformed authentication frame")
            return
        reply, error = check_auth(frame, handshake.nonce, self.secret)
        if reply is None:
            if error == "bad shared secret":
                self.stats.bad_secret += 1
                logger.warning("%s: KV connection from %s refused: bad shared secret", self._name, handshake.peer)
            else:
                self.stats.malformed += 1
            self._refuse(handshake, error)
            return
        busy = self._take_slot(handshake.conn, handshake.peer)
        if busy:
            self.stats.busy += 1
            self._refuse(handshake, busy)
            return
        self._forget(handshake)
        conn = handshake.conn
        try:
            conn.send(_encode(reply))
        except OSError:
            self._release(conn)
            conn.close()
            return
        self.stats.authenticated += 1
        conn.setblocking(True)
        threading.Thread(target=self._serve_and_release, args=(conn,), name=f"{self._name}-recv", daemon=True).start()

    def _refuse(self, handshake: _Handshake, message: str) -> None:
        """Tell the peer why (it waits for the verdict, so it reads this) and close."""
        self._forget(handshake)
        try:
            handshake.conn.send(_encode({"ok": False, "error": message}))
        except OSError:
            pass
        handshake.conn.close()

    # ------------------------------------------------------------------ slots
    def _take_slot(self, conn: socket.socket, peer: str) -> str:
        """Reserve a transfer slot for `conn`; '' on success, else why not."""
        with self._lock:
            if len(self._active) >= self._max_connections:
                return "too many concurrent KV transfers"
            if self._active_by_peer[peer] >= self._max_per_peer:
                return f"too many concurrent KV transfers from {peer}"
            self._active[conn] = peer
            self._active_by_peer[peer] += 1
            return ""

    def _release(self, conn: socket.socket) -> None:
        """Give back the slot of `conn`."""
        with self._lock:
            peer = self._active.pop(conn, None)
            if peer is not None:
                self._active_by_peer[peer] -= 1
                if self._active_by_peer[peer] <= 0:
                    del self._active_by_peer[peer]

    def _serve_and_release(self, conn: socket.socket) -> None:
        """Thread body: serve an authenticated connection, then free its slot and close it."""
        try:
            self._serve(conn)
        except Exception:  # a bug in one transfer must not take the slot with it
            logger.exception("%s: KV connection failed", self._name)
        finally:
            self._release(conn)
            conn.close()


def shutdown(conn: socket.socket) -> None:
    """Wake a thread blocked on `conn` (it sees EOF); the owner closes it."""
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
