"""A wave of waiting prompts is prefilled over a few steps (scheduler.PREFILL_WAVE_STEPS), decode steps
between, so their first tokens come in turn; a lone prompt keeps the whole budget; outputs are unchanged."""
from __future__ import annotations

import random

import pytest

from inference.engine import LLMEngine, SamplingParams
from inference.engine.scheduler import PREFILL_WAVE_ENV, PREFILL_WAVE_MIN_TOKENS, PREFILL_WAVE_STEPS
from inference.engine.sequence import RequestOutput

from .conftest import VOCAB, TinyModel
from .helpers import Collected, absorb, drain

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
WAVE = 12  # prompts of 80 tokens: 960 together, under the 2,048-token budget of one step
LENGTH = 80


def _wave(vocab: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, vocab) for _ in range(LENGTH)] for _ in range(WAVE)]


def _run(model: TinyModel, prompts: list[list[int]]) -> tuple[list[tuple[int, int, int]], dict[str, Collected],
                                                                  dict[str, int]]:
    """Every step's plan (prompt tokens, prompts, decode rows), the results, and the step at which each
    request's first token came."""
    engine = LLMEngine(model.path, block_size=16, num_blocks=256, max_num_batched_tokens=2048)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"w{i}", prompt, GREEDY)
    plans: list[tuple[int, int, int]] = []
    results: dict[str, Collected] = {}
    first_at: dict[str, int] = {}
    while engine.scheduler.waiting:
        outs = engine.step()
        absorb(results, outs)
        plans.append(tuple(engine.scheduler.last_plan)[:3])  # type: ignore[arg-type]
        for out in outs:
            if out.new_token_ids:
                first_at.setdefault(out.request_id, len(plans))
    drain(engine, results)
    return plans, results, first_at


def test_a_wave_is_prefilled_over_a_few_steps_with_decode_steps_between(
        llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = _wave(VOCAB)
    monkeypatch.delenv(PREFILL_WAVE_ENV, raising=False)
    plans, results, first_at = _run(llama, prompts)
    prefills = [tokens for tokens, _, _ in plans if tokens]
    # 960 tokens over PREFILL_WAVE_STEPS steps, each at least PREFILL_WAVE_MIN_TOKENS (a chunk may fill one).
    step = max(PREFILL_WAVE_MIN_TOKENS, -(-WAVE * LENGTH // PREFILL_WAVE_STEPS))
    assert prefills[0] <= step < WAVE * LENGTH, plans
    assert len(prefills) >= 3, plans
    # The running prompts decode between the wave's prefill steps, and first tokens come in turn.
    kinds = ["prefill" if tokens else "decode" for tokens, _, _ in plans]
    assert all(not (a == b == "prefill") for a, b in zip(kinds, kinds[1:], strict=False)), kinds
    assert len(set(first_at.values())) >= 3, first_at

    monkeypatch.setenv(PREFILL_WAVE_ENV, "1")  # off: the whole wave in one step, as before
    one_plans, one_results, one_first = _run(llama, prompts)
    assert [tokens for tokens, _, _ in one_plans if tokens] == [WAVE * LENGTH]
    assert len(set(one_first.values())) == 1
    assert {k: r.token_ids for k, r in results.items()} == {k: r.token_ids for k, r in one_results.items()}


def test_a_lone_prompt_keeps_the_whole_budget(llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREFILL_WAVE_ENV, raising=False)
    prompt = _wave(VOCAB)[0] * 4  # 320 tokens, alone
    plans, results, _ = _run(llama, [prompt])
    assert [tokens for tokens, _, _ in plans if tokens] == [len(prompt)]
    assert len(results["w0"].token_ids) == GREEDY.max_tokens


def test_a_bad_switch_names_itself(llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PREFILL_WAVE_ENV, "many")
    with pytest.raises(ValueError, match=PREFILL_WAVE_ENV):
        LLMEngine(llama.path, block_size=16, num_blocks=16)


def test_offline_generate_prefills_a_wave_in_one_step(llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # Offline, no first token is seen before the batch ends: the wave rule would only cost throughput.
    monkeypatch.delenv(PREFILL_WAVE_ENV, raising=False)
    prompts = _wave(VOCAB)
    engine = LLMEngine(llama.path, block_size=16, num_blocks=256, max_num_batched_tokens=2048)
    plans: list[int] = []
    step = engine.step

    def recording_step() -> list[RequestOutput]:
        outs = step()
        plans.append(engine.scheduler.last_plan[0])
        return outs

    monkeypatch.setattr(engine, "step", recording_step)
    results = engine.generate(prompts, GREEDY)
    assert [tokens for tokens in plans if tokens] == [WAVE * LENGTH]
    assert engine.scheduler.prefill_wave_steps == PREFILL_WAVE_STEPS  # restored for serving
    _, stepped, _ = _run(llama, prompts)  # the same prompts stepped as a worker does, over a few steps
    assert [r.token_ids for r in results] == [stepped[f"w{i}"].token_ids for i in range(WAVE)]
