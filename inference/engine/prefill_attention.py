"""Prefill attention in bf16 on a CPU as two batched GEMMs and a softmax, instead of torch's flash
kernel.

Why: on a CPU without AMX, `scaled_dot_product_attention` in bf16 runs its flash kernel at a small
fraction of the GEMM rate for SmolLM2's shapes (head_dim 64): measured on an AMD EPYC Zen 5, one
thread, 9 query heads over 3 KV heads, 256 queries over 512 keys: 3.2 ms, where the same attention
as QK^T (oneDNN bf16 GEMM, 0.3 ms) + a cast and an fp32 softmax (0.5 ms) + PV (0.3 ms) takes about
1.2 ms; 256 queries over 1,280 keys: 8.0 ms against about 3 ms (`bench/prefill_cached.py` measures
the whole forward). In fp32 the two are on par (the fp32 GEMMs are 4x slower), so fp32 keeps SDPA.

The scores round to bf16 once (the GEMM's output), as in the CPU decode path (`Attention._decode_cpu`);
the softmax runs in fp32 inside torch's kernel and its output rounds to bf16 once. The grouped-query
layout is folded into the GEMMs: the queries of the heads sharing a KV head are stacked as rows, so
no key or value is repeated.
The score matrix is materialised (`[batch, heads, q_len, k_len]`), so a step whose scores would
exceed `MAX_SCORE_BYTES` keeps the flash kernel (which tiles).

Not on a CPU with AMX tiles (eighteenth session, Intel Xeon family 6 model 207, torch 2.13): there
torch's flash kernel runs its bf16 blocks on AMX and beat these GEMMs at every prefill shape measured,
one thread: 512 causal queries 1.86 against 6.55 ms a layer, 4 x 512 7.8 against 31.6 (the masked
fill and the softmax over the full score matrix were two thirds of it), 256 after 1,024 cached 2.6
against 6.5, 2 x 128 after 384 cached 0.99 against 1.68, 64 queries 0.07 against 0.15. So there
the flash kernel serves every bf16 prefill (`gemm_attention_wanted`); `INFERENCE_GEMM_ATTENTION=1` /
`0` forces the GEMMs on / off on any CPU (A/B runs).
"""
from __future__ import annotations

import functools
import os

import torch

from .cpu_linear import cpu_kind

SWITCH = "INFERENCE_GEMM_ATTENTION"

# Above this many bytes of fp32 scores per call the flash kernel's tiling wins on memory (64 MiB: a
# 256-token chunk after ~7,000 cached tokens with SmolLM2's 9 heads).
MAX_SCORE_BYTES = 64 << 20


@functools.lru_cache(maxsize=1)
def gemm_attention_wanted() -> bool:
    """Whether bf16 prefill attention on this CPU runs as GEMMs at all: not where the CPU has AMX tiles
    (torch's flash kernel is faster there, see the module), unless `INFERENCE_GEMM_ATTENTION` says
    "1" (on) or "0" (off). Read once per process."""
    switch = os.environ.get(SWITCH, "").strip().lower()
    if switch in ("0", "false", "no", "off"):
        return False
    if switch in ("1", "true", "yes", "on"):
        return True
    return cpu_kind() != "avx512-amx"


def use_matmul_attention(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `matmul_attention` should run for q `[batch, q_len, heads, head_dim]` over k
    `[batch, k_len, kv_heads, head_dim]`: bf16 on a CPU that wants it (`gemm_attention_wanted`), more
    than one query, scores within bounds."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or q.shape[1] < 2 or not gemm_attention_wanted():
        return False
    return q.shape[0] * q.shape[2] * q.shape[1] * k.shape[1] * 4 <= MAX_SCORE_BYTES


def matmul_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Attention of q `[B, L, H, D]` over k, v `[B, S, KV, D]` (H a multiple of KV; query head h reads
    KV head h // (H / KV), as in `enable_gqa`), with an additive `attn_mask` broadcastable to
    `[B, 1, L, S]` or, with `is_causal`, the causal mask aligned to the top-left (L == S). Returns
    `[B * L, H * D]` in q's dtype, tokens in order."""
    b, n, h, d = q.shape
    s, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    # [B, KV, G*L, D]: the queries of the g heads that share a KV head are rows of one GEMM. Scaling
    # here makes the strided view contiguous in the same pass.
    qh = torch.empty((b, kvh, g, n, d), dtype=q.dtype, device=q.device)
    torch.mul(q.view(b, n, kvh, g, d).permute(0, 2, 3, 1, 4), scale, out=qh)
    keys = k.transpose(1, 2)  # [B, KV, S, D], a view: the GEMM reads it transposed
    scores = torch.matmul(qh.view(b, kvh, g * n, d), keys.transpose(2, 3)).view(b, kvh, g, n, s)
    # The masks hold only 0 and -inf: adding them in bf16 is exact.
    if attn_mask is not None:
        # [B or 1, 1, L, S] -> [B or 1, 1, 1, L, S]: one mask for every head.
        scores.add_(attn_mask.unsqueeze(2))
    elif is_causal:
        hidden = torch.ones((n, s), dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(hidden, float("-inf"))
    # torch's CPU softmax on bf16 computes in fp32 and rounds once on output: the same values as a
    # cast, an fp32 softmax and a cast back (checked bit for bit), without the two extra passes.
    probs = torch.softmax(scores, dim=-1).view(b, kvh, g * n, s)
    out = torch.matmul(probs, v.transpose(1, 2))  # [B, KV, G*L, D]
    return out.view(b, kvh, g, n, d).permute(0, 3, 1, 2, 4).reshape(b * n, h * d)
