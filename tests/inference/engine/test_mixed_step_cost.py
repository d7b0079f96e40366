"""Mixed steps whose prompt tokens follow the measured step cost (step_cost.py, `mixed_step_target`):
the fit, the budget it gives the real scheduler (shrinking as rows grow under a fixed time, never
under the floor, the fixed budget where no step can meet the target, bursts still whole), and greedy
outputs unchanged by the odd chunk sizes."""
from __future__ import annotations

import random

import pytest

from inference.engine import LLMEngine, SamplingParams
from inference.engine.scheduler import StepPlan
from inference.engine.step_cost import (
    AUTO_FACTOR,
    MixedStepBudget,
    StepCostModel,
    StepTarget,
    parse_step_target,
)
from inference.server.args import ServerArgs, parse_args

from .conftest import NEW_TOKENS, TinyModel
from .helpers import Collected, absorb, drain

GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# The synthetic cost the budget tests teach the engine: 10 ms + 5 ms a row, 1 ms a prompt token.
A, B, C = 0.010, 0.005, 0.001
WORKER = ["--service-type", "both", "--model-path"]  # a worker's command line up to its model folder


def _teach(model: StepCostModel, a: float = A, b: float = B, c: float = C, d: float = 0.0,
           noise: float = 0.0, seed: int = 0, steps: int = 200) -> None:
    """Feed `model` steps of 1-16 rows, every fourth with 8-120 prompt tokens, timed by the formula."""
    rng = random.Random(seed)
    for i in range(steps):
        rows = rng.randint(1, 16)
        tokens = rng.randint(8, 120) if i % 4 == 3 else 0
        t = a + b * rows + (d + c * tokens if tokens else 0.0)
        model.observe(rows, tokens, t * (1 + rng.uniform(-noise, noise)))


def test_the_fit_converges_on_synthetic_step_times() -> None:
    """±5 % noise on 12 ms + 4 ms a row (+ 3 ms + 1.2 ms a prompt token): predictions within 5 %."""
    model = StepCostModel()
    _teach(model, a=0.012, b=0.004, c=0.0012, d=0.003, noise=0.05)
    for rows, tokens in ((1, 0), (8, 0), (16, 0), (4, 64), (12, 16), (8, 120)):
        want = 0.012 + 0.004 * rows + (0.003 + 0.0012 * tokens if tokens else 0.0)
        got = model.predict(rows, tokens)
        assert got is not None and abs(got - want) / want < 0.05, (rows, tokens, got, want)


def test_a_step_slowed_by_another_process_moves_the_fit_little() -> None:
    """Steps 10x slower than the fit (the core taken away) count as 2x: a few of them do not triple
    the prediction; a lasting change of cost is still followed."""
    model = StepCostModel()
    _teach(model)
    for _ in range(3):
        model.observe(8, 0, 10 * (A + 8 * B))
    got = model.predict(8, 0)
    assert got is not None and got < 1.5 * (A + 8 * B)
    for _ in range(60):  # the steps really got slower: 3x
        model.observe(8, 0, 3 * (A + 8 * B))
    got = model.predict(8, 0)
    assert got is not None and got > 2.5 * (A + 8 * B)


def test_same_sized_steps_still_price_a_prompt_token() -> None:
    """Every mixed step with 64 tokens beside 8 rows (a fixed budget's steady state): the prompt cost is
    read as proportional, not free, so the budget is finite."""
    model = StepCostModel()
    for _ in range(20):
        model.observe(8, 0, A + 8 * B)
        model.observe(8, 64, A + 8 * B + 64 * C)
    room = model.tokens_within(8, StepTarget(ms=1000 * (A + 8 * B + 32 * C)))
    assert room is not None and 30 <= room <= 34


def test_no_budget_before_the_cost_is_measured() -> None:
    """Without two decode-only steps and one mixed step the budget is None (the scheduler keeps its
    own); from then on the fit decides."""
    budget = MixedStepBudget(StepTarget(ms=60), floor=16, cap=128)
    assert budget.tokens(2) is None
    budget.observe(2, 0, A + 2 * B)
    budget.observe(2, 40, A + 2 * B + 40 * C)
    assert budget.tokens(2) is None  # one decode-only step
    budget.observe(2, 300, 1.0)  # a burst over the cap: not fitted
    assert budget.model.prompt_samples == 1
    budget.observe(2, 0, A + 2 * B)
    assert budget.tokens(2) == 40  # 60 ms - 20 ms of rows = 40 tokens of 1 ms


