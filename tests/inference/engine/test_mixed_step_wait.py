"""The measured mixed-step budget's wait rule (step_cost.py, "A prompt's wait"): a step may take
`WAIT_SHARE` of the time the oldest waiting prompt has waited for its first token where that is longer
than the target (up to the cap), so a prompt fed a few tokens a step beside running streams gets steps
that grow with its wait. Waits are set by back-dating `Sequence.queued_at` (no timing asserts), as the
wait that allows a step of so many ms; greedy outputs stay transformers'."""

from __future__ import annotations

from inference.engine import LLMEngine, SamplingParams
from inference.engine.scheduler import StepPlan
from inference.engine.step_cost import WAIT_SHARE, MixedStepBudget, StepCostModel, StepTarget

from .conftest import NEW_TOKENS, TinyModel
from .helpers import Collected, absorb, drain
from .test_mixed_step_cost import _engine, _reteach, _teach

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _wait_for(step_s: float) -> float:
    """The wait after which a mixed step may take `step_s` seconds."""
    return step_s / WAIT_SHARE


def test_a_long_wait_widens_the_budget_up_to_the_cap() -> None:
    """Synthetic cost 10 ms + 5 ms a row + 1 ms a prompt token, 60 ms target beside 2 rows: 40 tokens;
    a wait that allows 30 ms (under the target) changes nothing; 100 ms: 80 tokens; 10 s: the cap.
    Beside 12 rows (70 ms alone: the fixed budget, 64) a 100 ms step leaves room for 30, under the
    fixed budget, so the fixed budget stays; 200 ms: 130 tokens, capped at 128."""
    budget = MixedStepBudget(StepTarget(ms=60), floor=16, cap=128, fallback=64, model=StepCostModel())
    _teach(budget.model)
    seen = [(budget.tokens(2, _wait_for(step)), budget.waited) for step in (0.0, 0.03, 0.1, 10.0)]
    assert seen == [(40, False), (40, False), (80, True), (128, True)]
    assert (budget.tokens(12, _wait_for(0.1)), budget.waited, budget.fell_back) == (64, False, True)
    assert (budget.tokens(12, _wait_for(0.2)), budget.waited, budget.fell_back) == (128, True, False)


def test_a_relative_target_grows_with_the_wait_too() -> None:
    """2x the rows' step beside 6 rows (40 ms): 40 tokens; a wait that allows 150 ms: 110."""
    budget = MixedStepBudget(StepTarget(factor=2.0), floor=16, cap=128)
    _teach(budget.model)
    assert budget.tokens(6, 0.0) == 40 and not budget.waited
    assert budget.tokens(6, _wait_for(0.15)) == 110 and budget.waited


def _plan_after_wait(engine: LLMEngine, llama: TinyModel, waited_s: float, results: dict[str, Collected]) -> StepPlan:
    """2 streams of the 3-token prompt running, the 70-token prompt queued `waited_s` seconds ago
    (back-dated); plan and run one step on the taught cost."""
    for i in range(2):
        engine.add_request(f"s{i}", llama.prompts[0], GREEDY)
    absorb(results, engine.step())
    _reteach(engine)  # the first step's real time is not the synthetic formula
    engine.add_request("w3", llama.prompts[3], GREEDY)
    seq = engine.get_sequence("w3")
    assert seq is not None
    seq.queued_at -= waited_s
    absorb(results, engine.step())
    return engine.scheduler.last_plan


def test_a_prompt_that_waited_goes_in_one_step(llama: TinyModel) -> None:
    """60 ms target beside 2 rows: 40 of the 70 tokens when the prompt has just arrived (the rest next
    step, its queue time kept across the chunks); queued long enough for a 100 ms step: all 70 in one
    step (room for 80), the step log's rule "cost-wait". Greedy tokens unchanged either way."""
    for waited_s, want, rule in ((0.0, (40, 1, 2), "cost"), (_wait_for(0.1), (70, 1, 2), "cost-wait")):
        engine = _engine(llama, StepTarget(ms=60))
        results: dict[str, Collected] = {}
        plan = _plan_after_wait(engine, llama, waited_s, results)
        assert plan == want and (plan.rule, plan.waiting) == (rule, 1)
        seq = engine.get_sequence("w3")
        if waited_s == 0.0:  # a chunk ran: the prompt waits again with the time it first queued
            assert seq is not None and seq in engine.scheduler.waiting and seq.num_cached == 40
            queued = seq.queued_at
            absorb(results, engine.step())
            assert engine.scheduler.last_plan == (30, 1, 2) and seq.queued_at == queued
        drain(engine, results)
        for rid, got in results.items():
            assert got.token_ids == llama.greedy[0 if rid.startswith("s") else 3], rid
        assert engine.kv_usage() == 0.0


def test_without_a_step_target_the_wait_changes_nothing(llama: TinyModel) -> None:
    """Without a step target the queue-scaled budget decides whatever the wait (the 70 waiting tokens
    over 2 rows: 35); the wait rule is the measured budget's only."""
    engine = LLMEngine(
        llama.path,
        block_size=16,
        num_blocks=96,
        max_num_batched_tokens=16,
        enable_mixed_prefill=True,
        enable_prefix_caching=False,
    )
    engine.scheduler.mixed_burst_tokens = 0
    results: dict[str, Collected] = {}
    plan = _plan_after_wait(engine, llama, 10.0, results)
    assert plan == (35, 1, 2) and plan.rule == "queue"
    drain(engine, results)
    assert results["w3"].token_ids == llama.greedy[3]
