"""Mixed prefill's burst rule (Scheduler.mixed_burst_tokens): while more prompts wait than streams
run, a mixed step takes the waiting prompts whole (up to the cap) instead of the queue-scaled
budget; outputs stay transformers' greedy tokens."""
from __future__ import annotations

import pytest

from inference.engine import LLMEngine, SamplingParams
from inference.engine.scheduler import MIXED_BURST_ENV, MIXED_BURST_TOKENS, mixed_burst_tokens

from .conftest import NEW_TOKENS, TinyModel
from .helpers import Collected, absorb, drain

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _engine(llama: TinyModel, burst: int) -> LLMEngine:
    """A mixed-prefill engine with a 16-token budget (8 budgets: 128 tokens a step at most without the
    burst rule), no prefix caching (prompts repeat), the burst cap `burst` (0: off)."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=96, max_num_batched_tokens=16,
                       enable_mixed_prefill=True, enable_prefix_caching=False)
    engine.scheduler.mixed_burst_tokens = burst
    return engine


def _running(engine: LLMEngine, llama: TinyModel, n: int, results: dict[str, Collected]) -> None:
    """Start `n` streams of the 3-token prompt (one step prefills them all); they decode from then on."""
    for i in range(n):
        engine.add_request(f"s{i}", llama.prompts[0], GREEDY)
    absorb(results, engine.step())
    assert engine.scheduler.last_plan == (3 * n, n, 0)


def _check_outputs(results: dict[str, Collected], llama: TinyModel, burst: dict[str, int]) -> None:
    """Every stream `s*` gives the 3-token prompt's greedy tokens, every `b*` its own prompt's."""
    for rid, got in results.items():
        want = llama.greedy[0] if rid.startswith("s") else llama.greedy[burst[rid]]
        assert got.token_ids == want, rid


@pytest.mark.parametrize(("burst", "plans"), [
    (1000, [(130, 4, 0)]),  # the whole burst in one step
    (0, [(128, 4, 0), (2, 1, 3)]),  # 8 budgets, then the last prompt's last 2 tokens beside 3 streams
])
def test_a_burst_at_an_idle_engine_takes_the_whole_queue(llama: TinyModel, burst: int,
                                                         plans: list[tuple[int, int, int]]) -> None:
    """3 + 17 + 40 + 70 prompt tokens arriving at an idle engine: one step with the burst rule, past
    the queue-scaled cap of 8 budgets without it."""
    engine = _engine(llama, burst)
    results: dict[str, Collected] = {}
    for i in range(4):
        engine.add_request(f"b{i}", llama.prompts[i], GREEDY)
    seen = []
    for _ in plans:
        absorb(results, engine.step())
        seen.append(engine.scheduler.last_plan)
    assert seen == plans
    drain(engine, results)
    _check_outputs(results, llama, {f"b{i}": i for i in range(4)})
    assert engine.kv_usage() == 0.0


def test_waiting_prompts_that_outnumber_the_streams_run_in_one_step(llama: TinyModel) -> None:
    """3 prompts (17 + 40 + 70 tokens) arriving while 2 streams run: all of them beside the 2 rows in
    one step; without the rule, the queued tokens per row (63) a step: 17 + 40, the 70-token prompt
    waits (a chunk of 6 would be less than a block)."""
    for burst, first in ((1000, (127, 3, 2)), (0, (57, 2, 2))):
        engine = _engine(llama, burst)
        results: dict[str, Collected] = {}
        _running(engine, llama, 2, results)
        for i in (1, 2, 3):
            engine.add_request(f"b{i}", llama.prompts[i], GREEDY)
        absorb(results, engine.step())
        assert engine.scheduler.last_plan == first
        drain(engine, results)
        _check_outputs(results, llama, {f"b{i}": i for i in (1, 2, 3)})
        assert engine.kv_usage() == 0.0


@pytest.mark.parametrize(("streams", "plan"), [
    (3, (36, 1, 3)),  # 110 // 3: the 40-token prompt's first 36
    (2, (40, 1, 2)),  # as many waiting as running, no burst either: 110 // 2 = 55, the 40 (15 < a block)
])
def test_streams_as_many_as_the_waiting_prompts_keep_the_budget(llama: TinyModel, streams: int,
                                                                plan: tuple[int, int, int]) -> None:
    """2 prompts (40 + 70 tokens) arriving while 2 or 3 streams run: no burst; the queued tokens per
    row a step, with or without the rule."""
    for burst in (1000, 0):
        engine = _engine(llama, burst)
        results: dict[str, Collected] = {}
        _running(engine, llama, streams, results)
        for i in (2, 3):
            engine.add_request(f"b{i}", llama.prompts[i], GREEDY)
        absorb(results, engine.step())
        assert engine.scheduler.last_plan == plan
        drain(engine, results)
        _check_outputs(results, llama, {"b2": 2, "b3": 3})


def test_a_burst_step_stops_at_the_cap(llama: TinyModel) -> None:
    """A cap of 50 tokens: the burst's 17-token prompt whole and 33 tokens of the 40-token one (a chunk
    fills the step); the rest follows in later steps."""
    engine = _engine(llama, 50)
    results: dict[str, Collected] = {}
    _running(engine, llama, 1, results)
    for i in (1, 2):
        engine.add_request(f"b{i}", llama.prompts[i], GREEDY)
    absorb(results, engine.step())
    assert engine.scheduler.last_plan == (50, 2, 1)
    drain(engine, results)
    _check_outputs(results, llama, {"b1": 1, "b2": 2})


def test_the_cap_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, llama: TinyModel) -> None:
    """ENGINE_MIXED_BURST_TOKENS sets a new scheduler's cap (0: off); unset, MIXED_BURST_TOKENS."""
    monkeypatch.delenv(MIXED_BURST_ENV, raising=False)
    assert mixed_burst_tokens() == MIXED_BURST_TOKENS
    monkeypatch.setenv(MIXED_BURST_ENV, "2048")
    assert mixed_burst_tokens() == 2048
    assert LLMEngine(llama.path, block_size=16, num_blocks=32, enable_mixed_prefill=True) \
        .scheduler.mixed_burst_tokens == 2048
    monkeypatch.setenv(MIXED_BURST_ENV, "0")
    assert mixed_burst_tokens() == 0
    monkeypatch.setenv(MIXED_BURST_ENV, "lots")
    with pytest.raises(ValueError, match=f"{MIXED_BURST_ENV} must be a whole number"):
        mixed_burst_tokens()


