"""The speculative row budget learned from step costs (spec_budget.py): the rule on given cost curves
(a GPU's flat one, a CPU's tiled and linear ones, this machine's kind measured), the cost curve learned
from step timings, and the engine with the learned budget: proposals sized by the costs it was given,
greedy output identical to plain decoding end to end."""
from __future__ import annotations

from pathlib import Path

import pytest

from inference.engine import LLMEngine, SamplingParams, SpeculativeConfig
from inference.engine.spec_budget import StepCosts, best_extra_rows, marginal_gains
from tests.support.copying_model import make_copying_model

K = 4


def rows_curve(cost: dict[int, float], lo: int, hi: int) -> list[float]:
    """`cost` as the list `best_extra_rows` takes (index 0 is `lo` rows)."""
    return [cost[r] for r in range(lo, hi + 1)]


def tiled(rows: int) -> float:
    """A step whose GEMM runs tiles of 8 rows, compute-bound past the first: flat within a tile, each
    new tile as dear as the first (an AMD EPYC Zen 4's SmolLM2 steps in the engine were near this:
    docs/benchmarks.md, 8 rows 13.7 ms, a verify step 2.5x a plain one)."""
    return 13.7 * -(-rows // 8)


# ------------------------------------------------------------------------------------- the rule


def test_flat_cost_takes_every_row_that_can_gain() -> None:
    """A GPU: rows cost (nearly) nothing, so every proposed token with a chance is verified."""
    costs = [10.0 + 0.001 * e for e in range(33)]
    gains = marginal_gains([0.6] * 8, [4] * 8)
    assert best_extra_rows(costs, 8, gains) == 32
    assert best_extra_rows(costs, 8, gains[:5]) == 5  # no more rows than proposed tokens
    assert best_extra_rows(costs, 8, [(0.0, i % 8) for i in range(32)]) == 0  # tokens that cannot be accepted
    # Rows this cheap slow the sequences without proposals by less than MAX_SLOWDOWN: they do not block.
    assert best_extra_rows(costs, 8, marginal_gains([0.6] * 3, [4] * 3)) == 12


def test_linear_cost_never_pays() -> None:
    """Compute-bound (a row costs what a decode row costs): a proposal emits less than a row's worth."""
    costs = [float(8 + e) for e in range(33)]
    assert best_extra_rows(costs, 8, [(0.99, i % 8) for i in range(32)]) == 0


def test_tiled_cost_fills_the_tile_only() -> None:
    """3 sequences ride in the 8-row tile for free, a full tile of 8 opens no new one even at 97 %
    acceptance: what the fixed row_tile=8 rule did."""
    gains3 = marginal_gains([0.97] * 3, [4] * 3)
    assert best_extra_rows([tiled(r) for r in range(3, 16)], 3, gains3) == 5
    gains8 = marginal_gains([0.97] * 8, [4] * 8)
    assert best_extra_rows([tiled(r) for r in range(8, 41)], 8, gains8) == 0


def test_zen5_like_cost_speculates_at_8_in_flight_when_acceptance_is_high() -> None:
    """SmolLM2 bf16 on an AMD EPYC Zen 5 (bench/verify_cost, medians): 16 rows ~1.44x, 24 rows ~2x the
    8-row step. High acceptance buys a second tile's worth of rows; low acceptance buys none."""
    cost = {r: 28.4 * (1 + 0.055 * (r - 8)) for r in range(8, 17)} | {r: 28.4 * (1.44 + 0.07 * (r - 16))
                                                                      for r in range(17, 41)}
    curve = rows_curve(cost, 8, 40)
    high = marginal_gains([0.8] * 8, [4] * 8)
    assert 8 <= best_extra_rows(curve, 8, high) <= 16
    low = marginal_gains([0.3] * 8, [4] * 8)
    assert best_extra_rows(curve, 8, low) == 0


def test_the_chosen_rows_beat_the_plain_step() -> None:
    """Whatever the curve, the rows taken give more expected tokens per second than the plain step (their
    expected tokens per extra second beat the plain step's tokens per second); none are taken when no
    number of rows does."""
    curves = [[10.0, 10.0, 30.0, 30.0, 31.0], [10.0, 13.0, 16.0, 19.0, 22.0], [10.0, 11.0, 12.0, 30.0, 30.0],
              [10.0, 10.5, 11.0, 11.5, 40.0]]
    gains = [0.9, 0.7, 0.5, 0.2]
    rows = [(g, 0) for g in gains]  # one sequence's 4 proposed tokens
    for costs in curves:
        e = best_extra_rows(costs, 4, rows, max_slowdown=1.0)  # (the slowdown bound apart: next test)
        if e:
            # Equivalently sum(gains[:e]) / (costs[e] - costs[0]) > 4 / costs[0] where the rows cost more.
            assert (4 + sum(gains[:e])) / costs[e] > 4 / costs[0]
        else:
            assert all((4 + sum(gains[:j])) / costs[j] <= 4 / costs[0] for j in range(1, 5))
    assert [best_extra_rows(c, 4, rows, max_slowdown=1.0) for c in curves] == [1, 0, 2, 3]


def test_no_sequence_is_slowed_for_the_others() -> None:
    """8 sequences, 7 of them copying text (every proposal confirmed), one with nothing to propose: the
    batch's tokens per second would gain most from 28 rows (3.8x a plain step's cost), but the eighth
    sequence would run at a quarter of its pace, so only what costs it at most MAX_SLOWDOWN is taken."""
    curve = [1.0 + 0.1 * e for e in range(33)]
    copying = marginal_gains([1.0] * 7 + [0.0], [4] * 7 + [0])
    assert best_extra_rows(curve, 8, copying, max_slowdown=1.0) == 28
    assert best_extra_rows(curve, 8, copying) == 1  # the one row within MAX_SLOWDOWN (1.1 <= 1 / 0.9)
    assert best_extra_rows(curve, 8, copying, max_slowdown=0.0) == 0
    # Half copying, half rarely confirmed: the batch would gain from the copying ones' 16 rows, which
    # would slow the others to 1.3 / 2.6 of their pace; every sequence copying, all rows pay.
    mixed = marginal_gains([1.0] * 4 + [0.3] * 4, [4] * 8)
    assert best_extra_rows(curve, 8, mixed, max_slowdown=1.0) == 16
    assert best_extra_rows(curve, 8, mixed) == 1
    assert best_extra_rows(curve, 8, marginal_gains([1.0] * 8, [4] * 8)) == 32


def test_marginal_gains_take_each_sequence_in_order() -> None:
    gains = marginal_gains([0.9, 0.5, 1.0], [3, 2, 2])
    assert [i for _, i in gains[:4]] == [2, 2, 0, 0]  # 1.0, 1.0, 0.9, 0.81
    assert gains[4:] == [(pytest.approx(0.729), 0), (0.5, 1), (0.25, 1)]
    # With equal gains a sequence's first token comes before anyone's second.
    assert [i for _, i in marginal_gains([1.0, 1.0], [2, 2])] == [0, 1, 0, 1]


# ------------------------------------------------------------------------------- the learned curve


def test_step_costs_median_interpolation_and_flat_top() -> None:
    costs = StepCosts(window=3, stale_steps=100)
    assert costs.curve(8, 12) is None  # the plain step's rows were never timed
    for s in (0.010, 0.011, 0.050):  # one step slowed by another process does not decide alone
        costs.observe(8, s)
    costs.observe(12, 0.014)
    assert costs.measured(8) == pytest.approx(0.011)
    curve = costs.curve(8, 16)
    assert curve is not None and len(curve) == 9
    assert curve[0] == pytest.approx(0.011) and curve[2] == pytest.approx(0.0125)  # 10 rows: halfway
    assert curve[4] == pytest.approx(0.014) and curve[8] == pytest.approx(0.014)  # flat above 12 rows
    costs.observe(20, 0.030)  # a measured row count above the range bounds its top's interpolation
    top = costs.curve(8, 16)
    assert top is not None and top[8] == pytest.approx(0.014 + (0.030 - 0.014) * 4 / 8)


def test_step_costs_forget_stale_samples() -> None:
    costs = StepCosts(window=5, stale_steps=10)
    costs.observe(12, 0.050)
    for _ in range(10):
        costs.observe(8, 0.010)
    assert costs.measured(12) is None  # measured long ago: unknown again, tried anew when it may pay
    curve = costs.curve(8, 12)
    assert curve is not None and curve[4] == pytest.approx(0.010)


# ----------------------------------------------------------------------------------- in the engine


@pytest.fixture(scope="module")
def copying_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama whose greedy output cycles (tests/support/copying_model.py)."""
    return make_copying_model(tiny_model_dir, tmp_path_factory.mktemp("copying") / "model")


def engine(path: Path, k: int | None = K, dtype: str = "float32") -> LLMEngine:
    """An engine over `path` with the learned row budget (the default), or none speculating (k None)."""
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    return LLMEngine(str(path), num_blocks=256, block_size=8, max_num_seqs=8, dtype=dtype, speculative=spec)


def running(eng: LLMEngine, copying_model: Path, n: int) -> list:
    """`n` requests whose prompts are the copying model's cycles (every one has a match), prefilled."""
    starts = [[40 + i, 41 + 2 * i] for i in range(n)]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    cycles = [r.token_ids[-24:] for r in engine(copying_model, k=None).generate(starts, params)]
    for i, p in enumerate(cycles):
        eng.add_request(f"r{i}", p, params)
    eng.step()  # the prefill
    return list(eng.scheduler.running)


def test_proposals_follow_the_measured_cost(copying_model: Path) -> None:
    """Given a flat cost curve the engine proposes up to K for all 8 sequences; given a linear one it
    proposes nothing; before the plain step was timed it proposes nothing."""
    eng = engine(copying_model)
    seqs = running(eng, copying_model, 8)
    s = eng.speculator
    assert s is not None and len(seqs) == 8
    assert s.propose(seqs) is None  # nothing measured yet: a plain step first
    for rows in range(8, 41):
        s.observe(rows, 0.010 + 0.00001 * (rows - 8))
    flat = s.propose(seqs)
    # A new sequence's hit rate is 0.5: its 1st to 4th tokens are worth 0.5, 0.25, 0.125, 0.0625.
    assert flat is not None and all(len(p) >= 3 for p in flat)
    for seq in seqs:
        s.trim(seq)
    eng2 = engine(copying_model)
    seqs2 = running(eng2, copying_model, 8)
    assert eng2.speculator is not None
    for rows in range(8, 41):
        eng2.speculator.observe(rows, 0.001 * rows)
    assert eng2.speculator.propose(seqs2) is None


def test_proposals_stay_within_the_linears_row_bound(copying_model: Path) -> None:
    """A verify step never runs more rows than the linears compute alike alone and together
    (`NgramSpeculator.max_rows`, from ModelRunner.max_step_rows): under a flat cost curve 8 sequences
    would propose up to 32 tokens; with a bound of 12 rows they propose 4, with 8 (or fewer) none."""
    for bound, most in ((12, 4), (8, 0), (5, 0)):
        eng = engine(copying_model)
        seqs = running(eng, copying_model, 8)
        s = eng.speculator
        assert s is not None
        s.max_rows = bound
        for rows in range(8, 41):
            s.observe(rows, 0.010 + 0.00001 * (rows - 8))
        proposals = s.propose(seqs)
        assert (sum(map(len, proposals)) if proposals else 0) == most, bound
        if proposals:
            for seq in seqs:
                s.trim(seq)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_tokens_identical_with_the_learned_budget(copying_model: Path, tiny_model_dir: Path,
                                                         dtype: str) -> None:
    """End to end on both models, the budget learned from the engine's own steps: the tokens are plain
    decoding's, the pool ends empty; the copying model's cycles get proposals verified (how many
    depends on the step times measured, the tokens must not)."""
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    starts = [[40 + i, 41 + 2 * i, 7 + i] for i in range(6)]
    for path in (copying_model, tiny_model_dir):
        plain = [r.token_ids for r in engine(path, None, dtype).generate(starts, params)]
        spec = engine(path, K, dtype)
        assert [r.token_ids for r in spec.generate(starts, params)] == plain
        assert spec.num_free_blocks == 256
        assert spec.speculator is not None and spec.speculator.costs.measured(6) is not None
        if path == copying_model:
            assert spec.speculator.num_accepted > 0
