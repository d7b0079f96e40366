"""The CPU C++ kernels (cpu_kernels.py, csrc/): each op against the torch ops it replaces, and engines
with the kernels against the same engines on torch ops."""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from inference.engine.cpu_kernels import load_kernels

from .conftest import TinyModel

ops = load_kernels()
pytestmark = pytest.mark.skipif(ops is None, reason="the CPU kernels do not build here (no compiler/ninja)")

# bf16 results are rounded once where torch rounds after every op: compare at bf16 resolution.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _reference_decode(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, rows: torch.Tensor,
                      slots: torch.Tensor, lens: torch.Tensor, layer_off: int, v_off: int,
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence in fp32 with plain torch ops: write the new K/V, attend over its own rows."""
    rows = rows.clone()
    n, heads, _ = q.shape
    group = heads // k_new.shape[1]
    outs = []
    for i in range(n):
        r = slots[i, : int(lens[i])] + layer_off
        rows[r[-1]], rows[r[-1] + v_off] = k_new[i], v_new[i]
        keys = rows[r].float().repeat_interleave(group, 1)  # [len, heads, hd]
        values = rows[r + v_off].float().repeat_interleave(group, 1)
        probs = torch.einsum("hd,lhd->hl", q[i].float() * scale, keys).softmax(-1)
        outs.append(torch.einsum("hl,lhd->hd", probs, values).reshape(-1))
    return torch.stack(outs), rows


@pytest.mark.parametrize(("dtype", "heads", "kv_heads", "head_dim"), [
    (torch.float32, 4, 2, 16),   # the tiny test models' shape (generic path)
    (torch.bfloat16, 4, 2, 16),  # generic bf16 path
    (torch.bfloat16, 4, 4, 64),  # tiny hd64 (the AVX512-BF16 path where the CPU has it)
    (torch.bfloat16, 9, 3, 64),  # SmolLM2's grouping
    (torch.float32, 8, 2, 128),  # the fp32 vector path (16 lanes with AVX-512, else 8)
    (torch.float32, 9, 3, 64),
])
def test_paged_decode_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(0)
    num_blocks, layers, bs = 96, 3, 16
    data = torch.randn(num_blocks, layers, 2, bs, kv_heads, head_dim).to(dtype)
    rows = data.view(-1, kv_heads, head_dim)
    lens = torch.tensor([1, 2, 15, 16, 17, 33, 64, 200, 5, 90], dtype=torch.int64)
    width = 16
    perm = torch.randperm(num_blocks)
    slots = torch.zeros(len(lens), width * bs, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens.tolist()):
        need = -(-n // bs)
        table = torch.zeros(width, dtype=torch.int64)
        table[:need] = perm[used : used + need]
        used += need
        slots[i] = (table[:, None] * (layers * 2 * bs) + torch.arange(bs)).flatten()
    # q, k, v as strided views of one fused projection, as the model passes them.
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, head_dim).to(dtype)
    q, k_new, v_new = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    layer_off, scale = 1 * 2 * bs, head_dim**-0.5
    expected, expected_rows = _reference_decode(q, k_new, v_new, rows, slots, lens, layer_off, bs, scale)
    got = ops.paged_decode(q, k_new, v_new, rows, slots, lens, layer_off, bs, scale)
    assert got.shape == (len(lens), heads * head_dim) and got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(rows, expected_rows)  # exactly the new K/V written, nothing else touched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_rope_and_silu_match_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    n, d, eps = 7, 96, 1e-5
    x, res, w = torch.randn(n, d).to(dtype), torch.randn(n, d).to(dtype), torch.rand(d).to(dtype) + 0.5
    tol: dict[str, Any] = {"atol": TOL[dtype], "rtol": TOL[dtype]}
    torch.testing.assert_close(ops.rms_norm(x, w, eps), F.rms_norm(x, (d,), w, eps), **tol)

    h, r = x.clone(), res.clone()
    ops.fused_add_rms_norm(h, r, w, eps)
    assert torch.equal(r, res + x)  # the residual add rounds exactly as torch's add
    torch.testing.assert_close(h, F.rms_norm(res + x, (d,), w, eps), **tol)

    heads, hd = 3, 32
    qkv = torch.randn(n, (heads + 1) * hd).to(dtype)  # the last head (like V) must stay untouched
    angle = torch.rand(n, hd // 2) * 6
    cos = torch.cat((angle.cos(), angle.cos()), -1).to(dtype)
    sin = torch.cat((-angle.sin(), angle.sin()), -1).to(dtype)
    x3 = qkv[:, : heads * hd].view(n, heads, hd).float()
    rotated = x3 * cos.float()[:, None] + torch.roll(x3, hd // 2, -1) * sin.float()[:, None]
    out = qkv.clone()
    ops.rope_inplace(out, heads, cos, sin)
    torch.testing.assert_close(out[:, : heads * hd].view(n, heads, hd).float(), rotated, **tol)
    assert torch.equal(out[:, heads * hd :], qkv[:, heads * hd :])

    gate_up = torch.randn(n, 2 * d).to(dtype) * 4
    gate_up[0, 0] = -100.0  # exp overflow in silu must give 0, not NaN
    expected = F.silu(gate_up[:, :d].float()) * gate_up[:, d:].float()
    torch.testing.assert_close(ops.silu_and_mul(gate_up).float(), expected, **tol)
    assert torch.isfinite(ops.silu_and_mul(gate_up)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 63, 64, 1000, 49152])
def test_argmax_rows_matches_torch_first_index_on_ties(dtype: torch.dtype, width: int) -> None:
    torch.manual_seed(width)
    x = torch.randn(9, width).to(dtype)
    x[1] = 0.0  # all tied: index 0
    if width > 3:
        x[2, width // 3] = x[2, width - 1] = 100.0  # two tied maxima in different chunks: the first
        x[3, -1] = 100.0  # the maximum in the ragged last chunk
    x[4] = float("-inf")
    x[4, width // 2] = -1e30
    assert torch.equal(ops.argmax_rows(x), torch.argmax(x, dim=-1))
    assert torch.equal(ops.argmax_rows(x[:, : max(1, width // 2)]), torch.argmax(x[:, : max(1, width // 2)], dim=-1))


def _torch_ops(engine: object) -> None:
    """Switch an engine to the torch path (what a host without a compiler runs)."""
    runner = engine.runner  # type: ignore[attr-defined]
    runner.model.cpu_ops = None
    runner.decode_kernel = False


def test_fp32_engine_with_kernels_matches_torch_path_and_transformers(llama: TinyModel) -> None:
    """fp32 stays the exact mode: greedy tokens equal transformers' with and without the kernels, and
    teacher-forced decode logits agree to float rounding."""
    from inference.engine import LLMEngine, SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    fast = LLMEngine(llama.path, num_blocks=64, dtype="float32")
    assert fast.runner.decode_kernel and fast.model.cpu_ops is not None
    assert [r.token_ids for r in fast.generate(llama.prompts, params)] == llama.greedy
    slow = LLMEngine(llama.path, num_blocks=64, dtype="float32")
    _torch_ops(slow)
    assert [r.token_ids for r in slow.generate(llama.prompts, params)] == llama.greedy


def _teacher_forced_logits(engine: object, model: TinyModel, steps: int = 4) -> list[torch.Tensor]:
    """fp32 logits of a prefill of `model.prompts` and `steps - 1` decode steps fed transformers' greedy
    tokens (the same inputs whatever the engine predicts)."""
    from inference.engine import SamplingParams
    from inference.engine.sequence import Sequence

    e = engine
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=8), i) for i, p in enumerate(model.prompts)]
    for s in seqs:
        s.block_ids = e.block_manager.allocate(e.scheduler.blocks_for(len(s.prompt_token_ids) + steps))  # type: ignore[attr-defined]
    out = []
    for step in range(steps):
        batch = sorted(seqs, key=lambda s: s.num_tokens)
        ids, meta = e.runner.prepare(batch, step == 0)  # type: ignore[attr-defined]
        with torch.inference_mode():
            lg = e.runner.model(ids, meta, e.runner.kv_cache).float()  # type: ignore[attr-defined]
        out.append(lg[torch.tensor([s.arrival for s in batch]).argsort()])  # back to prompt order
        for s in batch:
            s.num_cached = s.num_tokens
            s.output_token_ids.append(model.greedy[s.arrival][step])
    return out


@pytest.mark.parametrize("fixture", ["llama", "qwen2", "llama_variant"])
def test_bf16_kernels_as_accurate_as_torch_ops(fixture: str, request: pytest.FixtureRequest) -> None:
    """bf16: the kernels round once per op where torch rounds after every kernel, so their logits are
    not bit-equal to the torch path's; measured against the fp32 engine they are no further off."""
    from inference.engine import LLMEngine

    model: TinyModel = request.getfixturevalue(fixture)
    exact = _teacher_forced_logits(LLMEngine(model.path, num_blocks=64, dtype="float32"), model)
    fast = _teacher_forced_logits(LLMEngine(model.path, num_blocks=64, dtype="bfloat16"), model)
    slow_engine = LLMEngine(model.path, num_blocks=64, dtype="bfloat16")
    _torch_ops(slow_engine)
    slow = _teacher_forced_logits(slow_engine, model)
    # Mean |error| over all steps (single steps swing either way by ~1.5x: rounding noise).
    err_kernels = sum((a - ref).abs().mean().item() for ref, a in zip(exact, fast, strict=True))
    err_torch = sum((b - ref).abs().mean().item() for ref, b in zip(exact, slow, strict=True))
    assert err_kernels <= 1.2 * err_torch, (err_kernels, err_torch)
