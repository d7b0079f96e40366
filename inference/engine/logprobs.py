"""Log-probabilities of sampled and prompt tokens, computed in one batched pass per step.

They are raw: the log-softmax of the model's logits (fp32) before any logits processor,
temperature or top-k/top-p/min-p filter, as vLLM's default (`raw_logprobs`) and what
evaluation harnesses compare against the model itself. A step computes them only for the rows
whose request asks (`SamplingParams.logprobs`, `prompt_logprobs`): one log-softmax over those rows
and one `topk` for the widest request among them, then one `tolist` each, so the per-row Python
only slices lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sequence import Sequence


@dataclass(slots=True)
class TokenLogprobs:
    """One position: the chosen (or prompt) token's log-probability and the `top` most likely tokens
    there as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """Row i's log-probability of `token_ids[i]` and its `num_top[i]` most likely tokens.

    `logits` `[rows, vocab]` in any float dtype (cast to fp32 here); the rows are the ones that asked.
    """
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logp.device)
    chosen: list[float] = logp.gather(1, ids[:, None])[:, 0].tolist()
    widest = min(max(num_top), logp.shape[-1])
    if widest <= 0:
        return [TokenLogprobs(t, lp, []) for t, lp in zip(token_ids, chosen, strict=True)]
    top = torch.topk(logp, widest, dim=-1)
    top_ids: list[list[int]] = top.indices.tolist()
    top_lps: list[list[float]] = top.values.tolist()
    return [
        TokenLogprobs(t, lp, list(zip(ti[:k], tv[:k], strict=True)))
        for t, lp, ti, tv, k in zip(token_ids, chosen, top_ids, top_lps, num_top, strict=True)
    ]


def prefill_rows(new_tokens: list[int], wants_prompt: list[bool]) -> tuple[torch.Tensor, list[int]] | None:
    """The flat rows whose logits a prefill step needs when some sequence asks for prompt
    log-probabilities: every row of such a sequence, the last row of the others. Returns those rows
    (the model's `last_index`) and, per sequence, the position of its last row among them; None when
    no sequence asks (the step keeps its usual last rows)."""
    if not any(wants_prompt):
        return None
    rows: list[int] = []
    last: list[int] = []
    start = 0
    for n, wants in zip(new_tokens, wants_prompt, strict=True):
        rows.extend(range(start, start + n) if wants else (start + n - 1,))
        last.append(len(rows) - 1)
        start += n
    return torch.tensor(rows, dtype=torch.int64), last


def attach_sampled(seqs: list[Sequence], logits: torch.Tensor, sampled: list[int], is_prefill: bool) -> None:
    """Append each asking sequence's log-probabilities of its sampled token to its pending ones
    (`logits` one row per sequence, in `seqs` order; a chunk's row samples nothing)."""
    rows = [i for i, s in enumerate(seqs)
            if s.params.logprobs is not None and not (is_prefill and s.chunk)]
    if not rows:
        return
    found = token_logprobs(logits[rows], [sampled[i] for i in rows], [seqs[i].params.logprobs or 0 for i in rows])
    for i, entry in zip(rows, found, strict=True):
        seqs[i].pending_logprobs.append(entry)


def attach_prompt(seqs: list[Sequence], logits: torch.Tensor, last: list[int]) -> None:
    """Gather the prompt log-probabilities of this prefill step into each asking sequence.

    `logits` holds the rows `prefill_rows` chose: all of an asking sequence's new tokens (row j
    predicts the token after it), the last one of the others (`last[i]`: sequence i's last row)."""
    rows: list[int] = []
    targets: list[int] = []
    tops: list[int] = []
    owners: list[Sequence] = []
    for i, seq in enumerate(seqs):
        if not seq.wants_prompt_logprobs:
            continue
        prompt = seq.prompt_token_ids
        start = seq.num_cached  # the first new token's position
        first_row = last[i] - seq.num_new_tokens + 1
        if seq.prompt_logprobs is None or start == 0:
            seq.prompt_logprobs = [None]  # nothing predicts the first token
        # Row j predicts position start + j + 1; the prompt's last row predicts the sampled token.
        count = min(seq.num_new_tokens, len(prompt) - 1 - start)
        rows.extend(range(first_row, first_row + count))
        targets.extend(prompt[start + 1 : start + 1 + count])
        tops.extend([seq.params.prompt_logprobs or 0] * count)
        owners.extend([seq] * count)
    if not rows:
        return
    for seq, entry in zip(owners, token_logprobs(logits[rows], targets, tops), strict=True):
        assert seq.prompt_logprobs is not None
        seq.prompt_logprobs.append(entry)
