"""The panel GEMM's linears (csrc/panel_gemm*.cpp, cpu_linear.PanelLinear): fp32 equal to F.linear to float
rounding at every row count and column tail, bf16 within one bf16 rounding of the exact sum, the choice
rule per CPU kind and row count, and whole engines on the panels generating oneDNN's greedy tokens.

The bf16 kernel exists only in builds for CPUs with AVX512-BF16: its tests skip elsewhere, naming why."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from inference.engine.amx_linear import amx_kernel_available
from inference.engine.cpu_linear import (
    ALL_ROWS,
    AMX_ROWS,
    AMX_SWITCH,
    ONEDNN_MIN_ROWS,
    PANEL_ROWS,
    PANEL_SWITCH,
    PanelLinear,
    PrepackedLinear,
    amx_rows_limit,
    cpu_family,
    cpu_kind,
    linear_weight_bytes,
    panel_rows_limit,
    panel_rows_with_memory,
    prepacked_linear_available,
)

from .conftest import TinyModel

CPU = torch.device("cpu")
# Tiles of 4 / 8 / 16 / 12 rows and their tails, one panel group and more.
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 23, 24, 25, 64, 70]
# 33: two whole panels and one of a single column (no group of 2 or 4 panels); 200: 13 panels (groups of
# 4 and 2 with panels left over, the last partial).
OUT_FEATURES = [33, 200]


def _kernels():  # type: ignore[no-untyped-def]
    from inference.engine.cpu_kernels import load_kernels

    ops = load_kernels()
    if ops is None:
        pytest.skip("CPU kernels unavailable here (no compiler or the build failed)")
    return ops


def _bf16_kernels():  # type: ignore[no-untyped-def]
    ops = _kernels()
    if "bfloat16" not in ops.panel_variants():
        pytest.skip(f"no bf16 panel kernel on this CPU (needs AVX512-BF16; this build: {ops.panel_variants()})")
    return ops


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features", OUT_FEATURES)
def test_fp32_panel_linear_close_to_linear(bias: bool, rows: int, out_features: int) -> None:
    """fp32: each output a sequential fp32 FMA sum over k, as oneDNN's and MKL's: equal to float rounding."""
    ops = _kernels()
    torch.manual_seed(rows)
    lin = nn.Linear(96, out_features, bias=bias)
    packed = PanelLinear(lin, ops)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x.view(1, rows, 96)), lin(x).view(1, rows, out_features),
                                   atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(packed(x[:, ::2].repeat(1, 2)), lin(x[:, ::2].repeat(1, 2)), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 33), (97, 200), (576, 200)])
def test_bf16_panel_linear_within_one_rounding(bias: bool, rows: int, in_features: int, out_features: int) -> None:
    """bf16 (an odd in_features too: the last k pairs with 0): products of bf16 inputs summed in fp32 and
    rounded to bf16 once, so each output is within one bf16 rounding (2^-8 relative) of the fp32 sum of
    the same bf16 inputs; oneDNN's bf16 output is too."""
    ops = _bf16_kernels()
    torch.manual_seed(rows + in_features)
    lin = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    packed = PanelLinear(lin, ops)
    x = torch.randn(rows, in_features).to(torch.bfloat16)
    exact = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    with torch.inference_mode():
        got = packed(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-4)
        torch.testing.assert_close(packed(x.view(1, rows, in_features)), got.view(1, rows, out_features),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_match_row_by_row(dtype: torch.dtype) -> None:
    """A prefill-sized input of 150 rows (12-row tiles and a tail of 6) over 2,048 inputs gives the same
    rows as the kernel run on each row alone (its 4-row tile), and F.linear's result."""
    ops = _bf16_kernels() if dtype == torch.bfloat16 else _kernels()
    torch.manual_seed(7)
    lin = nn.Linear(2048, 40, bias=True).to(dtype)
    packed = PanelLinear(lin, ops)
    x = torch.randn(150, 2048).to(dtype)
    with torch.inference_mode():
        got = packed(x)
        one_by_one = torch.cat([packed(x[i : i + 1]) for i in range(x.shape[0])])
        exact = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    # The same sums in the same order whatever the tile: equal up to the last fp32 rounding's ulp.
    torch.testing.assert_close(got.float(), one_by_one.float(), rtol=2**-7 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-3 if dtype == torch.bfloat16 else 1e-5)
    torch.testing.assert_close(got.float(), exact, rtol=2**-8 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-3 if dtype == torch.bfloat16 else 1e-4)


def test_panel_linear_refuses_mismatched_inputs() -> None:
    ops = _kernels()
    panels = ops.pack_panels(torch.randn(40, 24))
    with pytest.raises(RuntimeError, match="panels do not match"):
        ops.panel_linear(torch.randn(2, 32), panels, 40)
    with pytest.raises(RuntimeError, match="panels do not match"):
        ops.panel_linear(torch.randn(2, 24), panels, 60)
    with pytest.raises(RuntimeError, match="bias"):
        ops.panel_linear(torch.randn(2, 24), panels, 40, torch.randn(39))
    with pytest.raises(RuntimeError, match="dtype"):
        ops.panel_linear(torch.randn(2, 24).to(torch.bfloat16), panels, 40)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.pack_panels(torch.randn(40, 24).half())
    if "bfloat16" not in ops.panel_variants():
        with pytest.raises(RuntimeError, match="AVX512-BF16"):
            ops.pack_panels(torch.randn(40, 24).to(torch.bfloat16))


def test_panel_variants_follow_the_cpu() -> None:
    """The build's kernels are the CPU's: 16-wide fp32 with AVX-512, bf16 panels with AVX512-BF16."""
    ops = _kernels()
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    variants = ops.panel_variants()
    assert variants[0] == ("float32x16" if "avx512f" in flags else "float32x8")
    assert ("bfloat16" in variants) == ("avx512_bf16" in flags and "avx512f" in flags)


def test_choice_rule_per_cpu_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Panels up to the measured row limit of this CPU kind and dtype; none without the kernels or a
    bf16 kernel; the switch forces every row count on or off."""
    ops = _kernels()
    monkeypatch.delenv(PANEL_SWITCH, raising=False)
    assert panel_rows_limit(torch.float32, None) == 0
    assert panel_rows_limit(torch.float16, ops) == 0
    kind = cpu_kind()
    assert panel_rows_limit(torch.float32, ops) == PANEL_ROWS.get((kind, torch.float32), 0)
    bf16 = PANEL_ROWS.get((kind, torch.bfloat16), 0) if "bfloat16" in ops.panel_variants() else 0
    amx = amx_rows_limit(torch.bfloat16, ops)  # bf16 on the AMX-tile GEMM instead (test_amx_linear.py)
    assert panel_rows_limit(torch.bfloat16, ops) == (amx or bf16)
    if kind == "avx2":
        assert panel_rows_limit(torch.float32, ops) == ALL_ROWS
    if kind == "avx512":  # the AMD EPYC Zen 4 figures: decode batches on the panels, prefill on oneDNN
        assert panel_rows_limit(torch.float32, ops) == 64
        assert bf16 in (0, 64)
    if kind == "avx512-zen5":  # Zen 5: prefill chunks up to 512 rows (bf16) / 256 (fp32) on the panels too
        assert panel_rows_limit(torch.float32, ops) == 256
        assert bf16 == 512
    if kind == "avx512-amx":  # Intel Xeon with AMX: no bf16 panels; the AMX-tile GEMM up to 64 rows
        assert panel_rows_limit(torch.float32, ops) == 64
        assert bf16 == 0
        assert amx == (AMX_ROWS[(kind, torch.bfloat16)] if amx_kernel_available(ops) else 0)
    monkeypatch.setenv(PANEL_SWITCH, "0")
    assert panel_rows_limit(torch.float32, ops) == panel_rows_limit(torch.bfloat16, ops) == 0
    monkeypatch.setenv(PANEL_SWITCH, "1")
    assert panel_rows_limit(torch.float32, ops) == ALL_ROWS
    assert panel_rows_limit(torch.bfloat16, ops) == (ALL_ROWS if "bfloat16" in ops.panel_variants() else 0)


def test_cpu_kind_sets_amx_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """AVX-512 CPUs with AMX tiles are their own kind: bf16 never on the panels (2-11x slower than
    oneDNN's AMX kernel at 16-256 rows there, and as fast as oneDNN padded to 4 rows at 1-3) but on the
    engine's AMX-tile GEMM up to 64 rows where it runs (oneDNN's AMX kernel above, and without it), fp32
    on the panels up to 64 rows."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr("inference.engine.cpu_linear._cpu_flags", lambda: {"avx512f", "amx_tile", "amx_bf16"})
    assert cpu_kind() == "avx512-amx"
    assert PANEL_ROWS[("avx512-amx", torch.float32)] == 64
    assert ("avx512-amx", torch.bfloat16) not in PANEL_ROWS
    assert ONEDNN_MIN_ROWS[("avx512-amx", torch.bfloat16)] == 4
    monkeypatch.delenv(PANEL_SWITCH, raising=False)
    ops = _kernels()
    assert panel_rows_limit(torch.float32, ops) == 64
    monkeypatch.delenv(AMX_SWITCH, raising=False)
    amx = AMX_ROWS[("avx512-amx", torch.bfloat16)] if amx_kernel_available(ops) else 0
    assert panel_rows_limit(torch.bfloat16, ops) == amx
    monkeypatch.setattr("inference.engine.cpu_linear._cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    monkeypatch.setattr("inference.engine.cpu_linear.cpu_family", lambda: ("AuthenticAMD", 25))
    assert cpu_kind() == "avx512"


def test_cpu_kind_sets_zen5_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """AMD family 26 (Zen 5: a full 512-bit datapath) is its own kind with its own measured row limits;
    Zen 4 (family 25) and other vendors' AVX-512 CPUs without AMX stay "avx512"."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr("inference.engine.cpu_linear._cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    for vendor, family, kind in [("AuthenticAMD", 26, "avx512-zen5"), ("AuthenticAMD", 25, "avx512"),
                                 ("GenuineIntel", 6, "avx512")]:
        monkeypatch.setattr("inference.engine.cpu_linear.cpu_family", lambda v=vendor, f=family: (v, f))
        assert cpu_kind() == kind
    assert ("avx512-zen5", torch.bfloat16) in PANEL_ROWS and ("avx512-zen5", torch.float32) in PANEL_ROWS


def test_cpu_family_reads_this_machine() -> None:
    """The vendor and family of this machine's /proc/cpuinfo, as the kernel choice reads them."""
    fields: dict[str, str] = {}
    for line in open("/proc/cpuinfo"):
        key, _, value = line.partition(":")
        if key.strip() in ("vendor_id", "cpu family"):
            fields.setdefault(key.strip(), value.strip())
    if not fields:
        pytest.skip("no /proc/cpuinfo vendor or family here")
    assert cpu_family() == (fields.get("vendor_id", ""), int(fields.get("cpu family", "0")))


@pytest.mark.skipif(not prepacked_linear_available(torch.float32, CPU), reason="torch built without oneDNN")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_above_the_limit_run_on_onednn(dtype: torch.dtype) -> None:
    """With a row limit, more rows give exactly oneDNN's prepacked output, up to it the panel kernel's."""
    ops = _bf16_kernels() if dtype == torch.bfloat16 else _kernels()
    if not prepacked_linear_available(dtype, CPU):
        pytest.skip("oneDNN has no bf16 kernels on this CPU")
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).to(dtype)
    hybrid = PanelLinear(lin, ops, max_rows=8)
    onednn, panels = PrepackedLinear(lin, batch_hint=32), PanelLinear(lin, ops)
    with torch.inference_mode():
        for rows in (1, 8, 9, 40):
            x = torch.randn(rows, 64).to(dtype)
            expected = onednn(x) if rows > 8 else panels(x)
            assert torch.equal(hybrid(x), expected)
    assert PanelLinear(lin, ops).packed_weight is None  # no oneDNN copy without a limit


def _engine_tokens(path: str, prompts: list[list[int]], dtype: str) -> tuple[list[list[int]], list[PanelLinear]]:
    """Greedy tokens of a fresh engine and its panel linears."""
    from inference.engine import LLMEngine, SamplingParams

    engine = LLMEngine(path, num_blocks=64, dtype=dtype)
    assert engine.model.lm_head.weight is engine.model.embed_tokens.weight  # the tie is kept
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    panels = [m for m in engine.model.modules() if isinstance(m, PanelLinear)]
    return [r.token_ids for r in engine.generate(prompts, params)], panels


def test_a_large_model_keeps_one_copy_of_its_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oneDNN copy for prefill-sized inputs is kept only while the linear weights fit the budget;
    past it the panels serve every row count (and 0 / ALL_ROWS limits are left as they are)."""
    from inference.engine import cpu_linear

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16, bias=False))
    assert linear_weight_bytes(model) == (64 * 32 + 32 * 16) * 4  # weights only, not biases
    monkeypatch.setattr(cpu_linear, "DUAL_COPY_MAX_BYTES", linear_weight_bytes(model))
    assert panel_rows_with_memory(64, model) == 64
    monkeypatch.setattr(cpu_linear, "DUAL_COPY_MAX_BYTES", linear_weight_bytes(model) - 1)
    assert panel_rows_with_memory(64, model) == ALL_ROWS
    assert panel_rows_with_memory(0, model) == 0 and panel_rows_with_memory(ALL_ROWS, model) == ALL_ROWS
    ops = _kernels()
    packed = copy_of(model)
    cpu_linear.prepack_linears(packed, panel_ops=ops, panel_rows=panel_rows_with_memory(64, packed))
    linears = [m for m in packed.modules() if isinstance(m, PanelLinear)]
    assert len(linears) == 2 and all(m.max_rows is None and m.packed_weight is None for m in linears)
    x = torch.randn(100, 64)  # above the CPU kind's limit: still the panels, still F.linear's answer
    torch.testing.assert_close(packed(x), model(x), rtol=1e-5, atol=1e-5)


def copy_of(model: nn.Module) -> nn.Module:
    """A deep copy (prepack_linears replaces the linears in place)."""
    import copy

    return copy.deepcopy(model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_panels_generates_onednns_tokens(llama_variant: TinyModel, monkeypatch: pytest.MonkeyPatch,
                                                   dtype: str) -> None:
    """A whole engine (biases, a tied LM head) with its linears on the panel kernel at every row count,
    and with the rule's row limit (prefill on oneDNN, decode on the panels), gives the greedy tokens of
    the same engine on oneDNN alone: fp32 to float rounding, bf16 within its rounding (the tiny model's
    logits are well separated, so no token flips)."""
    if dtype == "bfloat16":
        _bf16_kernels()
        if not prepacked_linear_available(torch.bfloat16, CPU):
            pytest.skip("oneDNN has no bf16 kernels on this CPU")
    else:
        _kernels()
    prompts = llama_variant.prompts
    monkeypatch.setenv(PANEL_SWITCH, "0")
    reference, none = _engine_tokens(llama_variant.path, prompts, dtype)
    assert none == []
    monkeypatch.setenv(PANEL_SWITCH, "1")
    everywhere, panels = _engine_tokens(llama_variant.path, prompts, dtype)
    assert panels and all(p.max_rows is None for p in panels)
    assert everywhere == reference
    monkeypatch.delenv(PANEL_SWITCH)
    limit = panel_rows_limit(getattr(torch, dtype), _kernels())
    if 0 < limit < ALL_ROWS and amx_rows_limit(getattr(torch, dtype), _kernels()) == 0:  # AMX: test_amx_linear
        by_rule, panels = _engine_tokens(llama_variant.path, prompts, dtype)
        assert panels and all(p.max_rows == limit for p in panels)
        assert by_rule == reference
