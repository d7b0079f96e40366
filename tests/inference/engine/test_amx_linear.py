"""The AMX-tile bf16 GEMM (csrc/amx_gemm.cpp, amx_linear.AmxLinear): within one bf16 rounding of the fp32
sum at every row count, row tail and column/K tail; each row bit for bit what it gives alone at any row
count (speculative verify steps need no row bound on it); the choice rule and its switch; whole engines on
it generating oneDNN's greedy tokens.

The kernel exists only in builds for CPUs with AMX-BF16 (Intel Xeon 4th generation and later): its tests
skip elsewhere (AVX2-only hosts, AMD Zen 4/5), naming why; the build compiles everywhere."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference.engine import cpu_linear
from inference.engine.amx_linear import AmxLinear, amx_kernel_available
from inference.engine.cpu_linear import (
    ALL_ROWS,
    AMX_ROWS,
    AMX_SWITCH,
    PANEL_SWITCH,
    PanelLinear,
    PrepackedLinear,
    amx_rows_limit,
    panel_rows_limit,
    prepack_linears,
    prepacked_linear_available,
    row_invariant_plan,
)

from .conftest import TinyModel

CPU = torch.device("cpu")
# One A tile and its tail, two (a whole 32-row chunk), chunks past it, more than 256 rows (two slices).
ROWS = [1, 2, 3, 8, 15, 16, 17, 31, 32, 33, 48, 64, 65, 100, 128, 300]


def _kernels():  # type: ignore[no-untyped-def]
    from inference.engine.cpu_kernels import load_kernels

    ops = load_kernels()
    if ops is None:
        pytest.skip("CPU kernels unavailable here (no compiler or the build failed)")
    return ops


def _amx_kernels():  # type: ignore[no-untyped-def]
    ops = _kernels()
    if not amx_kernel_available(ops):
        pytest.skip("no AMX GEMM here (needs AMX-BF16 and Linux's tile state; this CPU or build has neither)")
    return ops


def test_the_kernel_follows_the_cpu() -> None:
    """The build has the AMX GEMM where the CPU has AMX-BF16 tiles (the build targets the host), and
    refuses to run where it has not."""
    ops = _kernels()
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    has_amx = {"amx_tile", "amx_bf16", "avx512_bf16"} <= set(flags)
    assert amx_kernel_available(ops) == has_amx
    if not has_amx:
        packed = ops.amx_pack(torch.randn(40, 24).to(torch.bfloat16))  # packing is plain tensor work
        with pytest.raises(RuntimeError, match="no AMX kernel"):
            ops.amx_linear(torch.randn(2, 24).to(torch.bfloat16), packed, 40)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 48), (70, 100), (576, 960), (1536, 33)])
def test_within_one_rounding_of_the_fp32_sum(bias: bool, in_features: int, out_features: int) -> None:
    """Products of bf16 inputs summed in fp32 (the tiles' C registers), the bias added in fp32 and the
    sum rounded to bf16 once: each output within one bf16 rounding (rtol 2^-8, atol 1e-4) of
    F.linear in fp32 on the same bf16 inputs, at every row count (K and N tails: 70, 100, 33)."""
    ops = _amx_kernels()
    torch.manual_seed(in_features + out_features)
    lin = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    packed = AmxLinear(lin, ops)
    for rows in ROWS:
        x = torch.randn(rows, in_features).to(torch.bfloat16)
        exact = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
        with torch.inference_mode():
            got = packed(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        try:
            torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-4)
        except AssertionError as exc:
            raise AssertionError(f"{rows} rows: {exc}") from None


@pytest.mark.parametrize(("in_features", "out_features"), [(576, 1536), (1536, 576), (576, 4096), (70, 100)])
def test_each_row_is_the_row_alone_at_any_row_count(in_features: int, out_features: int) -> None:
    """A fixed order of accumulation over K whatever the row count, and a tile row depends only on its
    own input row: every row of a call of up to 300 rows is bit for bit that row computed alone."""
    ops = _amx_kernels()
    torch.manual_seed(3)
    lin = nn.Linear(in_features, out_features, bias=True).to(torch.bfloat16)
    packed = AmxLinear(lin, ops)
    x = torch.randn(300, in_features).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([packed(x[i : i + 1]) for i in range(x.shape[0])])
        for rows in ROWS:
            assert torch.equal(packed(x[:rows]), alone[:rows]), rows
        assert torch.equal(packed(x[100:164]), alone[100:164])  # the row's place in the call does not matter


def test_refuses_mismatched_inputs() -> None:
    ops = _amx_kernels()
    packed = ops.amx_pack(torch.randn(40, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.amx_linear(torch.randn(2, 96).to(torch.bfloat16), packed, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.amx_linear(torch.randn(2, 64).to(torch.bfloat16), packed, 80)
    with pytest.raises(RuntimeError, match="bias"):
        ops.amx_linear(torch.randn(2, 64).to(torch.bfloat16), packed, 40, torch.randn(39).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16"):
        ops.amx_linear(torch.randn(2, 64), packed, 40)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.amx_pack(torch.randn(40, 64))
    with pytest.raises(ValueError, match="bf16 only"):
        AmxLinear(nn.Linear(64, 40), ops)


@pytest.mark.skipif(not prepacked_linear_available(torch.bfloat16, CPU), reason="oneDNN has no bf16 kernels here")
def test_rows_above_the_limit_run_on_onednn() -> None:
    """With a row limit, more rows give exactly oneDNN's prepacked output, up to it the AMX kernel's."""
    ops = _amx_kernels()
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).to(torch.bfloat16)
    hybrid, onednn, amx = AmxLinear(lin, ops, max_rows=8), PrepackedLinear(lin, batch_hint=32), AmxLinear(lin, ops)
    with torch.inference_mode():
        for rows in (1, 8, 9, 40):
            x = torch.randn(rows, 64).to(torch.bfloat16)
            assert torch.equal(hybrid(x), onednn(x) if rows > 8 else amx(x)), rows
    assert amx.packed_weight is None  # no oneDNN copy without a limit


def test_choice_rule_and_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on the AMX kernel up to the AMX kind's measured limit (`AMX_ROWS`), where the kernel runs;
    never for fp32 or without the kernels; INFERENCE_AMX_GEMM forces it on (every row count) or off
    (oneDNN, as before it), and a forced INFERENCE_PANEL_GEMM (its own A/B) turns the automatic choice off.
    The speculative plan follows: the AMX limit as its verify bound, none when forced on."""
    ops = _amx_kernels()
    monkeypatch.delenv(AMX_SWITCH, raising=False)
    monkeypatch.delenv(PANEL_SWITCH, raising=False)
    monkeypatch.setattr(cpu_linear, "cpu_kind", lambda: "avx512-amx")
    limit = AMX_ROWS[("avx512-amx", torch.bfloat16)]
    assert 0 < limit < ALL_ROWS
    assert amx_rows_limit(torch.bfloat16, ops) == panel_rows_limit(torch.bfloat16, ops) == limit
    assert row_invariant_plan(torch.bfloat16, ops) == (limit, limit)
    assert amx_rows_limit(torch.float32, ops) == 0 and amx_rows_limit(torch.bfloat16, None) == 0
    monkeypatch.setenv(AMX_SWITCH, "0")
    assert amx_rows_limit(torch.bfloat16, ops) == panel_rows_limit(torch.bfloat16, ops) == 0
    assert row_invariant_plan(torch.bfloat16, ops) == (0, 32)  # oneDNN's own bound again
    monkeypatch.setenv(AMX_SWITCH, "1")
    assert amx_rows_limit(torch.bfloat16, ops) == ALL_ROWS
    assert row_invariant_plan(torch.bfloat16, ops) == (ALL_ROWS, None)
    monkeypatch.setenv(AMX_SWITCH, "auto")
    monkeypatch.setenv(PANEL_SWITCH, "0")
    assert amx_rows_limit(torch.bfloat16, ops) == 0
    monkeypatch.delenv(PANEL_SWITCH)
    monkeypatch.setattr(cpu_linear, "cpu_kind", lambda: "avx512")  # no entry: the panels' rule, not AMX
    assert amx_rows_limit(torch.bfloat16, ops) == 0


def test_prepack_picks_the_amx_kernel_for_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the rule, a bf16 model's linears become `AmxLinear`s with the limit (a oneDNN copy beside
    them), an fp32 model's stay on the panels."""
    ops = _amx_kernels()
    monkeypatch.delenv(AMX_SWITCH, raising=False)
    monkeypatch.delenv(PANEL_SWITCH, raising=False)
    monkeypatch.setattr(cpu_linear, "cpu_kind", lambda: "avx512-amx")
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 16, bias=False)).to(torch.bfloat16)
    limit = panel_rows_limit(torch.bfloat16, ops)
    assert prepack_linears(model, panel_ops=ops, panel_rows=limit) == 2
    assert all(isinstance(m, AmxLinear) and m.max_rows == limit and m.packed_weight is not None for m in model)
    fp32 = nn.Sequential(nn.Linear(64, 32))
    prepack_linears(fp32, panel_ops=ops, panel_rows=64)
    assert isinstance(fp32[0], PanelLinear)


