"""Speculative decoding (n-gram prompt lookup, speculative.py): greedy output identical to plain
decoding token for token, seeded output identical, unseeded output distributed alike, exact block
bookkeeping, and the proposer and acceptance rule themselves.

Two real checkpoints: the tiny Llama (random weights; its greedy text rarely repeats, so proposals are
mostly rejected), and the same model with every attention output projection zeroed ("copying"): its
next token depends on the last token only, so its greedy output falls into a cycle that n-gram lookup
predicts, and most proposals are accepted. The attention itself is checked on the random model by
verifying its true continuation (every proposal accepted) and a wrong one (rejected where it is wrong).
"""
from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from inference.engine import LLMEngine, SamplingParams, SpeculativeConfig
from inference.engine.speculative import accepted_tokens, find_ngram_proposal
from tests.support.copying_model import make_copying_model

K = 4


@pytest.fixture(scope="module")
def copying_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama whose greedy output cycles (tests/support/copying_model.py)."""
    return make_copying_model(tiny_model_dir, tmp_path_factory.mktemp("copying") / "model")


def engine(path: Path, dtype: str = "float32", k: int | None = K, row_tile: int = 0, **kw: object) -> LLMEngine:
    """An engine over `path`, speculating with `k` tokens (None: off); no row budget by default, so
    that every sequence of a full batch may propose."""
    spec = SpeculativeConfig(num_speculative_tokens=k, row_tile=row_tile) if k else None
    return LLMEngine(str(path), num_blocks=256, block_size=8, max_num_seqs=8, dtype=dtype, speculative=spec,
                     **kw)  # type: ignore[arg-type]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of varied lengths (ids above the special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 50))] for _ in range(n)]


# ------------------------------------------------------------------------------------- the proposer


def test_proposal_follows_the_latest_longest_match() -> None:
    t = np.array([1, 2, 3, 9, 7, 2, 3, 8, 5, 1, 2, 3], dtype=np.int64)
    # Suffix [1, 2, 3] occurs at 0..2 (followed by 9); [2, 3] also at 5..6 (followed by 8): longest wins.
    assert find_ngram_proposal(t, 2, 4, 3).tolist() == [9, 7, 2]
    # With at most 2-grams the latest 2-gram match wins.
    assert find_ngram_proposal(t, 1, 2, 3).tolist() == [8, 5, 1]
    # k caps the proposal; the tokens up to the end are all there is.
    assert find_ngram_proposal(t, 2, 4, 1).tolist() == [9]
    assert find_ngram_proposal(np.array([4, 5, 4, 5], dtype=np.int64), 2, 4, 8).tolist() == [4, 5]
    # No match of at least min_n tokens: nothing.
    assert find_ngram_proposal(np.array([1, 2, 3, 4, 3], dtype=np.int64), 2, 4, 3).tolist() == []
    assert find_ngram_proposal(np.array([1, 2, 3, 4, 3], dtype=np.int64), 1, 4, 3).tolist() == [4, 3]
    assert find_ngram_proposal(np.array([7], dtype=np.int64), 1, 4, 3).tolist() == []
    # In a loop the latest match is the previous period, whose continuation the end cuts short: the
    # latest match followed by all k tokens is taken instead.
    loop = np.array([9, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2], dtype=np.int64)
    assert find_ngram_proposal(loop, 2, 4, 4).tolist() == [1, 2, 1, 2]


def test_accepted_tokens_stop_at_the_first_disagreement() -> None:
    assert accepted_tokens([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all confirmed + the bonus token
    assert accepted_tokens([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # the sample replaces the first miss
    assert accepted_tokens([5], [4, 1]) == [4]
    assert accepted_tokens([], [3]) == [3]


def test_proposals_fill_the_last_row_tile_only(copying_model: Path) -> None:
    """With row_tile 8: a full batch of 8 runs plain decode steps; 3 sequences share the tile's 5
    free rows; the tokens stay plain decoding's."""
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    full = engine(copying_model, row_tile=8)
    ps = cycle_prompts(copying_model, 8)
    plain = [r.token_ids for r in engine(copying_model, k=None).generate(ps, params)]
    assert [r.token_ids for r in full.generate(ps, params)] == plain
    assert full.speculator is not None and full.speculator.num_proposed == 0
    few = engine(copying_model, row_tile=8)
    for i, p in enumerate(ps[:3]):
        few.add_request(f"r{i}", p, params)
    few.step()  # the prefill
    seqs = list(few.scheduler.running)
    proposals = few.speculator.propose(seqs) if few.speculator is not None else None
    assert proposals is not None and sum(map(len, proposals)) == 5
    assert [r.token_ids for r in few.generate(ps[3:6], params)] == plain[3:6]