def test_a_first_prompt_step_counts_before_any_decode_step() -> None:
    """A worker's first step is a prompt alone (no rows, no decode fit yet): it is fitted over no decode
    cost, so two decode steps later the budget is ready and prices a token from it (this step's fixed
    cost, 10 ms here, read as prompt cost: 30 ms for 20 tokens, 1.5 ms a token)."""
    budget = MixedStepBudget(StepTarget(ms=60), floor=16, cap=128)
    budget.observe(0, 20, A + 20 * C)
    assert budget.model.prompt_samples == 1
    budget.observe(2, 0, A + 2 * B)
    budget.observe(2, 0, A + 2 * B)
    assert budget.tokens(2) == 27  # (60 - 20) ms / 1.5 ms
    budget.observe(1, 300, 1.0)  # over the cap: still not fitted
    assert budget.model.prompt_samples == 1


def test_where_no_step_meets_the_target_the_fixed_budget_goes() -> None:
    """Room for 40 / 20 tokens: that many; for 10 (under the 16-token floor) or none (the rows alone
    take longer): the fixed budget, 64 (smaller chunks would only make more steps over the target)."""
    budget = MixedStepBudget(StepTarget(ms=60), floor=16, cap=128, fallback=64)
    _teach(budget.model)
    assert [budget.tokens(rows) for rows in (2, 6, 8, 12)] == [40, 20, 64, 64]
    assert MixedStepBudget(StepTarget(ms=60), floor=16, cap=128).fallback == 16


@pytest.mark.parametrize(("text", "want"), [
    ("off", None), (None, None), ("auto", StepTarget(factor=AUTO_FACTOR)), ("1.5x", StepTarget(factor=1.5)),
    ("150ms", StepTarget(ms=150.0)), (" 2X ", StepTarget(factor=2.0)),
])
def test_targets_parse(text: str | None, want: StepTarget | None) -> None:
    """off / auto / <k>x / <ms>ms."""
    assert parse_step_target(text) == want


