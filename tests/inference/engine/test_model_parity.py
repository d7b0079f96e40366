"""Our model and batching produce transformers' greedy tokens exactly."""
from __future__ import annotations

import os

import pytest

from inference.engine import LLMEngine, ModelConfig, SamplingParams

from .conftest import NEW_TOKENS, TinyModel
from .helpers import absorb, drain

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_batched_greedy_matches_transformers(name: str, request: pytest.FixtureRequest) -> None:
    """Four prompts of mixed lengths (3..70 tokens, crossing 16-token blocks) run as one batch."""
    model: TinyModel = request.getfixturevalue(name)
    engine = LLMEngine(model.path, block_size=16, num_blocks=64, max_num_seqs=8)
    for i, prompt in enumerate(model.prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    first = engine.step()
    assert sorted(o.request_id for o in first) == ["r0", "r1", "r2", "r3"]  # one batched prefill
    assert engine.num_running == 4
    results: dict = {}
    absorb(results, first)
    drain(engine, results)
    for i, ref in enumerate(model.greedy):
        res = results[f"r{i}"]
        assert res.token_ids == ref, f"prompt {i} ({len(model.prompts[i])} tokens)"
        assert res.finish_reason == "length"
    assert engine.block_manager.num_free == 64
    assert engine.kv_usage() == 0.0


def test_request_joining_mid_decode_matches(llama: TinyModel) -> None:
    """Continuous batching: a request added while others decode joins the batch after its prefill."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_seqs=8)
    results: dict = {}
    for i in range(3):
        engine.add_request(f"r{i}", llama.prompts[i], GREEDY)
    for _ in range(6):  # one prefill + five decode steps
        absorb(results, engine.step())
    assert all(len(results[f"r{i}"].token_ids) == 6 for i in range(3))
    engine.add_request("r3", llama.prompts[3], GREEDY)
    absorb(results, engine.step())  # the prefill of r3 alone
    assert len(results["r3"].token_ids) == 1 and len(results["r0"].token_ids) == 6
    outs = engine.step()  # one decode step for all four
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2", "r3"]
    absorb(results, outs)
    drain(engine, results)
    for i, ref in enumerate(llama.greedy):
        assert results[f"r{i}"].token_ids == ref


def test_preemption_under_tiny_pool_still_matches(llama: TinyModel) -> None:
    """8 blocks of 16 tokens cannot hold all four sequences: the newest get preempted and recomputed."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=8, max_num_seqs=8)
    for i, prompt in enumerate(llama.prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    results = drain(engine)
    assert engine.num_preemptions > 0
    for i, ref in enumerate(llama.greedy):
        assert results[f"r{i}"].token_ids == ref
        assert results[f"r{i}"].finish_reason == "length"
    assert engine.block_manager.num_free == 8


def test_variant_features_match(llama_variant: TinyModel) -> None:
    """Biases, tied embeddings, llama3 RoPE scaling and a sharded checkpoint."""
    assert os.path.isfile(os.path.join(llama_variant.path, "model.safetensors.index.json"))
    cfg = ModelConfig.from_pretrained(llama_variant.path)
    assert cfg.tie_word_embeddings and cfg.qkv_bias and cfg.mlp_bias
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    engine = LLMEngine(llama_variant.path, block_size=16, max_num_seqs=4)
    res = engine.generate(llama_variant.prompts, GREEDY)
    assert [r.token_ids for r in res] == llama_variant.greedy


def test_default_pool_size_and_cap(llama: TinyModel) -> None:
    """num_blocks defaults to max_num_seqs * max_model_len tokens, capped by kv_cache_bytes."""
    engine = LLMEngine(llama.path, block_size=16, max_num_seqs=4, max_model_len=128)
    assert engine.kv_cache.num_blocks == 4 * 128 // 16
    budget = 10 * engine.kv_cache.block_nbytes + 100  # 10 blocks and change: one 128-token sequence fits
    capped = LLMEngine(llama.path, block_size=16, max_num_seqs=4, max_model_len=128, kv_cache_bytes=budget)
    assert capped.kv_cache.num_blocks == 10


def test_kv_cache_layout(llama: TinyModel) -> None:
    """One block-major tensor; each block one contiguous byte range."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=10)
    kv = engine.kv_cache
    assert tuple(kv.data.shape) == (10, 2, 2, 16, 2, 16)
    assert kv.data.is_contiguous()
    assert kv.block_nbytes == 2 * 2 * 16 * 2 * 16 * 4
    assert kv.layout() == {"num_layers": 2, "block_size": 16, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
    assert kv.num_blocks == 10
    assert kv.data[3:5].data_ptr() - kv.data.data_ptr() == 3 * kv.block_nbytes


def test_unsupported_configs_raise() -> None:
    """Unknown architectures and RoPE types fail loudly with the offending name."""
    base = {
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        ModelConfig.from_dict({**base, "architectures": ["FalconForCausalLM"], "model_type": "falcon"})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_dict(
            {**base, "architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
        )
    cfg = ModelConfig.from_dict({**base, "model_type": "smollm", "eos_token_id": [3, 4]}, {"eos_token_id": 5})
    assert cfg.family == "llama" and cfg.eos_token_ids == [3, 4, 5] and cfg.rope_scaling is None


def test_add_request_rejects_what_can_never_fit(llama: TinyModel) -> None:
    """Too long for the context or the pool, empty, out-of-vocabulary, duplicate ids: ValueError."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=4, max_model_len=100)
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("a", [1] * 101, GREEDY)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("a", [1] * 70, GREEDY)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("a", [], GREEDY)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request("a", [512], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("a", [1], SamplingParams(max_tokens=0))
    engine.add_request("a", [1, 2], GREEDY)
    with pytest.raises(ValueError, match="already exists"):
        engine.add_request("a", [1, 2], GREEDY)
    assert engine.num_waiting == 1
