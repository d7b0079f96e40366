"""Per-step batch metadata: where each token of a flattened batch lives in the paged KV cache, and how
attention splits the batch so that no sequence pays for another one's context length.

The batch handed to `build_metadata` must be sorted by (cached tokens, context length), ascending:
then every attention group below is a contiguous slice of the batch, and no per-layer gather or
scatter of the queries is needed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sequence import Sequence

# One more SDPA call costs about as much as attending over this many extra (padded) key positions
# per sequence, measured on CPU with SmolLM2's shapes (one call ≈ 35 µs, ≈ 0.2 µs per key position of
# a sequence): decode buckets are split where padding would cost more than a call.
BUCKET_SPLIT_TOKENS = 128


@dataclass
class PrefillGroup:
    """Prompts of one length `q_len` computed from an empty cache: flat tokens `[start, end)`,
    `num_seqs * q_len` of them. Attention runs as one causal SDPA call over this step's own K/V (no
    mask tensor, no padding).

    A sequence whose first `cached` tokens are in cached blocks (prefix caching) is a group of its own
    (`num_seqs` 1): its `q_len` new queries attend to all `cached + q_len` keys, gathered from the
    cache (`gather_rows`, layer 0) under the additive causal `mask` `[1, 1, q_len, cached + q_len]`.
    """

    start: int
    end: int
    num_seqs: int
    q_len: int
    cached: int = 0
    gather_rows: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class DecodeBucket:
    """Decode rows `[start, end)` (one token each) whose context lengths are close: their keys are
    gathered padded to `max_k`, with an additive `mask` `[n, 1, 1, max_k]` (None when all lengths are
    equal)."""

    start: int
    end: int
    max_k: int
    gather_rows: torch.Tensor  # layer-0 K row of every key position, `[n * max_k]`
    mask: torch.Tensor | None
    _head_rows: torch.Tensor | None = field(default=None, repr=False)

    def head_rows(self, num_kv_heads: int, v_offset: int) -> torch.Tensor:
        """Layer-0 rows of `KVCache.head_rows` (one row per token and KV head) of the keys in head-major
        order `[n, kv_heads, max_k]`, then those of the values (`v_offset` rows further), flattened: one
        gather per layer yields keys and values already laid out for a batched matmul (no transposing
        copy per layer). Built on first use and kept for the step's other layers."""
        if self._head_rows is None:
            n = self.end - self.start
            heads = torch.arange(num_kv_heads, device=self.gather_rows.device).view(1, num_kv_heads, 1)
            k_rows = (self.gather_rows.view(n, 1, self.max_k) * num_kv_heads + heads).flatten()
            self._head_rows = torch.cat((k_rows, k_rows + v_offset))
        return self._head_rows


@dataclass
class BatchMetadata:
    """Computed once per step, shared by every layer.

    - `positions`: position of each flat token.
    - `write_rows`: layer-0 K row in `KVCache.rows` for each new token (its slot in its block).
    - `last_index`: flat index of each sequence's last token (the only rows that get logits).
    - exactly one of `prefill_groups` (a prefill step), `decode_buckets` (a decode step) and
      `decode_slots` (a decode step for the CPU kernel, see cpu_kernels.py) is set.
    - `decode_slots` `[batch, width]`: the `slot_rows` of each sequence; `decode_lens` `[batch]`: its
      keys, the new token included. The kernel writes the new K/V itself (`write_rows` is then unused).
    """

    positions: torch.Tensor
    write_rows: torch.Tensor
    last_index: torch.Tensor
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    decode_slots: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    # A verify step (speculative decoding): several rows of one sequence attend to each other's new
    # keys, so every row's K/V is written before any row attends (see `verify_metadata`).
    prewrite: bool = False
    # A mixed step (`mixed_metadata`): rows `[0, mixed_split)` are prefill tokens (`prefill_groups`,
    # `write_rows`), the rest one decode row per running sequence (`decode_slots` / `decode_lens`).
    mixed_split: int = 0

    @property
    def is_prefill(self) -> bool:
        """Whether this is a prefill step."""
        return bool(self.prefill_groups)


def block_table(seqs: list[Sequence]) -> torch.Tensor:
    """`[batch, max_blocks]` block ids, padded with block 0 (only ever read under a mask)."""
    width = max(len(s.block_ids) for s in seqs)
    return torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in seqs], dtype=torch.int64)


