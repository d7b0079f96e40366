"""Per-step reuse between decode steps: the patched block table always equals a fresh one, and the
engine's greedy tokens stay transformers' across block boundaries, batch changes and preemption."""
from __future__ import annotations

import torch

from inference.engine import LLMEngine, SamplingParams
from inference.engine.batch import BlockTableCache, block_table
from inference.engine.sequence import Sequence

from .conftest import TinyModel

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _seq(name: str, blocks: list[int]) -> Sequence:
    seq = Sequence(name, [1, 2, 3], GREEDY, 0)
    seq.block_ids = list(blocks)
    return seq


def test_block_table_cache_patches_rows_and_rebuilds_when_needed() -> None:
    """A row that gained a block is patched in place; a new batch or a wider table is rebuilt; the
    result always equals `block_table` of the same sequences."""
    cache = BlockTableCache()
    a, b, c = _seq("a", [4, 5]), _seq("b", [7]), _seq("c", [9, 1])
    first = cache.get([a, b, c])
    assert torch.equal(first, block_table([a, b, c]))
    b.block_ids.append(2)  # b crossed into a new block: same width, patched in place
    patched = cache.get([a, b, c])
    assert patched.data_ptr() == first.data_ptr()
    assert torch.equal(patched, block_table([a, b, c]))
    a.block_ids.append(8)  # wider than the table: rebuilt
    wider = cache.get([a, b, c])
    assert wider.shape == (3, 3) and torch.equal(wider, block_table([a, b, c]))
    other = cache.get([a, c])  # another batch: rebuilt
    assert torch.equal(other, block_table([a, c]))
    c.block_ids = [3]  # a row that shrank (blocks replaced) is re-padded with zeros
    same = cache.get([a, c])
    assert torch.equal(same, block_table([a, c]))
    cache.clear()
    assert torch.equal(cache.get([b]), block_table([b]))


def test_greedy_tokens_through_block_boundaries_and_batch_changes(llama: TinyModel) -> None:
    """Block size 4 (a new block every 4 steps), requests finishing at different lengths (the batch
    changes) and a pool small enough to preempt: the tokens are still transformers'."""
    engine = LLMEngine(llama.path, block_size=4, num_blocks=40, max_num_seqs=4, load_tokenizer=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 9, 17, 24)]
    got = [r.token_ids for r in engine.generate(llama.prompts, params)]
    assert got == [g[: p.max_tokens] for g, p in zip(llama.greedy, params, strict=True)]
    assert engine.num_preemptions > 0
