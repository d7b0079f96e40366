"""Sampling parameters, seeded reproducibility and stop conditions."""
from __future__ import annotations

import json

import pytest
import torch

from inference.engine import LLMEngine, SamplingParams
from inference.engine.sampler import sample, step_seed

from .conftest import NEW_TOKENS, TinyModel
from .helpers import drain


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"seed_offset": -1}, "seed_offset"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_validate_names_the_field(kwargs: dict, field: str) -> None:
    """validate() raises ValueError whose message starts with the bad field."""
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**kwargs).validate()


def test_dict_round_trip() -> None:
    """to_dict is JSON-safe and from_dict inverts it; unknown keys are refused."""
    p = SamplingParams(max_tokens=3, temperature=0.5, top_k=4, top_p=0.9, seed=7, stop=["x"], stop_token_ids=[2])
    assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p
    assert SamplingParams.from_dict({"stop": "END", "temperature": 1}).stop == ["END"]
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({"bogus": 1})
    SamplingParams().validate()


def sample_one(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """One row through the batched sampler."""
    return sample(logits[None, :], [params], [step])[0]


def test_sampler_filters() -> None:
    """top_k=1 is argmax; top_p keeps only the nucleus; a seed fixes the draw."""
    logits = torch.tensor([0.0, 5.0, 1.0, 4.9])
    for step in range(20):
        assert sample_one(logits, SamplingParams(temperature=1.0, top_k=1), step) == 1
        assert sample_one(logits, SamplingParams(temperature=1.0, top_p=0.3), step) == 1
        assert sample_one(logits, SamplingParams(temperature=1.0, top_k=2), step) in (1, 3)
    seeded = SamplingParams(temperature=2.0, seed=5)
    draws = [sample_one(logits, seeded, s) for s in range(30)]
    assert draws == [sample_one(logits, seeded, s) for s in range(30)]
    assert len(set(draws)) > 1
    assert step_seed(5, 3) != step_seed(5, 4) and step_seed(2**62, 1) < 2**63


def test_seeded_sampling_reproducible_across_engines(llama: TinyModel) -> None:
    """Same seed, same stream, whatever the batch composition or engine instance."""
    params = [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=s) for s in (1, 2, 3, 4)]
    a = LLMEngine(llama.path, block_size=16, num_blocks=64)
    together = [r.token_ids for r in a.generate(llama.prompts, params)]
    b = LLMEngine(llama.path, block_size=8, num_blocks=128)
    alone = [b.generate([p], [sp])[0].token_ids for p, sp in zip(llama.prompts, params, strict=True)]
    assert together == alone
    other = b.generate([llama.prompts[0]], [SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99)])
    assert other[0].token_ids != together[0]
    assert together[0] != llama.greedy[0][:16]  # really sampled


def test_seed_offset_continues_a_seeded_stream(llama: TinyModel) -> None:
    """A request that takes a seeded stream over after k tokens (prompt + those k tokens as its
    prompt, `seed_offset` k: what the router sends when it migrates a stream) produces exactly the
    rest of the unbroken run; without the offset it does not."""
    engine = LLMEngine(llama.path, block_size=8, num_blocks=128)
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    whole = engine.generate([llama.prompts[0]], [params])[0].token_ids
    k = 6
    prompt = [*llama.prompts[0], *whole[:k]]
    rest = SamplingParams(max_tokens=16 - k, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True, seed_offset=k)
    assert engine.generate([prompt], [rest])[0].token_ids == whole[k:]
    restarted = SamplingParams(max_tokens=16 - k, temperature=1.0, top_p=0.9, seed=11, ignore_eos=True)
    assert engine.generate([prompt], [restarted])[0].token_ids != whole[k:]


def test_top_k_1_equals_greedy(llama: TinyModel) -> None:
    """Sampling restricted to the top token is greedy decoding."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    res = engine.generate(llama.prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.7, top_k=1))
    assert [r.token_ids for r in res] == llama.greedy
    unseeded = engine.generate(llama.prompts[:1], SamplingParams(max_tokens=5, temperature=1.0))
    assert len(unseeded[0].token_ids) == 5


def test_stop_token_ids_eos_and_max_tokens(llama: TinyModel) -> None:
    """stop_token_ids / eos end with "stop" (the token is reported); ignore_eos and max_tokens."""
    ref = llama.greedy[1]
    stop_tok = ref[5]
    cut = ref.index(stop_tok) + 1
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    prompt = [llama.prompts[1]]
    res = engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=[stop_tok]))
    assert res[0].token_ids == ref[:cut] and res[0].finish_reason == "stop"

    engine.outputs.eos_token_ids = frozenset({stop_tok})
    res = engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert res[0].token_ids == ref[:cut] and res[0].finish_reason == "stop"
    res = engine.generate(prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    assert res[0].token_ids == ref and res[0].finish_reason == "length"

    res = engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert res[0].token_ids == ref[:5] and res[0].finish_reason == "length"


def test_max_model_len_ends_with_length(llama: TinyModel) -> None:
    """A sequence stops when prompt + output reach max_model_len."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_model_len=20)
    res = engine.generate([llama.prompts[1]], SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert res[0].token_ids == llama.greedy[1][:3] and res[0].finish_reason == "length"


def test_abort_frees_blocks_in_every_state(llama: TinyModel) -> None:
    """Running, waiting and reserved requests all give their blocks back on abort."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=12, max_num_seqs=2)
    start = engine.block_manager.num_free
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    for i, prompt in enumerate(llama.prompts):
        engine.add_request(f"r{i}", prompt, params)
    engine.reserve("kv", [3] * 30, params)
    for _ in range(3):
        engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 2
    for rid in ("r0", "r1", "r2", "r3", "kv", "unknown"):
        engine.abort(rid)
    results = drain(engine)
    assert {rid: r.finish_reason for rid, r in results.items() if r.finish_reason} == {
        "r0": "abort", "r1": "abort", "r2": "abort", "r3": "abort", "kv": "abort"
    }
    assert engine.block_manager.num_free == start
    assert not engine.has_work()
