"""LLMEngine: requests in, one scheduler iteration per `step()`, RequestOutputs out.

This module is the request lifecycle (validation, queues, reservations, KV arrival, release, abort,
failure, the step loop); what a sampled token does to its request (text, stop checks, outputs) is
`outputs.py`, the forward pass `model_runner.py`, the queues and blocks `scheduler.py`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Set

import torch

from .block_manager import BlockManager, NoFreeBlocks
from .config import ModelConfig
from .grammar import GrammarCompiler
from .handover import KVHandover
from .kv_cache import KVCache
from .memory import DEFAULT_GPU_MEMORY_UTILIZATION
from .model import LlamaForCausalLM
from .model_runner import ModelRunner
from .offline import CompletionResult, run_to_completion
from .outputs import OutputProcessor, eos_token_ids
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import RequestOutput, Sequence, SequenceStatus
from .speculative import NgramSpeculator, SpeculativeConfig, accepted_tokens
from .status import EngineStatus
from .step_cost import MixedStepBudget, StepTarget
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Share of the KV pool that decode-side sequences not running yet (waiting for their KV, or ready and
# queued for a batch slot) may hold together. The rest is headroom for the running batch to grow into,
# so that a long queue cannot make the running sequences preempt each other for lack of blocks.
DEFAULT_MAX_QUEUED_KV_FRACTION = 0.9


def _check_limits(block_size: int, max_num_seqs: int | None, max_queued_kv_fraction: float) -> None:
    """Refuse limits no engine can run with."""
    if block_size <= 0 or (max_num_seqs is not None and max_num_seqs <= 0):
        raise ValueError("block_size and max_num_seqs must be positive")
    if not 0.0 < max_queued_kv_fraction <= 1.0:
        raise ValueError("max_queued_kv_fraction must be in (0, 1]")


def default_batched_tokens(max_num_batched_tokens: int | None, max_model_len: int) -> int:
    """The prefill token budget per step: as given, else at least 2048 and up to 8192 (the context)."""
    return int(max_num_batched_tokens or max(2048, min(max_model_len, 8192)))


class LLMEngine(KVHandover):
    """A paged-KV, continuously batching inference engine for Llama-family checkpoints.

    Every public method takes `self.lock` (an RLock), so a server thread may call `reserve`,
    `kv_received` or `abort` while another thread loops `step()`. The disaggregation hooks (`reserve`,
    `kv_received`, `release`, the KV pool) are in handover.py, output processing in outputs.py.
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
        enable_mixed_prefill: bool = False,
        speculative: SpeculativeConfig | None = None,
        mixed_step_target: StepTarget | None = None,
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
        of that many tokens, alternating with decode steps. `enable_mixed_prefill` (with chunked
        prefill, on a CPU with the decode kernel: `ModelRunner.can_mix`): each step carries the
        running batch's decode rows and up to `max_num_batched_tokens` prompt tokens in one forward
        (vLLM's chunked prefill; the rows on top of the budget), so streams get a token every step.
        `max_queued_kv_fraction` bounds the blocks held by reserved and ready (not yet running)
        sequences together, see `reserve`.
        `speculative`: n-gram speculative decoding (speculative.py; None, the default: off): decode
        steps verify proposed tokens in the same forward; outputs are distributed as without it.
        `mixed_step_target` (with mixed prefill; None: off): a mixed step's prompt tokens are those that
        keep it within this time on the step cost measured here (step_cost.py), once measured.
        """
        _check_limits(block_size, max_num_seqs, max_queued_kv_fraction)
        self.model_path = model_path
        self.config = ModelConfig.from_pretrained(model_path)
        self.device = torch.device(device)
        self.tokenizer = Tokenizer.maybe_from_pretrained(model_path) if load_tokenizer else None
        self.block_size = block_size
        self.max_model_len = int(max_model_len or self.config.max_position_embeddings)
        max_batched = default_batched_tokens(max_num_batched_tokens, self.max_model_len)
        self.runner = ModelRunner(
            model_path, self.config, block_size=block_size, num_blocks=num_blocks,
            max_model_len=self.max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
            kv_cache_bytes=kv_cache_bytes, gpu_memory_utilization=gpu_memory_utilization,
            device=self.device, dtype=dtype, use_compile=use_compile,
            # A verify step runs more rows than the decode step it replaces: each row must come out as
            # it would alone, or greedy tokens drift from plain decoding's (bf16 on an AMX CPU did).
            row_invariant=speculative is not None,
        )
        self.max_num_seqs = self.runner.max_num_seqs
        self.model: LlamaForCausalLM = self.runner.model
        self.kv_cache: KVCache = self.runner.kv_cache
        self.dtype = self.runner.dtype
        self._build_scheduling(max_batched, max_queued_kv_fraction, enable_prefix_caching, enable_chunked_prefill,
                               enable_mixed_prefill and self.runner.can_mix)
        if mixed_step_target is not None and self.scheduler.enable_mixed_prefill:
            self.scheduler.step_budget = MixedStepBudget(
                mixed_step_target, floor=min(block_size, max_batched),
                cap=self.scheduler.mixed_queue_scale * max_batched, fallback=max_batched)
        if speculative is not None:
            speculative.validate()  # before anything else is built on it: a ValueError naming the field
        self.speculator = (
            NgramSpeculator(speculative, self.block_manager, block_size, max_rows=self.runner.max_step_rows)
            if speculative is not None else None
        )
        self._init_request_state()
        logger.info(
            "engine ready: %s (%s), %d KV blocks x %d tokens (%.1f MiB), max_model_len %d, batch %d",
            model_path, self.config.architecture, self.kv_cache.num_blocks, block_size,
            self.kv_cache.nbytes / 2**20, self.max_model_len, self.max_num_seqs,
        )

    def _build_scheduling(
        self, max_batched: int, max_queued_kv_fraction: float, prefix_caching: bool, chunked_prefill: bool,
        mixed_prefill: bool = False,
    ) -> None:
        """The block manager over the pool, the scheduler, and the output processor."""
        num_blocks = self.kv_cache.num_blocks
        self.block_manager = BlockManager(num_blocks)
        self.max_queued_blocks = max(1, int(num_blocks * max_queued_kv_fraction))
        self.scheduler = Scheduler(
            self.block_manager, self.block_size, self.max_num_seqs, max_batched,
            enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked_prefill,
            enable_mixed_prefill=mixed_prefill,
        )
        self.outputs = OutputProcessor(
            self.scheduler, self._finish, eos_token_ids=eos_token_ids(self.config, self.tokenizer),
            max_model_len=self.max_model_len, tokenizer=self.tokenizer,
        )
        # Structured output: grammars compiled for this tokenizer (its tables built on first use).
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size,
                                        sorted(eos_token_ids(self.config, self.tokenizer)))

    def _init_request_state(self) -> None:
        """No request yet: the lock, the live sequences and the counters."""
        self.lock = threading.RLock()
        self._seqs: dict[str, Sequence] = {}
        self._reserved: dict[str, Sequence] = {}  # decode side: WAITING_FOR_KV, by request id
        self._pending: list[RequestOutput] = []  # outputs produced outside step() (kv_received, abort)
        self._inflight: list[Sequence] = []  # the batch of the step being executed (failed on error)
        self._arrival = 0
        self.num_preemptions = 0  # total, for metrics and tests
        self.last_step_ran = False  # whether the last step() ran a forward pass (idle detection)

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
    def num_running(self) -> int:
        """Sequences in the decode batch."""
        return len(self.scheduler.running)

    @property
    def num_free_blocks(self) -> int:
        """Free KV blocks."""
        return self.block_manager.num_free

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from cached blocks (0.0 before any admission)."""
        return self.scheduler.prefix_cache_hit_rate

    @property
    def num_arrivals(self) -> int:
        """Requests admitted so far (reserved or queued)."""
        return self._arrival

    def status(self) -> EngineStatus:
        """Queue, batch and KV pool figures at this moment (no lock: each is one read)."""
        sch = self.scheduler
        return EngineStatus(
            waiting=len(sch.waiting), queued=sch.num_queued, running=len(sch.running),
            reserved=len(self._reserved), batch_size=self.max_num_seqs, kv_usage=self.block_manager.usage(),
            kv_blocks=self.kv_cache.num_blocks, kv_bytes=self.kv_cache.nbytes,
            prefix_cache_hit_rate=sch.prefix_cache_hit_rate,
        )

    def pause_with(self, paused: Set[str]) -> None:
        """Leave the running sequences whose ids are in `paused` out of decode steps (flow control:
        their consumer is behind). The caller owns the set and may change it from another thread;
        the scheduler reads membership once per step."""
        self.scheduler.paused = paused

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
        if params.grammar is not None:
            seq.grammar_state = self.grammars.new_state(params.grammar)
        self.outputs.prepare(seq)
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
        if any(t >= vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # GrammarError (a ValueError) naming the problem
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
        seq.pending_logprobs = []
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
            self._inflight = plan.prefill + plan.decode
            started = time.perf_counter()
            try:
                if plan.prefill and plan.decode:
                    outputs.extend(self._execute_mixed(plan.prefill, plan.decode))
                else:
                    outputs.extend(self._execute(batch, is_prefill=bool(plan.prefill)))
            except Exception as exc:
                logger.exception("engine step failed; failing %d request(s)", len(batch))
                outputs.extend(self.fail_inflight(f"engine error: {exc}"))
            self._inflight = []
            budget = self.scheduler.step_budget
            if budget is not None and (plan.prefill or self.speculator is None):  # no verify rows in the fit
                budget.observe(len(plan.decode), self.scheduler.last_plan[0], time.perf_counter() - started)
            return outputs

    def _execute(self, batch: list[Sequence], is_prefill: bool) -> list[RequestOutput]:
        """Run the forward pass for `batch`, sample, and apply the results."""
        if not is_prefill and self.speculator is not None:
            proposals = self.speculator.propose(batch)
            if proposals is not None:
                return self._execute_verify(batch, proposals)
            # The speculator's row budget learns what a step costs per row count (spec_budget.py).
            start = time.perf_counter()
            tokens = self.runner.run(batch, False)
            self.speculator.observe(len(batch), time.perf_counter() - start)
            return self.outputs.apply_decode(batch, tokens)
        tokens = self.runner.run(batch, is_prefill)
        if is_prefill:
            return self.outputs.apply(batch, tokens, True)
        return self.outputs.apply_decode(batch, tokens)

    def _execute_mixed(self, prefill: list[Sequence], decode: list[Sequence]) -> list[RequestOutput]:
        """One forward for a prefill batch and the running batch's decode rows (mixed prefill; no
        speculation in such a step), then both results applied."""
        prefill_tokens, decode_tokens = self.runner.run_mixed(prefill, decode)
        return self.outputs.apply_decode(decode, decode_tokens) + self.outputs.apply(prefill, prefill_tokens, True)

    def _execute_verify(self, batch: list[Sequence], proposals: list[list[int]]) -> list[RequestOutput]:
        """A decode step that verifies `proposals` (speculative.py): keep each sequence's accepted
        tokens, then free the lookahead blocks that rejected proposals had reserved."""
        assert self.speculator is not None
        start = time.perf_counter()
        sampled, logprobs = self.runner.run_verify(batch, proposals)
        self.speculator.observe(len(batch) + sum(map(len, proposals)), time.perf_counter() - start)
        emitted: list[list[int]] = []
        for seq, proposal, rows in zip(batch, proposals, sampled, strict=True):
            tokens = accepted_tokens(proposal, rows)
            self.speculator.record(seq, len(proposal), len(tokens) - 1)
            emitted.append(tokens)
        outputs = self.outputs.apply_verify(batch, emitted, logprobs)
        for seq in batch:
            if seq.block_ids and not seq.is_finished:
                self.speculator.trim(seq)
        return outputs

    # ---------------------------------------------------------------------------------------- helpers

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
        return run_to_completion(self, prompts, params)


__all__ = ["CompletionResult", "EngineStatus", "LLMEngine", "NoFreeBlocks"]
