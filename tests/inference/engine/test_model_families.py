"""Every supported model family against transformers: a small random-weight model built from the
family's real configuration shape (2 layers, its features switched on: RoPE scaling, sliding windows,
q/k norms, fused q/k/v, a head_dim that is not hidden / heads), saved with save_pretrained and the
tiny tokenizer, loaded by our engine; logits after the prefill and after each decode step match
transformers' in fp32 (with the CPU kernels and with torch ops), and greedy tokens are equal.

Norm weights are randomised too (transformers starts them at one), so a q/k norm that was not loaded,
or a (1 + w) norm read as w, shows as a logits difference.
"""
from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from inference.engine import LLMEngine, ModelConfig, SamplingParams
from inference.engine.dtypes import cpu_has_native_bf16

from .conftest import NEW_TOKENS, PROMPT_LENGTHS, TinyModel, _common_config, _make_prompts
from .test_logits_parity import STEPS, engine_logits, max_diff, reference_logits

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _llama31(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Llama 3.1's shape: llama3 RoPE scaling (original context 32, so the prompts reach past it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return LlamaForCausalLM, LlamaConfig(**cfg)


def _linear_rope(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Llama with linear RoPE scaling (position interpolation by 4)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg["rope_parameters"] = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    return LlamaForCausalLM, LlamaConfig(**cfg)


def _mistral(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Mistral v0.1's shape: a sliding window on every layer (16 here: the 40- and 70-token prompts
    cross it), and Mistral Nemo's head_dim that is not hidden / heads."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg.update(sliding_window=16, head_dim=32)
    return MistralForCausalLM, MistralConfig(**cfg)


def _mistral_full(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Mistral v0.2+: `sliding_window: null`."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg.update(sliding_window=None)
    return MistralForCausalLM, MistralConfig(**cfg)


def _qwen3(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Qwen3's shape: q/k norms, head_dim 32 with hidden 64 and 4 heads, untied head, theta 1e6."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg.update(head_dim=32, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return Qwen3ForCausalLM, Qwen3Config(**cfg)


def _qwen3_window(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Qwen3 with `use_sliding_window` from layer 1 on (`max_window_layers` 1), window 24."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg.update(head_dim=32, use_sliding_window=True, sliding_window=24, max_window_layers=1)
    return Qwen3ForCausalLM, Qwen3Config(**cfg)


def _phi3(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Phi-3-mini-4k's shape: fused qkv_proj and gate_up_proj, MHA, a sliding window of 2047 of 4096
    positions (scaled: 31 of 512)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg.update(num_key_value_heads=4, sliding_window=31)
    return Phi3ForCausalLM, Phi3Config(**cfg)


def _gemma2(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Gemma 2's shape: sliding window on every other layer (16), attention and final soft-capping
    (scaled down to 2 and 5 so that the caps bend these logits), query_pre_attn_scalar not head_dim,
    head_dim 32 with hidden 64, GeGLU, tied embeddings."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg.update(sliding_window=16, head_dim=32, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
               final_logit_softcapping=5.0, tie_word_embeddings=True)
    # Eager attention: transformers versions that run Gemma 2 on SDPA drop the attention soft cap.
    cfg["attn_implementation"] = "eager"
    return Gemma2ForCausalLM, Gemma2Config(**cfg)


def _gemma3(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """Gemma 3's shape: q/k norms, a sliding layer (window 16, local RoPE base 10k) and a full layer
    (base 1e6, linear RoPE scaling by 8 as in the 4B+ models), no soft-capping."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg.update(sliding_window=16, head_dim=32, query_pre_attn_scalar=32, tie_word_embeddings=True,
               layer_types=["sliding_attention", "full_attention"],
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    return Gemma3ForCausalLM, Gemma3TextConfig(**cfg)


FAMILIES: dict[str, Callable[[dict[str, Any]], tuple[Any, Any]]] = {
    "llama31": _llama31,
    "llama_linear_rope": _linear_rope,
    "mistral": _mistral,
    "mistral_full": _mistral_full,
    "qwen3": _qwen3,
    "qwen3_window": _qwen3_window,
    "phi3": _phi3,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
}


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation of one prompt (batch 1). The attention mask is given: without
    one, generate() masks every prompt token equal to the pad id out of attention."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return list(out[0, len(prompt) :].tolist())


@torch.inference_mode()
def _randomise_norms(model: Any, generator: torch.Generator) -> None:
    """Norm weights around one instead of exactly one (see the module docstring)."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))


def build_family(root: Path, name: str, tokenizer_dir: Path, seed: int) -> TinyModel:
    """Build, save (with the tiny tokenizer) and reference-run the family `name`."""
    model_cls, config = FAMILIES[name](_common_config())
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    _randomise_norms(model, torch.Generator().manual_seed(seed))
    path = root / name
    model.save_pretrained(path, safe_serialization=True)
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, path / file)
    prompts = _make_prompts(seed + 1, PROMPT_LENGTHS)
    return TinyModel(str(path), model, prompts, [hf_greedy(model, p) for p in prompts])


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           tiny_model_dir: Path) -> TinyModel:
    """One family's tiny checkpoint and transformers' references."""
    root = tmp_path_factory.mktemp("families")
    return build_family(root, request.param, tiny_model_dir, 100 + sorted(FAMILIES).index(request.param))


@pytest.fixture
def torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built in this test run on torch ops, as with INFERENCE_CPU_KERNELS=0 (the switch itself
    is read once per process)."""
    monkeypatch.setattr("inference.engine.model_runner.load_kernels", lambda: None)


def test_fp32_logits_match(family: TinyModel) -> None:
    """Prefill and four decode steps, batched, with the CPU kernels where they build."""
    engine = LLMEngine(family.path, block_size=16, num_blocks=64)
    assert max_diff(engine, family.hf_model.float(), family.prompts) < 1e-4


def test_fp32_logits_match_on_torch_ops(family: TinyModel, torch_ops: None) -> None:
    """The same on the torch path (what a GPU runs: decode buckets instead of the kernel's slots)."""
    engine = LLMEngine(family.path, block_size=16, num_blocks=64)
    assert engine.model.cpu_ops is None
    assert max_diff(engine, family.hf_model.float(), family.prompts) < 1e-4


def test_greedy_tokens_equal(family: TinyModel) -> None:
    """24 greedy tokens of each prompt, all four prompts in one batch."""
    engine = LLMEngine(family.path, block_size=16, num_blocks=64, max_num_seqs=8)
    results = engine.generate(family.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                             ignore_eos=True))
    assert [r.token_ids for r in results] == family.greedy


def bf16_error_bound(family: TinyModel, tokens: list[list[int]]) -> float:
    """What bf16 rounding alone costs here: transformers' own bf16 logits against its fp32 ones on
    our tokens, tripled. Random weights with randomised norms make bf16's error a few percent of the
    logits (more than a fixed share of them allows in some families), and ours rounds in other places:
    Gemma's (1 + w) norm weights are rounded to bf16 once folded (measured on an H200: ours 0.61,
    transformers' own 0.27); a bug shows as an error the size of the logits (9.6 there)."""
    hf32 = family.hf_model.float()
    hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
    worst = 0.0
    for prompt, generated in zip(family.prompts, tokens, strict=True):
        ref = reference_logits(hf32, prompt, generated, STEPS)
        own = reference_logits(hf16, prompt, generated, STEPS)
        worst = max(worst, max(float((a - b).abs().max()) for a, b in zip(own, ref, strict=True)))
    return 3 * worst


def engine_diff(engine: LLMEngine, family: TinyModel) -> tuple[float, list[list[int]]]:
    """Largest |ours - transformers fp32| over every row and step (on any device), and our tokens."""
    ours, tokens = engine_logits(engine, family.prompts, STEPS)
    hf = family.hf_model.float()
    worst = 0.0
    for i, prompt in enumerate(family.prompts):
        ref = reference_logits(hf, prompt, tokens[i], STEPS)
        worst = max(worst, max(float((ours[t][i].float().cpu() - ref[t]).abs().max()) for t in range(STEPS)))
    return worst, tokens


def test_chunked_and_cached_prefill_match(family: TinyModel) -> None:
    """Prefills over cached keys (sliding windows cut through them): the 70-token prompt in chunks of
    32, then a prompt sharing its first three blocks, which come from the prefix cache."""
    engine = LLMEngine(family.path, block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    long = family.prompts[3]
    assert engine.generate([long], greedy)[0].token_ids == family.greedy[3]
    variant = long[:48] + family.prompts[1]
    assert engine.generate([variant], greedy)[0].token_ids == hf_greedy(family.hf_model, variant)
    assert engine.prefix_cache_hit_rate > 0


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no native bf16")
def test_bf16_logits_close(family: TinyModel) -> None:
    """bf16 weights and KV: within three times transformers' own bf16 error."""
    engine = LLMEngine(family.path, block_size=16, num_blocks=64, dtype="bfloat16")
    worst, tokens = engine_diff(engine, family)
    assert 0 < worst < bf16_error_bound(family, tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_fp32_logits_and_tokens_match(family: TinyModel) -> None:
    """On a GPU (SDPA over decode buckets, no CPU kernels): fp32 logits within float rounding, greedy
    tokens equal."""
    engine = LLMEngine(family.path, block_size=16, num_blocks=64, max_num_seqs=8, device="cuda", dtype="float32")
    worst, _ = engine_diff(engine, family)
    assert worst < 1e-3
    results = engine.generate(family.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [r.token_ids for r in results] == family.greedy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_bf16_logits_close(family: TinyModel) -> None:
    """On a GPU in bf16: within three times transformers' own bf16 error."""
    engine = LLMEngine(family.path, block_size=16, num_blocks=64, max_num_seqs=8, device="cuda", dtype="bfloat16")
    worst, tokens = engine_diff(engine, family)
    bound = bf16_error_bound(family, tokens)
    print(f"cuda bf16 {family.path}: ours {worst:.3g}, bound {bound:.3g}")
    assert 0 < worst < bound


BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 2, "max_position_embeddings": 64}


@pytest.mark.parametrize(("extra", "message"), [
    ({"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.75}, "partial_rotary_factor"),
    ({"architectures": ["Phi3ForCausalLM"],
      "rope_parameters": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}}, "longrope"),
    ({"architectures": ["MistralForCausalLM"], "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"architectures": ["Qwen3ForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "linear"}}, "missing 'factor'"),
    ({"architectures": ["Gemma2ForCausalLM"], "hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 16, "layer_types": ["chunked_attention"] * 2},
     "layer_types"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 0}, "sliding_window must be positive"),
    ({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}, "FalconForCausalLM"),
])
def test_unsupported_features_are_refused(extra: dict[str, Any], message: str) -> None:
    """A feature the engine does not implement fails at load, naming the feature."""
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **extra})


def test_family_features_are_read() -> None:
    """Each family's flags come from its config.json fields (real checkpoints' spellings)."""
    mistral = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 16})
    assert mistral.family == "mistral" and [mistral.layer_window(i) for i in range(2)] == [16, 16]
    wide = ModelConfig.from_dict({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert wide.sliding_window is None  # never drops a key within max_position_embeddings
    qwen3 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 16,
                                   "sliding_window": 8, "use_sliding_window": False})
    assert qwen3.qk_norm and qwen3.head_dim == 16 and not qwen3.qkv_bias and qwen3.sliding_window is None
    qwen2 = ModelConfig.from_dict({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 8,
                                   "use_sliding_window": True, "max_window_layers": 1})
    assert qwen2.qkv_bias and [qwen2.layer_window(i) for i in range(2)] == [None, 8]
    phi3 = ModelConfig.from_dict({**BASE, "architectures": ["Phi3ForCausalLM"], "sliding_window": 31,
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                      "partial_rotary_factor": 1.0}})
    assert phi3.family == "phi3" and phi3.sliding_window == 31 and phi3.rope_scaling is None
    gemma2 = ModelConfig.from_dict({**BASE, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 16,
                                    "query_pre_attn_scalar": 24, "attn_logit_softcapping": 50.0,
                                    "final_logit_softcapping": 30.0})
    assert gemma2.hidden_act == "gelu_tanh" and gemma2.tie_word_embeddings
    assert gemma2.gemma is not None and gemma2.gemma.attn_logit_softcapping == 50.0
    assert [gemma2.layer_window(i) for i in range(2)] == [16, None]
    gemma3 = ModelConfig.from_dict({**BASE, "model_type": "gemma3_text", "sliding_window": 16, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}})
    assert gemma3.qk_norm and gemma3.rope_theta == 1e6 and gemma3.rope_scaling is not None
    assert gemma3.gemma is not None and gemma3.gemma.rope_local_theta == 1e4
    assert gemma3.layer_types == ["sliding_attention", "sliding_attention"]
