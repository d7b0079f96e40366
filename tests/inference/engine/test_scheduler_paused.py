"""Scheduler: paused sequences (flow control) are left out of decode steps but keep blocks and slot."""
from __future__ import annotations

from inference.engine.block_manager import BlockManager
from inference.engine.sampling_params import SamplingParams
from inference.engine.scheduler import Scheduler
from inference.engine.sequence import Sequence

BLOCK = 4


def _running(sch: Scheduler, bm: BlockManager, n: int, prompt_len: int) -> list[Sequence]:
    """`n` running sequences whose prompt KV is cached (as after a prefill)."""
    seqs = []
    for i in range(n):
        seq = Sequence(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64), arrival=i)
        seq.block_ids = bm.allocate(sch.blocks_for(prompt_len))
        seq.num_cached = prompt_len
        seq.output_token_ids.append(7)
        sch.add_running(seq)
        seqs.append(seq)
    return seqs


def test_paused_sequences_skip_decode_and_keep_their_blocks() -> None:
    """Fast path (no block needed): the paused one is not in the batch and stays running."""
    bm = BlockManager(16)
    sch = Scheduler(bm, BLOCK, max_num_seqs=4, max_num_batched_tokens=64)
    a, b, c = _running(sch, bm, 3, prompt_len=2)
    sch.paused = {"r1"}
    plan = sch.schedule()
    assert plan.decode == [a, c]
    assert sch.running == [a, b, c]
    assert b.block_ids and not plan.preempted


def test_paused_sequences_survive_the_allocating_path_and_are_never_preempted() -> None:
    """Slow path (a block is needed, the pool is dry): the newest unpaused sequence is preempted, the
    paused one (newer still) keeps its blocks, and the running list keeps arrival order."""
    bm = BlockManager(3)
    sch = Scheduler(bm, BLOCK, max_num_seqs=4, max_num_batched_tokens=64)
    # Prompt 4 + 1 output = 5 tokens: the KV of the 5th needs a second block in each sequence.
    a, b, c = _running(sch, bm, 3, prompt_len=4)
    assert bm.num_free == 0
    sch.paused = {"r2"}
    plan = sch.schedule()
    assert plan.preempted == [b]
    assert plan.decode == [a]
    assert sch.running == [a, c]
    assert len(c.block_ids) == 1 and len(a.block_ids) == 2


def test_all_paused_lets_the_next_prefill_chunk_run() -> None:
    """After a prefill chunk the running batch normally decodes first; when all of it is paused the
    step admits (here: the waiting prompt) instead of doing nothing."""
    bm = BlockManager(32)
    sch = Scheduler(bm, BLOCK, max_num_seqs=4, max_num_batched_tokens=8, enable_chunked_prefill=True)
    (a,) = _running(sch, bm, 1, prompt_len=2)
    long = Sequence("long", list(range(1, 21)), SamplingParams(max_tokens=4), arrival=5)
    sch.add(long)
    first = sch.schedule()
    assert first.prefill == [long] and long.chunk == 8
    long.num_cached, long.chunk = 8, 0
    sch.requeue_partial(long)
    sch.paused = {"r0"}
    second = sch.schedule()
    assert second.prefill == [long] and not second.decode
    assert sch.running == [a]
