"""How many prompt tokens a mixed step may carry: as many as keep the step within a time target, on the
step cost this engine measures (Sarathi-Serve's stall-free batching: a step's prompt tokens are chosen
so that the running streams' next token is not delayed past a bound).

Why not a fixed token budget: what a prompt token and a running row cost depends on the CPU, the model,
the dtype, the context and whatever else runs on the cores. On an Intel Xeon with AMX a decode step of
8 rows took 77-97 ms and a 64-token chunk after a 384-token cached prefix added ~90 ms; `vllm serve`'s
ITL p99 on that workload was 164 ms, so a step could carry only ~60-80 ms of prompt work, which a
fixed 64-token budget does not know (docs/benchmarks.md, issue 19's tails).

The model. A step of `r` decode rows and `p` prompt tokens takes `a + b*r` when `p` is 0 and
`a + b*r + d + c*p` otherwise, `(a, b)` fitted on the decode-only steps and `(d, c)` on the residuals
of the steps with prompt tokens, each an exponentially weighted least-squares fit (`DECAY` per
sample of its kind: a recent window, so the fit follows the context growing and other processes
coming and going; mixed steps are rarer than decode steps and keep their own memory). Each fit has a
weak prior where its data cannot decide: a flat decode cost while every step had the same rows (the
slope `b` is pulled to 0), a proportional prompt cost while every mixed step had the same tokens (the
intercept `d` is pulled to 0; a zero slope there would make prompt tokens free). A sample far over the
prediction (another process took the core) counts at most `OUTLIER` times the prediction.

The budget. The target is `factor x` the predicted decode-only step of the running rows ("2x":
relative, so it follows the batch as vLLM's own step does) or an absolute time ("150ms": the budget
shrinks as rows grow). The step gets `(target - a - b*r - d) / c` prompt tokens, at most `cap`. Where
that is under `floor`, no mixed step beside these rows can stay within the target (on the AMX Xeon a
mixed step cost ~10-30 ms more than the rows alone before its first token, then ~0.4 ms a token):
smaller chunks would only make more steps over it, so the step takes the scheduler's fixed budget
(`fallback`, at least `floor`: prompts always progress). Until both fits have samples the scheduler
keeps its own budget, so they start early: a prompt-only step before any decode step (a worker's first
prompts) is fitted over no decode cost, and two decode steps and one step with prompt tokens are
enough (on Zen 4 a fresh worker's first wave ran four fixed 64-token steps beside 6-7 rows, 139-157 ms
against vllm serve's ITL p99 of 132 ms, while the fit waited for its fourth decode step; replayed, the
fit of three predicted those steps within 5 %: fifteenth session). Steps with more prompt tokens than
`cap` (bursts, taken whole by the scheduler's burst rule) are not fitted: a large GEMM's cost per
token is lower than a small chunk's, and the fit is for the steps it decides.

A prompt's wait. The target protects the running streams' next token; a prompt that waits meanwhile
pays for it in its first token, and TTFT p99 is the slowest of a few dozen first tokens. Once a waiting
prompt has gone more than `OVERDUE_TARGETS` target steps without progress (since it was queued, or
since its last chunk ran), the scheduler takes the waiting prompts whole in the next step (up to its
burst cap), as it does a burst. Why whole rather than larger
steps: ITL p99 counts gaps, and a step beside `r` streams gives `r` of them; the same prompt tokens
in one step cost each stream one long gap, spread over several steps each stream several gaps, and
the first version of this rule, steps growing with the wait up to 8 budgets, put 512-token steps of
0.3-0.5 s beside 4-7 streams, the top 1 % of the gaps (ITL p99 1.16-1.66x vllm serve's on a busy
AMX Xeon at 512 in / 128 out). A prompt that the target feeds a chunk every step is never overdue, nor
is one that arrives during a step and goes in the next; the prompts left behind a burst step, which
waited seconds, are: on that Xeon at 512 in / 128 out the target fed them 47-71 tokens a step beside
5-7 streams, and the last had its first token about 5 s after the wave began against vllm serve's
TTFT p99 of 2.5 s (docs/benchmarks.md, "Tails against vllm serve, seventeenth session").
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

DECAY = 0.95  # weight of the older samples of a fit per new sample of its kind (a window of ~20)
OUTLIER = 1.5  # a sample counts at most this many times the prediction
PRIOR = 1e-3  # the weak prior's weight, relative to the fit's sample weight
MIN_DECODE_SAMPLES = 2  # decode-only steps before the budget is used
MIN_PROMPT_SAMPLES = 1  # steps with prompt tokens before the budget is used
# "auto": the target is this many decode-only steps of the running rows. 2: with one worker per core
# each holds about half the streams, and twice its decode step is about one step of all of them, a
# single-process server's steady gap (vllm serve's ITL p99 on the shared-prefix workload is its 16-row
# decode step). It was 1.6 (fourteenth session, AMX Xeon): on Zen 4 that left room for less than a
# block beside 6-7 rows (a cached-prefix token ~1.5 ms, a mixed step's fixed cost ~10 ms), so 15 of 21
# mixed steps fell back to the fixed 64 tokens (145-184 ms; ITL p99 148 ms) where 2x took 22-29 tokens
# a step (88 ms mean; ITL p99 103 ms): docs/benchmarks.md, "Tails against vllm serve, fifteenth session".
AUTO_FACTOR = 2.0
# A waiting prompt is overdue after this many target steps without progress (module docstring, "A
# prompt's wait"): one fed a chunk every step never is; one left behind a burst step is.
OVERDUE_TARGETS = 2.0
# The workers' --mixed-step-target unless told otherwise.
DEFAULT_MIXED_STEP_TARGET = "off"
TARGET_FORMS = "off, auto, <k>x (k > 1: k decode-only steps of the running rows) or <ms>ms"


@dataclass(frozen=True)
class StepTarget:
    """The time a mixed step should stay within: `factor` times the predicted decode-only step of the
    running rows, or `ms` milliseconds (exactly one is set)."""

    factor: float | None = None
    ms: float | None = None

    def seconds(self, decode_s: float) -> float:
        """The target for a step whose rows alone take `decode_s` seconds."""
        return self.factor * decode_s if self.factor is not None else (self.ms or 0.0) / 1000.0

    def __str__(self) -> str:
        return f"{self.factor:g}x" if self.factor is not None else f"{self.ms:g}ms"


def parse_step_target(text: str | None, name: str = "--mixed-step-target") -> StepTarget | None:
    """`text` as a StepTarget (None for "off" or None); ValueError naming `name` for anything else."""
    if text is None:
        return None
    value = text.strip().lower()
    if value == "off":
        return None
    if value == "auto":
        return StepTarget(factor=AUTO_FACTOR)
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(x|ms)", value)
    number = float(m.group(1)) if m else math.nan
    if m and m.group(2) == "x" and 1.0 < number <= 100.0:
        return StepTarget(factor=number)
    if m and m.group(2) == "ms" and 0.0 < number <= 600_000.0:
        return StepTarget(ms=number)
    raise ValueError(f"{name} must be {TARGET_FORMS}, got {text!r}")


class _LineFit:
    """y = intercept + slope * x by exponentially weighted least squares, with a weak prior pulling
    `pull` ("slope" or "intercept") to 0 where the samples cannot decide between the two."""

    def __init__(self, pull: str, decay: float = DECAY) -> None:
        self.pull = pull
        self.decay = decay
        self.n = 0  # samples seen
        self.w = self.sx = self.sxx = self.sy = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        """One sample; older ones weigh `decay` less each time."""
        k = self.decay
        self.n += 1
        self.w, self.sx, self.sxx = k * self.w + 1.0, k * self.sx + x, k * self.sxx + x * x
        self.sy, self.sxy = k * self.sy + y, k * self.sxy + x * y

    def coefficients(self) -> tuple[float, float] | None:
        """(intercept, slope), None before the first sample."""
        if self.n == 0:
            return None
        # Normal equations [[w, sx], [sx, sxx + l1]] @ [i, s] = [sy, sxy] with the prior's weight on
        # the pulled coefficient (l0 on the intercept, l1 on the slope), scaled to the data's own.
        l0 = PRIOR * self.w if self.pull == "intercept" else 0.0
        l1 = PRIOR * max(self.sxx, 1.0) if self.pull == "slope" else 0.0
        a00, a01, a11 = self.w + l0, self.sx, self.sxx + l1
        det = a00 * a11 - a01 * a01
        if det <= 1e-12 * max(a00 * a11, 1e-30):
            return None
        return (a11 * self.sy - a01 * self.sxy) / det, (a00 * self.sxy - a01 * self.sy) / det


class StepCostModel:
    """The step time of `rows` decode rows plus `tokens` prompt tokens, learned from the steps run
    (module docstring: decode-only steps fit `a + b*rows`, the others `d + c*tokens` on top)."""

    def __init__(self, decay: float = DECAY) -> None:
        """Fits forgetting `decay` of their weight per sample of their kind."""
        self._decode = _LineFit("slope", decay)
        self._prompt = _LineFit("intercept", decay)

    @property
    def decode_samples(self) -> int:
        """Decode-only steps observed."""
        return self._decode.n

    @property
    def prompt_samples(self) -> int:
        """Steps with prompt tokens observed."""
        return self._prompt.n

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A step of `rows` decode rows and `tokens` prompt tokens took `seconds`."""
        expected = self.predict(rows, tokens)
        if expected is not None and expected > 0:
            seconds = min(seconds, OUTLIER * expected)  # another process held the core
        if tokens == 0:
            self._decode.add(rows, seconds)
            return
        # A prompt-only step before any decode step: over no decode cost (the fit's `d` absorbs the
        # step's fixed cost until decode steps price it).
        base = self.predict(rows, 0) if self._decode.n or rows else 0.0
        if base is not None:
            self._prompt.add(tokens, seconds - base)

    def predict(self, rows: int, tokens: int) -> float | None:
        """Predicted seconds of such a step; None while the fits it needs have no samples."""
        dec = self._decode.coefficients()
        if dec is None:
            return None
        base = max(0.0, dec[0] + dec[1] * rows)
        if tokens == 0:
            return base
        pro = self._prompt.coefficients()
        return None if pro is None else base + max(0.0, pro[0] + pro[1] * tokens)

    def tokens_within(self, rows: int, target: StepTarget) -> float | None:
        """Prompt tokens a step of `rows` rows may carry to stay within `target` (may be < 0: the rows
        alone take longer); None until both fits have enough samples or while a prompt token looks
        free (the fit cannot price it yet)."""
        if self._decode.n < MIN_DECODE_SAMPLES or self._prompt.n < MIN_PROMPT_SAMPLES:
            return None
        base, pro = self.predict(rows, 0), self._prompt.coefficients()
        if base is None or pro is None or pro[1] <= 0:
            return None
        return (target.seconds(base) - base - max(0.0, pro[0])) / pro[1]


