"""LLMEngine: requests in, one scheduler iteration per `step()`, RequestOutputs out."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from .block_manager import BlockManager, NoFreeBlocks, block_hashes
from .config import ModelConfig
from .detokenizer import IncrementalDetokenizer
from .kv_cache import KVCache
from .memory import DEFAULT_GPU_MEMORY_UTILIZATION
from .model import LlamaForCausalLM
from .model_runner import ModelRunner
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence, SequenceStatus
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Share of the KV pool that decode-side sequences not running yet (waiting for their KV, or ready and
# queued for a batch slot) may hold together. The rest is headroom for the running batch to grow into,
# so that a long queue cannot make the running sequences preempt each other for lack of blocks.
DEFAULT_MAX_QUEUED_KV_FRACTION = 0.9


@dataclass
class CompletionResult:
    """A finished request as returned by the offline `LLMEngine.generate` helper."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None


class LLMEngine:
    """A paged-KV, continuously batching inference engine for Llama-family checkpoints.

    Every public method takes `self.lock` (an RLock), so a server thread may call `reserve`,
    `kv_received` or `abort` while another thread loops `step()`.
    """

    def __init__(
        self,
        model_path: str,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_num_seqs: int | None = None,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        use_compile: bool = False,
        max_num_batched_tokens: int | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = torch.float32,
        load_tokenizer: bool = True,
        max_queued_kv_fraction: float = DEFAULT_MAX_QUEUED_KV_FRACTION,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
    ) -> None:
        """Load config, weights (and the tokenizer, if the folder has one) and allocate the KV pool.

        The KV pool has `num_blocks` blocks when given; otherwise it is sized from memory (see
        `memory.py`): `kv_cache_bytes` (default: a share of the available host memory) on a CPU,
        `gpu_memory_utilization` of the GPU less the profiled peak on a GPU, never more than
        `max_num_seqs * max_model_len` tokens; `KVPoolTooSmall` (a ValueError) when it cannot hold one
        `max_model_len` sequence. `max_num_seqs` None: derived from the pool. `max_model_len` defaults
        to the model's `max_position_embeddings`. `use_compile`: torch.compile the dense parts of the model
        (compile.py; `CompileUnavailable` without a C++ compiler on a CPU).
        `dtype`: a torch dtype, or "auto" / "float32" / "bfloat16" /
        "float16" (see `dtypes.resolve_dtype`); the KV cache uses the same dtype. The default fp32
        matches transformers' fp32 token for token. `enable_prefix_caching`: full blocks are
        registered under chained content hashes and a new prefill reuses the longest cached prefix.
        `enable_chunked_prefill`: a prompt longer than `max_num_batched_tokens` is computed in chunks
        of that many tokens, alternating with decode steps. `max_queued_kv_fraction` bounds the
        blocks held by reserved and ready (not yet running) sequences together, see `reserve`.
        """
        if block_size <= 0 or (max_num_seqs is not None and max_num_seqs <= 0):
            raise ValueError("block_size and max_num_seqs must be positive")
        if not 0.0 < max_queued_kv_fraction <= 1.0:
            raise ValueError("max_queued_kv_fraction must be in (0, 1]")
        self.model_path = model_path
        self.config = ModelConfig.from_pretrained(model_path)
        self.device = torch.device(device)
        self.tokenizer = Tokenizer.maybe_from_pretrained(model_path) if load_tokenizer else None
        self.block_size = block_size
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        cfg = self.config
        max_batched = int(max_num_batched_tokens or max(2048, min(self.max_model_len, 8192)))
        self.runner = ModelRunner(
            model_path,
            cfg,
            block_size=block_size,
            num_blocks=num_blocks,
            max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_batched,
            kv_cache_bytes=kv_cache_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            device=self.device,
            dtype=dtype,
            use_compile=use_compile,
        )
        self.max_num_seqs = self.runner.max_num_seqs
        self.model: LlamaForCausalLM = self.runner.model
        self.kv_cache: KVCache = self.runner.kv_cache
        self.dtype = self.runner.dtype
        num_blocks = self.kv_cache.num_blocks
        self.block_manager = BlockManager(num_blocks)
        self.max_queued_blocks = max(1, int(num_blocks * max_queued_kv_fraction))
        self.scheduler = Scheduler(
            self.block_manager,
            block_size,
            self.max_num_seqs,
            max_batched,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
        )

        eos = list(cfg.eos_token_ids)
        if not eos and self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

        self.lock = threading.RLock()
        self._seqs: dict[str, Sequence] = {}
        self._reserved: dict[str, Sequence] = {}  # decode side: WAITING_FOR_KV, by request id
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (kv_received, abort)
        self._inflight: list[Sequence] = []  # the batch of the step being executed (failed on error)
        self._arrival = 0
        self.num_preemptions = 0  # total, for metrics and tests
        self.last_step_ran = False  # whether the last step() ran a forward pass (idle detection)
        logger.info(
            "engine ready: %s (%s), %d KV blocks x %d tokens (%.1f MiB), max_model_len %d, batch %d",
            model_path,
            cfg.architecture,
            num_blocks,
            block_size,
            self.kv_cache.nbytes / 2**20,
            self.max_model_len,
            self.max_num_seqs,
        )

    # ----------------------------------------------------------------------------------------- queries

    @property
    def num_waiting(self) -> int:
        """Sequences queued for prefill."""
        return len(self.scheduler.waiting)

    @property
    def num_ready(self) -> int:
        """Decode-side sequences whose KV arrived, queued for a slot in the running batch."""
        return len(self.scheduler.ready)

    @property
    def num_queued(self) -> int:
        """Sequences waiting for a batch slot: ready plus queued for prefill (/health `queue_depth`)."""
        return self.scheduler.num_queued

    @property
    def queued_blocks(self) -> int:
        """KV blocks held by sequences that are not running yet (reserved or ready)."""
        with self.lock:
            held = sum(len(s.block_ids) for s in self._reserved.values())
            return held + sum(len(s.block_ids) for s in self.scheduler.ready)

    @property
    def num_running(self) -> int:
        """Sequences in the decode batch."""
        return len(self.scheduler.running)

    @property
    def num_reserved(self) -> int:
        """Decode-side sequences waiting for their prompt KV."""
        return len(self._reserved)

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks."""
        return self.block_manager.num_free

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from cached blocks (0.0 before any admission)."""
        sch = self.scheduler
        return sch.prefix_hit_tokens / sch.prefix_query_tokens if sch.prefix_query_tokens else 0.0

    def kv_usage(self) -> float:
        """Fraction of KV blocks in use."""
        return self.block_manager.usage()

    def has_work(self) -> bool:
        """Whether `step()` has anything to do (queued/running sequences or undelivered outputs)."""
        sch = self.scheduler
        return bool(sch.waiting or sch.ready or sch.running or self._pending)

    def get_sequence(self, request_id: str) -> Sequence | None:
        """The live sequence of a request (None once it finished and was dropped)."""
        return self._seqs.get(request_id)

    # ---------------------------------------------------------------------------------------- mutators

    def _new_sequence(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prefill_only: bool
    ) -> Sequence:
        """Validate a request and build its Sequence (not queued yet)."""
        prompt = self.check_request(prompt_token_ids, params)
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already exists")
        self._arrival += 1
        seq = Sequence(request_id, prompt, params, self._arrival, prefill_only=prefill_only)
        if self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt, params.stop)
        # The same conditions as `_append_token`'s, folded once per request for the decode fast path.
        stop_ids = frozenset(params.stop_token_ids)
        seq.stop_ids = stop_ids if params.ignore_eos else stop_ids | self.eos_token_ids
        seq.token_limit = min(len(prompt) + params.max_tokens, self.max_model_len)
        return seq

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """Validate a request without queuing it (no lock needed: reads only fixed configuration).
        Returns the prompt as a list of ints; raises ValueError naming the problem."""
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        vocab = self.config.vocab_size
        prompt = [int(t) for t in prompt_token_ids]
        if any(t < 0 or t >= vocab for t in prompt):
            raise ValueError(f"prompt_token_ids must be in [0, {vocab})")
        if len(prompt) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt)} tokens, more than the context length {self.max_model_len}"
            )
        if self.scheduler.blocks_for(len(prompt)) > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt of {len(prompt)} tokens needs more than the {self.block_manager.num_blocks} "
                f"KV blocks of {self.block_size} tokens this engine has"
            )
        return prompt

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        prefill_only: bool = False,
    ) -> None:
        """Queue a request. With `prefill_only`, it finishes after the prompt with the first token,
        `finish_reason="prefilled"` and its `block_ids`, and keeps its blocks until `release()`.

        Raises ValueError for invalid params or a prompt that can never fit.
        """
        with self.lock:
            seq = self._new_sequence(request_id, prompt_token_ids, params or SamplingParams(), prefill_only)
            self._seqs[request_id] = seq
            self.scheduler.add(seq)

    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """Decode side: allocate blocks for the prompt's KV and park the request (`WAITING_FOR_KV`) until
        `kv_received`. Returns the block ids.

        Blocks are reserved at once (the prefill worker writes straight into them), but sequences not
        running yet may hold at most `max_queued_blocks` together, so the running batch keeps room to
        grow. Raises `NoFreeBlocks` when the pool cannot hold the prompt now or when that bound would be
        passed (a request alone in the queue is only bound by the free blocks, so any prompt that fits
        the pool can be served).
        """
        with self.lock:
            seq = self._new_sequence(request_id, prompt_token_ids, params, prefill_only=False)
            need = self.scheduler.blocks_for(seq.num_prompt_tokens)
            queued = self.queued_blocks
            if queued and queued + need > self.max_queued_blocks:
                raise NoFreeBlocks(
                    f"need {need} KV blocks; requests not running yet already hold {queued} of the "
                    f"{self.max_queued_blocks} they may"
                )
            # Prefix caching across the hop: blocks of this prompt's prefix cached here from earlier
            # requests are shared, and only the rest is sent (`reserved_hits`; always at least the
            # block of the last prompt token, whose KV comes with the first token).
            hits = self.scheduler.cached_prefix(seq)
            seq.block_ids = self.block_manager.extend_prefix(hits, need - len(hits))
            seq.reserved_hits = len(hits)
            if self.scheduler.enable_prefix_caching:
                self.scheduler.prefix_query_tokens += seq.num_prompt_tokens
                self.scheduler.prefix_hit_tokens += len(hits) * self.block_size
            seq.status = SequenceStatus.WAITING_FOR_KV
            self._seqs[request_id] = seq
            self._reserved[request_id] = seq
            return list(seq.block_ids)

    def reserved_hits(self, request_id: str) -> int:
        """How many of a reserved request's first blocks were cached here when it was reserved (the
        prefill worker sends its prompt blocks from that index on); 0 for an unknown request."""
        with self.lock:
            seq = self._seqs.get(request_id)
            return seq.reserved_hits if seq is not None else 0

    def kv_received(self, request_id: str, first_token_id: int) -> None:
        """The prompt KV of a reserved request is in its blocks: append the first token (sampled by the
        prefill worker; its output is delivered by the next `step()`), then queue for a batch slot
        (FIFO in arrival order; it runs as soon as fewer than `max_num_seqs` sequences run)."""
        with self.lock:
            seq = self._seqs.get(request_id)
            if seq is None:
                raise KeyError(f"unknown request {request_id!r}")
            if seq.status != SequenceStatus.WAITING_FOR_KV:
                raise ValueError(f"request {request_id!r} is {seq.status.value}, not waiting for KV")
            if not 0 <= int(first_token_id) < self.config.vocab_size:
                raise ValueError(f"first_token_id {first_token_id} is outside the vocabulary")
            del self._reserved[request_id]
            seq.num_cached = seq.num_prompt_tokens
            self._register_blocks(seq, 0)
            self._append_token(seq, int(first_token_id))
            if seq.finish_reason is not None:
                self._finish(seq, seq.finish_reason)
            else:
                self.scheduler.add_ready(seq)
            self._pending.append(seq.take_output())

    def release(self, request_id: str) -> None:
        """Free the blocks a prefill-only request kept for the KV transfer (abort if it is still live)."""
        with self.lock:
            seq = self._seqs.get(request_id)
            if seq is None:
                return
            if seq.status == SequenceStatus.PREFILLED:
                self._free_blocks(seq)
                seq.status = SequenceStatus.FINISHED
                del self._seqs[request_id]
            else:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request in any state and free its blocks; a not yet finished request gets a final
        output with `finish_reason="abort"` (delivered by the next `step()`). Unknown ids are ignored."""
        with self.lock:
            seq = self._seqs.get(request_id)
            if seq is None:
                return
            if seq.status == SequenceStatus.PREFILLED:
                self.release(request_id)
                return
            self._fail(seq, "abort")

    def _fail(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Finish a live sequence early (abort/error) and queue its final output."""
        self.scheduler.remove(seq)
        seq.pending_token_ids = []
        seq.pending_text = ""
        self._finish(seq, reason)
        out = seq.take_output()
        out.error = error
        self._pending.append(out)

    def fail_inflight(self, error: str) -> list[RequestOutput]:
        """Fail the sequences of the batch that was executing (after an exception) and return their
        error outputs plus anything pending."""
        with self.lock:
            for seq in self._inflight:
                if seq.request_id in self._seqs and not seq.is_finished:
                    self._fail(seq, "error", error)
            self._inflight = []
            out, self._pending = self._pending, []
            return out

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Fail every live request (last resort when the engine itself is broken)."""
        with self.lock:
            for seq in list(self._seqs.values()):
                if seq.status == SequenceStatus.PREFILLED:
                    self.release(seq.request_id)
                elif not seq.is_finished:
                    self._fail(seq, "error", error)
            out, self._pending = self._pending, []
            return out

    # ------------------------------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: a prefill batch if any waiting prompt fits, else one decode step for
        every running sequence. Returns the outputs produced (including ones queued by `kv_received` /
        `abort`). An exception in the forward pass fails that batch's requests (finish_reason "error")."""
        with self.lock:
            outputs, self._pending = self._pending, []
            plan = self.scheduler.schedule()
            self.last_step_ran = bool(plan.prefill or plan.decode)
            for seq in plan.too_long:
                self._finish(seq, "length")
                outputs.append(seq.take_output())
            batch = plan.prefill or plan.decode
            if not batch:
                return outputs
            self.num_preemptions += len(plan.preempted)
            self._inflight = list(batch)
            try:
                outputs.extend(self._execute(batch, is_prefill=bool(plan.prefill)))
            except Exception as exc:
                logger.exception("engine step failed; failing %d request(s)", len(batch))
                outputs.extend(self.fail_inflight(f"engine error: {exc}"))
            self._inflight = []
            return outputs

    def _execute(self, batch: list[Sequence], is_prefill: bool) -> list[RequestOutput]:
        """Run the forward pass for `batch`, sample, and apply the results."""
        tokens = self.runner.run(batch, is_prefill)
        if is_prefill:
            return self._apply(batch, tokens, True)
        return self._apply_decode(batch, tokens)

    def _apply_decode(self, batch: list[Sequence], tokens: list[int]) -> list[RequestOutput]:
        """Apply a decode step's tokens: `_apply(batch, tokens, False)`, cheaper per sequence.

        The per-sequence Python after the forward is most of a small model's step overhead, so the
        common case (the token neither stops the request nor reaches its length limit, no stop
        strings, a byte-level detokenizer or none) takes one set lookup, one comparison and one
        `RequestOutput`; every other sequence (it finishes, has stop strings, a `decode`-based
        detokenizer, pending output) goes through `_append_token`, the one place that decides how a
        request ends. Checking stop ids on the sampled tensor instead is not cheaper: `torch.isin` of 32
        tokens plus `.any().item()` took 5.6 µs against 1.5 µs for 32 set lookups (and the Python loop
        over the batch stays, to append the tokens).
        """
        outputs: list[RequestOutput] = []
        emit = outputs.append
        caching = self.scheduler.enable_prefix_caching
        bs = self.block_size
        for seq, tok in zip(batch, tokens, strict=True):
            out_ids = seq.output_token_ids
            n_prompt = len(seq.prompt_token_ids)
            n = n_prompt + len(out_ids)  # tokens before `tok`: every one is cached now
            before, seq.num_cached = seq.num_cached, n
            if caching and n // bs > before // bs:  # a block became full: register it
                self._register_blocks(seq, before)
            detok = seq.detokenizer
            stop_ids = seq.stop_ids
            # `n + 1`: the total once `tok` is appended.
            if (stop_ids is None or tok in stop_ids or n + 1 >= seq.token_limit or seq.pending_token_ids
                    or seq.pending_text or (detok is not None and not detok.plain)):
                self._append_token(seq, tok)
                if seq.finish_reason is not None:
                    self.scheduler.remove(seq)
                    self._finish(seq, seq.finish_reason)
                emit(seq.take_output())
                continue
            out_ids.append(tok)
            text = detok.append_plain(tok) if detok is not None else ""
            emit(RequestOutput(seq.request_id, [tok], text, False, None, n_prompt, len(out_ids)))
        return outputs

    def _apply(self, batch: list[Sequence], tokens: list[int], is_prefill: bool) -> list[RequestOutput]:
        """Apply a step's sampled tokens (one per sequence of `batch`, in its order): advance the cached
        counts, register full blocks, append the tokens, finish what stopped, build the outputs."""
        outputs: list[RequestOutput] = []
        caching = self.scheduler.enable_prefix_caching
        bs = self.block_size
        for seq, tok in zip(batch, tokens, strict=True):
            if is_prefill and seq.chunk:
                # A chunk of a longer prompt: no token yet (its logits are dropped), more chunks follow.
                before, seq.num_cached, seq.chunk = seq.num_cached, seq.num_cached + seq.chunk, 0
                self._register_blocks(seq, before)
                self.scheduler.requeue_partial(seq)
                continue
            before, seq.num_cached = seq.num_cached, seq.num_tokens
            if caching and seq.num_cached // bs > before // bs:  # a block became full: register it
                self._register_blocks(seq, before)
            if seq.prefill_only and not seq.output_token_ids:
                # Prefill side of a disaggregated request: report the first token and keep the blocks.
                # Stop checks happen on the decode side (kv_received), which owns the stream.
                seq.output_token_ids.append(tok)
                seq.pending_token_ids.append(tok)
                seq.status = SequenceStatus.PREFILLED
                seq.finish_reason = "prefilled"
                outputs.append(seq.take_output())
                continue
            self._append_token(seq, tok)
            if seq.finish_reason is not None:
                self.scheduler.remove(seq)
                self._finish(seq, seq.finish_reason)
            elif is_prefill:
                self.scheduler.add_running(seq)
            outputs.append(seq.take_output())
        return outputs

    # ---------------------------------------------------------------------------------------- helpers

    def _register_blocks(self, seq: Sequence, before: int) -> None:
        """Register the blocks that became full since `before` cached tokens under their content
        hashes, so that later prefills can reuse them (prefix caching)."""
        if not self.scheduler.enable_prefix_caching:
            return
        first, full = before // self.block_size, seq.num_cached // self.block_size
        if full <= first:
            return
        seq.block_hashes = block_hashes(seq.all_token_ids()[: full * self.block_size], self.block_size,
                                        seq.block_hashes[:full])
        for i in range(first, full):
            self.block_manager.register(seq.block_ids[i], seq.block_hashes[i])

    def _append_token(self, seq: Sequence, token: int) -> None:
        """Append a generated token, update the text and decide whether the request is finished."""
        out_ids = seq.output_token_ids
        out_ids.append(token)
        seq.pending_token_ids.append(token)
        params = seq.params
        detok = seq.detokenizer
        reason: str | None = None
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            reason = "stop"  # the stop token is reported in token ids but not rendered into text
        elif detok is not None and detok.append(token):
            reason = "stop"
        n_out = len(out_ids)
        if reason is None and (
            n_out >= params.max_tokens or len(seq.prompt_token_ids) + n_out >= self.max_model_len
        ):
            reason = "length"
        if detok is not None:
            if reason is not None:
                detok.flush()
            seq.pending_text += detok.take_delta(final=reason is not None)
        if reason is not None:
            seq.finish_reason = reason

    def _finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished, free blocks and forget the sequence."""
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        self._free_blocks(seq)
        self._seqs.pop(seq.request_id, None)
        self._reserved.pop(seq.request_id, None)

    def _free_blocks(self, seq: Sequence) -> None:
        """Return a sequence's blocks to the pool."""
        if seq.block_ids:
            self.block_manager.free(seq.block_ids)
            seq.block_ids = []
        seq.num_cached = 0

    # ------------------------------------------------------------------------------------ offline use

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[CompletionResult]:
        """Run prompts to completion (offline helper; not for use while another thread drives step())."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{self._arrival + 1}-{i}" for i in range(len(prompts))]
        results = {rid: CompletionResult(rid, [], "", None) for rid in ids}
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        remaining = set(ids)
        idle_steps = 0
        while remaining:
            outs = self.step()
            # Three idle steps in a row mean nothing can be scheduled (e.g. the pool is held by
            # transfers); a prefill chunk produces no output but is progress.
            idle_steps = 0 if outs or self.last_step_ran else idle_steps + 1
            if idle_steps > 2:
                raise RuntimeError(f"requests {sorted(remaining)} cannot make progress")
            for out in outs:
                res = results.get(out.request_id)
                if res is None:
                    continue
                res.token_ids.extend(out.new_token_ids)
                res.text += out.new_text
                if out.finished:
                    res.finish_reason = out.finish_reason
                    remaining.discard(out.request_id)
        return [results[rid] for rid in ids]


__all__ = ["CompletionResult", "LLMEngine", "NoFreeBlocks"]
