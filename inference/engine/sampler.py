"""Token sampling, vectorized over the batch: logits processors (penalties, logit_bias,
min_tokens; `logits_processors.py`), greedy, temperature, top-k, top-p, min-p, and per-request seeds
that give the same stream in every process.

Sampling uses the exponential-race form of a categorical draw: with `E_v ~ Exp(1)` independent,
`argmax_v p_v / E_v` is distributed as `p`. Unseeded rows draw all their noise in one call; a seeded
row draws its noise from a CPU `torch.Generator` seeded from (seed, output index), the only per-row
work, so a prefill worker and a decode worker (on any device) continue the same stream.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .logits_processors import TokenHistory, apply_processors, process
from .sampling_params import SamplingParams

# Mixes (seed, step) into one generator seed. Any fixed injective-enough mix works; what matters is that
# every process computes the same value for the same request and step.
_SEED_MULT = 1_000_003
_SEED_MOD = 2**63


def step_seed(seed: int, step: int) -> int:
    """The generator seed for output token `step` of a request seeded with `seed`."""
    return (seed * _SEED_MULT + step) % _SEED_MOD


def seeded_noise(seed: int, step: int, vocab: int) -> torch.Tensor:
    """The `Exp(1)` noise `[vocab]` (fp32, CPU) of output token `step` of a request seeded `seed`."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(step_seed(seed, step))
    return torch.empty(vocab, dtype=torch.float32).exponential_(generator=generator)


def _filter(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Apply top-k, top-p and min-p to temperature-scaled fp32 `[rows, vocab]` logits (masked → -inf)."""
    vocab = x.shape[-1]
    dev = x.device
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(ks) < vocab:
        k_t = torch.tensor(ks, device=dev)
        kth = torch.topk(x, max(ks), dim=-1).values.gather(1, (k_t - 1)[:, None])
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs_sorted = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top one always stays).
        cum_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
        remove = torch.zeros_like(cum_before, dtype=torch.bool).scatter_(1, order, cum_before >= top_p[:, None])
        x = x.masked_fill(remove, float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p[:, None] * probs.amax(-1, keepdim=True), float("-inf"))
    return x


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of the largest value of each row (the first one on ties, as `torch.argmax`).

    `max(dim).indices` instead of `argmax`: on a CPU torch's argmax over a long row is not vectorized;
    measured for `[32, 49152]` logits (SmolLM2's vocabulary) 6.1 ms against 1.2 ms in bf16 and 2.3
    against 0.8 ms in fp32: a tenth of a SmolLM2 decode step.
    """
    return x.max(dim=-1).indices


def inverse_cdf_sample(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of `probs` `[rows, vocab]`, drawn from the row's distribution by one uniform
    number against its cumulative sum (in float64: the tail's sums stay exact to ~1e-16).

    Unseeded rows take this path instead of the exponential race (argmax of probs / Exp(1) noise):
    the race draws one exponential number per vocabulary entry, and torch's CPU `exponential_` cost
    1.4 ms a row for SmolLM2's 49,152 entries on the AMX Xeon (a third of a 16-row decode step at
    temperature 1.0); the cumulative sum and one search cost a fraction of it. Same distribution; a
    zero-probability entry is never drawn (its cumulative sum equals its predecessor's).
    """
    cdf = probs.double().cumsum_(dim=-1)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def _greedy_ids(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: Sequence[TokenHistory] | None,
    rows: list[int] | None = None,
) -> torch.Tensor:
    """The argmax of each row's processed logits (only `rows` when given)."""
    if rows is not None:
        logits = logits[rows]
        params = [params[i] for i in rows]
        histories = None if histories is None else [histories[i] for i in rows]
    if histories is not None:
        logits = apply_processors(logits, params, histories)
    return row_argmax(logits)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    steps: list[int],
    histories: Sequence[TokenHistory] | None = None,
) -> list[int]:
    """One token per row of `logits` `[batch, vocab]`; `steps[i]` is row i's output index (for seeds),
    `histories[i]` row i's tokens (needed when a row uses a logits processor).

    Greedy rows take the argmax of the processed logits. Sampled rows are processed after the
    temperature scaling, with the additive terms scaled alike (`process`'s `scales`), so no extra
    copy of the logits is made; a seeded row takes this same path in every batch. A row whose
    temperature is so small that the scaled logits overflow takes the argmax too (its limit),
    instead of failing the batch with NaNs.
    """
    if histories is not None and not any(p.has_processors for p in params):
        histories = None
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return [int(t) for t in _greedy_ids(logits, params, histories).tolist()]
    picked = [params[i] for i in rows]
    temps = torch.tensor([p.temperature for p in picked], dtype=torch.float32, device=logits.device)[:, None]
    # One pass over the logits where possible: every row sampled needs no row gather.
    if len(rows) < len(params):
        x = logits[rows].float().div_(temps)
    elif logits.dtype != torch.float32:
        x = logits.float().div_(temps)
    else:
        x = logits / temps
    if histories is not None:
        x = process(x, picked, [histories[i] for i in rows], [1.0 / p.temperature for p in picked])
    # Overflow shows as +inf (or NaN); -inf is a masked token (min_tokens) or a harmless underflow.
    finite = ~(torch.isposinf(x) | torch.isnan(x)).any(-1)
    all_finite = bool(finite.all())
    if not all_finite:
        x = torch.where(finite[:, None], x, torch.zeros_like(x))
    x = _filter(x, picked)
    probs = torch.softmax(x, dim=-1)
    seeds = {j: p.seed for j, p in enumerate(picked) if p.seed is not None}
    if not seeds:
        choice = inverse_cdf_sample(probs)
    else:
        choice = torch.empty(len(picked), dtype=torch.long, device=probs.device)
        # A seeded row draws its own exponential race (the same noise in any batch: reproducible).
        seeded = list(seeds)
        noise = torch.stack([seeded_noise(seed, steps[rows[j]], probs.shape[-1]) for j, seed in seeds.items()])
        choice[seeded] = row_argmax(probs[seeded] / noise.to(device=probs.device, dtype=probs.dtype))
        free = [j for j, p in enumerate(picked) if p.seed is None]
        if free:
            choice[free] = inverse_cdf_sample(probs[free])
    if not all_finite:
        choice = torch.where(finite, choice, _greedy_ids(logits, params, histories, rows))
    if len(rows) == len(params):
        return [int(t) for t in choice.tolist()]
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    out = torch.empty(len(params), dtype=choice.dtype, device=choice.device)
    out[greedy_rows] = _greedy_ids(logits, params, histories, greedy_rows)
    out[rows] = choice
    return [int(t) for t in out.tolist()]