class MixedStepBudget:
    """The prompt-token budget of mixed steps that follows the measured step cost (module docstring)."""

    def __init__(self, target: StepTarget, floor: int, cap: int, fallback: int | None = None,
                 model: StepCostModel | None = None) -> None:
        """Budgets of `floor` to `cap` prompt tokens keeping steps within `target`; `fallback` (default
        `floor`) where even `floor` would not."""
        if not 0 < floor <= cap:
            raise ValueError(f"the mixed step budget needs 0 < floor <= cap, got {floor} and {cap}")
        self.target = target
        self.floor = floor
        self.cap = cap
        self.fallback = max(floor, min(cap, fallback or floor))
        self.model = model or StepCostModel()
        self.fell_back = False  # the last `tokens` gave the fallback (no step could meet the target)

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        """A step ran (`rows` decode rows, `tokens` prompt tokens, `seconds`): fit it unless it was a
        burst beyond `cap` or had no work."""
        if (rows or tokens) and tokens <= self.cap:
            self.model.observe(rows, tokens, seconds)

    def tokens(self, rows: int) -> int | None:
        """The budget of a mixed step beside `rows` decode rows; None while the cost is unknown (the
        scheduler keeps its fixed budget)."""
        room = self.model.tokens_within(rows, self.target)
        if room is None:
            return None
        tokens = round(room)  # the fit is coarser than half a token
        self.fell_back = tokens < self.floor
        return self.fallback if self.fell_back else min(self.cap, tokens)

    def overdue(self, rows: int, waited_s: float) -> bool:
        """Whether a prompt that has waited `waited_s` seconds without progress beside `rows` decode rows
        has waited more than `OVERDUE_TARGETS` target steps (module docstring: the scheduler then takes
        the waiting prompts whole); False while the decode cost is unknown."""
        base = self.model.predict(rows, 0)
        return base is not None and waited_s > OVERDUE_TARGETS * self.target.seconds(base)