def decode_split(ctx_lens: list[int]) -> list[tuple[int, int]]:
    """Split ascending context lengths into `[start, end)` buckets: a sequence joins the current
    bucket unless the padding it adds to the bucket's earlier members outweighs one more call."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(ctx_lens)):
        if (i - start) * (ctx_lens[i] - ctx_lens[i - 1]) > BUCKET_SPLIT_TOKENS:
            out.append((start, i))
            start = i
    out.append((start, len(ctx_lens)))
    return out


def prefill_split(q_lens: list[int]) -> list[tuple[int, int]]:
    """Runs of equal prompt lengths in an ascending list, as `[start, end)` sequence ranges."""
    out: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(q_lens)):
        if q_lens[i] != q_lens[start]:
            out.append((start, i))
            start = i
    out.append((start, len(q_lens)))
    return out


def slot_rows(table: torch.Tensor, block_size: int, block_stride: int) -> torch.Tensor:
    """`[batch, max_blocks * block_size]`: the layer-0 K row (in `KVCache.rows`) of every token position
    of every sequence of a block table."""
    return (table[:, :, None] * block_stride + torch.arange(block_size)).flatten(1)


class DecodeSlotCache:
    """The slot rows of the last decode batch, reused while the batch stays the same.

    Between two decode steps of an unchanged batch only a few sequences' blocks change: one that
    crossed into a new block (every `block_size` steps), one whose speculative lookahead blocks were
    freed and others reserved, one preempted and prefilled again between two decode steps. So each
    sequence's block list is compared with the one its row was built from, and a row that differs is
    patched instead of the whole table being rebuilt from Python lists; each step then reads its write
    rows and key rows out of it with one indexing op each. The comparison is of the whole list, not its
    length: a sequence can end up with as many blocks as before but another block among them (its
    lookahead block went to another sequence and it got a new one), and a row built from the old list
    would write into and attend over the other sequence's block. The cache holds the sequences
    themselves: their `id()`s, the key, cannot be reused by new objects while it does.
    """

    def __init__(self, block_size: int, block_stride: int) -> None:
        """Rows for a KV cache of `block_size` tokens per block, `block_stride` rows between blocks."""
        self.block_size = block_size
        self.block_stride = block_stride
        self._seqs: list[Sequence] = []
        self._key: tuple[int, ...] = ()
        self._blocks: list[list[int]] = []  # each row's block ids when it was built
        self._slots: torch.Tensor | None = None
        # Whether the last `get` was for the same sequences, in the same order, as the call before it:
        # the caller may then reuse what it derived from the batch's fixed attributes (its params).
        self.same_batch = False

    def get(self, seqs: list[Sequence]) -> torch.Tensor:
        """`slot_rows` of `seqs` (in this order), patched from the previous call's when possible."""
        key = tuple(map(id, seqs))
        slots = self._slots
        self.same_batch = slots is not None and key == self._key
        if slots is None or not self.same_batch \
                or max(len(s.block_ids) for s in seqs) * self.block_size > slots.shape[1]:
            slots = slot_rows(block_table(seqs), self.block_size, self.block_stride)
            self._blocks = [s.block_ids.copy() for s in seqs]
        else:
            width = slots.shape[1] // self.block_size
            offsets: torch.Tensor | None = None
            for i, s in enumerate(seqs):
                ids = s.block_ids
                if ids != self._blocks[i]:
                    if offsets is None:
                        offsets = torch.arange(self.block_size)
                    row = torch.tensor(ids + [0] * (width - len(ids)), dtype=torch.int64)
                    slots[i] = (row[:, None] * self.block_stride + offsets).flatten()
                    self._blocks[i] = ids.copy()
        self._seqs, self._key, self._slots = list(seqs), key, slots
        return slots

    def clear(self) -> None:
        """Forget the cached batch (and release its sequences)."""
        self._seqs, self._key, self._blocks, self._slots = [], (), [], None
        self.same_batch = False


