"""What every worker has, whatever its role: the engine, health, info, metrics, limits and aborts.

`PrefillWorker` (prefill.py) and `DecodeWorker` (decode.py) build on it; `create_worker` (worker.py)
picks the role's class. The worker reads the engine only through `AsyncEngine`'s own methods.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Coroutine
from typing import Any

import torch

from inference.engine import AsyncEngine, LLMEngine, SamplingParams, SpeculativeConfig
from inference.engine.compile import CompileUnavailable
from inference.engine.kv_events import KVEventLog
from inference.engine.memory import KVPoolTooSmall
from inference.engine.sampling_params import load_sampling_defaults
from inference.engine.scheduler import SchedulerSettingError
from inference.engine.step_cost import parse_step_target
from inference.kv_transfer import KVLayout
from inference.kv_transfer.verbs import VerbsDevice
from inference.server.args import DEFAULT_SPECULATIVE_TOKENS, ServerArgs
from inference.server.errors import EXIT_KV_POOL_TOO_SMALL, StartupError, WorkerError, bad_request
from inference.server.kv_events import KVEventSource
from inference.server.load import LoadSignals
from inference.server.metrics import WorkerMetrics
from inference.server.resources import Utilization, pin_cpus, select_device
from inference.server.tombstones import AbortTombstones
from inference.server.transport import open_rdma_device
from inference.wire.kv_events import WorkerLoad

logger = logging.getLogger(__name__)

# Seconds after an abort that found nothing at which it looks again for the request (still
# reserving its blocks when the abort came): one engine step is the usual window.
ABORT_RECHECK_S = (0.5, 1.5, 3.0)


def load_engine(args: ServerArgs, device: torch.device) -> LLMEngine:
    """The engine the flags describe; StartupError with a message naming the flag to change."""
    try:
        return LLMEngine(
            str(args.model_path),
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks,
            max_num_seqs=args.batch_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            dtype=args.dtype,
            enable_prefix_caching=args.prefix_caching,
            enable_chunked_prefill=args.chunked_prefill,
            enable_mixed_prefill=args.mixed_prefill,
            mixed_step_target=parse_step_target(args.mixed_step_target),
            max_model_len=args.max_sequence_length or args.context_length,
            kv_cache_bytes=args.kv_cache_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            use_compile=args.compile,
            device=device,
            speculative=SpeculativeConfig(
                method=args.speculative,
                num_speculative_tokens=args.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS,
            ) if args.speculative else None,
        )
    except KVPoolTooSmall as exc:  # its message names the flag to change
        raise StartupError(str(exc), EXIT_KV_POOL_TOO_SMALL) from exc
    except (CompileUnavailable, SchedulerSettingError) as exc:  # their messages name the flag or variable
        raise StartupError(str(exc)) from exc
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot load the model from --model-path {args.model_path}: {exc}") from exc


class WorkerCore:
    """One worker process's state shared by both roles; the HTTP app (inference.server.app) calls it."""

    role: str

    def __init__(self, args: ServerArgs) -> None:
        """Pin CPUs, open the RDMA device (before the model loads: fail fast), load the engine."""
        self.args = args
        self.cpus = pin_cpus(args.base_cpu_id, args.num_threads)
        self.device = select_device()
        self.rdma_device: VerbsDevice | None = open_rdma_device(args)
        llm = load_engine(args, self.device)
        try:
            # What a request that leaves temperature/top_p/top_k/min_p out samples with (as vLLM does).
            self.sampling_defaults = load_sampling_defaults(args.model_path)
        except ValueError as exc:
            raise StartupError(f"--model-path {args.model_path}: {exc}") from exc
        model_max = llm.config.max_position_embeddings
        self.context_length = min(args.context_length or model_max, model_max)
        self.max_sequence_length = min(args.max_sequence_length or self.context_length, model_max)
        self.model_name = args.served_model_name or args.model_path.name
        self.metrics = WorkerMetrics(self.role, self.model_name)
        self.utilization = Utilization(self.cpus, self.device)
        # Windowed readings for the autoscaler (a 5 s sample of the queue alone misses short prompts).
        self.signals = LoadSignals()
        self.engine = AsyncEngine(llm, stream_window=args.stream_window)
        self.layout = KVLayout.from_dict(self.engine.kv_layout())
        # The prefix cache's changes, streamed to routers at /internal/kv-events (KV-aware routing).
        kv_log = KVEventLog()
        llm.block_manager.watch(kv_log)
        self.kv_events = KVEventSource(kv_log, self.role, self.layout.block_size, self.load_report)
        self.started_at = time.time()
        # Tasks that must finish even if the request that started them is cancelled (kept
        # referenced here so that they are not garbage collected while running).
        self._background: set[asyncio.Future[None]] = set()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Open what the role listens on (nothing here)."""

    def stop(self) -> None:
        """Stop the engine thread."""
        self.engine.shutdown()

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
        status = self.engine.status()
        body.update(
            role=self.role,
            model=self.model_name,
            queue_depth=status.queued,
            running=status.running,
            reserved=status.reserved,
            batch_size=status.batch_size,
            kv_usage=round(status.kv_usage, 4),
            kv_blocks=status.kv_blocks,
            kv_bytes=status.kv_bytes,
        )
        body.update(self.role_health())
        body.update(self.signals.snapshot())
        return body

    def load_report(self) -> WorkerLoad:
        """What this worker has ahead of it now, for the load lines of its KV event stream (every router
        process reads the same): running, waiting (queued for a slot or, on a decode worker, for the KV),
        prompt tokens still to prefill and the rate it prefills them at, KV usage."""
        status = self.engine.status()
        pending, rate = self.signals.prefill_queue()
        return WorkerLoad(running=status.running, waiting=status.queued + status.reserved,
                          prompt_tokens_pending=pending, prefill_tokens_per_s=round(rate, 1) if rate else None,
                          kv_usage=round(status.kv_usage, 3))

    def role_health(self) -> dict[str, Any]:
        """What the role adds to /health (nothing here)."""
        return {}

    def info(self) -> dict[str, Any]:
        """Static facts the router and control plane read."""
        status = self.engine.status()
        return {
            "role": self.role,
            "model": self.model_name,
            "model_path": str(self.args.model_path),
            "context_length": self.context_length,
            "max_sequence_length": self.max_sequence_length,
            "block_size": self.layout.block_size,
            "num_kv_blocks": status.kv_blocks,
            "kv_transport": self.args.kv_transport,
            "max_tokens_limit": self.args.max_tokens_limit,
            "batch_size": status.batch_size,
            "max_queue": self.args.max_queue,
            "dtype": self.layout.dtype,
            "prefix_caching": self.args.prefix_caching,
            "chunked_prefill": self.args.chunked_prefill,
            "mixed_prefill": self.args.mixed_prefill,
            "mixed_step_target": self.args.mixed_step_target if self.args.mixed_prefill else None,
            "speculative": self.args.speculative,
            "num_speculative_tokens": (self.args.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS)
            if self.args.speculative else None,
            "device": str(self.device),
            "cpus": self.cpus,
            "started_at": self.started_at,
        }

    def render_metrics(self) -> bytes:
        """Prometheus text with gauges refreshed now."""
        m = self.metrics
        status = self.engine.status()
        m.queue_depth.set(status.queued)
        m.reserved.set(status.reserved)
        m.running.set(status.running)
        m.kv_usage.set(status.kv_usage)
        m.prefix_cache_hit_ratio.set(status.prefix_cache_hit_rate)
        m.cpu_utilization.set(self.utilization.cpu())
        gpu = self.utilization.gpu()
        if gpu is not None:
            m.gpu_utilization.set(gpu)
        return m.render()

    # ------------------------------------------------------------------ request limits
    def check_prompt_length(self, n: int) -> None:
        """400 for a prompt over the context length or leaving no room to generate."""
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

    def clamp(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Cut max_tokens so prompt+output stays within --max-sequence-length (finish_reason=length)."""
        room = self.max_sequence_length - prompt_len
        return dataclasses.replace(params, max_tokens=room) if params.max_tokens > room else params

    # ------------------------------------------------------------------ aborts
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

        What the role has of the request ends now (`abort_now`). The id is remembered for a while (a
        tombstone): the request itself may still be on its way.
        """
        # First, before any await: a request arriving meanwhile must already find the tombstone.
        self.aborted_ids.add(request_id)
        if not await self.abort_now(request_id):
            # Nothing here yet; the request may be past its tombstone check but not registered
            # (reserving its blocks in a thread): look again once that window has passed.
            self.in_background(self._abort_stragglers(request_id))

    async def abort_now(self, request_id: str) -> bool:
        """Cancel whatever of `request_id` lives here now; whether anything did."""
        live = self.engine.is_live(request_id)
        found = await self.abort_role_part(request_id)
        self.engine.abort(request_id)
        return live or found

    async def abort_role_part(self, request_id: str) -> bool:
        """End the role's own part of a request (a KV wait, a prefill task); whether there was one."""
        return False

    def has_pending(self, request_id: str) -> bool:
        """Whether the role has registered the request (waiting for KV, or prefilling)."""
        return False

    async def _abort_stragglers(self, request_id: str) -> None:
        """Abort `request_id` again should it have registered after its abort found nothing."""
        for delay in ABORT_RECHECK_S:
            await asyncio.sleep(delay)
            if self.has_pending(request_id):
                logger.info("abort of %s: applied to the request that arrived meanwhile", request_id)
                await self.abort_now(request_id)
                return

    def in_background(self, work: Coroutine[Any, Any, None]) -> asyncio.Future[None]:
        """Run `work` as a task of its own that finishes even if its caller is cancelled."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task
