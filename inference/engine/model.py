"""Llama-family decoder (Llama, SmolLM, Qwen2, Qwen3, Mistral, Phi-3; Gemma in gemma.py) with paged
attention over `KVCache`. What the families change is read from `ModelConfig` (families.py): q/k
norms, sliding windows (attention_window.py), RoPE scaling.

Tokens of a batch travel flattened (`[num_tokens, hidden]`) through every projection and MLP so that
no FLOPs are spent on padding. Attention reads only what each sequence owns (see `batch.py`): a
prefill runs one causal SDPA call per group of equal-length prompts over the step's own K/V, a
decode step one SDPA call per bucket of sequences with close context lengths, gathering from the
paged cache only that bucket's keys.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .attention_window import bucketed, windowed
from .batch import BatchMetadata, DecodeBucket
from .config import ModelConfig
from .kv_cache import KVCache
from .prefill_attention import matmul_attention, use_matmul_attention
from .rope import RotaryEmbedding, apply_rope, rope_inv_freq


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (accumulated in fp32, as in HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        """`dim` features, `eps` added to the mean square."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dimension."""
        # One fused kernel instead of five ops and two casts (~2x faster at decode shapes). It
        # accumulates in fp32 like HF; in half precision it rounds once where HF rounds twice.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention with fused q/k/v projection and paged KV."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        """Build projections for layer `layer_idx`."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # Qwen3 / Gemma 3: each head of q and k is RMS-normalised before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        # `project`, or its compiled version with --compile.
        self._project: Callable[
            [torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]
        ] = self.project

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: BatchMetadata,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        """Attend for the flat tokens `x` `[num_tokens, hidden]`; writes their K/V into the cache."""
        q, k, v = self._project(x, cos, sin)
        return self.attend(q, k, v, meta, kv_cache)

    def forward_fused(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMetadata, kv_cache: KVCache | None,
        ops: Any,
    ) -> torch.Tensor:
        """`forward` with the CPU kernels (cpu_kernels.py): RoPE in place on the fused projection, and
        decode attention straight over the paged cache. `cos` / `sin` are `[n, head_dim]`."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            self._norm_qk(qkv.view(n, -1, self.head_dim))
        ops.rope_inplace(qkv, self.num_heads + self.num_kv_heads, cos, sin)
        q = qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(n, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(n, self.num_kv_heads, self.head_dim)
        if meta.mixed_split and meta.decode_slots is not None and meta.decode_lens is not None \
                and kv_cache is not None:
            # A mixed step: the prefill rows attend as a prefill step, the decode rows through the kernel.
            p = meta.mixed_split
            self._write_kv(k[:p], v[:p], meta, kv_cache)
            out_p = self._prefill(q[:p], k[:p], v[:p], meta, kv_cache)
            out_d = ops.paged_decode(q[p:], k[p:], v[p:], kv_cache.rows, meta.decode_slots, meta.decode_lens,
                                     self.layer_idx * kv_cache.layer_stride, kv_cache.block_size, self.scale)
            return self.o_proj(torch.cat((out_p, out_d)))
        if meta.decode_slots is not None and meta.decode_lens is not None and kv_cache is not None:
            if meta.prewrite:  # a verify step: a row may attend to keys of rows another thread writes
                self._write_kv(k, v, meta, kv_cache)
            # Writes this token's K/V into its slot and attends over each sequence's own rows.
            out = ops.paged_decode(q, k, v, kv_cache.rows, meta.decode_slots, meta.decode_lens,
                                   self.layer_idx * kv_cache.layer_stride, kv_cache.block_size, self.scale)
            return self.o_proj(out)
        return self.attend(q, k, v, meta, kv_cache)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMetadata, kv_cache: KVCache | None
    ) -> torch.Tensor:
        """Write k/v into the cache, attend (prefill groups or decode buckets) and project the output."""
        if kv_cache is not None:
            self._write_kv(k, v, meta, kv_cache)

        if meta.is_prefill:
            out = self._prefill(q, k, v, meta, kv_cache)
        else:
            if kv_cache is None:
                raise ValueError("attention over cached context needs a KV cache")
            out = self._decode(q, meta, kv_cache)
        return self.o_proj(out)

    def _write_kv(self, k: torch.Tensor, v: torch.Tensor, meta: BatchMetadata, kv_cache: KVCache) -> None:
        """Store the new tokens' keys and values in their slots (`meta.write_rows`) of this layer."""
        k_rows = meta.write_rows + self.layer_idx * kv_cache.layer_stride
        kv_cache.rows.index_copy_(0, k_rows, k.to(kv_cache.dtype))
        kv_cache.rows.index_copy_(0, k_rows + kv_cache.block_size, v.to(kv_cache.dtype))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[n, heads, head_dim]` and k, v `[n, kv_heads, head_dim]` of the flat tokens, RoPE applied."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            self._norm_qk(qkv.view(n, -1, self.head_dim))
        # q and k rotated together: one set of RoPE ops per layer instead of two.
        qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads,
                                                                  self.head_dim), cos, sin)
        v = qkv[:, self.q_size + self.kv_size :]
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v.reshape(n, self.num_kv_heads, self.head_dim)

    def _norm_qk(self, heads: torch.Tensor) -> None:
        """RMS-normalise, in place, the q heads and the k heads of the fused projection's output viewed
        as `[n, heads + 2 * kv_heads, head_dim]` (each with its own weight)."""
        assert self.q_norm is not None and self.k_norm is not None
        q = heads[:, : self.num_heads]
        k = heads[:, self.num_heads : self.num_heads + self.num_kv_heads]
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))

    def compile_projection(self) -> None:
        """Use a torch.compile'd `project` from now on (`--compile`, see compile.py)."""
        self._project = torch.compile(self.project, dynamic=True)

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """SDPA over `[batch, len, heads, head_dim]` inputs; returns `[batch * q_len, q_size]`. A bf16
        prefill on a CPU runs as GEMMs and a softmax instead (prefill_attention.py: 2-3x faster there)."""
        if use_matmul_attention(q, k):
            return matmul_attention(q, k, v, self.scale, attn_mask, is_causal)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        return out.transpose(1, 2).reshape(-1, self.q_size)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: BatchMetadata, kv_cache: KVCache | None
    ) -> torch.Tensor:
        """Fresh prompts attend causally to their own K/V: one maskless call per prompt length; a
        prompt with a cached prefix attends to its keys gathered from the cache."""
        outs = []
        for g in meta.prefill_groups:
            if g.cached:
                if kv_cache is None or g.gather_rows is None:
                    raise ValueError("a prefill over a cached prefix needs the KV cache")
                rows = g.gather_rows + self.layer_idx * kv_cache.layer_stride
                shape = (1, g.cached + g.q_len, self.num_kv_heads, self.head_dim)
                keys = kv_cache.rows.index_select(0, rows).view(shape).to(q.dtype)
                values = kv_cache.rows.index_select(0, rows + kv_cache.block_size).view(shape).to(q.dtype)
                qg = q[g.start : g.end].view(1, g.q_len, self.num_heads, self.head_dim)
                outs.append(self._sdpa(qg, keys, values, attn_mask=g.mask))
                continue
            shape_q = (g.num_seqs, g.q_len, self.num_heads, self.head_dim)
            shape_kv = (g.num_seqs, g.q_len, self.num_kv_heads, self.head_dim)
            # A mask here is a sliding window's band (attention_window.py); otherwise plain causal.
            outs.append(
                self._sdpa(
                    q[g.start : g.end].view(shape_q),
                    k[g.start : g.end].view(shape_kv),
                    v[g.start : g.end].view(shape_kv),
                    attn_mask=g.mask,
                    is_causal=g.mask is None,
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode(self, q: torch.Tensor, meta: BatchMetadata, kv_cache: KVCache) -> torch.Tensor:
        """One query per sequence against its cached context, bucket by bucket."""
        outs = []
        layer_offset = self.layer_idx * kv_cache.layer_stride
        for bk in meta.decode_buckets:
            n = bk.end - bk.start
            if q.device.type == "cpu":
                outs.append(self._decode_cpu(q[bk.start : bk.end], bk, kv_cache, layer_offset))
                continue
            rows = bk.gather_rows + layer_offset
            keys = kv_cache.rows.index_select(0, rows).view(n, bk.max_k, self.num_kv_heads, self.head_dim)
            values = kv_cache.rows.index_select(0, rows + kv_cache.block_size).view(
                n, bk.max_k, self.num_kv_heads, self.head_dim
            )
            if keys.dtype != q.dtype:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            qb = q[bk.start : bk.end].view(n, 1, self.num_heads, self.head_dim)
            outs.append(self._sdpa(qb, keys, values, attn_mask=bk.mask))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_cpu(self, q: torch.Tensor, bk: DecodeBucket, kv_cache: KVCache, layer_offset: int) -> torch.Tensor:
        """One query per sequence as two batched matmuls and an fp32 softmax. On CPU this beats SDPA
        for a single query: measured on SmolLM2's shapes (batch 32, 70 keys) 0.17 ms against 2.2 ms in
        bf16 (the flash kernel is tiled for many queries) and 0.27 against 0.38 ms in fp32. Keys and
        values are gathered head-major (`[n, kv_heads, max_k, head_dim]`), so neither matmul copies them
        into another layout first."""
        n, kvh, hd = q.shape[0], self.num_kv_heads, self.head_dim
        rows = bk.head_rows(kvh, kv_cache.block_size * kvh) + layer_offset * kvh
        kv = kv_cache.head_rows.index_select(0, rows).view(2, n, kvh, bk.max_k, hd)
        keys, values = kv[0], kv[1]
        if keys.dtype != q.dtype:
            keys, values = keys.to(q.dtype), values.to(q.dtype)
        # Scaling q (a strided view of the fused projection) also makes it contiguous: one kernel for both.
        qg = q.view(n, kvh, self.num_heads // kvh, hd) * self.scale
        # Mask and softmax in fp32: torch's CPU element-wise and softmax kernels are slower on bf16 than a
        # cast plus the fp32 kernel (measured [64, 4, 1, 55]: softmax 40 us in bf16, 22 us cast + fp32).
        scores = torch.matmul(qg, keys.transpose(2, 3)).float()  # [n, kv, group, k]
        if bk.mask is not None:
            scores = scores + bk.mask
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(n, self.q_size)


class MLP(nn.Module):
    """SiLU-gated MLP with fused gate/up projection."""

    def __init__(self, config: ModelConfig) -> None:
        """Build projections."""
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate(x)) * up(x))."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor, ops: Any) -> torch.Tensor:
        """`forward` with the CPU kernels' SiLU·mul (one pass instead of split, silu, mul)."""
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        """Build attention, MLP and the two norms."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: BatchMetadata,
        kv_cache: KVCache | None,
    ) -> torch.Tensor:
        """x + attn(norm(x)), then + mlp(norm(.))."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: BatchMetadata,
        kv_cache: KVCache | None,
        ops: Any,
    ) -> torch.Tensor:
        """The same block with the CPU kernels, vLLM-style: `x` arrives normalised (`input_layernorm` of
        `residual`), the attention output is added to `residual` in place and normalised in one pass,
        and the MLP output is returned un-added (the next norm adds it)."""
        h = self.self_attn.forward_fused(x, cos, sin, meta, kv_cache, ops)
        post = self.post_attention_layernorm
        ops.fused_add_rms_norm(h, residual, post.weight, post.eps)
        return self.mlp.forward_fused(h, ops)


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus LM head; returns logits for the last token of each sequence only."""

    def __init__(self, config: ModelConfig) -> None:
        """Build all modules (weights come from `weights.load_model`)."""
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config)
        # The compiled CPU kernels (cpu_kernels.py) when the model runner enabled them; None: torch ops.
        self.cpu_ops: Any = None
        self.layer_windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
        self.tie_weights()

    def make_layer(self, config: ModelConfig, layer_idx: int) -> DecoderLayer:
        """Decoder layer `layer_idx` (a family with another block overrides this)."""
        return DecoderLayer(config, layer_idx)

    def init_buffers(self, device: str | torch.device) -> None:
        """Compute the buffers that are not in the checkpoint (RoPE frequencies, in fp32) on `device`:
        after loading onto the meta device they are uninitialised."""
        self.rotary.inv_freq = rope_inv_freq(self.config).to(device)

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head when the config says so."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, kv_cache: KVCache | None) -> torch.Tensor:
        """Logits `[batch, vocab]` in the model's dtype for the last token of each sequence in the flat
        batch (the sampler casts the rows it samples to fp32; greedy rows take the argmax as they are,
        which picks the same token: casting to fp32 is exact)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(meta.positions, x.dtype)
        if self.cpu_ops is None:
            # The runner may have prepared a CPU-kernel decode step while the kernels are not used here.
            meta = bucketed(meta, x.dtype)
        metas = self.layer_metas(meta, x.dtype)
        if self.cpu_ops is not None:
            return self.lm_head(self._forward_fused(x, cos, sin, metas, kv_cache, self.cpu_ops))
        for layer, layer_meta in zip(self.layers, metas, strict=True):
            x = layer(x, cos, sin, layer_meta, kv_cache)
        x = self.norm(x[meta.last_index])
        return self.lm_head(x)

    def layer_metas(self, meta: BatchMetadata, dtype: torch.dtype) -> list[BatchMetadata]:
        """Each layer's metadata: `meta` itself, or for a sliding-window layer `meta` limited to the
        window (built once per step and shared by the layers of that window)."""
        if self.config.sliding_window is None:  # every layer attends fully: nothing to build
            return [meta] * len(self.layer_windows)
        by_window = {w: meta if w is None else windowed(meta, w, dtype) for w in set(self.layer_windows)}
        return [by_window[w] for w in self.layer_windows]

    def _forward_fused(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, metas: list[BatchMetadata],
        kv_cache: KVCache | None, ops: Any,
    ) -> torch.Tensor:
        """The decoder stack with the CPU kernels: the residual stream is updated in place and each
        residual add is fused into the norm that follows it. Returns the final norm of the last tokens."""
        n = x.shape[0]
        cos, sin = cos.view(n, -1), sin.view(n, -1)
        layers: list[DecoderLayer] = list(self.layers)  # type: ignore[arg-type]
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        residual = x
        h = ops.rms_norm(residual, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        meta = metas[0]
        for layer, nxt, layer_meta in zip(layers, norms, metas, strict=True):
            h = layer.forward_fused(h, residual, cos, sin, layer_meta, kv_cache, ops)
            if nxt is self.norm and meta.last_index.shape[0] != n:
                # A prefill: only each sequence's last token needs the final norm.
                return ops.rms_norm((residual + h)[meta.last_index], nxt.weight, nxt.eps)  # type: ignore[no-any-return]
            ops.fused_add_rms_norm(h, residual, nxt.weight, nxt.eps)
        return h
