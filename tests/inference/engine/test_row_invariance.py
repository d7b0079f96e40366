"""Speculative decoding's linears compute each row as they would alone (cpu_linear.row_invariant_plan):
a verify step runs more rows than the decode step it replaces, so a row whose result depended on the
rows beside it would drift from plain decoding's greedy tokens, as bf16 on oneDNN's AMX kernel did past
32 rows (and on the panels at 1-4 rows beside oneDNN above) on the twelfth session's Xeon; and a prompt
must be computed with the plain engine's kernels, which panels at every row count did not do on the
thirteenth session's Zen 4 EPYC."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from inference.engine import LLMEngine, SpeculativeConfig, cpu_linear
from inference.engine.amx_linear import AmxLinear
from inference.engine.cpu_linear import (
    ALL_ROWS,
    AMX_SWITCH,
    ONEDNN_ROW_INVARIANT_ROWS,
    PANEL_ROWS,
    PANEL_SWITCH,
    PanelLinear,
    PrepackedLinear,
    prepack_linears,
    prepacked_linear_available,
    row_invariant_plan,
)

CPU = torch.device("cpu")


def _kernels():  # type: ignore[no-untyped-def]
    from inference.engine.cpu_kernels import load_kernels

    ops = load_kernels()
    if ops is None:
        pytest.skip("CPU kernels unavailable here (no compiler or the build failed)")
    return ops


def test_the_plan_per_cpu_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """AMX bf16: oneDNN alone, at most its stable row count a step; elsewhere the usual panel limit
    (so prompts run on the plain engine's kernels), verify steps within it; panels at every row count
    need no bound; a forced switch is obeyed (no row bound then)."""
    ops = _kernels()
    monkeypatch.delenv(PANEL_SWITCH, raising=False)
    monkeypatch.setenv(AMX_SWITCH, "0")  # oneDNN's AMX kernel (the engine's AMX GEMM: test_amx_linear.py)
    monkeypatch.setattr(cpu_linear, "cpu_kind", lambda: "avx512-amx")
    assert row_invariant_plan(torch.bfloat16, ops) == (0, ONEDNN_ROW_INVARIANT_ROWS[("avx512-amx", torch.bfloat16)])
    amx_fp32 = PANEL_ROWS[("avx512-amx", torch.float32)]
    assert row_invariant_plan(torch.float32, ops) == (amx_fp32, amx_fp32)  # fp32 panels on AMX up to 64 rows
    monkeypatch.setenv(PANEL_SWITCH, "0")
    assert row_invariant_plan(torch.bfloat16, ops) == (0, None)
    monkeypatch.setenv(PANEL_SWITCH, "1")
    assert row_invariant_plan(torch.float32, ops) == (ALL_ROWS, None)
    monkeypatch.setenv(PANEL_SWITCH, "auto")
    monkeypatch.setattr(cpu_linear, "cpu_kind", lambda: "avx512-zen5")
    bf16_panels = "bfloat16" in ops.panel_variants()
    zen5 = PANEL_ROWS[("avx512-zen5", torch.bfloat16)]
    assert row_invariant_plan(torch.bfloat16, ops) == ((zen5, zen5) if bf16_panels else (0, None))
    monkeypatch.setattr(cpu_linear, "cpu_kind", lambda: "avx2")
    assert row_invariant_plan(torch.float32, ops) == (ALL_ROWS, None)
    monkeypatch.setattr(cpu_linear, "cpu_kind", lambda: "sse4")  # no panel entry: no panels, no bound
    assert row_invariant_plan(torch.float32, ops) == (0, None)
    assert row_invariant_plan(torch.float16, ops) == (0, None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_speculative_engine_computes_a_prompt_with_the_plain_engines_kernels(tiny_model_dir: Path,
                                                                               dtype: str) -> None:
    """On this machine's CPU, every linear of a speculative engine gives a prefill-sized input (100 rows)
    the plain engine's bits, and verify steps stay within the rows its kernels compute alone. Panels at
    every row count under speculation gave a 100-token prompt other bits than the plain engine's
    oneDNN, and greedy tokens drifted (SmolLM2 bf16 on a Zen 4 EPYC, thirteenth session)."""
    plain = LLMEngine(str(tiny_model_dir), num_blocks=64, block_size=8, max_num_seqs=4, dtype=dtype)
    spec = LLMEngine(str(tiny_model_dir), num_blocks=64, block_size=8, max_num_seqs=4, dtype=dtype,
                     speculative=SpeculativeConfig(num_speculative_tokens=4))
    theirs = dict(spec.runner.model.named_modules())
    torch.manual_seed(0)
    compared = 0
    with torch.no_grad():
        for name, ours in plain.runner.model.named_modules():
            if not isinstance(ours, (PanelLinear, PrepackedLinear, AmxLinear)):
                continue
            other = theirs[name]
            assert type(other) is type(ours), name
            if isinstance(ours, (PanelLinear, AmxLinear)):
                assert isinstance(other, (PanelLinear, AmxLinear)) and other.max_rows == ours.max_rows, name
            x = torch.randn(100, ours.in_features, dtype=ours.weight.dtype)
            assert torch.equal(other(x), ours(x)), name
            compared += 1
    panel_rows = {m.max_rows for m in theirs.values() if isinstance(m, (PanelLinear, AmxLinear))}
    speculator = spec.speculator
    assert speculator is not None
    if panel_rows == {None}:  # panels at every row count: each row alone, no bound needed
        assert speculator.max_rows is None
    elif panel_rows:  # panels up to a limit, oneDNN above: verify steps within the limit
        assert speculator.max_rows in panel_rows
    assert compared > 0 or not prepacked_linear_available(plain.runner.dtype, CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linears_under_the_plan_compute_each_row_alone(dtype: torch.dtype) -> None:
    """On this machine's CPU: SmolLM2's MLP and LM-head shapes packed as the plan says give, for every
    row count up to its bound (80 where there is none), each row bit for bit what that row gives alone."""
    ops = _kernels()
    if not prepacked_linear_available(dtype, CPU):
        pytest.skip(f"no oneDNN {dtype} linears on this CPU")
    panel_rows, bound = row_invariant_plan(dtype, ops)
    top = bound or 80
    torch.manual_seed(0)
    for in_f, out_f in ((576, 1536), (1536, 576), (576, 4096)):
        model = nn.Sequential(nn.Linear(in_f, out_f, bias=False)).to(dtype)
        if panel_rows > 0:
            prepack_linears(model, panel_ops=ops, panel_rows=panel_rows)
        else:
            prepack_linears(model)
        x = torch.randn(top, in_f, dtype=dtype)
        with torch.no_grad():
            alone = torch.cat([model(x[i : i + 1]) for i in range(top)])
            for rows in sorted({1, 2, 4, 5, 8, 9, 16, 17, 31, top // 2, top - 1, top}):
                together = model(x[:rows])
                assert torch.equal(together, alone[:rows]), (in_f, out_f, rows, panel_rows, bound)


def test_the_amx_bound_holds_without_the_cpu_kernels(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's own row bound (AMX bf16) does not depend on the engine's kernels: a speculative engine
    with them turned off still caps its verify steps there, and one on any other CPU kind has no bound."""
    if not prepacked_linear_available(torch.bfloat16, CPU):
        pytest.skip("no oneDNN bf16 linears on this CPU")
    from inference.engine.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "_choose_kernels", lambda self, use_compile: None)  # no CPU kernels
    monkeypatch.delenv(PANEL_SWITCH, raising=False)
    monkeypatch.setattr(cpu_linear, "cpu_kind", lambda: "avx512-amx")

    def spec_engine() -> LLMEngine:
        return LLMEngine(str(tiny_model_dir), num_blocks=64, block_size=8, max_num_seqs=4, dtype="bfloat16",
                         speculative=SpeculativeConfig(num_speculative_tokens=4))

    engine = spec_engine()
    bound = ONEDNN_ROW_INVARIANT_ROWS[("avx512-amx", torch.bfloat16)]
    assert engine.runner.max_step_rows == bound
    assert engine.speculator is not None and engine.speculator.max_rows == bound
    monkeypatch.setattr(cpu_linear, "cpu_kind", lambda: "avx512")
    assert spec_engine().runner.max_step_rows is None