def kernel_decode_metadata(
    seqs: list[Sequence], slots: torch.Tensor, last_index: torch.Tensor | None = None
) -> tuple[torch.Tensor, BatchMetadata]:
    """Input ids and metadata of a decode step over `seqs` for the CPU decode kernel: each sequence's
    slot rows and length, nothing per bucket (any order of `seqs` works). `last_index`: a cached
    `arange(len(seqs))` (built when None).

    Lengths and input ids come from one pass over the sequences into one tensor (no properties per
    sequence, one `torch.tensor` instead of two): this runs every step, after a forward that evicted
    the sequences from the CPU caches, where each Python attribute read costs several times more than
    in a warm loop.
    """
    ctx: list[int] = []
    last: list[int] = []
    for s in seqs:
        out, prompt = s.output_token_ids, s.prompt_token_ids
        ctx.append(len(prompt) + len(out))  # num_tokens
        last.append(out[-1] if out else prompt[-1])  # last_token_id
    both = torch.tensor((ctx, last), dtype=torch.int64)
    ctx_t = both[0]
    pos = ctx_t - 1
    if last_index is None:
        last_index = torch.arange(len(seqs))
    meta = BatchMetadata(positions=pos, write_rows=pos, last_index=last_index, decode_slots=slots, decode_lens=ctx_t)
    return both[1], meta


def verify_metadata(
    seqs: list[Sequence], proposals: list[list[int]], slots: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, BatchMetadata]:
    """Input ids and metadata of a verify step (speculative decoding) over `seqs` with their `slots`
    (`DecodeSlotCache.get(seqs)`): each sequence's last token followed by its proposed tokens, each
    one a decode row of its own that shares the sequence's slot rows and sees one more key than the
    row before it (its position + 1), so rows attend causally to the sequence's cache and to the
    rows before them. In the CPU decode kernel's form (`decode_slots` / `decode_lens`, any order);
    models without the kernel turn it into a bucket (`attention_window.bucketed`).
    Logits come out for every row (`last_index`), in this order."""
    ids: list[int] = []
    lens: list[int] = []
    counts: list[int] = []
    for s, proposal in zip(seqs, proposals, strict=True):
        n = s.num_tokens
        ids.append(s.last_token_id)
        ids.extend(proposal)
        lens.extend(range(n, n + len(proposal) + 1))
        counts.append(len(proposal) + 1)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    rows = slots.repeat_interleave(torch.tensor(counts), dim=0)
    pos = lens_t - 1
    write_rows = rows.gather(1, pos[:, None])[:, 0]
    meta = BatchMetadata(
        positions=pos.to(device), write_rows=write_rows.to(device), last_index=torch.arange(len(ids), device=device),
        decode_slots=rows.to(device), decode_lens=lens_t.to(device), prewrite=True,
    )
    return torch.tensor(ids, dtype=torch.int64, device=device), meta


def mixed_metadata(
    prefill: tuple[torch.Tensor, BatchMetadata], decode: tuple[torch.Tensor, BatchMetadata]
) -> tuple[torch.Tensor, BatchMetadata]:
    """One step's input ids and metadata carrying a prefill batch and a decode batch (vLLM's chunked
    prefill: prompt tokens ride in the running batch's forward, one weight pass for both): the prefill
    step's rows (`build_metadata`) first, then the CPU-kernel decode step's (`kernel_decode_metadata`).
    Logits come out for every prefill sequence's last token, then for every decode row."""
    p_ids, p = prefill
    d_ids, d = decode
    if d.decode_slots is None or d.decode_lens is None or not p.prefill_groups:
        raise ValueError("a mixed step joins a prefill step and a CPU-kernel decode step")
    n = p_ids.shape[0]
    meta = BatchMetadata(
        positions=torch.cat((p.positions, d.positions)), write_rows=p.write_rows,
        last_index=torch.cat((p.last_index, d.last_index + n)), prefill_groups=p.prefill_groups,
        decode_slots=d.decode_slots, decode_lens=d.decode_lens, mixed_split=n,
    )
    return torch.cat((p_ids, d_ids)), meta