@pytest.mark.parametrize(("burst", "streams", "waiting", "plan", "rule"), [
    (1000, 2, (1, 2, 3), (127, 3, 2), "burst"),  # 3 waiting beside 2 streams, taken whole
    (0, 2, (1, 2, 3), (57, 2, 2), "queue"),  # the queued tokens per row (63), over the 16 budget
    (1000, 3, (1,), (16, 1, 3), "fixed"),  # 17 queued tokens over 3 rows: the budget itself
])
def test_the_plan_names_the_rule_that_set_its_budget(llama: TinyModel, burst: int, streams: int,
                                                     waiting: tuple[int, ...], plan: tuple[int, int, int],
                                                     rule: str) -> None:
    """`last_plan.rule` and `.waiting` (the step log's last two columns): which rule gave a mixed step
    its prompt tokens and how many prompts waited; a decode-only step names none."""
    engine = _engine(llama, burst)
    results: dict[str, Collected] = {}
    _running(engine, llama, streams, results)
    absorb(results, engine.step())
    assert (engine.scheduler.last_plan, engine.scheduler.last_plan.rule, engine.scheduler.last_plan.waiting) \
        == ((0, 0, streams), "", 0)
    for i in waiting:
        engine.add_request(f"b{i}", llama.prompts[i], GREEDY)
    absorb(results, engine.step())
    got = engine.scheduler.last_plan
    assert (got, got.rule, got.waiting) == (plan, rule, len(waiting))
    drain(engine, results)
    _check_outputs(results, llama, {f"b{i}": i for i in waiting})
