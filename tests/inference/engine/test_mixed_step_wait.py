"""The measured mixed-step budget's overdue rule (step_cost.py, "A prompt's wait"): once a waiting prompt
has gone more than `OVERDUE_TARGETS` target steps without progress, the next step takes the waiting
prompts whole beside the running rows (up to the burst cap), instead of the target's budget. Waits are
set by back-dating `Sequence.queued_at` (no timing asserts); greedy outputs stay transformers'."""

from __future__ import annotations

from inference.engine import LLMEngine, SamplingParams
from inference.engine.scheduler import StepPlan
from inference.engine.step_cost import OVERDUE_TARGETS, MixedStepBudget, StepTarget

from .conftest import NEW_TOKENS, TinyModel
from .helpers import Collected, absorb, drain
from .test_mixed_step_cost import _engine, _reteach, _teach

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def test_overdue_after_the_given_number_of_target_steps() -> None:
    """Synthetic cost 10 ms + 5 ms a row: a 60 ms target is overdue past OVERDUE_TARGETS x 60 ms
    whatever the rows; 2x the rows' step beside 6 rows (40 ms) past OVERDUE_TARGETS x 80 ms. Nothing
    is overdue before the decode cost is measured."""
    fixed = MixedStepBudget(StepTarget(ms=60), floor=16, cap=128)
    assert not fixed.overdue(2, 100.0)  # nothing measured yet
    _teach(fixed.model)
    limit = OVERDUE_TARGETS * 0.060
    assert [fixed.overdue(rows, limit * x) for rows in (2, 12) for x in (0.9, 1.1)] == [False, True, False, True]
    relative = MixedStepBudget(StepTarget(factor=2.0), floor=16, cap=128)
    _teach(relative.model)
    limit = OVERDUE_TARGETS * 0.080
    assert (relative.overdue(6, limit * 0.9), relative.overdue(6, limit * 1.1)) == (False, True)


def _plan_after_wait(
    engine: LLMEngine, llama: TinyModel, prompts: tuple[int, ...], waited_s: float, results: dict[str, Collected]
) -> StepPlan:
    """2 streams of the 3-token prompt running, `prompts` queued `waited_s` seconds ago (back-dated);
    plan and run one step on the taught cost (60 ms target: 40 prompt tokens beside 2 rows)."""
    for i in range(2):
        engine.add_request(f"s{i}", llama.prompts[0], GREEDY)
    absorb(results, engine.step())
    _reteach(engine)  # the first step's real time is not the synthetic formula
    for i in prompts:
        engine.add_request(f"w{i}", llama.prompts[i], GREEDY)
        seq = engine.get_sequence(f"w{i}")
        assert seq is not None
        seq.queued_at -= waited_s
    absorb(results, engine.step())
    return engine.scheduler.last_plan


def _finish(engine: LLMEngine, llama: TinyModel, results: dict[str, Collected]) -> None:
    """Run to the end; every request gives its prompt's greedy tokens and the pool empties."""
    drain(engine, results)
    for rid, got in results.items():
        assert got.token_ids == llama.greedy[0 if rid.startswith("s") else int(rid[1:])], rid
    assert engine.kv_usage() == 0.0


def test_overdue_prompts_go_whole_in_one_step(llama: TinyModel) -> None:
    """The 40- and 70-token prompts waiting beside 2 rows (not a burst: 2 waiting, 2 running): just
    queued, the 60 ms target's 40 tokens (the first prompt); overdue, all 110 in one step, rule
    "cost-wait" (the burst cap, 1,000 here, above the 8-budget cap of 128)."""
    overdue_s = OVERDUE_TARGETS * 0.060 * 1.5
    for waited_s, want, rule in ((0.0, (40, 1, 2), "cost"), (overdue_s, (110, 2, 2), "cost-wait")):
        engine = _engine(llama, StepTarget(ms=60), burst=1000)
        results: dict[str, Collected] = {}
        plan = _plan_after_wait(engine, llama, (2, 3), waited_s, results)
        assert plan == want and (plan.rule, plan.waiting) == (rule, 2)
        _finish(engine, llama, results)


def test_a_prompt_fed_every_step_is_not_overdue(llama: TinyModel) -> None:
    """The 70-token prompt beside 2 rows, burst rule off: 40 tokens, then its wait starts again (a chunk
    ran), so the rest goes by the target too; back-dated past the limit after its first chunk, the
    rest goes whole (30 tokens either way here; the rule names which decided)."""
    for late in (False, True):
        engine = _engine(llama, StepTarget(ms=60))
        results: dict[str, Collected] = {}
        plan = _plan_after_wait(engine, llama, (3,), 0.0, results)
        assert plan == (40, 1, 2) and plan.rule == "cost"
        seq = engine.get_sequence("w3")
        assert seq is not None and seq in engine.scheduler.waiting and seq.num_cached == 40
        if late:
            seq.queued_at -= OVERDUE_TARGETS * 0.060 * 1.5
        absorb(results, engine.step())
        plan = engine.scheduler.last_plan
        assert plan == (30, 1, 2) and plan.rule == ("cost-wait" if late else "cost")
        _finish(engine, llama, results)


def test_without_a_step_target_the_wait_changes_nothing(llama: TinyModel) -> None:
    """Without a step target the queue-scaled budget decides whatever the wait (the 70 waiting tokens
    over 2 rows: 35); the overdue rule is the measured budget's only."""
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
    plan = _plan_after_wait(engine, llama, (3,), 10.0, results)
    assert plan == (35, 1, 2) and plan.rule == "queue"
    _finish(engine, llama, results)