def test_config_validation_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0).validate()
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="eagle").validate()
    with pytest.raises(ValueError, match="row_tile"):
        SpeculativeConfig(row_tile=-1).validate()
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2).validate()


# -------------------------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("model", "min_rate"), [("copying_model", 0.8), ("tiny_model_dir", 0.0)])
def test_greedy_tokens_identical(request: pytest.FixtureRequest, model: str, min_rate: float, dtype: str) -> None:
    """On the copying model most proposals are accepted; on the random one most are rejected (its
    text does not repeat). Either way the tokens are plain decoding's and the pool ends empty."""
    path = request.getfixturevalue(model)
    ps = prompts(12, seed=1)
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    plain = [r.token_ids for r in engine(path, dtype, None).generate(ps, params)]
    spec_engine = engine(path, dtype)
    assert [r.token_ids for r in spec_engine.generate(ps, params)] == plain
    s = spec_engine.speculator
    assert s is not None and s.acceptance_rate >= min_rate and (min_rate == 0 or s.num_accepted > 300)
    assert spec_engine.num_free_blocks == 256


def test_stops_inside_an_accepted_run_end_where_plain_decoding_ends(copying_model: Path) -> None:
    """max_tokens, a stop token and a stop string reached in the middle of accepted proposals: the
    tokens after the stop are dropped, text and finish reason as without speculation."""
    ps = prompts(6, seed=3)
    plain_engine, spec_engine = engine(copying_model, k=None), engine(copying_model, k=6)
    free = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    cycles = [r.token_ids for r in plain_engine.generate(ps, free)]
    cases: list[SamplingParams] = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in range(1, 40, 3)
    ]
    # A stop token taken from the cycle's tail (reached after proposals started being accepted).
    cases += [SamplingParams(max_tokens=60, temperature=0.0, stop_token_ids=[c[-3]]) for c in cycles[:3]]
    tok = plain_engine.tokenizer
    assert tok is not None
    texts = [tok.decode(c) for c in cycles]
    cases += [SamplingParams(max_tokens=60, temperature=0.0, stop=[t[-12:-6]]) for t in texts[:3] if t[-12:-6].strip()]
    for params in cases:
        plain = plain_engine.generate(ps, params)
        spec = spec_engine.generate(ps, params)
        assert [(r.token_ids, r.text, r.finish_reason) for r in spec] == \
            [(r.token_ids, r.text, r.finish_reason) for r in plain], params
    assert spec_engine.speculator is not None and spec_engine.speculator.num_accepted > 100
    assert spec_engine.num_free_blocks == 256


