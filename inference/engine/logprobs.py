"""Log-probabilities of sampled and prompt tokens, computed in one batched pass per step.

They are raw: the log-softmax of the model's logits (fp32) before any logits processor,
temperature or top-k/top-p/min-p filter, as vLLM's default (`raw_logprobs`) and what
evaluation harnesses compare against the model itself. A step computes them only for the rows
whose request asks (`SamplingParams.logprobs`, `prompt_logprobs`): on a CPU each row's log-sum-exp
and top-k logits in one C++ call (csrc/row_logprobs.cpp, no [rows, vocab] log-softmax written),
elsewhere one log-softmax over those rows and one top-k for the widest request among them
(`row_topk`); then one `tolist` each, so the per-row Python only slices lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .cpu_kernels import loaded_kernels

if TYPE_CHECKING:
    from .sequence import Sequence


@dataclass(slots=True)
class TokenLogprobs:
    """One position: the chosen (or prompt) token's log-probability and the `top` most likely tokens
    there as (token id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


# Top-k in two steps: the maximum of each chunk of this many values (one vectorized pass), then the
# exact top-k among the values of the k chunks with the largest maxima (the k largest values lie in
# at most k chunks, and those chunks' maxima are among the k largest chunk maxima).
_TOPK_CHUNK = 64


def row_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of `x` `[rows, vocab]` and their indices, largest first (as
    `torch.topk`, whose CPU kernel is slow on long rows: SmolLM2's [32, 49152] fp32 logits took 2.2 ms
    against 0.3 ms for the chunked form, single thread on the AVX2 EPYC)."""
    rows, vocab = x.shape
    c = _TOPK_CHUNK
    if vocab % c or k * c >= vocab:
        values, indices = torch.topk(x, k, dim=-1)
        return values, indices
    chunk_max = x.view(rows, vocab // c, c).amax(-1)
    chunks = torch.topk(chunk_max, k, dim=-1).indices
    cols = (chunks[:, :, None] * c + torch.arange(c, device=x.device)).view(rows, k * c)
    values, picked = torch.topk(x.gather(1, cols), k, dim=-1)
    return values, cols.gather(1, picked)


def _row_kernel(logits: torch.Tensor) -> Any:
    """The C++ `row_lse_topk` (csrc/row_logprobs.cpp) when it applies to `logits`: CPU, fp32 or bf16, a
    contiguous last dim, and the CPU kernels loaded in this process (the model runner loads them when it
    runs on them); None otherwise (the torch path)."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16) or logits.stride(-1) != 1:
        return None
    return getattr(loaded_kernels(), "row_lse_topk", None)


def _reduced(logits: torch.Tensor, ids: torch.Tensor, widest: int) -> tuple[torch.Tensor, torch.Tensor | None,
                                                                           torch.Tensor | None]:
    """The log-probabilities of `ids` (one per row) and the `widest` largest of each row with their
    indices (None when `widest` is 0). With the kernel no [rows, vocab] log-softmax is written: the
    log-sum-exp and the top logits come from two passes over the rows, and logprob = logit - lse."""
    kernel = _row_kernel(logits)
    if kernel is not None:
        lse, values, indices = kernel(logits, widest)
        chosen = logits.gather(1, ids[:, None])[:, 0].float() - lse
        return chosen, (values - lse[:, None] if widest else None), (indices if widest else None)
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, ids[:, None])[:, 0]
    if not widest:
        return chosen, None, None
    top_values, top_indices = row_topk(logp, widest)
    return chosen, top_values, top_indices


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """Row i's log-probability of `token_ids[i]` and its `num_top[i]` most likely tokens.

    `logits` `[rows, vocab]` in any float dtype (fp32 arithmetic); the rows are the ones that asked.
    """
    if not token_ids:
        return []
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    widest = max(0, min(max(num_top), logits.shape[-1]))
    found, values, indices = _reduced(logits, ids, widest)
    chosen: list[float] = found.tolist()
    if values is None or indices is None:
        return [TokenLogprobs(t, lp, []) for t, lp in zip(token_ids, chosen, strict=True)]
    top_ids: list[list[int]] = indices.tolist()
    top_lps: list[list[float]] = values.tolist()
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
    # Every row asking (the usual batch of one kind of request): no gather, which copies the rows.
    asking = logits if len(rows) == len(seqs) else logits[rows]
    found = token_logprobs(asking, [sampled[i] for i in rows], [seqs[i].params.logprobs or 0 for i in rows])
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
