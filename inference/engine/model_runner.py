"""ModelRunner: the model, its KV pool and dtype, and one forward + sample per step.

`LLMEngine` owns the request lifecycle (queues, blocks, stopping, outputs); the runner turns a batch
of sequences into token ids: it orders the batch by context length (so that attention groups are
contiguous slices, see `batch.py`), builds the step's metadata with tensor ops, runs the model and
samples.
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from .batch import (
    BatchMetadata,
    DecodeSlotCache,
    build_metadata,
    decode_metadata,
    kernel_decode_metadata,
    mixed_metadata,
    verify_metadata,
)
from .compile import check_compile_available, compile_model
from .config import ModelConfig
from .cpu_kernels import load_kernels
from .cpu_linear import (
    ALL_ROWS,
    panel_rows_limit,
    panel_rows_with_memory,
    prepack_linears,
    prepacked_linear_available,
    row_invariant_plan,
)
from .dtypes import dtype_name, resolve_dtype
from .gpu_budget import profile_gpu_kv_budget
from .grammar import prefetch_masks
from .host_memory import ClaimHandle, claim_cpu_pool
from .kv_cache import KVCache
from .logprobs import TokenLogprobs, attach_prompt, attach_sampled, prefill_rows, token_logprobs
from .memory import (
    AUTO_BATCH_CAP,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    format_bytes,
    plan_pool,
)
from .model import LlamaForCausalLM
from .sampler import row_argmax, sample
from .sequence import Sequence
from .speculative import row_histories
from .weights import load_model

logger = logging.getLogger(__name__)


class ModelRunner:
    """Loads the weights in the resolved dtype, sizes and allocates the paged KV cache in the same dtype
    (see `memory.py`), and executes steps."""

    def __init__(
        self,
        model_path: str,
        config: ModelConfig,
        *,
        block_size: int,
        num_blocks: int | None,
        max_model_len: int,
        max_num_seqs: int | None,
        max_num_batched_tokens: int,
        kv_cache_bytes: int | None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        device: torch.device,
        dtype: str | torch.dtype,
        use_compile: bool = False,
        row_invariant: bool = False,
    ) -> None:
        """`num_blocks` given: exactly that pool (`max_num_seqs` defaults to the CPU cap then). Otherwise
        the pool is sized from memory: `kv_cache_bytes` when given, else on a CPU a share of the host
        memory available and not claimed by other workers (host_memory.py), on a GPU
        `gpu_memory_utilization` of its memory minus the profiled peak; `max_num_seqs` None is derived
        from the pool. Raises `KVPoolTooSmall` when that pool cannot hold one `max_model_len`
        sequence, `CompileUnavailable` for `use_compile` without a usable compiler. `row_invariant`: the
        linears compute each row as they would alone (cpu_linear.row_invariant_plan), within
        `max_step_rows` rows a step (None: any), as speculative decoding needs."""
        self.config = config
        self.device = device
        self.dtype = resolve_dtype(dtype, device, config.hidden_size)
        self.block_size = block_size
        if use_compile:
            check_compile_available(device)  # before the weights load: fail fast
        self.model: LlamaForCausalLM = load_model(model_path, config, device, self.dtype)
        ops = self._choose_kernels(use_compile)
        self.max_step_rows: int | None = None
        if not use_compile:
            self._prepack(ops, row_invariant)
        num_blocks = self._size_pool(
            num_blocks, max_num_seqs, max_model_len, max_num_batched_tokens, kv_cache_bytes, gpu_memory_utilization
        )
        try:
            self.kv_cache = KVCache(
                num_blocks, config.num_hidden_layers, block_size, config.num_key_value_heads, config.head_dim,
                self.dtype, device,
            )
        except BaseException:
            if self.kv_claim is not None:
                self.kv_claim.release()
            raise
        if self.kv_claim is not None:  # the claim goes with the pool (a dead process's claim never counts)
            self.kv_claim.mark_resident()  # zero-filled: already out of the available memory others see
            weakref.finalize(self.kv_cache, self.kv_claim.release)
        self.compiled = use_compile
        self._init_step_caches()
        if use_compile:
            compile_model(self.model)
        self.model.cpu_ops = ops
        self.decode_kernel = ops is not None
        logger.info(
            "model runner: %s on %s, KV cache %d blocks (%s), batch %d%s%s",
            dtype_name(self.dtype), device, num_blocks, format_bytes(self.kv_cache.nbytes), self.max_num_seqs,
            ", compiled" if use_compile else "", ", CPU kernels" if self.decode_kernel else "",
        )

    def _choose_kernels(self, use_compile: bool) -> Any:
        """The C++ CPU kernels (decode attention over the paged cache, fused norms, RoPE, SiLU·mul, the
        panel GEMM) when they build here (cpu_kernels.py), on a CPU in fp32 or bf16; None (torch
        ops) otherwise, and with --compile (inductor fuses)."""
        if self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16) and not use_compile:
            return load_kernels()
        return None

    def _prepack(self, ops: Any, row_invariant: bool = False) -> None:
        """Pack the linear layers' weights once for the kernels that run them: the panel GEMM up to the
        row count where it beat oneDNN on this CPU kind (cpu_linear.panel_rows_limit: fp32 on an AVX2 CPU,
        bf16 and fp32 decode batches with AVX-512), oneDNN's reordered weights for the rest on a CPU
        (unless the weights are too large for two copies: panel_rows_with_memory); left as they are
        otherwise. `row_invariant`: the usual choice with verify steps bounded so that a row's result does
        not depend on the rows beside it (cpu_linear.row_invariant_plan: within the panel row limit, or
        within the rows oneDNN is stable for)."""
        onednn = prepacked_linear_available(self.dtype, self.device)
        if self.device.type != "cpu":
            rows = 0
        elif row_invariant:  # without the kernels too: oneDNN's own row bound (AMX bf16) still holds
            rows, self.max_step_rows = row_invariant_plan(self.dtype, ops)
        else:
            rows = panel_rows_limit(self.dtype, ops)
        if rows > 0:
            rows = panel_rows_with_memory(rows, self.model) if onednn else ALL_ROWS
            if rows >= ALL_ROWS:  # the panels take every row count, each row computed alone: no bound
                self.max_step_rows = None
            prepack_linears(self.model, panel_ops=ops, panel_rows=rows)
        elif onednn:
            prepack_linears(self.model)

    def _size_pool(
        self,
        num_blocks: int | None,
        max_num_seqs: int | None,
        max_model_len: int,
        max_num_batched_tokens: int,
        kv_cache_bytes: int | None,
        gpu_memory_utilization: float,
    ) -> int:
        """The KV pool's block count; sets `max_num_seqs`, `kv_budget_bytes` and `kv_claim` (see `__init__`).
        A CPU pool is sized and recorded in the host's claims registry under its lock (host_memory.py), so
        that workers started together share the host's memory instead of each sizing from what it saw."""
        config, device = self.config, self.device
        block_bytes = KVCache.bytes_per_block(
            config.num_hidden_layers, self.block_size, config.num_key_value_heads, config.head_dim, self.dtype
        )
        self.kv_claim: ClaimHandle | None = None
        if num_blocks is not None:
            self.max_num_seqs = max_num_seqs or AUTO_BATCH_CAP["cpu"]
            self.kv_budget_bytes = num_blocks * block_bytes

        def plan(budget: int, source: str) -> int:
            return self._plan(budget, source, block_bytes, max_model_len, max_num_seqs)

        if device.type != "cuda":  # the pool lives in host memory
            blocks, self.kv_claim = claim_cpu_pool(plan, block_bytes, kv_cache_bytes=kv_cache_bytes,
                                                   num_blocks=num_blocks)
            return blocks
        if num_blocks is not None:
            return num_blocks
        if kv_cache_bytes is None:
            budget = profile_gpu_kv_budget(self.model, self.device, self.dtype, self.block_size,
                                           gpu_memory_utilization, max_num_seqs, max_num_batched_tokens)
            return plan(budget, f"--gpu-memory-utilization {gpu_memory_utilization}")
        # An explicit size on a GPU replaces the utilization rule, as in vLLM.
        return plan(kv_cache_bytes, f"--kv-cache-memory {format_bytes(kv_cache_bytes)}")

    def _plan(self, budget: int, source: str, block_bytes: int, max_model_len: int, max_num_seqs: int | None) -> int:
        """plan_pool for `budget` (KVPoolTooSmall naming `source`); sets `max_num_seqs` and `kv_budget_bytes`."""
        plan = plan_pool(
            budget_bytes=budget,
            block_bytes=block_bytes,
            block_size=self.block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            device_kind=self.device.type,
            source=source,
        )
        self.max_num_seqs, self.kv_budget_bytes = plan.max_num_seqs, budget
        return plan.num_blocks

    def _init_step_caches(self) -> None:
        """What decode steps reuse between steps of an unchanged batch (empty at first)."""
        # Slot rows of the decode batch, reused between decode steps of an unchanged batch, and what
        # else a decode step derives from its batch alone: whether every sequence is greedy (the
        # params of a sequence never change), and `arange(batch)` (`last_index`).
        self._slots = DecodeSlotCache(self.block_size, self.kv_cache.block_stride)
        self._batch_greedy = False
        self._batch_logprobs = False
        self._aranges: dict[int, torch.Tensor] = {}
        # Set by a greedy kernel decode step, cleared by every `run`: the next decode step's lengths and
        # input ids (this step's lengths + 1, the tokens it sampled), valid when that step runs the
        # same batch (see `prepare`).
        self._next_decode: tuple[torch.Tensor, torch.Tensor] | None = None

    def prepare(self, seqs: list[Sequence], is_prefill: bool) -> tuple[torch.Tensor, BatchMetadata]:
        """Input ids and metadata for `seqs`, which must be in `order`'s order."""
        if not is_prefill:
            if self.decode_kernel:
                n = len(seqs)
                last_index = self._aranges.get(n)
                if last_index is None:
                    last_index = self._aranges[n] = torch.arange(n)
                slots = self._slots.get(seqs)
                nxt = self._next_decode
                if nxt is not None and self._slots.same_batch:
                    # The previous `run` was a decode step of this very batch, and the engine appended
                    # each sequence's sampled token (a sequence that finished, was aborted, preempted
                    # or paused left the batch, and a failed step fails the whole batch, so the batch
                    # would differ): lengths and last tokens are known without reading the sequences.
                    lens, input_ids = nxt
                    pos = lens - 1
                    meta = BatchMetadata(positions=pos, write_rows=pos, last_index=last_index,
                                         decode_slots=slots, decode_lens=lens)
                    return input_ids, meta
                return kernel_decode_metadata(seqs, slots, last_index)
            return decode_metadata(seqs, self._slots.get(seqs), self.dtype, self.device)
        return build_metadata(seqs, is_prefill, self.block_size, self.kv_cache.block_stride, self.dtype, self.device)

    @staticmethod
    def order(batch: list[Sequence]) -> list[int]:
        """Indices of `batch` sorted by (cached tokens, context length), the order `prepare` needs: fresh
        prompts first, by length; in a decode step (one new token each) simply by context length."""
        return sorted(range(len(batch)), key=lambda i: (batch[i].num_cached, batch[i].num_tokens))

    def _any_logprobs(self, seqs: list[Sequence], is_prefill: bool) -> bool:
        """Whether a sequence of the batch asks for its sampled tokens' log-probabilities (a decode
        step of an unchanged batch knows from the previous step)."""
        if is_prefill or not self._slots.same_batch:
            wants = any(s.params.logprobs is not None for s in seqs)
            if not is_prefill:
                self._batch_logprobs = wants
            return wants
        return self._batch_logprobs

    @torch.inference_mode()
    def run(self, batch: list[Sequence], is_prefill: bool) -> list[int]:
        """Forward `batch` (a prefill of whole prompts, or one decode token each) and sample one token
        per sequence; returns them in `batch` order."""
        # The decode kernel attends per sequence: no length order needed, so no reordering either.
        order = self.order(batch) if is_prefill or not self.decode_kernel else None
        seqs = batch if order is None else [batch[i] for i in order]
        input_ids, meta = self.prepare(seqs, is_prefill)
        self._next_decode = None  # valid for the step right after a decode step only
        # The common all-greedy batch needs neither the per-row parameters nor the sampler's tensors.
        # Decode steps of the batch the slot cache saw last time (most of them) know the answer.
        if is_prefill or not self._slots.same_batch:
            greedy = all(s.params.greedy and not s.params.has_processors for s in seqs)
            if not is_prefill:
                self._batch_greedy = greedy
        else:
            greedy = self._batch_greedy
        prompt_rows = prefill_rows([s.num_new_tokens for s in seqs], [s.wants_prompt_logprobs for s in seqs]) \
            if is_prefill else None
        if prompt_rows is not None:  # echo: the logits of every prompt row of the sequences that ask
            meta.last_index = prompt_rows[0].to(meta.last_index.device)
        if not greedy:
            # Structured output: the constrained rows' masks are computed in their own thread while the
            # forward pass runs, so the batch does not wait for them afterwards (no-op without grammars).
            prefetch_masks(seqs)
        logits = self.model(input_ids, meta, self.kv_cache)
        if prompt_rows is not None:
            attach_prompt(seqs, logits, prompt_rows[1])
            logits = logits[prompt_rows[1]]
        if greedy:
            ops = self.model.cpu_ops
            ids = row_argmax(logits) if ops is None else ops.argmax_rows(logits)
            sampled: list[int] = ids.tolist()
            if meta.decode_lens is not None:  # a kernel decode step: see `prepare`
                self._next_decode = (meta.decode_lens + 1, ids)
        else:
            sampled = sample(logits, [s.params for s in seqs],
                             [s.params.seed_offset + len(s.output_token_ids) for s in seqs], seqs)
        if self._any_logprobs(seqs, is_prefill):
            attach_sampled(seqs, logits, sampled, is_prefill)
        if order is None:
            return sampled
        tokens = [0] * len(batch)
        for pos, i in enumerate(order):
            tokens[i] = sampled[pos]
        return tokens

    @property
    def can_mix(self) -> bool:
        """Whether one forward may carry a prefill batch and a decode batch: the CPU decode kernel runs
        in this model's forward (Gemma's torch-ops forward and non-CPU devices run them apart)."""
        return self.decode_kernel and type(self.model).forward is LlamaForCausalLM.forward

    @torch.inference_mode()
    def run_mixed(self, prefill: list[Sequence], decode: list[Sequence]) -> tuple[list[int], list[int]]:
        """A prefill batch and a decode batch in one forward (`batch.mixed_metadata`): the sampled
        tokens of each, in `prefill` and `decode` order. Where the model cannot mix (`can_mix`) or a
        prompt asks for its prompt log-probabilities, they run as two forwards."""
        if not self.can_mix or any(s.wants_prompt_logprobs for s in prefill):
            return self.run(prefill, True), self.run(decode, False)
        self._next_decode = None
        order = self.order(prefill)
        pseqs = [prefill[i] for i in order]
        p = build_metadata(pseqs, True, self.block_size, self.kv_cache.block_stride, self.dtype, self.device)
        n = len(decode)
        last_index = self._aranges.get(n)
        if last_index is None:
            last_index = self._aranges[n] = torch.arange(n)
        input_ids, meta = mixed_metadata(p, kernel_decode_metadata(decode, self._slots.get(decode), last_index))
        # What the next plain decode step of this batch reuses (see `run`): the slot cache now holds it.
        self._batch_greedy = all(s.params.greedy and not s.params.has_processors for s in decode)
        self._batch_logprobs = any(s.params.logprobs is not None for s in decode)
        seqs = pseqs + decode
        greedy = self._batch_greedy and all(s.params.greedy and not s.params.has_processors for s in pseqs)
        if not greedy:
            prefetch_masks(seqs)
        logits = self.model(input_ids, meta, self.kv_cache)
        if greedy:
            ops = self.model.cpu_ops
            sampled: list[int] = (row_argmax(logits) if ops is None else ops.argmax_rows(logits)).tolist()
        else:
            sampled = sample(logits, [s.params for s in seqs],
                             [s.params.seed_offset + len(s.output_token_ids) for s in seqs], seqs)
        k = len(pseqs)
        if self._batch_logprobs or any(s.params.logprobs is not None for s in pseqs):
            attach_sampled(pseqs, logits[:k], sampled[:k], True)
            attach_sampled(decode, logits[k:], sampled[k:], False)
        tokens = [0] * k
        for pos, i in enumerate(order):
            tokens[i] = sampled[pos]
        return tokens, sampled[k:]

    @torch.inference_mode()
    def run_verify(
        self, batch: list[Sequence], proposals: list[list[int]]
    ) -> tuple[list[list[int]], list[list[TokenLogprobs]] | None]:
        """A decode step that also verifies proposed tokens (speculative decoding, see speculative.py):
        every sequence's last token and its proposals (`proposals[i]`, maybe empty) run as rows of one
        forward over the paged KV, and every row is sampled as the plain decode step for that output
        index would be (its history extended by the proposals before it, its seed's step).

        Returns per sequence, in `batch` order, the `1 + len(proposals[i])` sampled tokens, and when a
        sequence asks for log-probabilities, per sequence the entries of those tokens (empty lists for
        the others; None when none asks)."""
        self._next_decode = None
        slots = self._slots.get(batch)
        input_ids, meta = verify_metadata(batch, proposals, slots, self.device)
        # What later plain decode steps of this batch reuse (see `run`): the slot cache now holds it.
        greedy = self._batch_greedy = all(s.params.greedy and not s.params.has_processors for s in batch)
        wants_logprobs = self._batch_logprobs = any(s.params.logprobs is not None for s in batch)
        counts = [1 + len(p) for p in proposals]
        if not greedy:
            prefetch_masks(batch)  # constrained sequences never propose: one row each, as in `run`
        logits = self.model(input_ids, meta, self.kv_cache)
        if greedy:
            ops = self.model.cpu_ops
            sampled: list[int] = (row_argmax(logits) if ops is None else ops.argmax_rows(logits)).tolist()
        else:
            params = [s.params for s, c in zip(batch, counts, strict=True) for _ in range(c)]
            steps = [s.params.seed_offset + len(s.output_token_ids) + j
                     for s, c in zip(batch, counts, strict=True) for j in range(c)]
            sampled = sample(logits, params, steps, row_histories(batch, proposals))
        per_seq: list[list[int]] = []
        start = 0
        for c in counts:
            per_seq.append(sampled[start : start + c])
            start += c
        if not wants_logprobs:
            return per_seq, None
        return per_seq, self._verify_logprobs(batch, counts, logits, sampled)

    @staticmethod
    def _verify_logprobs(
        batch: list[Sequence], counts: list[int], logits: torch.Tensor, sampled: list[int]
    ) -> list[list[TokenLogprobs]]:
        """The log-probability entries of every row's sampled token, per asking sequence (one
        batched pass over their rows; the caller keeps those of the tokens it emits)."""
        rows: list[int] = []
        tops: list[int] = []
        start = 0
        for s, c in zip(batch, counts, strict=True):
            if s.params.logprobs is not None:
                rows.extend(range(start, start + c))
                tops.extend([s.params.logprobs] * c)
            start += c
        found = token_logprobs(logits[rows], [sampled[r] for r in rows], tops)
        out: list[list[TokenLogprobs]] = []
        taken = 0
        for s, c in zip(batch, counts, strict=True):
            if s.params.logprobs is None:
                out.append([])
                continue
            out.append(found[taken : taken + c])
            taken += c
        return out