def test_verify_rows_attend_like_decode_steps(tiny_model_dir: Path) -> None:
    """On the random model (where attention matters), verifying the true greedy continuation accepts
    all of it, and a proposal wrong at position j is cut there with the true token in its place."""
    ps = prompts(4, seed=4)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    truth = [r.token_ids for r in engine(tiny_model_dir, k=None).generate(ps, params)]
    eng = engine(tiny_model_dir)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params)
    eng.step()  # the prefill: one token each
    seqs = [eng.get_sequence(f"r{i}") for i in range(len(ps))]
    assert all(s is not None and len(s.output_token_ids) == 1 for s in seqs)
    batch = [s for s in seqs if s is not None]
    # Sequence 0 gets the truth, 1 a proposal wrong at its third token, 2 none, 3 a wrong first token.
    wrong = truth[1][1:6]
    wrong[2] = (wrong[2] + 1) % 512
    proposals = [truth[0][1:6], wrong, [], [(truth[3][1] + 7) % 512]]
    for seq, proposal in zip(batch, proposals, strict=True):
        need = -(-(seq.num_tokens + len(proposal)) // eng.block_size) - len(seq.block_ids)
        seq.block_ids.extend(eng.block_manager.allocate(max(0, need)))
    outputs = eng._execute_verify(batch, proposals)
    got = {o.request_id: o.new_token_ids for o in outputs}
    assert got["r0"] == truth[0][1:7]  # 5 accepted + the bonus token
    assert got["r1"] == truth[1][1:4]  # 2 accepted, the third replaced by the true token
    assert got["r2"] == truth[2][1:2]
    assert got["r3"] == truth[3][1:2]
    for seq in batch:  # the lookahead blocks of rejected tokens are back in the pool
        assert len(seq.block_ids) == -(-seq.num_tokens // eng.block_size)
    while eng.has_work():
        eng.step()
    assert eng.num_free_blocks == 256


def test_blocks_and_prefix_hashes_cover_accepted_tokens_only(copying_model: Path) -> None:
    """After every step each running sequence holds the blocks a plain decode would (none left from
    rejected proposals), and the
    content hashes registered (what KV events announce) are those of a plain run."""
    ps = prompts(8, seed=5)
    params = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)
    hashes = []
    for k in (None, K):
        eng = engine(copying_model, k=k)
        for i, p in enumerate(ps):
            eng.add_request(f"r{i}", p, params)
        while eng.has_work():
            eng.step()
            held = 0
            for seq in eng.scheduler.running:
                # A plain decode holds the blocks of its cached tokens, and the next token's once planned.
                assert -(-(seq.num_tokens - 1) // eng.block_size) <= len(seq.block_ids) \
                    <= -(-seq.num_tokens // eng.block_size)
                held += len(seq.block_ids)
            assert eng.block_manager.num_free + held >= eng.block_manager.num_blocks  # shared blocks count once
        assert eng.num_free_blocks == 256
        hashes.append(sorted(eng.block_manager.held_hashes()))
    assert hashes[0] == hashes[1] and hashes[0]


# ------------------------------------------------------------------------------------------ sampled


def cycle_prompts(copying_model: Path, n: int) -> list[list[int]]:
    """Prompts made of the copying model's own greedy cycles (from `n` different starts): every
    position has an n-gram match from the start, so sampled requests propose at once."""
    starts = [[40 + i, 41 + 2 * i] for i in range(n)]
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    return [r.token_ids[-24:] for r in engine(copying_model, k=None).generate(starts, greedy)]


@pytest.mark.parametrize(("extra", "min_accepted"), [
    ({}, 30),
    ({"top_p": 0.9, "top_k": 50}, 30),
    # Penalties push the sampler off the cycle the proposals come from: few are accepted.
    ({"repetition_penalty": 1.05, "frequency_penalty": 0.1, "presence_penalty": 0.1}, 5),
    ({"min_tokens": 30, "logit_bias": {17: 3.0}}, 30),
])
def test_seeded_sampling_identical_to_plain_decoding(copying_model: Path, extra: dict, min_accepted: int) -> None:
    """Every verify row draws the noise its output index would draw without speculation, and sees the
    history (penalties, min_tokens) its position would: seeded streams are the same token for token."""
    ps = cycle_prompts(copying_model, 8)
    params = [SamplingParams(max_tokens=60, temperature=0.7, seed=100 + i, stop_token_ids=[5], **extra)
              for i in range(len(ps))]
    plain = [r.token_ids for r in engine(copying_model, k=None).generate(ps, params)]
    spec_engine = engine(copying_model)
    assert [r.token_ids for r in spec_engine.generate(ps, params)] == plain
    assert spec_engine.speculator is not None and spec_engine.speculator.num_accepted >= min_accepted


def run_with_logprobs(eng: LLMEngine, ps: list[list[int]], params: SamplingParams) -> list[tuple[list, list]]:
    """Each request's tokens and log-probability entries, gathered from its step outputs."""
    got: dict[str, tuple[list, list]] = {f"r{i}": ([], []) for i in range(len(ps))}
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params)
    while eng.has_work():
        for out in eng.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.logprobs or [])
    return [got[f"r{i}"] for i in range(len(ps))]


def test_logprobs_match_plain_decoding(copying_model: Path) -> None:
    ps = prompts(4, seed=7)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = run_with_logprobs(engine(copying_model, k=None), ps, params)
    spec_engine = engine(copying_model)
    spec = run_with_logprobs(spec_engine, ps, params)
    assert spec_engine.speculator is not None and spec_engine.speculator.num_accepted > 20
    for (a_tokens, a_lps), (b_tokens, b_lps) in zip(plain, spec, strict=True):
        assert a_tokens == b_tokens and len(b_lps) == len(b_tokens) == len(a_lps)
        for x, y in zip(a_lps, b_lps, strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_unseeded_sampling_distributed_as_plain_decoding(copying_model: Path) -> None:
    """Tokens 2-4 of many unseeded samples (each verified as a proposal: the prompt is the model's own
    cycle): each position's distribution, speculative against plain, within the total variation
    distance 2,000 samples each allow (fixed torch seed, so the test is deterministic)."""
    prompt = cycle_prompts(copying_model, 1)[0]
    torch.manual_seed(0)
    n = 2000
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    spec_engine = engine(copying_model)
    samples = []
    for eng in (engine(copying_model, k=None), spec_engine):
        rows: list[list[int]] = []
        for _ in range(n // 50):
            rows += [r.token_ids for r in eng.generate([prompt] * 50, params)]
        samples.append(rows)
    assert spec_engine.speculator is not None and spec_engine.speculator.num_accepted > n // 2
    for pos in (1, 2, 3):
        a = Counter(r[pos] for r in samples[0])
        b = Counter(r[pos] for r in samples[1])
        tv = 0.5 * sum(abs(a[t] - b[t]) for t in set(a) | set(b)) / n
        # Sampling noise alone: 0.02-0.07 at positions 1-2, 0.067-0.092 at position 3 (torch seeds 0-5,
        # the exponential race and the inverse-CDF draw alike); accepting a proposal too often (or too
        # rarely) by a factor 1.25 already moves the top token's share by 0.15 or more.
        assert tv < 0.11, (pos, tv)


# -------------------------------------------------------------------------------- when not to speculate


def test_grammar_requests_are_not_speculated(copying_model: Path) -> None:
    ps = prompts(2, seed=8)
    grammar = {"type": "regex", "pattern": "[a-z ]{5,40}"}
    params = SamplingParams(max_tokens=30, temperature=0.0, grammar=grammar)  # type: ignore[arg-type]
    plain = [r.token_ids for r in engine(copying_model, k=None).generate(ps, params)]
    spec_engine = engine(copying_model)
    assert [r.token_ids for r in spec_engine.generate(ps, params)] == plain
    assert spec_engine.speculator is not None and spec_engine.speculator.num_proposed == 0


def test_proposing_stops_when_proposals_keep_failing(tiny_model_dir: Path) -> None:
    """Random text on the random model: after a few rejected proposals a sequence stops proposing,
    so nearly every step is a plain decode step."""
    rng = random.Random(9)
    text = [rng.randrange(3, 512) for _ in range(40)]
    # The prompt repeats bigrams so that lookups find matches, while the model's continuation differs.
    ps = [text + text[: 10 + i] for i in range(4)]
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    eng = engine(tiny_model_dir)
    eng.generate(ps, params)
    s = eng.speculator
    assert s is not None and 0 < s.num_proposed < 0.2 * 300 * len(ps)
    assert s.acceptance_rate < 0.3


def test_abort_mid_speculation_frees_every_block(copying_model: Path) -> None:
    """Aborting speculating requests between steps (holding lookahead-trimmed blocks) and during a
    run returns the pool whole; the others finish as plain decoding would."""
    ps = cycle_prompts(copying_model, 4)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain = [r.token_ids for r in engine(copying_model, k=None).generate(ps, params)]
    eng = engine(copying_model)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
    finished: dict[str, str | None] = {}
    steps = 0
    while eng.has_work():
        for out in eng.step():
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        steps += 1
        if steps == 4:
            eng.abort("r1")
            eng.abort("r3")
    assert finished == {"r0": "length", "r1": "abort", "r2": "length", "r3": "abort"}
    assert tokens["r0"] == plain[0] and tokens["r2"] == plain[2]
    assert 0 < len(tokens["r1"]) < 60 and tokens["r1"] == plain[1][: len(tokens["r1"])]
    assert eng.speculator is not None and eng.speculator.num_accepted > 20
    assert eng.num_free_blocks == 256



@pytest.mark.parametrize("row_tile", [None, 0])
def test_the_learned_budget_keeps_offering_whole_continuations(copying_model: Path, row_tile: int | None) -> None:
    """Under the learned row budget (row_tile None) the fixed rules' heuristics are off: a sequence
    in a cool-down after failed proposals, whose last proposal was cut to one token, still offers its
    whole continuation (K tokens), and the budget's hit rate decides how many rows run. The fixed
    rules (row_tile 0 here) keep both heuristics: no offer during the cool-down, then a short one."""
    ps = cycle_prompts(copying_model, 2)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    eng = engine(copying_model, row_tile=row_tile)  # type: ignore[arg-type]
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, params)
    for _ in range(6):
        eng.step()
    spec = eng.speculator
    assert spec is not None
    batch = [seq for i in range(len(ps)) if (seq := eng.get_sequence(f"r{i}")) is not None]
    assert len(batch) == len(ps) and all(seq.spec_state is not None for seq in batch)
    for seq in batch:  # as after a run of rejections: cooling down, next proposal one token long
        assert seq.spec_state is not None
        seq.spec_state.off_until, seq.spec_state.k = spec.steps + 100, 1
    offered = [len(p) for _, p in spec._lookup(batch)]
    if row_tile is None:
        assert offered == [K] * len(ps)
    else:
        assert offered == []
        for seq in batch:
            assert seq.spec_state is not None
            seq.spec_state.off_until = 0
        assert [len(p) for _, p in spec._lookup(batch)] == [1] * len(ps)
