"""How many rows a decode step spends on speculative proposals: decided from what steps cost here.

A verify row costs what the hardware makes it cost: on a GPU (or one CPU core at 1 to 7 rows) a step
of a few more rows costs about the same, so proposals are nearly free; on a CPU whose batch already
fills the GEMM's register tiles a row can cost what a decode row costs, and on an AMD EPYC Zen 4 the
9th row of SmolLM2's step doubled its time (the panel GEMM's 8-row tile). No CPU kind is assumed
here: `StepCosts` learns the step's wall time per row count from the engine's own decode and verify
steps, and `best_extra_rows` picks the number of proposal rows that maximises the step's expected
tokens per second against that curve.

The rule. A plain step of `b` sequences emits `b` tokens in `cost(b)`. Giving the proposals `e` rows
emits `b + A(e)` expected tokens in `cost(b + e)`, where `A(e)` is the sum of the `e` largest
marginal gains: the `j`-th proposed token of a sequence whose proposals are confirmed token by token
with probability `q` is emitted with probability `q ** j` (it needs the `j - 1` before it). The step
takes the `e` with the most expected tokens per second, and `e > 0` only where
`A(e) / (cost(b + e) - cost(b)) > b / cost(b)`: the extra rows' accepted tokens per extra second
beat the plain step's tokens per second.

Learning the curve. Each row count keeps its last `WINDOW` step times (the median is its cost, so a
step slowed by another process does not decide alone); samples older than `STALE_STEPS` steps are
dropped (context grows, other processes come and go). A row count without samples is interpolated
linearly between its measured neighbours and, above the largest measured one, taken as flat (as
cheap as that one): optimistic, so that a larger step is tried once where it would pay if it were
as cheap, and measured; the interpolation then narrows the search in a few steps instead of trying
every row count. The plain step's own cost must be measured and fresh before any proposal is made.

Nobody is slowed much. Every sequence of the batch pays the step's cost, and one without proposals
(or with proposals unlikely to be confirmed) gains nothing from the others' rows: a step may slow its
expected tokens per second by at most `MAX_SLOWDOWN`. Without that, the rows that raise the batch's
tokens per second can lower a batch's completion: on SmolLM2 with 8 random prompts at 8 in flight
(an AMD EPYC Zen 5), the requests whose answers loop finished in few verify steps of 30-36 rows
(2-3x a plain step) while one that did not loop ran its 160 steps at that price, then alone.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from statistics import median

WINDOW = 5  # step times kept per row count
STALE_STEPS = 400  # a sample older than this many observed steps no longer counts
# The most a step's proposals may slow one sequence's expected tokens per second (a sequence without
# proposals pays the extra rows' cost and gains nothing): 10 %, room for a GPU's nearly flat cost.
MAX_SLOWDOWN = 0.10


class StepCosts:
    """Decode / verify step wall times per row count, learned from the steps the engine runs."""

    def __init__(self, window: int = WINDOW, stale_steps: int = STALE_STEPS) -> None:
        """Keep `window` samples per row count, each for `stale_steps` observed steps."""
        self.window = window
        self.stale_steps = stale_steps
        self.clock = 0  # steps observed
        self._samples: dict[int, deque[tuple[int, float]]] = {}

    def observe(self, rows: int, seconds: float) -> None:
        """One step of `rows` query rows took `seconds` (wall time)."""
        self.clock += 1
        q = self._samples.get(rows)
        if q is None:
            q = self._samples[rows] = deque(maxlen=self.window)
        q.append((self.clock, seconds))

    def measured(self, rows: int) -> float | None:
        """The median of the fresh samples of `rows`, None when there is none."""
        q = self._samples.get(rows)
        if not q:
            return None
        kept = [(t, s) for t, s in q if self.clock - t < self.stale_steps]
        if len(kept) < len(q):  # forget stale ones for good, so a row count can become unknown again
            q.clear()
            q.extend(kept)
        return median([s for _, s in kept]) if kept else None

    def curve(self, lo: int, hi: int) -> list[float] | None:
        """Estimated cost of `lo`..`hi` rows (index 0 is `lo`), None when `lo` has no fresh sample.
        Unmeasured row counts are interpolated between measured ones, flat above the largest."""
        known = {r: c for r in self._row_counts(lo, hi) if (c := self.measured(r)) is not None}
        if lo not in known:
            return None
        points = sorted(known.items())
        out: list[float] = []
        j = 0
        for r in range(lo, hi + 1):
            while j + 1 < len(points) and points[j + 1][0] <= r:
                j += 1
            r0, c0 = points[j]
            if r == r0 or j + 1 == len(points):
                out.append(c0)
            else:
                r1, c1 = points[j + 1]
                out.append(c0 + (c1 - c0) * (r - r0) / (r1 - r0))
        return out

    def _row_counts(self, lo: int, hi: int) -> list[int]:
        """Sampled row counts from `lo` to `hi` plus the nearest sampled one above `hi` (it bounds the
        interpolation of the top of the range)."""
        rows = sorted(r for r in self._samples if r >= lo)
        inside = [r for r in rows if r <= hi]
        above = [r for r in rows if r > hi][:1]
        return inside + above


def best_extra_rows(
    costs: Sequence[float], base_rows: int, gains: Sequence[tuple[float, int]], max_slowdown: float = MAX_SLOWDOWN
) -> int:
    """The number of proposal rows `e` (0 .. len(gains), at most len(costs) - 1) that maximises
    `(base_rows + sum of the first e gains) / costs[e]`: expected tokens per second of a step of
    `base_rows` sequences (`costs[e]`: the cost of `base_rows + e` rows; `gains`: (marginal expected
    tokens, sequence) of each extra row, largest first, as `marginal_gains` gives them), among the
    `e` that slow no sequence's expected tokens per second by more than `max_slowdown`: a sequence
    with `a` expected extra tokens goes at `(1 + a) / costs[e]` against `1 / costs[0]` plainly, so
    rows that cost more than that share are not spent on the others (a sequence without proposals
    keeps its pace, and a batch's slowest request is not made slower). Ties keep the smaller `e`."""
    best_e, best_rate = 0, base_rows / costs[0]
    tokens = float(base_rows)
    extra: dict[int, float] = {}  # expected extra tokens per sequence
    for e in range(1, min(len(gains), len(costs) - 1) + 1):
        gain, seq = gains[e - 1]
        tokens += gain
        extra[seq] = extra.get(seq, 0.0) + gain
        slowest = 1.0 + (min(extra.values()) if len(extra) >= base_rows else 0.0)
        if slowest * costs[0] < (1.0 - max_slowdown) * costs[e]:
            continue
        rate = tokens / costs[e]
        if rate > best_rate * (1 + 1e-9):
            best_e, best_rate = e, rate
    return best_e


def marginal_gains(hit_rates: Sequence[float], lengths: Sequence[int]) -> list[tuple[float, int]]:
    """Every proposal row as (expected tokens it adds, index of its sequence), largest first: the
    `j`-th token (1-based) of sequence `i` adds `hit_rates[i] ** j`. A sequence's rows stay in order
    (ties go to the earlier row), so any prefix of the result takes each sequence's first tokens."""
    rows = [(q ** j, j, i) for i, (q, n) in enumerate(zip(hit_rates, lengths, strict=True))
            for j in range(1, n + 1)]
    rows.sort(key=lambda r: (-r[0], r[1], r[2]))
    return [(g, i) for g, _, i in rows]