def decode_metadata(
    seqs: list[Sequence], slots: torch.Tensor, mask_dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, BatchMetadata]:
    """Input ids and metadata of a decode step over `seqs` (sorted by `num_tokens`, ascending), from
    their `slot_rows` (see `DecodeSlotCache`). The same as `build_metadata(..., is_prefill=False)`."""
    b = len(seqs)
    ctx = [s.num_tokens for s in seqs]
    ctx_t = torch.tensor(ctx, dtype=torch.int64)
    pos = ctx_t - 1
    seg = torch.arange(b)
    meta = BatchMetadata(positions=pos.to(device), write_rows=slots[seg, pos].to(device), last_index=seg.to(device))
    for i, j in decode_split(ctx):
        max_k = ctx[j - 1]
        rows = slots[i:j, :max_k].flatten()
        mask = None
        if ctx[i] != max_k:
            k = torch.arange(max_k)
            mask = torch.zeros((j - i, 1, 1, max_k), dtype=mask_dtype).masked_fill_(
                (k[None, :] >= ctx_t[i:j, None])[:, None, None, :], float("-inf")
            ).to(device)
        meta.decode_buckets.append(DecodeBucket(i, j, max_k, rows.to(device), mask))
    return torch.tensor([s.last_token_id for s in seqs], dtype=torch.int64, device=device), meta


def build_metadata(
    seqs: list[Sequence],
    is_prefill: bool,
    block_size: int,
    block_stride: int,
    mask_dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, BatchMetadata]:
    """Input token ids and metadata of one step over `seqs` (sorted by `num_tokens`, ascending).

    A prefill step computes each sequence's tokens after its `num_cached` cached ones.
    """
    b = len(seqs)
    ctx = [s.num_tokens for s in seqs]
    ctx_t = torch.tensor(ctx, dtype=torch.int64)
    table = block_table(seqs)
    if is_prefill:
        flat: list[int] = []
        for s in seqs:
            flat += s.all_token_ids()[s.num_cached : s.num_cached + s.num_new_tokens]
        cached_t = torch.tensor([s.num_cached for s in seqs], dtype=torch.int64)
        q_t = torch.tensor([s.num_new_tokens for s in seqs], dtype=torch.int64)
        ends = torch.cumsum(q_t, 0)
        seg = torch.repeat_interleave(torch.arange(b), q_t)
        pos = torch.arange(len(flat)) - (ends - q_t)[seg] + cached_t[seg]
        last_index = ends - 1
    else:
        flat = [s.last_token_id for s in seqs]
        seg = torch.arange(b)
        pos = ctx_t - 1
        last_index = seg
    write_rows = table[seg, pos // block_size] * block_stride + pos % block_size
    meta = BatchMetadata(
        positions=pos.to(device),
        write_rows=write_rows.to(device),
        last_index=last_index.to(device),
    )
    if is_prefill:
        cached = [s.num_cached for s in seqs]
        q_lens = [s.num_new_tokens for s in seqs]
        ctx = [c + q for c, q in zip(cached, q_lens, strict=True)]  # keys attended: up to the chunk's end
        offsets = [0]
        for n in q_lens:
            offsets.append(offsets[-1] + n)
        fresh = sum(1 for c in cached if c == 0)  # sorted: the fresh prompts come first
        if fresh:
            meta.prefill_groups = [
                PrefillGroup(offsets[i], offsets[j], j - i, q_lens[i]) for i, j in prefill_split(q_lens[:fresh])
            ]
        for i in range(fresh, b):
            k = torch.arange(ctx[i])
            rows = table[i, k // block_size] * block_stride + k % block_size
            q_pos = torch.arange(cached[i], ctx[i])
            mask = torch.zeros((1, 1, q_lens[i], ctx[i]), dtype=mask_dtype).masked_fill_(
                k[None, None, None, :] > q_pos[None, None, :, None], float("-inf")
            )
            meta.prefill_groups.append(
                PrefillGroup(offsets[i], offsets[i + 1], 1, q_lens[i], cached[i], rows.to(device), mask.to(device))
            )
    else:
        for i, j in decode_split(ctx):
            max_k = ctx[j - 1]
            k = torch.arange(max_k)
            rows = (table[i:j, k // block_size] * block_stride + (k % block_size)[None, :]).flatten()
            mask = None
            if ctx[i] != max_k:
                mask = torch.zeros((j - i, 1, 1, max_k), dtype=mask_dtype).masked_fill_(
                    (k[None, :] >= ctx_t[i:j, None])[:, None, None, :], float("-inf")
                )
                mask = mask.to(device)
            meta.decode_buckets.append(DecodeBucket(i, j, max_k, rows.to(device), mask))
    return torch.tensor(flat, dtype=torch.int64, device=device), meta
