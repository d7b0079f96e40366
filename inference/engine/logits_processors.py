"""Logits processors, vectorized over the rows that use them: min_tokens, logit_bias, the
repetition, frequency and presence penalties, and structured output's token masks (`grammar.py`).

Order (vLLM's): the stop tokens of a row short of `min_tokens` are masked (-inf), `logit_bias` is
added, then the repetition penalty (a logit of a token seen in prompt or output is divided by it when
positive, multiplied when not), then `frequency_penalty * count + presence_penalty * (count > 0)`
is subtracted, the counts taken over the generated tokens. Each step costs a few tensor ops over the
processed rows: the rows' tokens are laid end to end in one flat index tensor (no per-row tensor
work), the penalties gather the logits of those tokens, change them and scatter them back (counts
from one `index_add_`), and a batch where no row uses a processor costs one `any()` over its
parameters.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from .grammar import apply_grammars
from .sampling_params import SamplingParams
from .token_history import TokenHistory, generated_ids


def flat_index(token_lists: list[list[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`row * vocab + token` for every token of every row (row = list index) as one int64 tensor,
    and each entry's row. numpy's `fromiter` reads the lists 8x faster than `torch.tensor`."""
    lens = [len(t) for t in token_lists]
    flat = torch.from_numpy(np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=sum(lens)))
    rows = torch.repeat_interleave(torch.arange(len(token_lists), dtype=torch.int64), torch.tensor(lens))
    return rows * vocab + flat, rows


def token_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    """`[len(token_lists), vocab]` fp32: how often each token occurs in each row's list."""
    counts = torch.zeros(len(token_lists) * vocab, dtype=torch.float32)
    index, _ = flat_index(token_lists, vocab)
    counts.index_add_(0, index, torch.ones(index.shape[0], dtype=torch.float32))
    return counts.view(len(token_lists), vocab)


def _pairs(rows: list[tuple[int, dict[int, float]]], vocab: int) -> tuple[list[int], list[int], list[float]]:
    r_idx: list[int] = []
    t_idx: list[int] = []
    values: list[float] = []
    for r, mapping in rows:
        for token, value in mapping.items():
            if token < vocab:  # the engine refuses out-of-vocabulary ids; a padded vocab is safe
                r_idx.append(r)
                t_idx.append(token)
                values.append(value)
    return r_idx, t_idx, values


def process(
    x: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory],
    scales: Sequence[float] | None = None,
) -> torch.Tensor:
    """Apply every row's processors to fp32 logits `x` `[rows, vocab]` (contiguous), in place.

    `scales` (the sampler's `1 / temperature` per row): `x` is already scaled, so the additive terms
    (bias, frequency and presence penalties) are scaled alike; the repetition penalty divides or
    multiplies by the sign, which scaling keeps. This spares the sampler a copy of the logits.
    """
    vocab = x.shape[-1]
    dev = x.device
    scale = list(scales) if scales is not None else [1.0] * len(params)
    # min_tokens: the row's stop ids (EOS unless ignore_eos, and stop_token_ids) are masked.
    short = [
        (r, dict.fromkeys(h.stop_ids if h.stop_ids is not None else p.stop_token_ids, float("-inf")))
        for r, (p, h) in enumerate(zip(params, histories, strict=True))
        if p.min_tokens and p.seed_offset + len(h.output_token_ids) < p.min_tokens
    ]
    biased = short + [(r, p.logit_bias) for r, p in enumerate(params) if p.logit_bias]
    if biased:
        r_idx, t_idx, values = _pairs(biased, vocab)
        if scales is not None:
            values = [v * scale[r] for r, v in zip(r_idx, values, strict=True)]
        if r_idx:
            at = (torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev))
            x.index_put_(at, torch.tensor(values, dtype=x.dtype, device=dev), accumulate=True)
    # The penalties touch only the logits of tokens a row has seen: a gather, the arithmetic on those
    # few values and a scatter back, instead of [rows, vocab] passes (4x less time at batch 32).
    # Entries of a token seen several times write the same value, so duplicates are harmless.
    flat = x.view(-1)
    if any(p.repetition_penalty != 1.0 for p in params):
        index, rows = flat_index(
            [h.prompt_token_ids + h.output_token_ids if p.repetition_penalty != 1.0 else []
             for p, h in zip(params, histories, strict=True)],
            vocab,
        )
        index, rows = index.to(dev), rows.to(dev)
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=x.dtype, device=dev)[rows]
        seen = flat[index]
        flat[index] = torch.where(seen > 0, seen / penalty, seen * penalty)
    if any(p.frequency_penalty or p.presence_penalty for p in params):
        index, rows = flat_index(
            [generated_ids(h, p) if p.frequency_penalty or p.presence_penalty else []
             for p, h in zip(params, histories, strict=True)],
            vocab,
        )
        index, rows = index.to(dev), rows.to(dev)
        frequency = torch.tensor([p.frequency_penalty * s for p, s in zip(params, scale, strict=True)],
                                 dtype=x.dtype, device=dev)[rows]
        presence = torch.tensor([p.presence_penalty * s for p, s in zip(params, scale, strict=True)],
                                dtype=x.dtype, device=dev)[rows]
        # Presence once per seen token (duplicates write the same value), then frequency once per
        # occurrence (index_add_ accumulates): no [rows, vocab] count tensor.
        flat[index] = flat[index] - presence
        flat.index_add_(0, index, -frequency)
    if any(p.grammar is not None for p in params):
        # Structured output last: whatever the other processors did, a forbidden token stays -inf.
        apply_grammars(x, params, histories)
    return x


def apply_processors(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> torch.Tensor:
    """`logits` `[batch, vocab]` with every row's processors applied: when a row has one, a new fp32
    tensor (the caller may write it), else `logits` itself. Rows without a processor keep their values."""
    rows = [i for i, p in enumerate(params) if p.has_processors]
    if not rows:
        return logits
    if len(rows) == len(params):
        x = logits.float()
        return process(x.clone() if x is logits or not x.is_contiguous() else x, params, histories)
    sub = process(logits[rows].float().contiguous(), [params[i] for i in rows], [histories[i] for i in rows])
    return logits.float().index_copy(0, torch.tensor(rows, device=logits.device), sub)