@pytest.mark.parametrize("text", ["", "fast", "1x", "0.5x", "0ms", "150", "-3ms", "2x150ms"])
def test_bad_targets_fail_naming_the_flag(text: str, llama: TinyModel, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad --mixed-step-target stops the worker at startup with a message naming the flag."""
    with pytest.raises(ValueError, match="--mixed-step-target must be"):
        parse_step_target(text)
    with pytest.raises(SystemExit):
        parse_args([*WORKER, llama.path, f"--mixed-step-target={text}"])
    assert "--mixed-step-target must be" in capsys.readouterr().err


def test_the_flag_reaches_the_worker_args_and_back(llama: TinyModel) -> None:
    """The flag survives to_argv (the agent's command line) and defaults to DEFAULT_MIXED_STEP_TARGET."""
    args = parse_args([*WORKER, llama.path, "--mixed-prefill", "--mixed-step-target", "1.8x"])
    assert args.mixed_step_target == "1.8x"
    assert parse_args(args.to_argv()).mixed_step_target == "1.8x"
    assert ServerArgs.with_defaults(model_path=llama.path).mixed_step_target == parse_args(
        [*WORKER, llama.path]).mixed_step_target


def _engine(llama: TinyModel, target: StepTarget | None, burst: int = 0) -> LLMEngine:
    """A mixed-prefill engine with a 16-token fixed budget (cap 8 budgets: 128; floor: a block),
    no prefix caching (prompts repeat), the burst rule at `burst` (0: off), its step cost taught the
    synthetic A + B*rows + C*tokens."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=96, max_num_batched_tokens=16,
                       enable_mixed_prefill=True, enable_prefix_caching=False, mixed_step_target=target)
    engine.scheduler.mixed_burst_tokens = burst
    _reteach(engine)
    return engine


def _reteach(engine: LLMEngine) -> None:
    """Replace what the engine's step budget learned by the synthetic cost alone."""
    if engine.scheduler.step_budget is not None:
        engine.scheduler.step_budget.model = StepCostModel()
        _teach(engine.scheduler.step_budget.model)


def _first_plan(engine: LLMEngine, llama: TinyModel, streams: int, waiting: tuple[int, ...]) -> StepPlan:
    """Start `streams` streams of the 3-token prompt, queue `waiting` prompts, plan one step (taught
    cost; real step times only come in after it), then run everything and check the greedy tokens."""
    results: dict[str, Collected] = {}
    for i in range(streams):
        engine.add_request(f"s{i}", llama.prompts[0], GREEDY)
    absorb(results, engine.step())
    assert engine.scheduler.last_plan == (3 * streams, streams, 0)
    _reteach(engine)  # the first step's real time is not the synthetic formula
    for i in waiting:
        engine.add_request(f"w{i}", llama.prompts[i], GREEDY)
    absorb(results, engine.step())
    plan = engine.scheduler.last_plan
    drain(engine, results)
    for rid, got in results.items():
        assert got.token_ids == llama.greedy[0 if rid.startswith("s") else int(rid[1:])], rid
    assert engine.kv_usage() == 0.0
    return plan


@pytest.mark.parametrize(("streams", "tokens", "rule"), [
    (2, 40, "cost"), (4, 30, "cost"), (6, 20, "cost"), (12, 16, "cost-fallback"),
])
def test_the_budget_shrinks_as_rows_grow_down_to_the_floor(llama: TinyModel, streams: int, tokens: int,
                                                           rule: str) -> None:
    """A 60 ms target, the 70-token prompt waiting: (60 - 10 - 5 * rows) tokens of 1 ms beside 2 / 4 /
    6 rows; 12 rows alone take 70 ms: the fixed budget, here the floor (a block), so the prompt still
    progresses. The plan names the rule that decided (the step log's column)."""
    plan = _first_plan(_engine(llama, StepTarget(ms=60)), llama, streams, (3,))
    assert plan == (tokens, 1, streams) and (plan.rule, plan.waiting) == (rule, 1)


@pytest.mark.parametrize(("streams", "tokens"), [(2, 20), (6, 40)])
def test_a_relative_target_follows_the_rows(llama: TinyModel, streams: int, tokens: int) -> None:
    """2x the rows' step: as many ms of prompt as the rows take (20 ms at 2 rows, 40 at 6)."""
    assert _first_plan(_engine(llama, StepTarget(factor=2.0)), llama, streams, (3,)) == (tokens, 1, streams)


def test_the_budget_replaces_the_queue_scaling(llama: TinyModel) -> None:
    """2 prompts (40 + 70) beside 2 rows: the fixed rule takes the queued tokens per row (55: the 40
    whole), the measured cost at 30 ms only 10 tokens' room, under the floor: the fixed budget, 16."""
    fixed = _first_plan(_engine(llama, None), llama, 2, (2, 3))
    assert fixed == (40, 1, 2) and (fixed.rule, fixed.waiting) == ("queue", 2)
    measured = _first_plan(_engine(llama, StepTarget(ms=30)), llama, 2, (2, 3))
    assert measured == (16, 1, 2) and measured.rule == "cost-fallback"


def test_a_burst_still_goes_whole(llama: TinyModel) -> None:
    """3 prompts (17 + 40 + 70) waiting beside 2 rows, burst rule on: all 127 tokens in one step
    whatever the target (the budget would be 16)."""
    plan = _first_plan(_engine(llama, StepTarget(ms=30), burst=1000), llama, 2, (1, 2, 3))
    assert plan == (127, 3, 2) and (plan.rule, plan.waiting) == ("burst", 3)


def test_the_engine_feeds_the_fit_its_steps(llama: TinyModel) -> None:
    """Real steps reach the model: decode-only and mixed samples both counted."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=96, max_num_batched_tokens=16,
                       enable_mixed_prefill=True, enable_prefix_caching=False,
                       mixed_step_target=StepTarget(factor=AUTO_FACTOR))
    budget = engine.scheduler.step_budget
    assert budget is not None
    results: dict[str, Collected] = {}
    engine.add_request("s0", llama.prompts[0], GREEDY)
    for i in (2, 3):  # each prompt arrives beside running streams: a mixed step
        for _ in range(6):
            absorb(results, engine.step())
        engine.add_request(f"w{i}", llama.prompts[i], GREEDY)
    drain(engine, results)
    assert budget.model.decode_samples >= 10 and budget.model.prompt_samples >= 2
    assert budget.model.predict(1, 0) is not None
    assert results["w2"].token_ids == llama.greedy[2] and results["w3"].token_ids == llama.greedy[3]


def test_a_fresh_engine_decides_its_first_mixed_step(llama: TinyModel) -> None:
    """A new worker's steps: its first prompt alone, two decode steps, then a prompt arrives beside the
    stream: the measured cost already decides that step (before, the fixed rule decided until four
    decode steps and two mixed ones had run: on Zen 4 a fresh worker's first wave took 64-token steps
    beside 6-7 rows, over vllm serve's ITL p99). Real step times: which tokens it gives is the host's."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=96, max_num_batched_tokens=16,
                       enable_mixed_prefill=True, enable_prefix_caching=False,
                       mixed_step_target=StepTarget(factor=AUTO_FACTOR))
    results: dict[str, Collected] = {}
    engine.add_request("s0", llama.prompts[0], GREEDY)
    for _ in range(3):
        absorb(results, engine.step())
    assert [engine.scheduler.last_plan.rule, engine.scheduler.last_plan.waiting] == ["", 0]
    engine.add_request("w3", llama.prompts[3], GREEDY)
    absorb(results, engine.step())
    plan = engine.scheduler.last_plan
    assert plan[1:] == (1, 1) and plan.rule in ("cost", "cost-fallback") and plan.waiting == 1
    drain(engine, results)
    assert results["s0"].token_ids == llama.greedy[0] and results["w3"].token_ids == llama.greedy[3]


def test_off_without_mixed_prefill(llama: TinyModel) -> None:
    """The target needs mixed steps: an engine without them has no step budget."""
    engine = LLMEngine(llama.path, block_size=16, num_blocks=32, mixed_step_target=StepTarget(ms=60))
    assert engine.scheduler.step_budget is None
