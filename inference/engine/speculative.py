"""Speculative decoding without a draft model: n-gram prompt lookup (vLLM's `ngram` method).

Per running sequence, the last `n` tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
are looked up in the sequence's own prompt + output; the up to `k` tokens that followed the latest
longest match are proposed. The engine verifies every proposal of a decode batch in one forward
(each speculating sequence contributes its last token plus its proposals as query rows over its
paged KV, see `ModelRunner.run_verify`), samples every row as a plain decode step would, and keeps
the longest prefix of the proposal that the samples agree with, plus the sample after it.

Why this is exact. Row `j` of a sequence's rows holds the target's distribution `p_j` of the next
token given the context extended by the first `j` proposed tokens. Sampling `x_j ~ p_j` and
accepting proposal `t = proposals[j]` iff `x_j == t` accepts `t` with probability `p_j(t)`; when it
rejects, `x_j` is distributed as `p_j` with `t` removed and renormalised, and `x_j` is what is
emitted. That is the rejection-sampling rule for a point-mass draft (vLLM's `min(1, p/q)` with
`q = one-hot(t)`, residual `max(0, p - q)`), so the output is distributed as without speculation;
greedy rows take the argmax, so greedy output is identical. Each row draws its noise exactly as the
non-speculative step for that output index would (a seeded request's noise is a function of its seed
and the output index), so a seeded stream is token for token the one a plain decode draws, which
keeps a migrated seeded stream's continuation exact too.

What a sequence proposes. With the learned row budget (the default, `row_tile` None) every sequence with
a match offers its whole continuation (up to K tokens) and the budget (spec_budget.py) decides how
many of those rows the step runs, from each sequence's recent per-token hit rate and what rows cost
here: a sequence whose proposals keep failing gets no rows where rows cost, and still gets them where
they are nearly free (few rows in flight on a CPU), which is where a copy that starts after a stretch
of new text pays most. The fixed rules (`row_tile` n >= 0) have no cost to weigh, so they keep two
heuristics of their own: a proposal one token longer than the last accepted run (doubled after a
proposal accepted whole), and automatic off: a sequence whose proposals are mostly rejected (random
text) stops proposing for a cool-down that doubles each time it fails again. Under the budget those
heuristics cost steps: on SmolLM2 rewriting 8 paragraphs at 8 in flight (AMD EPYC Zen 4), the request
that ran longest, alone for its last ~90 tokens where a 5-row verify costs ~10 % more than a plain
step, was held to short proposals or none for whole cool-downs, while its text switched between
copies of the prompt and new words every few tokens.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .spec_budget import StepCosts, best_extra_rows, marginal_gains

if TYPE_CHECKING:
    from .block_manager import BlockManager
    from .sequence import Sequence

SPECULATIVE_METHODS = ("ngram",)

# Acceptance bookkeeping per sequence (automatic off, under the fixed row rules only): once at least
# MIN_PROPOSED proposed tokens count in the decayed window, a sequence whose share of accepted
# proposals is below MIN_ACCEPT_RATE stops proposing for COOLDOWN_STEPS decode steps, doubled at each
# further failure up to MAX_COOLDOWN_STEPS. A verify row costs about a decode row, so at 0.3 the
# proposals pay back only their own cost: below it speculating is a loss.
MIN_PROPOSED = 8
MIN_ACCEPT_RATE = 0.3
WINDOW_DECAY = 0.75  # the counters decay by this factor per verify step (a window of ~4 steps)
# A sequence's per-token hit rate (the row budget's gains) is its own decayed count blended with the
# engine-wide rate, weighted as this many proposed tokens: a new sequence starts from the engine's.
HIT_RATE_PRIOR = 2.0
ENGINE_DECAY = 0.95  # the engine-wide counts decay per sequence's verify outcome (a longer window)
COOLDOWN_STEPS = 16
MAX_COOLDOWN_STEPS = 512


@dataclass(frozen=True)
class SpeculativeConfig:
    """How the engine speculates: `method` "ngram" (prompt lookup), at most `num_speculative_tokens`
    proposed tokens per sequence and step, matching the last `prompt_lookup_max` down to
    `prompt_lookup_min` tokens."""

    method: str = "ngram"
    num_speculative_tokens: int = 8  # server.args.DEFAULT_SPECULATIVE_TOKENS: why 8
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    # How many rows a step gives proposals. None (the default): as many as maximise the step's
    # expected tokens per second on the step cost this engine measures per row count (spec_budget.py:
    # nearly all on a GPU, where rows are almost free; few or none on a CPU whose batch is past its
    # GEMM tile). n > 0: a fixed rule, proposals fill only the free rows of the batch's last tile of n
    # rows (what an AMD EPYC Zen 4's panel GEMM needed: 8 rows 13.7 ms, 9 rows 25 ms; kept for A/B
    # runs). 0: no budget, every sequence proposes up to K.
    row_tile: int | None = None

    def validate(self) -> None:
        """Raise ValueError naming the field that no engine can run with."""
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.row_tile is not None and self.row_tile < 0:
            raise ValueError(f"row_tile must be >= 0, got {self.row_tile}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}"
            )


def find_ngram_proposal(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The up to `k` tokens that followed the latest occurrence of the longest suffix of `tokens`
    (between `min_n` and `max_n` tokens long) found earlier in `tokens` and followed by `k` tokens
    (else its earliest occurrence); empty when there is none.

    Vectorised: the positions holding the last token are found in one comparison over the array,
    then the candidates are extended backwards one token at a time (at most `max_n - 1` small
    comparisons), so a step costs a few microseconds per sequence even at thousands of tokens.
    """
    size = tokens.shape[0]
    if k <= 0 or size <= min_n:
        return tokens[:0]
    # Candidate ends c (c <= size - 2: the suffix itself is not a match) with tokens[c] == last.
    cand = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])
    if cand.size == 0:
        return tokens[:0]
    n = 1
    for j in range(1, min(max_n, size - 1)):
        longer = cand[cand >= j]
        longer = longer[tokens[longer - j] == tokens[size - 1 - j]]
        if longer.size == 0:
            break
        cand, n = longer, j + 1
    if n < min_n:
        return tokens[:0]
    # The latest of the longest matches whose continuation has all k tokens, else the earliest (the
    # longest continuation): in a loop the latest match is the previous period, cut short by the end.
    full = cand[cand <= size - 1 - k]
    start = int(full[-1] if full.size else cand[0]) + 1
    return tokens[start : start + k]


