"""Prefill on one engine, copy the KV blocks, decode on another: same tokens as colocated."""
from __future__ import annotations

import pytest

from inference.engine import LLMEngine, NoFreeBlocks, SamplingParams, SequenceStatus

from .conftest import NEW_TOKENS, TinyModel
from .helpers import Collected, drain

PARAMS = {
    "greedy": SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0),
    "seeded": SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, top_k=100, seed=1234),
}


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_prefill_transfer_decode_equals_colocated(llama: TinyModel, kind: str) -> None:
    """The disaggregation hooks end to end, with an in-process "transfer" of the block bytes."""
    params = PARAMS[kind]
    colocated = LLMEngine(llama.path, block_size=16, num_blocks=64)
    expected = [r.token_ids for r in colocated.generate(llama.prompts, params)]
    if kind == "greedy":
        assert expected == llama.greedy

    prefill = LLMEngine(llama.path, block_size=16, num_blocks=32)
    decode = LLMEngine(llama.path, block_size=16, num_blocks=48)
    decode.reserve("other", [1] * 20, params)  # so the decode side's block ids differ from the prefill side's
    for i, prompt in enumerate(llama.prompts):
        prefill.add_request(f"r{i}", prompt, params, prefill_only=True)
    prefilled = drain(prefill)
    held = sum(-(-len(p) // 16) for p in llama.prompts)
    assert prefill.block_manager.num_free == 32 - held  # blocks stay allocated until release()

    for i, prompt in enumerate(llama.prompts):
        rid = f"r{i}"
        out = prefilled[rid]
        assert out.finish_reason == "prefilled" and len(out.token_ids) == 1
        src = out.outputs[-1].block_ids
        assert src is not None and len(src) == -(-len(prompt) // 16)
        dst = decode.reserve(rid, prompt, params)
        assert len(dst) == len(src) and dst != src
        assert decode.get_sequence(rid).status == SequenceStatus.WAITING_FOR_KV  # type: ignore[union-attr]
        decode.kv_cache.data[dst] = prefill.kv_cache.data[src]
        decode.kv_received(rid, out.token_ids[0])
        prefill.release(rid)
    assert prefill.block_manager.num_free == 32

    decode.abort("other")
    results = drain(decode)
    assert results["other"].finish_reason == "abort"
    for i in range(len(llama.prompts)):
        res = results[f"r{i}"]
        # The decode side's stream starts with the first token (emitted by kv_received).
        assert res.token_ids == expected[i]
        assert res.token_ids[0] == prefilled[f"r{i}"].token_ids[0]
        assert res.finish_reason == "length"
        assert res.outputs[-1].num_output_tokens == NEW_TOKENS
    assert decode.block_manager.num_free == 48


def test_reserve_raises_no_free_blocks_and_leaves_no_trace(llama: TinyModel) -> None:
    """A reserve that does not fit now raises NoFreeBlocks; one that can never fit raises ValueError."""
    # The whole pool may be queued here: this test is about the free blocks, not the queued bound.
    engine = LLMEngine(llama.path, block_size=16, num_blocks=5, max_queued_kv_fraction=1.0)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    assert engine.reserve("a", [1] * 40, params) == [0, 1, 2]
    with pytest.raises(NoFreeBlocks):
        engine.reserve("b", [1] * 40, params)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.reserve("c", [1] * 90, params)
    assert engine.reserve("b", [1] * 20, params) == [3, 4]  # the failed id is free to use again
    assert not engine.has_work()  # reserved sequences are never scheduled
    assert engine.num_reserved == 2
    engine.abort("a")
    engine.abort("b")
    results = drain(engine)
    assert {k: v.finish_reason for k, v in results.items()} == {"a": "abort", "b": "abort"}
    assert engine.block_manager.num_free == 5


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (SamplingParams(max_tokens=1, temperature=0.0), "length"),
        (SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[7]), "stop"),
    ],
)
def test_first_token_can_finish_the_request(llama: TinyModel, params: SamplingParams, reason: str) -> None:
    """kv_received applies the stop checks to the first token."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=8)
    engine.reserve("a", [1, 2, 3], params)
    engine.kv_received("a", 7)
    assert engine.has_work()
    results = drain(engine)
    assert results["a"].token_ids == [7] and results["a"].finish_reason == reason
    assert engine.block_manager.num_free == 8


def test_kv_received_misuse(llama: TinyModel) -> None:
    """kv_received for unknown or not-reserved requests fails loudly."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=8)
    with pytest.raises(KeyError):
        engine.kv_received("nope", 1)
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="not waiting for KV"):
        engine.kv_received("a", 1)


def test_release_and_abort_of_prefilled(llama: TinyModel) -> None:
    """abort() on a prefilled request frees its blocks without a second final output."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=8)
    engine.add_request("a", llama.prompts[2], SamplingParams(temperature=0.0), prefill_only=True)
    results: dict[str, Collected] = drain(engine)
    assert results["a"].finish_reason == "prefilled"
    assert engine.block_manager.num_free == 8 - 3
    engine.abort("a")
    assert engine.block_manager.num_free == 8
    assert engine.step() == []