def _engine_tokens(path: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[AmxLinear]]:
    """Greedy bf16 tokens of a fresh engine and its AMX linears."""
    from inference.engine import LLMEngine, SamplingParams

    engine = LLMEngine(path, num_blocks=64, dtype="bfloat16")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    amx = [m for m in engine.model.modules() if isinstance(m, AmxLinear)]
    return [r.token_ids for r in engine.generate(prompts, params)], amx


@pytest.mark.skipif(not prepacked_linear_available(torch.bfloat16, CPU), reason="oneDNN has no bf16 kernels here")
def test_engine_on_amx_generates_onednns_tokens(llama_variant: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole bf16 engine (biases, a tied LM head) on the AMX kernel at every row count, and under the
    rule (prefill past the limit on oneDNN), gives oneDNN's greedy tokens (bf16 rounding apart, the tiny
    model's logits are well separated)."""
    _amx_kernels()
    monkeypatch.setattr(cpu_linear, "cpu_kind", lambda: "avx512-amx")
    monkeypatch.delenv(PANEL_SWITCH, raising=False)
    monkeypatch.setenv(AMX_SWITCH, "0")
    reference, none = _engine_tokens(llama_variant.path, llama_variant.prompts)
    assert none == []
    monkeypatch.setenv(AMX_SWITCH, "1")
    everywhere, amx = _engine_tokens(llama_variant.path, llama_variant.prompts)
    assert amx and all(m.max_rows is None for m in amx)
    assert everywhere == reference
    monkeypatch.delenv(AMX_SWITCH)
    by_rule, amx = _engine_tokens(llama_variant.path, llama_variant.prompts)
    assert amx and all(m.max_rows == AMX_ROWS[("avx512-amx", torch.bfloat16)] for m in amx)
    assert by_rule == reference
