"""Per-step reuse between decode steps: the patched slot rows always equal fresh ones, decode metadata
built from them equals the general builder's, and the engine's greedy tokens stay transformers' across
block boundaries, batch changes and preemption."""
from __future__ import annotations

import pytest
import torch

from inference.engine import LLMEngine, SamplingParams
from inference.engine.batch import (
    BatchMetadata,
    DecodeSlotCache,
    block_table,
    build_metadata,
    decode_metadata,
    kernel_decode_metadata,
    slot_rows,
)
from inference.engine.sequence import Sequence

from .conftest import TinyModel
from .helpers import Collected, absorb

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
BLOCK = 4
STRIDE = 2 * 2 * BLOCK  # two layers of K and V


def _seq(name: str, blocks: list[int]) -> Sequence:
    seq = Sequence(name, [1, 2, 3], GREEDY, 0)
    seq.block_ids = list(blocks)
    return seq


def _fresh(seqs: list[Sequence]) -> torch.Tensor:
    return slot_rows(block_table(seqs), BLOCK, STRIDE)


def test_slot_cache_patches_rows_and_rebuilds_when_needed() -> None:
    """A row that gained a block is patched in place; a new batch or a wider table is rebuilt; the
    result always equals the slot rows of a fresh block table."""
    cache = DecodeSlotCache(BLOCK, STRIDE)
    a, b, c = _seq("a", [4, 5]), _seq("b", [7]), _seq("c", [9, 1])
    first = cache.get([a, b, c])
    assert torch.equal(first, _fresh([a, b, c]))
    assert first[0, BLOCK + 1].item() == 5 * STRIDE + 1  # block 5, offset 1
    b.block_ids.append(2)  # b crossed into a new block: same width, patched in place
    patched = cache.get([a, b, c])
    assert patched.data_ptr() == first.data_ptr()
    assert torch.equal(patched, _fresh([a, b, c]))
    a.block_ids.append(8)  # wider than the table: rebuilt
    wider = cache.get([a, b, c])
    assert wider.shape == (3, 3 * BLOCK) and torch.equal(wider, _fresh([a, b, c]))
    other = cache.get([a, c])  # another batch: rebuilt
    assert torch.equal(other, _fresh([a, c]))
    c.block_ids = [3]  # a row that shrank (blocks replaced) is re-padded with block 0
    assert torch.equal(cache.get([a, c]), _fresh([a, c]))
    cache.clear()
    assert torch.equal(cache.get([b]), _fresh([b]))


def test_slot_cache_patches_a_row_whose_blocks_changed_but_not_their_number() -> None:
    """Speculative decoding frees a sequence's lookahead block after a verify step and reserves one
    again before the next: when another sequence took the freed block in between, the sequence holds
    as many blocks as before but another one among them. Its row must follow, or it writes and reads
    the other sequence's block (greedy tokens drifted at 8 in flight on a Zen 5 EPYC, sixteenth
    session, when rows were patched only when their number of blocks changed)."""
    cache = DecodeSlotCache(BLOCK, STRIDE)
    a, b = _seq("a", [4, 5, 6]), _seq("b", [7, 8])
    first = cache.get([a, b])
    del a.block_ids[2:]  # a's lookahead block 6 freed (trim) ...
    b.block_ids.append(6)  # ... taken by b ...
    a.block_ids.append(9)  # ... and a reserves another: still three blocks
    patched = cache.get([a, b])
    assert patched.data_ptr() == first.data_ptr()
    assert torch.equal(patched, _fresh([a, b]))
    assert patched[0, 2 * BLOCK].item() == 9 * STRIDE
    a.block_ids[0] = 3  # any block of the list, not only the last (a preempted and prefilled again)
    assert torch.equal(cache.get([a, b]), _fresh([a, b]))
    assert torch.equal(cache.get([a, b]), _fresh([a, b]))  # unchanged: nothing to patch, still right


