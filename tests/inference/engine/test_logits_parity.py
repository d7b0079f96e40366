"""Logits of our engine (batched prefill + decode steps over the paged cache) against transformers run
one sequence at a time: fp32 within float rounding, bf16 within bf16 rounding."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from inference.engine import LLMEngine, SamplingParams

from .conftest import TinyModel
from .helpers import drain

STEPS = 5
SMOLLM2 = Path(__file__).resolve().parents[3] / "model_cache" / "SmolLM2-135M-Instruct"


def engine_logits(engine: LLMEngine, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], Any]:
    """Greedy-run `prompts` as one batch; returns the logits of every step with rows in prompt order,
    and the generated tokens. Prompts must have distinct lengths (rows are ordered by length)."""
    captured: list[torch.Tensor] = []
    hook = engine.model.register_forward_hook(lambda _m, _i, out: captured.append(out.detach().clone()))
    try:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
        results = drain(engine)
    finally:
        hook.remove()
    by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    inverse = torch.tensor([by_length.index(i) for i in range(len(prompts))])
    return [step[inverse] for step in captured], [results[f"r{i}"].token_ids for i in range(len(prompts))]


@torch.inference_mode()
def reference_logits(hf: Any, prompt: list[int], generated: list[int], steps: int) -> list[torch.Tensor]:
    """transformers' fp32 logits at the position of each of our steps (teacher-forced on our tokens)."""
    ids = torch.tensor([prompt + generated[: steps - 1]])
    logits = hf(input_ids=ids).logits[0].float()
    return [logits[len(prompt) - 1 + t] for t in range(steps)]


def max_diff(engine: LLMEngine, hf: Any, prompts: list[list[int]]) -> float:
    """Largest |ours - transformers| over all rows and steps."""
    ours, tokens = engine_logits(engine, prompts, STEPS)
    assert len(ours) == STEPS  # one prefill + STEPS - 1 decode steps, each one batch
    worst = 0.0
    for i, prompt in enumerate(prompts):
        ref = reference_logits(hf, prompt, tokens[i], STEPS)
        for t in range(STEPS):
            worst = max(worst, float((ours[t][i] - ref[t]).abs().max()))
    return worst


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama_variant"])
def test_fp32_logits_match_transformers(name: str, request: pytest.FixtureRequest) -> None:
    model: TinyModel = request.getfixturevalue(name)
    engine = LLMEngine(model.path, block_size=16, num_blocks=64)
    assert max_diff(engine, model.hf_model.float(), model.prompts) < 1e-4


def test_bf16_logits_close_to_transformers(llama: TinyModel) -> None:
    """bf16 weights and KV: the error is bf16's (8 mantissa bits), not a bug's (which shows as O(1))."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, dtype="bfloat16")
    assert engine.kv_cache.dtype == torch.bfloat16 and engine.kv_cache.layout()["dtype"] == "bfloat16"
    with torch.inference_mode():
        scale = max(float(llama.hf_model(input_ids=torch.tensor([p])).logits.abs().max()) for p in llama.prompts)
    diff = max_diff(engine, llama.hf_model.float(), llama.prompts)
    assert 0 < diff < 0.05 * scale


@pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="SmolLM2 not prepared (make demo-model)")
def test_smollm2_logits_match_transformers() -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(SMOLLM2), dtype=torch.float32).eval()
    engine = LLMEngine(str(SMOLLM2), block_size=16, num_blocks=64, max_num_seqs=4)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (5, 23, 70)]
    assert max_diff(engine, hf, prompts) < 5e-4