@dataclass
class NgramState:
    """One sequence's token array (appended as it grows) and acceptance statistics."""

    buffer: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))
    size: int = 0
    proposed: float = 0.0  # decayed counts over the recent verify steps
    accepted: float = 0.0
    off_until: int = 0  # decode step (the speculator's counter) before which it does not propose
    cooldown: int = COOLDOWN_STEPS
    # Tokens to propose next (at most the configured K): one more than were accepted after a rejection,
    # doubled after a proposal accepted whole, so rows are spent where the text is being copied.
    k: int = 0
    total_proposed: int = 0
    total_accepted: int = 0
    # Decayed per-token counts for the hit rate: a proposal of n tokens with a accepted tried a + 1 of
    # them (the first miss ends it) or n (all confirmed); hits are the a.
    tried: float = 0.0
    hits: float = 0.0

    def tokens(self, seq: Sequence) -> np.ndarray:
        """`seq`'s prompt + output as an int64 array, appending only what is new since the last call."""
        prompt, out = seq.prompt_token_ids, seq.output_token_ids
        total = len(prompt) + len(out)
        if total < self.size:  # cannot happen to a live sequence; rebuild rather than be wrong
            self.size = 0
        if total > self.buffer.shape[0]:
            grown = np.empty(max(total + 64, 2 * self.buffer.shape[0]), dtype=np.int64)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        if self.size < len(prompt):
            self.buffer[self.size : len(prompt)] = prompt[self.size :]
            self.size = len(prompt)
        if self.size < total:
            self.buffer[self.size : total] = out[self.size - len(prompt) :]
            self.size = total
        return self.buffer[:total]

    @property
    def accept_rate(self) -> float:
        """Share of the recent proposed tokens that were accepted (0.5 before any)."""
        return self.accepted / self.proposed if self.proposed else 0.5

    def hit_rate(self, prior: float) -> float:
        """Probability that a proposed token is confirmed given those before it were: the recent
        per-token rate, blended with `prior` (the engine's rate) as HIT_RATE_PRIOR tokens."""
        return (self.hits + HIT_RATE_PRIOR * prior) / (self.tried + HIT_RATE_PRIOR)

    def record(self, proposed: int, accepted: int, step: int, max_k: int) -> None:
        """Count one verify step's outcome: the next proposal's length, and switch proposing off for a
        while when it does not pay."""
        self.k = min(max_k, 2 * max(self.k, proposed)) if accepted == proposed else accepted + 1
        self.tried = self.tried * WINDOW_DECAY + min(proposed, accepted + 1)
        self.hits = self.hits * WINDOW_DECAY + accepted
        self.proposed = self.proposed * WINDOW_DECAY + proposed
        self.accepted = self.accepted * WINDOW_DECAY + accepted
        self.total_proposed += proposed
        self.total_accepted += accepted
        if self.proposed >= MIN_PROPOSED and self.accepted < MIN_ACCEPT_RATE * self.proposed:
            self.off_until = step + self.cooldown
            self.cooldown = min(2 * self.cooldown, MAX_COOLDOWN_STEPS)
            self.proposed = self.accepted = 0.0
        elif accepted >= MIN_ACCEPT_RATE * proposed and self.cooldown > COOLDOWN_STEPS:
            self.cooldown = max(COOLDOWN_STEPS, self.cooldown // 2)


def accepted_tokens(proposal: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified sequence emits: the samples up to and including the first one that
    disagrees with the proposal (all `len(proposal) + 1` when every proposed token is confirmed)."""
    for j, tok in enumerate(proposal):
        if sampled[j] != tok:
            return sampled[: j + 1]
    return sampled[: len(proposal) + 1]


def can_speculate(seq: Sequence) -> bool:
    """Whether `seq` may propose: not a prefill-only request, and no structured output (its grammar
    matcher would have to advance through tokens that may be rejected; such a sequence decodes one
    token per step). Penalties, logit bias, min_tokens, seeds and logprobs are exact under
    speculation (each row sees the history its position would have)."""
    return seq.params.grammar is None and not seq.prefill_only


class NgramSpeculator:
    """Proposes tokens for a decode batch, reserving the KV slots they need, learns per sequence
    whether proposing pays (`record`) and what a step costs per row count (`observe`)."""

    def __init__(
        self, config: SpeculativeConfig, block_manager: BlockManager, block_size: int, max_rows: int | None = None
    ) -> None:
        """Proposals per `config`; lookahead blocks come from `block_manager`. `max_rows`: the most rows a
        verify step may run (the linears' row-invariant bound, ModelRunner.max_step_rows; None: any)."""
        config.validate()
        self.config = config
        self.max_rows = max_rows
        self.block_manager = block_manager
        self.block_size = block_size
        self.steps = 0  # decode steps seen (the clock of the per-sequence cool-downs)
        self.num_proposed = 0  # totals, for metrics and the benchmark
        self.num_accepted = 0
        self.num_verify_steps = 0
        self.costs = StepCosts()  # the learned row budget's cost curve (row_tile None)
        self.tried = 0.0  # engine-wide decayed per-token counts: the prior of a sequence's hit rate
        self.hits = 0.0

    @property
    def hit_rate(self) -> float:
        """The engine's recent per-token hit rate (0.5 before any proposal was verified)."""
        return (self.hits + 1.0) / (self.tried + 2.0)

    def observe(self, rows: int, seconds: float) -> None:
        """A decode (`rows` = the batch) or verify step's forward and sampling took `seconds`."""
        self.costs.observe(rows, seconds)

    def propose(self, batch: list[Sequence]) -> list[list[int]] | None:
        """Each sequence's proposed tokens (empty: it decodes one token) with the KV blocks for them
        allocated; None when no sequence of `batch` proposes (a plain decode step).

        The step's rows are budgeted (`SpeculativeConfig.row_tile`): by default the rows that
        maximise the expected tokens per second on the measured step cost (spec_budget.py), each
        going to the proposed token most likely to be emitted; with a fixed tile, the free rows of the
        batch's last tile, given first to the sequences whose proposals were accepted most. A proposal
        never needs a block the pool lacks: it is shortened to the slots the sequence already holds
        instead (speculation never preempts), and never runs past the sequence's token limit
        (max_tokens or the context length)."""
        self.steps += 1
        cfg = self.config
        b = len(batch)
        cap = b * (1 + cfg.num_speculative_tokens)  # the step's rows at most
        if self.max_rows is not None:
            # Past the linears' row-invariant bound a verified row would not be what plain decoding computes.
            cap = min(cap, self.max_rows)
        costs: list[float] | None = None
        if cfg.row_tile is None:
            costs = self.costs.curve(b, cap) if cap > b else None
            if costs is None:  # the plain step's cost first: every budget is relative to it
                return None
            budget = cap - b
        elif cfg.row_tile:
            budget = min(-(-b // cfg.row_tile) * cfg.row_tile, cap) - b
        else:
            budget = cap - b
        if budget <= 0:
            return None
        found = self._lookup(batch)
        if not found:
            return None
        if costs is not None:
            prior = self.hit_rate
            gains = marginal_gains([batch[i].spec_state.hit_rate(prior) for i, _ in found],
                                   [len(p) for _, p in found])
            extra = best_extra_rows(costs, b, gains)
            rows = Counter(j for _, j in gains[:extra])
            chosen = [(i, p[: rows[j]]) for j, (i, p) in enumerate(found) if rows[j]]
        else:
            chosen = sorted(found, key=lambda f: -batch[f[0]].spec_state.accept_rate)
        out: list[list[int]] = [[] for _ in batch]
        for i, proposal in chosen:
            proposal = self._reserve(batch[i], proposal[:budget])
            budget -= len(proposal)
            out[i] = proposal
            if budget <= 0:
                break
        return out if any(out) else None

    def _lookup(self, batch: list[Sequence]) -> list[tuple[int, list[int]]]:
        """(index in `batch`, proposed tokens) of every sequence that may propose and has a match."""
        cfg = self.config
        found: list[tuple[int, list[int]]] = []
        for i, seq in enumerate(batch):
            state = seq.spec_state
            if state is None:
                if not can_speculate(seq):
                    continue
                state = seq.spec_state = NgramState()
            budgeted = cfg.row_tile is None  # the cost budget weighs every row: no heuristics of its own
            if state.off_until > self.steps and not budgeted:
                continue
            n = seq.num_tokens
            # Emitting a+1 tokens after a accepted ones: never propose past the last token allowed.
            limit = (seq.token_limit or n + cfg.num_speculative_tokens + 1) - n - 1
            k = min(cfg.num_speculative_tokens if budgeted else (state.k or cfg.num_speculative_tokens), limit)
            if k <= 0:
                continue
            tokens = find_ngram_proposal(state.tokens(seq), cfg.prompt_lookup_min, cfg.prompt_lookup_max, k)
            if tokens.shape[0]:
                found.append((i, tokens.tolist()))
        return found

    def _reserve(self, seq: Sequence, proposal: list[int]) -> list[int]:
        """`proposal` with the KV blocks its tokens need allocated, shortened to the slots `seq` holds
        when the pool has too few free blocks."""
        n, bs, bm = seq.num_tokens, self.block_size, self.block_manager
        need = -(-(n + len(proposal)) // bs) - len(seq.block_ids)
        if need > 0:
            if bm.can_allocate(need):
                seq.block_ids.extend(bm.allocate(need))
            else:
                proposal = proposal[: max(0, len(seq.block_ids) * bs - n)]
        return proposal

    def record(self, seq: Sequence, proposed: int, accepted: int) -> None:
        """One verify step's outcome for `seq` (automatic off, totals)."""
        self.num_proposed += proposed
        self.num_accepted += accepted
        if proposed:
            self.tried = self.tried * ENGINE_DECAY + min(proposed, accepted + 1)
            self.hits = self.hits * ENGINE_DECAY + accepted
        if seq.spec_state is not None and proposed:
            seq.spec_state.record(proposed, accepted, self.steps, self.config.num_speculative_tokens)

    def trim(self, seq: Sequence) -> None:
        """Free the blocks `seq` holds past the one its next token goes into (the lookahead slots of
        rejected proposals): block bookkeeping stays exactly what a plain decode would hold."""
        keep = -(-seq.num_tokens // self.block_size)
        if len(seq.block_ids) > keep:
            self.block_manager.free(seq.block_ids[keep:])
            del seq.block_ids[keep:]

    @property
    def acceptance_rate(self) -> float:
        """Share of proposed tokens accepted so far (0.0 before any)."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0


@dataclass(slots=True)
class RowHistory:
    """The token history a verify row samples under (the logits processors' `TokenHistory`): its
    sequence's, extended by the proposed tokens before the row."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: frozenset[int] | None


def row_histories(batch: list[Sequence], proposals: list[list[int]]) -> list[Sequence | RowHistory]:
    """One history per verify row, in row order: the sequence itself for its first row (grammar
    matchers and every processor read it as in a plain decode step), a `RowHistory` for the rows
    after proposed tokens."""
    out: list[Sequence | RowHistory] = []
    for seq, proposal in zip(batch, proposals, strict=True):
        out.append(seq)
        for j in range(1, len(proposal) + 1):
            out.append(RowHistory(seq.prompt_token_ids, seq.output_token_ids + proposal[:j], seq.stop_ids))
    return out
