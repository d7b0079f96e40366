"""The decode worker: reserve blocks, hand out a transfer descriptor, wait (under a lease) for a prefill
worker to write the prompt's KV, then continue generation in the continuous batch, streaming tokens.

Its KV receiver is built with it and never absent; the event stream itself is decode_stream.py.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from inference.engine import NoFreeBlocks, SamplingParams
from inference.kv_transfer import KVTransferError, TransferStats
from inference.kv_transfer.lease import Lease
from inference.server.args import SUGGESTED_STREAM_WINDOW, ServerArgs
from inference.server.core import WorkerCore
from inference.server.credit import StreamCredit
from inference.server.decode_stream import DecodeStream, Event, KVWaiter
from inference.server.errors import StartupError, bad_request, overloaded
from inference.server.logprobs import LogprobRenderer
from inference.server.pending_prefix import PendingPrefixes, pending_prefix_credit_enabled
from inference.server.requests import parse_sampling, prompt_token_ids
from inference.server.transport import build_receiver

logger = logging.getLogger(__name__)


class DecodeWorker(WorkerCore):
    """A decode worker: the core plus its KV receiver and the requests waiting for their KV."""

    role = "decode"
    # A `both` worker (colocated.py) prefills every prompt itself; a decode worker only those the
    # router offers under its threshold (local_prefill.py).
    prefills_every_prompt = False

    def __init__(self, args: ServerArgs) -> None:
        """Load the engine and build the KV receiver over its pool (its port opens in `start`)."""
        super().__init__(args)
        self._kv_waiters: dict[str, KVWaiter] = {}
        self.receiver = build_receiver(args, self.engine, self.layout, self._on_kv_received, self.rdma_device)
        self.logprob_texts = LogprobRenderer(self.engine.tokenizer)
        # The blocks of the local prefills taken here and not computed yet (local_prefill.py); the switch
        # (WORKER_PENDING_PREFIX_CREDIT) is read once, here.
        self.pending_prefixes = PendingPrefixes(self.engine.engine.block_size, pending_prefix_credit_enabled())

    def start(self) -> None:
        """Open the KV port."""
        try:
            self.receiver.start()
        except KVTransferError as exc:
            raise StartupError(f"--kv-port {self.args.kv_port}: {exc}") from exc

    def stop(self) -> None:
        """Stop the KV port and the engine thread."""
        self.receiver.stop()
        super().stop()

    def role_health(self) -> dict[str, Any]:
        """Decode workers take credited streams (inference/server/credit.py)."""
        return {"stream_credit": True}

    def info(self) -> dict[str, Any]:
        """The core's facts plus the KV port."""
        return {**super().info(), "kv_port": self.receiver.port}

    # ------------------------------------------------------------------ aborts
    async def abort_role_part(self, request_id: str) -> bool:
        """A request waiting for its KV ends its stream at once; later writes for it are refused."""
        await asyncio.to_thread(self.receiver.cancel, request_id)
        waiter = self._kv_waiters.pop(request_id, None)
        if waiter is not None and not waiter.event.is_set():
            waiter.aborted = True
            waiter.event.set()
        if waiter is not None:
            logger.info("abort of %s: decode request cancelled", request_id)
        return waiter is not None

    def has_pending(self, request_id: str) -> bool:
        """Whether the request is registered here (waiting for its KV, or streaming)."""
        return request_id in self._kv_waiters

    # ------------------------------------------------------------------ requests
    async def open_decode(
        self, body: dict[str, Any], server_host: str, credit: StreamCredit | None = None
    ) -> AsyncIterator[Event]:
        """Validate and reserve; return the NDJSON event stream (descriptor first) of a decode request.

        With `credit` (the router acknowledges what it relayed) the stream sends tokens only within
        the credit, and the engine pauses the sequence once its outputs pile up (the worker's
        `--stream-window`, or SUGGESTED_STREAM_WINDOW where that is off).
        Raises WorkerError (400/429) before anything is reserved, so the router sees a plain status.
        """
        received_at = time.perf_counter()
        request_id = str(body.get("request_id") or uuid.uuid4().hex)
        self.refuse_if_aborted(request_id)
        params = parse_sampling(body.get("sampling"), self.args.max_tokens_limit, self.sampling_defaults)
        ids = prompt_token_ids(body, self.engine.tokenizer, self.engine.config.vocab_size)
        self.check_prompt_length(len(ids))
        params = self.clamp(params, len(ids))
        if self.engine.status().waiting + len(self._kv_waiters) >= self.args.max_queue:
            self.metrics.outcome("rejected")
            raise overloaded(f"decode queue is full ({self.args.max_queue} waiting); retry later")
        window = (self.args.stream_window or SUGGESTED_STREAM_WINDOW) if credit is not None else None
        block_ids, hits = await self._reserve(request_id, ids, params, window)
        waiter = KVWaiter(loop=asyncio.get_running_loop())
        self._kv_waiters[request_id] = waiter
        host = self.args.kv_advertise_host or server_host
        # The first `hits` blocks are cached here already: the prefill side sends the ones after them.
        descriptor = self.receiver.expect(
            request_id, block_ids[hits:], len(ids), self.args.kv_lease_timeout, host, first_block=hits
        )
        self.metrics.prompt_tokens.inc(len(ids))
        stream = DecodeStream(self, request_id, ids, descriptor, waiter, received_at, params.to_dict(), credit,
                              cached_tokens=hits * self.engine.engine.block_size)
        return stream.events()

    async def _reserve(
        self, request_id: str, ids: list[int], params: SamplingParams, window: int | None
    ) -> tuple[list[int], int]:
        """Reserve the prompt's blocks: their ids and how many were cached here already (429 when the
        pool or the queue bound is full, 400 for a request the engine refuses)."""

        def reserve() -> tuple[list[int], int]:
            # Both take the engine lock, held across a step: off the event loop.
            blocks = self.engine.reserve(request_id, ids, params, window)
            return blocks, self.engine.reserved_hits(request_id)

        try:
            return await asyncio.to_thread(reserve)
        except NoFreeBlocks as exc:
            self.metrics.outcome("rejected")
            raise overloaded(f"KV cache is full ({exc}); retry later") from exc
        except ValueError as exc:
            raise bad_request(str(exc)) from exc

    def _on_kv_received(self, request_id: str, first_token: int, stats: TransferStats) -> None:
        """Receiver thread: the prompt's KV is in place; start decoding (raises if aborted meanwhile)."""
        waiter = self._kv_waiters.get(request_id)
        if waiter is None:
            raise KVTransferError(f"request {request_id} is no longer waiting")
        if request_id in self.aborted_ids:  # aborted while it was being reserved: end it now
            waiter.aborted = True
            waiter.loop.call_soon_threadsafe(waiter.event.set)
            raise KVTransferError(f"request {request_id} was aborted")
        self.engine.kv_received(request_id, first_token)
        waiter.stats = stats
        self.metrics.kv_transfer_bytes.inc(stats.nbytes)
        self.metrics.kv_transfer_seconds.observe(stats.seconds)
        waiter.loop.call_soon_threadsafe(waiter.event.set)

    async def wait_for_kv(self, request_id: str, waiter: KVWaiter) -> dict[str, Any] | None:
        """Wait for the prompt's KV for as long as the prefill worker keeps the lease alive.

        Returns None once the KV arrived (or an abort ended the wait), else the fields of the
        `kv_timeout` error line: who went silent, for how long, and the last progress seen.
        """
        lease = self.receiver.lease(request_id)
        if lease is None:
            # Already gone from the receiver: the KV arrived or an abort came first, and the event
            # is about to be set; a lease nobody can renew bounds the wait should it not be.
            lease = Lease(self.args.kv_lease_timeout)
        while not waiter.event.is_set():
            try:
                await asyncio.wait_for(waiter.event.wait(), timeout=max(lease.remaining(), 0.0))
            except TimeoutError:
                if lease.expire():  # else a renewal came in meanwhile: wait on
                    logger.warning("lease of %s expired: %s", request_id, lease.expiry_message())
                    return {"message": lease.expiry_message(), **lease.describe()}
        if lease.renewals and not waiter.aborted:
            progress = lease.last_progress
            logger.info(
                "KV of %s arrived after %d lease renewal(s) over %.1fs (last progress: %s)",
                request_id, lease.renewals, time.monotonic() - lease.granted_at,
                progress.stage if progress else "none",
            )
        return None

    async def decode_ended(self, request_id: str, outcome: str, finished: bool) -> None:
        """A stream's last step: count its outcome and, unless it finished, abort the request."""
        self._kv_waiters.pop(request_id, None)
        self.metrics.outcome(outcome)
        if not finished:
            # A client disconnect cancels the stream inside an anyio cancel scope, which cancels
            # every await there too: the abort runs as its own task so that it always completes (a
            # reservation still waiting for KV would otherwise never be freed).
            await asyncio.shield(self.in_background(self.abort(request_id)))
