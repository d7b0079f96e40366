"""A prefill or decode worker: the engine, its KV transport, metrics, and the request flows.

Decode: reserve blocks → hand out a transfer descriptor → wait (under a lease) for a prefill worker
to write the prompt's KV → continue generation in the continuous batch, streaming tokens.
Prefill: run the prompt (batched with other prefills), sample the first token, write the KV blocks
into the decode worker's reserved blocks, answer with the first token and timings.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from inference.engine import AsyncEngine, LLMEngine, NoFreeBlocks, SamplingParams
from inference.engine.compile import CompileUnavailable
from inference.engine.memory import KVPoolTooSmall
from inference.engine.sampling_params import load_sampling_defaults
from inference.engine.sequence import SequenceStatus
from inference.kv_transfer import (
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferError,
    TransferDescriptor,
    TransferStats,
)
from inference.kv_transfer.keeper import LeaseKeeper
from inference.kv_transfer.lease import Lease, LeaseLost
from inference.kv_transfer.rdma import RdmaKVReceiver, RdmaKVSender
from inference.kv_transfer.receiver import kv_bind_host
from inference.kv_transfer.tcp import TcpKVReceiver, TcpKVSender
from inference.kv_transfer.verbs import VerbsDevice
from inference.server.args import SUGGESTED_STREAM_WINDOW, ServerArgs
from inference.server.credit import StreamCredit
from inference.server.errors import StartupError, WorkerError, bad_request, overloaded
from inference.server.load import LoadSignals
from inference.server.metrics import WorkerMetrics
from inference.server.requests import parse_sampling, parse_token_ids, prompt_token_ids
from inference.server.resources import Utilization, pin_cpus, select_device
from inference.server.tombstones import AbortTombstones

logger = logging.getLogger(__name__)

# How long a decode stream waits for the next engine output before declaring the engine stuck.
OUTPUT_TIMEOUT_S = 120.0

# Seconds after an abort that found nothing at which it looks again for the request (still
# reserving its blocks when the abort came): one engine step is the usual window.
ABORT_RECHECK_S = (0.5, 1.5, 3.0)

# Test-only fault injection (docs/internals.md): a prefill worker started with this variable set
# sleeps that many seconds between computing the prompt and sending its KV, so that tests can kill
# or stall it mid-transfer reproducibly. Never set it in production.
FAULT_PREFILL_DELAY_ENV = "PLATFORM_FAULT_PREFILL_DELAY_S"


def fault_prefill_delay_s() -> float:
    """The injected delay before each KV send, from PLATFORM_FAULT_PREFILL_DELAY_S (0: none)."""
    raw = os.environ.get(FAULT_PREFILL_DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError as exc:
        raise StartupError(f"{FAULT_PREFILL_DELAY_ENV}={raw!r} is not a number of seconds") from exc
    return max(value, 0.0)


@dataclass
class _KVWaiter:
    """A decode request waiting for its KV: the event is set from the receiver thread."""

    loop: asyncio.AbstractEventLoop
    event: asyncio.Event = field(default_factory=asyncio.Event)
    stats: TransferStats | None = None
    # Set (with the event) by an abort, so the stream ends now instead of at the end of the lease.
    aborted: bool = False


class Worker:
    """One worker process's state; the HTTP app (inference.server.app) calls its methods."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.role = args.service_type
        self.cpus = pin_cpus(args.base_cpu_id, args.num_threads)
        self.device = select_device()
        # Checked before the model loads, so a host without RDMA fails fast with a clear message.
        rdma_device = self._check_rdma(args.rdma_device or "") if args.kv_transport == "rdma" else None
        try:
            self.engine = LLMEngine(
                str(args.model_path),
                block_size=args.block_size,
                num_blocks=args.num_kv_blocks,
                max_num_seqs=args.batch_size,
                max_num_batched_tokens=args.max_num_batched_tokens,
                dtype=args.dtype,
                enable_prefix_caching=args.prefix_caching,
                enable_chunked_prefill=args.chunked_prefill,
                max_model_len=args.max_sequence_length or args.context_length,
                kv_cache_bytes=args.kv_cache_bytes,
                gpu_memory_utilization=args.gpu_memory_utilization,
                use_compile=args.compile,
                device=self.device,
            )
        except (KVPoolTooSmall, CompileUnavailable) as exc:  # their messages name the flag to change
            raise StartupError(str(exc)) from exc
        except (OSError, ValueError) as exc:
            raise StartupError(f"cannot load the model from --model-path {args.model_path}: {exc}") from exc
        try:
            # What a request that leaves temperature/top_p/top_k/min_p out samples with (as vLLM does).
            self.sampling_defaults = load_sampling_defaults(args.model_path)
        except ValueError as exc:
            raise StartupError(f"--model-path {args.model_path}: {exc}") from exc
        model_max = self.engine.config.max_position_embeddings
        self.context_length = min(args.context_length or model_max, model_max)
        self.max_sequence_length = min(args.max_sequence_length or self.context_length, model_max)
        self.model_name = args.served_model_name or args.model_path.name
        self.metrics = WorkerMetrics(self.role, self.model_name)
        self.utilization = Utilization(self.cpus, self.device)
        # Windowed readings for the autoscaler (a 5 s sample of the queue alone misses short prompts).
        self.signals = LoadSignals()
        self.layout = KVLayout.from_dict(self.engine.kv_cache.layout())
        self.async_engine = AsyncEngine(self.engine, stream_window=args.stream_window)
        self._kv_waiters: dict[str, _KVWaiter] = {}
        self.receiver: KVReceiver | None = None
        self.sender: KVSender | None = None
        if rdma_device is not None:
            self._build_rdma(rdma_device)
        elif self.role == "decode":
            self.receiver = TcpKVReceiver(
                self.engine.kv_cache.data,
                self.layout,
                self._on_kv_received,
                bind_host=kv_bind_host(args.host, args.kv_advertise_host, args.shared_secret),
                port=args.kv_port,
                secret=args.shared_secret,
            )
        else:
            self.sender = TcpKVSender(self.engine.kv_cache.data, self.layout, secret=args.shared_secret)
        self.started_at = time.time()
        # Tasks that must finish even if the request that started them is cancelled (kept
        # referenced here so that they are not garbage collected while running).
        self._background: set[asyncio.Future[None]] = set()
        # Prefills in progress by request id, so that /internal/abort can cancel them.
        self._prefill_tasks: dict[str, asyncio.Task[dict[str, Any]]] = {}
        self.fault_prefill_delay_s = fault_prefill_delay_s() if self.role == "prefill" else 0.0
        if self.fault_prefill_delay_s:
            logger.warning(
                "fault injection active: every KV send waits %.1fs first (%s; tests only)",
                self.fault_prefill_delay_s, FAULT_PREFILL_DELAY_ENV,
            )

    def _build_rdma(self, device: VerbsDevice) -> None:
        """RDMA receiver (decode) or sender (prefill) on `device`; registering the KV pool can fail."""
        args = self.args
        try:
            if self.role == "decode":
                self.receiver = RdmaKVReceiver(
                    self.engine.kv_cache.data,
                    self.layout,
                    self._on_kv_received,
                    device=device,
                    bind_host=kv_bind_host(args.host, args.kv_advertise_host, args.shared_secret),
                    port=args.kv_port,
                    secret=args.shared_secret,
                )
            else:
                self.sender = RdmaKVSender(
                    self.engine.kv_cache.data, self.layout, device=device, secret=args.shared_secret
                )
        except KVTransferError as exc:
            device.close()
            raise StartupError(f"--rdma-device {device.name}: {exc}; start with --kv-transport tcp") from exc

    @staticmethod
    def _check_rdma(device: str) -> VerbsDevice:
        """Open the RDMA device; fail at startup, naming it and the tools to inspect it, when unusable."""
        from inference.kv_transfer import verbs
        from inference.kv_transfer.rdma_detect import rdma_available

        ok, reason, devices = rdma_available()
        hint = "check `ibstat` / `ibv_devices`, or start with --kv-transport tcp"
        if not ok:
            raise StartupError(f"--rdma-device {device}: RDMA is not usable here ({reason}); {hint}")
        if device not in devices:
            raise StartupError(f"--rdma-device {device}: no such device (found {devices}); {hint}")
        try:
            return verbs.PyverbsVerbs.from_env().open_device(device)
        except (verbs.VerbsError, ValueError) as exc:  # ValueError: malformed PLATFORM_RDMA_* variables
            raise StartupError(f"--rdma-device {device}: cannot open it ({exc}); {hint}") from exc

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Open the KV port (decode)."""
        if self.receiver is not None:
            try:
                self.receiver.start()
            except KVTransferError as exc:
                raise StartupError(f"--kv-port {self.args.kv_port}: {exc}") from exc

    def stop(self) -> None:
        """Stop the KV port and the engine thread."""
        if self.receiver is not None:
            self.receiver.stop()
        self.async_engine.shutdown()

    # ------------------------------------------------------------------ status
    def health(self) -> dict[str, Any]:
        """The guide's health answer plus role, model, queue depth, running, reserved and KV usage.

        `queue_depth`: sequences waiting for a batch slot (KV arrived, or queued for prefill);
        `running`: sequences in the batch (at most `batch_size`); `reserved`: decode requests whose
        blocks are reserved and whose KV has not arrived yet. Plus the autoscaler's windowed readings
        (inference.server.load): pending prompt tokens, sustained prefill tokens/s, busy ratio, TTFT/ITL p90.
        """
        body: dict[str, Any] = {"status": "healthy"}
        gpu = self.utilization.gpu()
        if gpu is not None:
            body["gpu_utilization"] = gpu
        else:
            body["cpu_utilization"] = self.utilization.cpu()
        body.update(
            role=self.role,
            model=self.model_name,
            queue_depth=self.engine.num_queued,
            running=self.engine.num_running,
            reserved=self.engine.num_reserved,
            batch_size=self.engine.max_num_seqs,
            kv_usage=round(self.engine.kv_usage(), 4),
            kv_blocks=self.engine.kv_cache.num_blocks,
            kv_bytes=self.engine.kv_cache.nbytes,
        )
        if self.role == "decode":
            body["stream_credit"] = True  # takes credited decode streams (inference/server/credit.py)
        body.update(self.signals.snapshot())
        return body

    def info(self) -> dict[str, Any]:
        """Static facts the router and control plane read."""
        info: dict[str, Any] = {
            "role": self.role,
            "model": self.model_name,
            "model_path": str(self.args.model_path),
            "context_length": self.context_length,
            "max_sequence_length": self.max_sequence_length,
            "block_size": self.layout.block_size,
            "num_kv_blocks": self.engine.kv_cache.num_blocks,
            "kv_transport": self.args.kv_transport,
            "max_tokens_limit": self.args.max_tokens_limit,
            "batch_size": self.engine.max_num_seqs,
            "max_queue": self.args.max_queue,
            "dtype": self.layout.dtype,
            "prefix_caching": self.args.prefix_caching,
            "chunked_prefill": self.args.chunked_prefill,
            "device": str(self.device),
            "cpus": self.cpus,
            "started_at": self.started_at,
        }
        if self.receiver is not None:
            info["kv_port"] = self.receiver.port  # type: ignore[attr-defined]
        return info

    def render_metrics(self) -> bytes:
        """Prometheus text with gauges refreshed now."""
        m = self.metrics
        m.queue_depth.set(self.engine.num_queued)
        m.reserved.set(self.engine.num_reserved)
        m.running.set(self.engine.num_running)
        m.kv_usage.set(self.engine.kv_usage())
        m.prefix_cache_hit_ratio.set(self.engine.prefix_cache_hit_rate)
        m.cpu_utilization.set(self.utilization.cpu())
        gpu = self.utilization.gpu()
        if gpu is not None:
            m.gpu_utilization.set(gpu)
        return m.render()

    # ------------------------------------------------------------------ shared
    def _check_prompt_length(self, n: int) -> None:
        if n > self.context_length:
            raise bad_request(
                f"prompt has {n} tokens, longer than the context length of {self.context_length} "
                "(--context-length); shorten the prompt"
            )
        if n >= self.max_sequence_length:
            raise bad_request(
                f"prompt has {n} tokens, leaving no room to generate within --max-sequence-length "
                f"{self.max_sequence_length}"
            )

    def _clamp(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Cut max_tokens so prompt+output stays within --max-sequence-length (finish_reason=length)."""
        room = self.max_sequence_length - prompt_len
        if params.max_tokens > room:
            params.max_tokens = room
        return params

    @functools.cached_property
    def aborted_ids(self) -> AbortTombstones:
        """Request ids aborted lately, so that a request arriving after its abort is refused."""
        return AbortTombstones()

    def refuse_if_aborted(self, request_id: str) -> None:
        """Raise 409 `aborted` for a request whose abort arrived first (nothing gets reserved)."""
        if request_id in self.aborted_ids:
            logger.info("%s arrived after its abort: refused", request_id)
            self.metrics.outcome("aborted")
            raise WorkerError(409, f"request {request_id} was aborted before it arrived", "aborted")

    async def abort(self, request_id: str) -> None:
        """Abort a request in any state and free its blocks (idempotent).

        A decode request waiting for its KV ends its stream at once; a prefill in progress is
        cancelled (its blocks are freed once a KV send already under way has finished). The id is
        remembered for a while (a tombstone): the request itself may still be on its way.
        """
        # First, before any await: a request arriving meanwhile must already find the tombstone.
        self.aborted_ids.add(request_id)
        if not await self._abort_now(request_id):
            # Nothing here yet; the request may be past its tombstone check but not registered
            # (reserving blocks in a thread): look again once that window has passed.
            later = asyncio.ensure_future(self._abort_stragglers(request_id))
            self._background.add(later)
            later.add_done_callback(self._background.discard)

    async def _abort_now(self, request_id: str) -> bool:
        """Cancel whatever of `request_id` lives here now; whether anything did."""
        live = self.engine.get_sequence(request_id) is not None
        if self.receiver is not None:
            await asyncio.to_thread(self.receiver.cancel, request_id)
        waiter = self._kv_waiters.pop(request_id, None)
        if waiter is not None and not waiter.event.is_set():
            waiter.aborted = True
            waiter.event.set()
        task = self._prefill_tasks.get(request_id)
        if task is not None and not task.done():
            logger.info("abort of %s: cancelling its prefill", request_id)
            task.cancel()
        elif waiter is not None:
            logger.info("abort of %s: decode request cancelled", request_id)
        self.async_engine.abort(request_id)
        return live or waiter is not None or task is not None

    async def _abort_stragglers(self, request_id: str) -> None:
        """Abort `request_id` again should it have registered after its abort found nothing."""
        for delay in ABORT_RECHECK_S:
            await asyncio.sleep(delay)
            if request_id in self._kv_waiters or request_id in self._prefill_tasks:
                logger.info("abort of %s: applied to the request that arrived meanwhile", request_id)
                await self._abort_now(request_id)
                return

    # ------------------------------------------------------------------ decode
    def _on_kv_received(self, request_id: str, first_token: int, stats: TransferStats) -> None:
        """Receiver thread: the prompt's KV is in place; start decoding (raises if aborted meanwhile)."""
        waiter = self._kv_waiters.get(request_id)
        if waiter is None:
            raise KVTransferError(f"request {request_id} is no longer waiting")
        if request_id in self.aborted_ids:  # aborted while it was being reserved: end it now
            waiter.aborted = True
            waiter.loop.call_soon_threadsafe(waiter.event.set)
            raise KVTransferError(f"request {request_id} was aborted")
        self.async_engine.kv_received(request_id, first_token)
        waiter.stats = stats
        self.metrics.kv_transfer_bytes.inc(stats.nbytes)
        self.metrics.kv_transfer_seconds.observe(stats.seconds)
        waiter.loop.call_soon_threadsafe(waiter.event.set)

    async def open_decode(
        self, body: dict[str, Any], server_host: str, credit: StreamCredit | None = None
    ) -> AsyncIterator[dict[str, Any]]:
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
        self._check_prompt_length(len(ids))
        params = self._clamp(params, len(ids))
        if self.engine.num_waiting + len(self._kv_waiters) >= self.args.max_queue:
            self.metrics.outcome("rejected")
            raise overloaded(f"decode queue is full ({self.args.max_queue} waiting); retry later")
        try:
            window = (self.args.stream_window or SUGGESTED_STREAM_WINDOW) if credit is not None else None

            def reserve() -> tuple[list[int], int]:
                # Both take the engine lock, held across a step: off the event loop.
                blocks = self.async_engine.reserve(request_id, ids, params, window)
                return blocks, self.engine.reserved_hits(request_id)

            block_ids, hits = await asyncio.to_thread(reserve)
        except NoFreeBlocks as exc:
            self.metrics.outcome("rejected")
            raise overloaded(f"KV cache is full ({exc}); retry later") from exc
        except ValueError as exc:
            raise bad_request(str(exc)) from exc
        waiter = _KVWaiter(loop=asyncio.get_running_loop())
        self._kv_waiters[request_id] = waiter
        host = self.args.kv_advertise_host or server_host
        assert self.receiver is not None
        # The first `hits` blocks are cached here already: the prefill side sends the ones after them.
        descriptor = self.receiver.expect(
            request_id, block_ids[hits:], len(ids), self.args.kv_lease_timeout, host, first_block=hits
        )
        self.metrics.prompt_tokens.inc(len(ids))
        return self._decode_events(request_id, ids, descriptor, waiter, received_at, params.to_dict(), credit)

    async def _wait_for_kv(self, request_id: str, waiter: _KVWaiter) -> dict[str, Any] | None:
        """Wait for the prompt's KV for as long as the prefill worker keeps the lease alive.

        Returns None once the KV arrived (or an abort ended the wait), else the fields of the
        `kv_timeout` error line: who went silent, for how long, and the last progress seen.
        """
        assert self.receiver is not None
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

    async def _decode_events(
        self,
        request_id: str,
        ids: list[int],
        descriptor: TransferDescriptor,
        waiter: _KVWaiter,
        received_at: float,
        sampling: dict[str, Any],
        credit: StreamCredit | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        finished = False
        outcome = "aborted"
        try:
            # `sampling`: the parameters resolved here (model defaults filled in), which the router
            # hands to the prefill worker so that the first token is sampled exactly as the rest.
            yield {"type": "descriptor", "descriptor": descriptor.to_dict(), "prompt_token_ids": ids,
                   "sampling": sampling}
            expiry = await self._wait_for_kv(request_id, waiter)
            if expiry is not None:
                outcome = "kv_timeout"
                # `reason` lets the router tell a lease that ran out (the prefill side went silent:
                # it retries with a fresh reservation) from a failing decode worker.
                yield {"type": "error", "reason": "kv_timeout", **expiry}
                return
            if waiter.aborted:
                return
            kv_wait = time.perf_counter() - received_at
            decode_started = time.perf_counter()
            last_token_at: float | None = None
            completion_tokens = 0
            stream = self.async_engine.stream(request_id)
            while True:
                if credit is not None and not credit.allows(completion_tokens):
                    # Outputs wait in the engine's channel meanwhile; past its window the sequence
                    # pauses. Bounded: a router that stopped acknowledging has closed or aborted.
                    try:
                        async with asyncio.timeout(OUTPUT_TIMEOUT_S):
                            await credit.wait(completion_tokens)
                    except TimeoutError:
                        outcome = "error"
                        yield {"type": "error", "message": f"no credit from the router for {OUTPUT_TIMEOUT_S:.0f}s"}
                        return
                try:
                    # asyncio.timeout arms a timer; wait_for would also wrap each token's wait in a
                    # task of its own (once per generated token, on the loop that also handles aborts).
                    async with asyncio.timeout(OUTPUT_TIMEOUT_S):
                        out = await anext(stream)
                except StopAsyncIteration:
                    break
                now = time.perf_counter()
                if out.new_token_ids:
                    if last_token_at is None:
                        self.metrics.ttft.observe(now - received_at)
                        self.signals.observe("ttft", now - received_at)
                    else:
                        self.metrics.itl.observe((now - last_token_at) / len(out.new_token_ids))
                        self.signals.observe("itl", (now - last_token_at) / len(out.new_token_ids))
                    last_token_at = now
                    completion_tokens += len(out.new_token_ids)
                    self.metrics.generation_tokens.inc(len(out.new_token_ids))
                    yield {"type": "token", "token_ids": out.new_token_ids, "text": out.new_text}
                elif out.new_text:
                    yield {"type": "token", "token_ids": [], "text": out.new_text}
                if out.finished:
                    finished = True
                    if out.finish_reason in ("abort", "error"):
                        # One label for every abort, whichever way it reached the stream.
                        outcome = "aborted" if out.finish_reason == "abort" else "error"
                        yield {"type": "error", "message": f"request ended: {out.finish_reason}"}
                        return
                    outcome = "ok"
                    self.metrics.e2e.observe(time.perf_counter() - received_at)
                    yield {
                        "type": "done",
                        "finish_reason": out.finish_reason,
                        "usage": {"prompt_tokens": len(ids), "completion_tokens": completion_tokens},
                        "timings": {
                            "kv_wait_s": round(kv_wait, 6),
                            "decode_s": round(time.perf_counter() - decode_started, 6),
                            "kv_transfer_s": round(waiter.stats.seconds, 6) if waiter.stats else None,
                            "kv_bytes": waiter.stats.nbytes if waiter.stats else 0,
                        },
                    }
                    return
            outcome = "error"
            yield {"type": "error", "message": "engine stream ended without finishing"}
        except TimeoutError:
            outcome = "error"
            yield {"type": "error", "message": f"no output from the engine for {OUTPUT_TIMEOUT_S:.0f}s"}
        finally:
            self._kv_waiters.pop(request_id, None)
            self.metrics.outcome(outcome)
            if not finished:
                # A client disconnect cancels this stream inside an anyio cancel scope, which
                # cancels every await here too: the abort runs as its own task so that it always
                # completes (a reservation still waiting for KV would otherwise never be freed).
                abort = asyncio.ensure_future(self.abort(request_id))
                self._background.add(abort)
                abort.add_done_callback(self._background.discard)
                await asyncio.shield(abort)

    # ------------------------------------------------------------------ prefill
    async def prefill(self, body: dict[str, Any]) -> dict[str, Any]:
        """Run the prompt, write its KV into the decode worker's blocks, answer with the first token.

        The work runs in its own task, registered under the request id, so that
        `POST /internal/abort` can cancel it (409 `aborted`; the router has gone by then).
        """
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise bad_request("'request_id' must be a non-empty string")
        self.refuse_if_aborted(request_id)
        task = asyncio.ensure_future(self._prefill(request_id, body))
        self._prefill_tasks[request_id] = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                # Cancelled by an abort, not by this handler being cancelled.
                self.metrics.outcome("aborted")
                raise WorkerError(409, f"prefill of {request_id} was aborted", "aborted") from None
            raise
        finally:
            if self._prefill_tasks.get(request_id) is task:
                del self._prefill_tasks[request_id]

    async def _prefill(self, request_id: str, body: dict[str, Any]) -> dict[str, Any]:
        started = time.perf_counter()
        ids = parse_token_ids(body.get("prompt_token_ids"), self.engine.config.vocab_size, "prompt_token_ids")
        params = parse_sampling(body.get("sampling"), self.args.max_tokens_limit, self.sampling_defaults)
        try:
            descriptor = TransferDescriptor.from_dict(body.get("descriptor"))
        except ValueError as exc:
            raise bad_request(f"invalid 'descriptor': {exc}") from exc
        if descriptor.num_tokens != len(ids):
            raise bad_request(
                f"descriptor covers {descriptor.num_tokens} tokens but the prompt has {len(ids)}"
            )
        if descriptor.transport != self.sender.transport:  # type: ignore[union-attr]
            raise bad_request(
                f"decode asked for the {descriptor.transport} transport; this prefill worker uses "
                f"{self.args.kv_transport} (--kv-transport)"
            )
        self._check_prompt_length(len(ids))
        if descriptor.lease_remaining() <= 0:
            raise WorkerError(409, f"the decode lease of {request_id} has expired", "lease_expired")
        # The first token is sampled here with the request's own parameters (seeded streams continue
        # on the decode side), but only one token: decode owns the rest.
        first_params = SamplingParams.from_dict({**params.to_dict(), "max_tokens": 1})
        phase = "accepted"

        def stage() -> str:
            """The progress renewals report; while computing, the engine says queued or running."""
            if phase != "computing":
                return phase
            seq = self.engine.get_sequence(request_id)
            return "computing" if seq is not None and seq.status is SequenceStatus.RUNNING else "queued"

        # Renews the decode worker's lease from now until the KV send has finished, so the blocks
        # stay reserved however long a valid prompt takes; a lost lease stops the work.
        keeper = LeaseKeeper(descriptor, secret=self.args.shared_secret, holder=self._holder(), stage=stage)
        keeper.start()
        send: asyncio.Future[TransferStats] | None = None
        try:
            try:
                # Bounded by the lease's hard cap (just the lease for a decode worker without renewals).
                async with asyncio.timeout(max(descriptor.lease_cap_remaining(), 0.01)):
                    phase = "computing"
                    self.signals.prefill_started(len(ids))
                    computed = False
                    try:
                        first_token, block_ids = await keeper.guard(
                            self._compute_prompt(request_id, ids, first_params)
                        )
                        computed = True
                    finally:
                        self.signals.prefill_finished(len(ids), computed=computed)
                    prefill_s = time.perf_counter() - started
                    self.metrics.ttft.observe(prefill_s)
                    self.signals.observe("ttft", prefill_s)
                    self.metrics.prompt_tokens.inc(len(ids))
                    phase = "prefilled"
                    if self.fault_prefill_delay_s:
                        logger.warning(
                            "fault injection: delaying the KV send of %s by %.1fs",
                            request_id, self.fault_prefill_delay_s,
                        )
                        await keeper.guard(asyncio.sleep(self.fault_prefill_delay_s))
            except TimeoutError as exc:
                self.metrics.outcome("timeout")
                raise WorkerError(
                    504, f"prefill of {request_id} outlived the decode lease's cap", "timeout"
                ) from exc
            except LeaseLost as exc:
                # The decode worker has freed the blocks: the router retries with a fresh reservation.
                self.metrics.outcome("timeout")
                raise WorkerError(409, f"the decode lease of {request_id} was lost: {exc}", "lease_expired") from exc
            if descriptor.lease_remaining() <= 0 or keeper.lost.is_set():
                self.metrics.outcome("timeout")
                raise WorkerError(409, f"the decode lease of {request_id} expired before the KV send", "lease_expired")
            phase = "sending"
            # Shielded: cancelling (an abort) must not free the source blocks while the send thread
            # still reads them; the finally below defers the release until that thread is done.
            send = asyncio.ensure_future(
                asyncio.to_thread(
                    self.sender.send,  # type: ignore[union-attr]
                    descriptor,
                    block_ids,
                    first_token,
                    max(descriptor.lease_cap_remaining(), 0.01),
                )
            )
            try:
                stats = await asyncio.shield(send)
            except KVTransferError as exc:
                self.metrics.outcome("transfer_failed")
                raise WorkerError(502, f"KV transfer failed: {exc}", "kv_transfer_error") from exc
        finally:
            keeper.stop()
            if send is not None and not send.done():
                send.add_done_callback(lambda done: self._release_after_send(request_id, done))
            else:
                await asyncio.to_thread(self.async_engine.release, request_id)
        self.metrics.kv_transfer_bytes.inc(stats.nbytes)
        self.metrics.kv_transfer_seconds.observe(stats.seconds)
        self.metrics.e2e.observe(time.perf_counter() - started)
        self.metrics.outcome("ok")
        return {
            "first_token": first_token,
            "kv_bytes": stats.nbytes,
            "prefill_s": round(prefill_s, 6),
            "transfer_s": round(stats.seconds, 6),
        }

    async def _compute_prompt(
        self, request_id: str, ids: list[int], params: SamplingParams
    ) -> tuple[int, list[int]]:
        """Run the prompt in the engine (batched with other prefills): its first token and KV blocks."""
        first_token: int | None = None
        block_ids: list[int] = []
        async for out in self.async_engine.generate(request_id, ids, params, prefill_only=True):
            if out.new_token_ids:
                first_token = out.new_token_ids[0]
            if out.finished:
                if out.finish_reason != "prefilled":
                    raise WorkerError(500, f"prefill ended with {out.finish_reason}", "engine_error")
                block_ids = list(out.block_ids or [])
        if first_token is None or not block_ids:
            raise WorkerError(500, "prefill produced no first token", "engine_error")
        return first_token, block_ids

    def _holder(self) -> str:
        """How this prefill worker names itself in lease renewals (the decode worker quotes it)."""
        host = self.args.host if self.args.host not in ("", "0.0.0.0", "::") else socket.gethostname()
        return f"http://{host}:{self.args.port}"

    def _release_after_send(self, request_id: str, send: asyncio.Future[TransferStats]) -> None:
        """Free an aborted prefill's blocks once its KV send thread has finished with them."""
        if not send.cancelled() and send.exception() is not None:  # retrieved, so asyncio does not warn
            logger.info("KV send of aborted %s ended with: %s", request_id, send.exception())
        self.async_engine.release(request_id)
