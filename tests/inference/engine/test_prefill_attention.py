"""bf16 prefill attention as GEMMs + softmax (prefill_attention.py) against torch's SDPA, and a prompt
prefilled over a cached prefix against the same prompt prefilled fresh."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.engine import LLMEngine, SamplingParams, prefill_attention
from inference.engine.prefill_attention import (
    MAX_SCORE_BYTES,
    SWITCH,
    gemm_attention_wanted,
    matmul_attention,
    use_matmul_attention,
)

from .conftest import TinyModel
from .test_logits_parity import engine_logits


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """fp32 SDPA of `[B, L, H, D]` inputs with `enable_gqa`, as `[B * L, H * D]`."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k.transpose(1, 2).float(),
                                         v.transpose(1, 2).float(), attn_mask=mask.float(), scale=0.125,
                                         enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape[0] * q.shape[1], -1)


def _causal_after(cached: int, new: int) -> torch.Tensor:
    """Additive mask `[1, 1, new, cached + new]`: query i (position cached + i) sees keys <= its position."""
    k = torch.arange(cached + new)
    q = torch.arange(cached, cached + new)
    return torch.zeros((1, 1, new, cached + new)).masked_fill_(k[None, :] > q[:, None], float("-inf"))


@pytest.mark.parametrize(("batch", "cached", "new", "heads", "kv_heads"),
                         [(1, 0, 40, 9, 3), (3, 0, 17, 4, 2), (1, 100, 50, 9, 3), (2, 33, 31, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_sdpa_with_mask_and_causal(batch: int, cached: int, new: int, heads: int, kv_heads: int,
                                          dtype: torch.dtype) -> None:
    """Same attention as SDPA with grouped-query heads (head h reads KV head h // group), with an
    offset causal mask and, for fresh prompts, `is_causal`: fp32 to float rounding, bf16 no further
    from fp32 than torch's own bf16 SDPA (plus one bf16 ulp of the output)."""
    g = torch.Generator().manual_seed(batch * 100 + cached)
    q = torch.randn(batch, new, heads, 64, generator=g)
    k = torch.randn(batch, cached + new, kv_heads, 64, generator=g)
    v = torch.randn(batch, cached + new, kv_heads, 64, generator=g)
    mask = _causal_after(cached, new)
    ref = _reference(q, k, v, mask)
    ours = matmul_attention(q.to(dtype), k.to(dtype), v.to(dtype), 0.125, mask.to(dtype)).float()
    if dtype == torch.float32:
        assert float((ours - ref).abs().max()) < 1e-5
    else:
        torch_bf16 = _reference(q.to(dtype), k.to(dtype), v.to(dtype), mask.to(dtype))
        torch_err = float((torch_bf16 - ref).abs().max())
        assert float((ours - ref).abs().max()) < 2 * torch_err + 2e-2
    if cached == 0:
        causal = matmul_attention(q.to(dtype), k.to(dtype), v.to(dtype), 0.125, is_causal=True)
        assert torch.equal(causal, matmul_attention(q.to(dtype), k.to(dtype), v.to(dtype), 0.125, mask.to(dtype)))


def test_used_for_bf16_cpu_prefill_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 prefill shapes on a CPU that wants the GEMMs take the GEMM path; fp32, single queries
    (decode) and score matrices over the memory bound do not."""
    monkeypatch.setattr(prefill_attention, "gemm_attention_wanted", lambda: True)
    q = torch.zeros(1, 16, 9, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 32, 3, 64, dtype=torch.bfloat16)
    assert use_matmul_attention(q, k)
    assert not use_matmul_attention(q.float(), k.float())
    assert not use_matmul_attention(q[:, :1], k)
    long_k = torch.empty(1, MAX_SCORE_BYTES // (4 * 9 * 16) + 1, 3, 64, dtype=torch.bfloat16)
    assert not use_matmul_attention(q, long_k)


@pytest.mark.parametrize(("kind", "switch", "wanted"),
                         [("avx512-amx", None, False), ("avx512", None, True), ("avx512-zen5", None, True),
                          ("avx512-amx", "1", True), ("avx512", "0", False)])
def test_gemm_attention_not_on_amx_unless_switched(monkeypatch: pytest.MonkeyPatch, kind: str, switch: str | None,
                                                   wanted: bool) -> None:
    """A CPU with AMX tiles keeps torch's flash kernel (faster there); the others take the GEMMs; the
    switch overrides either way. A bf16 prefill shape follows the choice."""
    monkeypatch.setattr(prefill_attention, "cpu_kind", lambda: kind)
    if switch is None:
        monkeypatch.delenv(SWITCH, raising=False)
    else:
        monkeypatch.setenv(SWITCH, switch)
    gemm_attention_wanted.cache_clear()
    try:
        assert gemm_attention_wanted() is wanted
        q = torch.zeros(1, 16, 9, 64, dtype=torch.bfloat16)
        assert use_matmul_attention(q, torch.zeros(1, 16, 3, 64, dtype=torch.bfloat16)) is wanted
    finally:
        gemm_attention_wanted.cache_clear()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_over_cached_prefix_matches_fresh_prefill(llama: TinyModel, dtype: str) -> None:
    """A prompt whose first 3 blocks are cached (its prefill attends to keys gathered from the cache
    under the offset causal mask) gives the logits and greedy tokens of the same prompt prefilled
    fresh, in fp32 and in bf16 (where both prefills run the GEMM attention, or on an AMX CPU both the
    flash kernel)."""
    prompt = llama.prompts[3]  # 70 tokens
    fresh = LLMEngine(llama.path, block_size=16, num_blocks=64, dtype=dtype, enable_prefix_caching=False)
    want, want_tokens = engine_logits(fresh, [prompt], 4)
    cached = LLMEngine(llama.path, block_size=16, num_blocks=64, dtype=dtype)
    cached.generate([prompt[:50]], SamplingParams(max_tokens=1, temperature=0.0))
    got, got_tokens = engine_logits(cached, [prompt], 4)
    assert cached.scheduler.prefix_hit_tokens == 48  # the first 3 blocks, from the 50-token prompt
    tol = 1e-4 if dtype == "float32" else 0.1
    for ours, ref in zip(got, want, strict=True):
        assert float((ours.float() - ref.float()).abs().max()) < tol
    assert got_tokens == want_tokens