def test_decode_metadata_equals_the_general_builder() -> None:
    """Mixed context lengths (several buckets, masks): the cached-slot decode metadata is exactly what
    `build_metadata` computes for the same decode step."""
    lengths = [5, 6, 6, 40, 41, 300]
    seqs = []
    next_block = 1
    for i, n in enumerate(lengths):
        seq = Sequence(f"s{i}", list(range(1, n)), GREEDY, i)
        seq.output_token_ids = [7]  # n tokens: n - 1 cached, the newest one to compute
        seq.num_cached = n - 1
        blocks = -(-n // BLOCK)
        seq.block_ids = list(range(next_block, next_block + blocks))
        next_block += blocks
        seqs.append(seq)
    ids_a, want = build_metadata(seqs, False, BLOCK, STRIDE, torch.float32, torch.device("cpu"))
    ids_b, got = decode_metadata(seqs, DecodeSlotCache(BLOCK, STRIDE).get(seqs), torch.float32, torch.device("cpu"))
    assert torch.equal(ids_a, ids_b)
    for name in ("positions", "write_rows", "last_index"):
        assert torch.equal(getattr(want, name), getattr(got, name))
    assert len(want.decode_buckets) == len(got.decode_buckets) > 1
    for x, y in zip(want.decode_buckets, got.decode_buckets, strict=True):
        assert (x.start, x.end, x.max_k) == (y.start, y.end, y.max_k)
        assert torch.equal(x.gather_rows, y.gather_rows)
        assert (x.mask is None) == (y.mask is None)
        if x.mask is not None and y.mask is not None:
            assert torch.equal(x.mask, y.mask)


def test_greedy_tokens_through_block_boundaries_and_batch_changes(llama: TinyModel) -> None:
    """Block size 4 (a new block every 4 steps), requests finishing at different lengths (the batch
    changes) and a pool small enough to preempt: the tokens are still transformers'."""
    engine = LLMEngine(llama.path, block_size=4, num_blocks=40, max_num_seqs=4, load_tokenizer=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 9, 17, 24)]
    got = [r.token_ids for r in engine.generate(llama.prompts, params)]
    assert got == [g[: p.max_tokens] for g, p in zip(llama.greedy, params, strict=True)]
    assert engine.num_preemptions > 0


def test_reused_decode_inputs_equal_fresh_ones(llama: TinyModel) -> None:
    """A kernel decode step of the same batch as the step before takes its lengths and input ids from
    that step (`ModelRunner._next_decode`) instead of the sequences: at every decode step, through
    finishes, an abort, new arrivals, chunked prefills in between and preemption, they equal
    `kernel_decode_metadata` of the sequences, and the tokens stay transformers'."""
    engine = LLMEngine(llama.path, block_size=4, num_blocks=40, max_num_seqs=4, load_tokenizer=False,
                       max_num_batched_tokens=16)
    runner = engine.runner
    if not runner.decode_kernel:
        pytest.skip("the CPU kernels are not built here")
    prepare = runner.prepare
    reused = 0

    def checked(seqs: list[Sequence], is_prefill: bool) -> tuple[torch.Tensor, BatchMetadata]:
        nonlocal reused
        reuse = not is_prefill and runner._next_decode is not None
        ids, meta = prepare(seqs, is_prefill)
        if not is_prefill:
            assert meta.decode_slots is not None
            want_ids, want = kernel_decode_metadata(seqs, meta.decode_slots)
            assert torch.equal(ids, want_ids)
            for name in ("positions", "write_rows", "last_index", "decode_lens"):
                assert torch.equal(getattr(meta, name), getattr(want, name)), name
            reused += reuse and runner._slots.same_batch
        return ids, meta

    setattr(runner, "prepare", checked)  # noqa: B010 - instance attribute shadows the method
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 9, 17, 60)]
    results: dict[str, Collected] = {}
    for i, (prompt, p) in enumerate(zip(llama.prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    for step in range(400):
        if step == 30:  # a new arrival whose prompt is prefilled in chunks between decode steps
            engine.add_request("late", llama.prompts[3], params[0])
        if step == 40:
            engine.abort("r3")
        if not engine.has_work():
            break
        absorb(results, engine.step())
    assert reused > 10 and engine.num_preemptions > 0
    for i in range(3):
        assert results[f"r{i}"].token_ids == llama.greedy[i][: params[i].max_tokens]
    assert results["r3"].finish_reason == "abort"
    assert results["late"].token_ids == llama.greedy[3][: params[0].max_tokens]
