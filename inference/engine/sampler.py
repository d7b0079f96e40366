"""Token sampling: greedy, temperature, top-k, top-p, with per-request deterministic seeds."""
from __future__ import annotations

import torch

from .sampling_params import SamplingParams

# Mixes (seed, step) into one generator seed. Any fixed injective-enough mix works; what matters is that
# every process computes the same value for the same request and step.
_SEED_MULT = 1_000_003
_SEED_MOD = 2**63


def step_seed(seed: int, step: int) -> int:
    """The generator seed for output token `step` of a request seeded with `seed`."""
    return (seed * _SEED_MULT + step) % _SEED_MOD


def sample_one(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """Sample one token from a `[vocab]` fp32 CPU logits row according to `params`."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    scaled = logits / params.temperature
    if not bool(torch.isfinite(scaled).all()):
        # A tiny temperature (1e-38, or a denormal that is 0 in fp32) overflows to inf and softmax
        # gives NaN, which failed the whole batch. Its limit is greedy decoding, so decode greedily.
        return int(torch.argmax(logits).item())
    logits = scaled
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=True)
        probs_sorted = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p (the top one always stays).
        cum_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
        remove_sorted = cum_before >= params.top_p
        remove = torch.zeros_like(remove_sorted).scatter(0, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(step_seed(params.seed, step))
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample(logits: torch.Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """Sample one token per row of `logits` `[batch, vocab]`.

    Greedy rows share one batched argmax; other rows are sampled one by one on CPU in fp32 (so seeded
    streams are identical on every machine, whatever device ran the model).
    """
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    if all(p.greedy for p in params):
        return [int(t) for t in greedy_ids]
    cpu_logits = logits.float().cpu()
    out: list[int] = []
    for i, p in enumerate(params):
        out.append(int(greedy_ids[i]) if p.greedy else sample_one(cpu_logits[i], p, steps[i]))
    return out
