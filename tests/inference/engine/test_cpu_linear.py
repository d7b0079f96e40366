"""Prepacked oneDNN linears (cpu_linear.py): same outputs as nn.Linear, used by CPU engines (the panel
kernel's linears: test_cpu_linear_panels.py)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from inference.engine.cpu_linear import PANEL_SWITCH, PrepackedLinear, prepack_linears, prepacked_linear_available

from .conftest import TinyModel

CPU = torch.device("cpu")
ONEDNN = prepacked_linear_available(torch.float32, CPU)
pytestmark = pytest.mark.skipif(not ONEDNN, reason="torch built without oneDNN")
# oneDNN's bf16 kernels need AVX-512 BW/VL/DQ or AVX-NE-CONVERT; AVX2-only CPUs run bf16 on F.linear.
needs_bf16 = pytest.mark.skipif(not prepacked_linear_available(torch.bfloat16, CPU),
                                reason="oneDNN has no bf16 kernels on this CPU")


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_prepacked_linear_equals_linear(bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed = PrepackedLinear(lin, batch_hint=32)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), lin(x))
        assert torch.equal(packed(x.view(1, rows, 96)), lin(x).view(1, rows, 160))  # leading dims kept


@needs_bf16
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_padded_to_the_minimum_are_the_rows_alone(dtype: torch.dtype) -> None:
    """A call with fewer rows than oneDNN's fast path takes (ONEDNN_MIN_ROWS: 4 for bf16 on AMX) is padded
    with zero rows: each real row bit for bit what the unpadded call gives."""
    torch.manual_seed(0)
    lin = nn.Linear(576, 1536, bias=True).to(dtype)
    padded, plain = PrepackedLinear(lin, batch_hint=32), PrepackedLinear(lin, batch_hint=32)
    padded.min_rows, plain.min_rows = 4, 1
    x = torch.randn(5, 576, dtype=dtype)
    with torch.inference_mode():
        for rows in range(1, 6):
            assert torch.equal(padded(x[:rows]), plain(x[:rows])), rows


def test_prepack_keeps_parameters_and_ties() -> None:
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50, bias=False))
    model[1].weight = model[0].weight  # a tied LM head
    assert prepack_linears(model) == 1
    head = model[1]
    assert isinstance(head, PrepackedLinear)
    assert head.weight is model[0].weight
    assert "1.weight" in model.state_dict() and "1.packed_weight" not in model.state_dict()


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fp32_prepacked_linear_close_to_linear(rows: int) -> None:
    """fp32 is prepacked too; oneDNN sums in another order than MKL, so equal to float rounding only."""
    assert prepacked_linear_available(torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    lin = nn.Linear(576, 1536)
    packed = PrepackedLinear(lin, batch_hint=32)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x), atol=2e-5, rtol=1e-5)


@needs_bf16
def test_bf16_engine_prepacks_and_generates_the_same_tokens(llama_variant: TinyModel,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Prepacking changes no output: greedy tokens equal those of the same bf16 engine with plain
    linears (llama_variant has biases and a tied LM head)."""
    from inference.engine import LLMEngine, SamplingParams

    monkeypatch.setenv(PANEL_SWITCH, "0")  # oneDNN's linears (not the panel kernel's) at every row count
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    packed = LLMEngine(llama_variant.path, num_blocks=64, dtype="bfloat16")
    assert any(isinstance(m, PrepackedLinear) for m in packed.model.modules())
    assert packed.model.lm_head.weight is packed.model.embed_tokens.weight
    got = [r.token_ids for r in packed.generate(llama_variant.prompts, params)]
    monkeypatch.setattr("inference.engine.model_runner.prepacked_linear_available", lambda *a: False)
    plain = LLMEngine(llama_variant.path, num_blocks=64, dtype="bfloat16")
    assert not any(isinstance(m, PrepackedLinear) for m in plain.model.modules())
    assert got == [r.token_ids for r in plain.generate(llama_variant.prompts, params)]


def test_bf16_prepacking_follows_onednn_bf16_support(llama_variant: TinyModel,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dtype bfloat16` builds and generates on every CPU: prepacked where oneDNN has bf16 kernels,
    plain `F.linear` where it has none (an AVX2-only CPU, where the reorder raises)."""
    from inference.engine import LLMEngine, SamplingParams

    monkeypatch.setenv(PANEL_SWITCH, "0")

    supported = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert prepacked_linear_available(torch.bfloat16, CPU) == supported
    engine = LLMEngine(llama_variant.path, num_blocks=64, dtype="bfloat16")
    assert any(isinstance(m, PrepackedLinear) for m in engine.model.modules()) == supported
    out = engine.generate(llama_variant.prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [len(r.token_ids) for r in out] == [4] * len(llama_variant.prompts)
