"""The KV event log (engine side), the router's index and the `kv-aware` policy, without processes."""
from __future__ import annotations

import random

from inference.engine.block_manager import BlockManager
from inference.engine.kv_events import KVEventLog
from inference.router.endpoint import Endpoint
from inference.router.kv_index import CURRENT_PROMPT, PREDICTED_UNCACHED, KVIndex, PromptBlocks
from inference.router.policies import KVAware
from inference.wire.kv_events import KVEventBatch, KVSnapshot, block_hashes, decode_line


def _log_over(manager: BlockManager) -> KVEventLog:
    log = KVEventLog(capacity=8)
    manager.watch(log)
    return log


def test_block_manager_tells_stores_and_evictions_and_batches_coalesce() -> None:
    manager = BlockManager(2)
    log = _log_over(manager)
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    blocks = manager.allocate(2)
    manager.register(blocks[0], a)
    manager.register(blocks[1], b)
    seq, held = log.snapshot()
    assert seq == 2 and sorted(held) == [a, b]
    manager.free(blocks)
    reused = manager.allocate(1)  # evicts the least recently freed cached block: a
    manager.register(reused[0], c)
    assert log.since(seq) == (4, [c], [a])
    assert log.since(0) == (4, [b, c], [a])  # a stored then removed: only its final state
    assert log.since(4) == (4, [], [])


def test_a_reader_behind_the_log_needs_a_snapshot() -> None:
    manager = BlockManager(1)
    log = _log_over(manager)
    for i in range(10):  # 19 changes through one block; the log keeps 8
        block = manager.allocate(1)
        manager.register(block[0], bytes([i]) * 16)
        manager.free(block)
    assert log.since(0) is None
    assert log.since(log.seq - 3) is not None


def test_snapshot_and_batch_lines_round_trip() -> None:
    import orjson

    snapshot = KVSnapshot(role="prefill", block_size=8, epoch="e1", seq=3, hashes=[b"\x01" * 16])
    assert decode_line(orjson.loads(snapshot.encode())) == snapshot
    batch = KVEventBatch(seq=5, stored=[b"\x02" * 16], removed=[b"\x01" * 16])
    assert decode_line(orjson.loads(batch.encode())) == batch
    assert decode_line({"type": "keepalive"}) is None


def _index_with(url: str, token_ids: list[int], block_size: int = 4) -> KVIndex:
    index = KVIndex()
    index.apply_snapshot(url, KVSnapshot(role="prefill", block_size=block_size, epoch="e", seq=0,
                                         hashes=block_hashes(token_ids, block_size)))
    return index


def test_cached_tokens_follow_the_engine_rule() -> None:
    prompt = list(range(3, 19))  # 16 tokens = 4 blocks of 4
    index = _index_with("http://w:1", prompt)
    # The engine computes at least the last token: a prompt of whole blocks reuses one block fewer.
    assert index.cached_tokens("http://w:1", PromptBlocks(prompt)) == 12
    assert index.cached_tokens("http://w:1", PromptBlocks(prompt + [7, 7])) == 16
    assert index.cached_tokens("http://w:1", PromptBlocks([99] + prompt)) == 0
    assert index.cached_tokens("http://other:1", PromptBlocks(prompt)) == 0
    index.apply_batch("http://w:1", KVEventBatch(seq=1, removed=block_hashes(prompt, 4)[2:3]))
    assert index.cached_tokens("http://w:1", PromptBlocks(prompt + [7])) == 8  # a hole ends the prefix
    index.drop("http://w:1")
    assert not index.knows("http://w:1")


def test_kv_aware_prefers_the_holder_until_its_load_outweighs_the_prefix() -> None:
    holder, other = Endpoint("http://w:1", "prefill"), Endpoint("http://w:2", "prefill")
    prompt = list(range(3, 203))
    policy = KVAware(random.Random(1))
    policy.configure(_index_with(holder.url, prompt), token_weight=1.0, load_weight=64.0)
    token = CURRENT_PROMPT.set(PromptBlocks(prompt))
    try:
        assert all(policy.choose([other, holder]) is holder for _ in range(10))
        holder.inflight = 4  # 4 x 64 > the 196 cached tokens
        assert policy.choose([other, holder]) is other
        assert policy.choose_where([other, holder], lambda e: e is not other) is holder
        assert policy.predicted_cached_tokens == 11 * 196  # ten and the last choice of the holder
        holder.inflight = 0
        holder.pending_tokens = 197  # its prefills in flight compute more than the prefix saves
        assert policy.choose([other, holder]) is other
        assert PREDICTED_UNCACHED.get() == 200  # what the chosen one computes (prefill_call counts it)
    finally:
        CURRENT_PROMPT.reset(token)


def test_kv_aware_skips_only_workers_that_cannot_reach_the_best_cost() -> None:
    """The choice skips the index lookup of a worker whose load alone exceeds the best cost so far; on
    random pools (loads, queued tokens, held prefixes) it still picks among exactly the cheapest."""
    rng = random.Random(11)
    prompt = [rng.randrange(3, 900) for _ in range(160)]  # 40 blocks of 4
    for trial in range(200):
        index = KVIndex()
        endpoints = [Endpoint(f"http://w{trial}-{i}:1", "prefill") for i in range(rng.randrange(1, 12))]
        for e in endpoints:
            held = prompt[: 4 * rng.randrange(0, 41)]
            index.apply_snapshot(e.url, KVSnapshot(role="prefill", block_size=4, epoch="e", seq=0,
                                                   hashes=block_hashes(held, 4)))
            e.inflight = rng.randrange(0, 6)
            e.pending_tokens = rng.choice([0, 0, rng.randrange(0, 300)])
        policy = KVAware(random.Random(trial))
        policy.configure(index, token_weight=1.0, load_weight=float(rng.choice([1, 16, 64])))
        blocks = PromptBlocks(prompt)
        costs = {e.url: 1.0 * (160 - index.cached_tokens(e.url, blocks) + e.queued_tokens())
                 + policy.load_weight * e.load() for e in endpoints}
        cheapest = {url for url, cost in costs.items() if cost == min(costs.values())}
        token = CURRENT_PROMPT.set(blocks)
        try:
            chosen = {policy.choose(endpoints).url for _ in range(3 * len(cheapest))}
        finally:
            CURRENT_PROMPT.reset(token)
        assert chosen <= cheapest, (trial, chosen, cheapest)


def test_kv_aware_without_a_prompt_or_index_goes_by_load_with_random_ties() -> None:
    a, b, c = (Endpoint(f"http://w:{i}", "decode") for i in (1, 2, 3))
    c.inflight = 1
    policy = KVAware(random.Random(3))
    chosen = {policy.choose([a, b, c]).url for _ in range(40)}
    assert chosen == {a.url, b.url}


def test_the_decode_choice_weighs_cached_tokens_by_what_they_save_there() -> None:
    from inference.router.pool import WorkerPool

    pool = WorkerPool(["http://p:1"], ["http://d:1", "http://d:2"], "kv-aware", kv_remote_decode_share=1 / 16)
    holder, other = pool.endpoints("decode")
    prompt = list(range(3, 403))  # 400 tokens, 396 cached on the holder
    index = pool.kv_index
    index.apply_snapshot(holder.url, KVSnapshot(role="decode", block_size=4, epoch="e", seq=0,
                                                hashes=block_hashes(prompt, 4)))
    holder.inflight = 2  # 2 x 64 in load against 396 cached tokens
    token = CURRENT_PROMPT.set(PromptBlocks(prompt))
    try:
        # Remote prefill: the holder's prefix saves only its transfer (396 / 16 < 128): the lighter one.
        assert pool.choose("decode") is other
        # Decode workers that may prefill (local prefill offered, by the client or the deployment): the holder.
        pool.default_local_prefill_tokens = 64
        assert pool.choose("decode") is holder
        pool.local_prefill_tokens = 0  # a managed router's deployment turned it off
        assert pool.choose("decode") is other
        pool.set_endpoints("prefill", [])  # colocated: every prompt is prefilled where it lands
        assert pool.choose("decode") is holder
    finally:
        CURRENT_PROMPT.reset(token)


def test_the_inverted_match_equals_each_workers_own_prefix_through_changes() -> None:
    """`KVIndex.match` (one walk over the prompt, masks of workers per block) says for every worker what
    a plain model of its held set says (the run of the prompt's hashes from the first that it holds),
    through snapshots, batches with holes, drops, slot reuse and two block sizes."""
    from itertools import takewhile

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 900) for _ in range(rng.randrange(1, 130))] for _ in range(6)]
    prompts += [prompts[0][:40] + [rng.randrange(3, 900) for _ in range(50)]]  # shares a prefix
    index = KVIndex()
    urls = [f"http://w{i}:1" for i in range(40)]  # more workers than 32: masks past one machine word
    sizes = {url: rng.choice([4, 4, 8]) for url in urls}
    held: dict[str, set[bytes]] = {}  # the model: what each worker holds
    for step in range(400):
        url = rng.choice(urls)
        size = sizes[url]
        action = rng.random()
        if action < 0.3 or url not in held:
            hashes = [h for p in rng.sample(prompts, 2) for h in block_hashes(p[: rng.randrange(0, len(p) + 1)], size)]
            index.apply_snapshot(url, KVSnapshot(role="decode", block_size=size, epoch="e", seq=step, hashes=hashes))
            held[url] = set(hashes)
        elif action < 0.85:
            some = block_hashes(rng.choice(prompts), size)
            stored = rng.sample(some, min(len(some), rng.randrange(0, 6)))
            removed = [h for h in rng.sample(some, min(len(some), rng.randrange(0, 3))) if h not in stored]
            index.apply_batch(url, KVEventBatch(seq=step, stored=stored, removed=removed))
            held[url] = (held[url] - set(removed)) | set(stored)
        else:
            index.drop(url)
            held.pop(url)
        prompt = PromptBlocks(rng.choice(prompts))
        match = index.match(prompt)
        for u in urls:
            expected = len(list(takewhile(held.get(u, set()).__contains__, prompt.hashes(sizes[u])))) * sizes[u]
            assert match.get(u, 0) == expected, (step, u)
        assert index.match(prompt) is match  # unchanged index: the prompt's last match again
    assert index.status()["distinct_blocks"] >= 1


def test_a_dropped_worker_leaves_no_bit_behind_and_its_slot_is_reused() -> None:
    prompt = list(range(3, 35))
    index = _index_with("http://a:1", prompt)
    index.apply_snapshot("http://b:1", KVSnapshot(role="decode", block_size=4, epoch="e", seq=0,
                                                  hashes=block_hashes(prompt, 4)))
    assert index.match(PromptBlocks(prompt)) == {"http://a:1": 28, "http://b:1": 28}
    index.drop("http://a:1")
    index.drop("http://b:1")
    assert index.match(PromptBlocks(prompt)) == {} and index.status()["distinct_blocks"] == 0
    index.apply_snapshot("http://c:1", KVSnapshot(role="decode", block_size=4, epoch="e", seq=0,
                                                  hashes=block_hashes(prompt[:8], 4)))
    assert index.match(PromptBlocks(prompt)) == {"http://c:1": 8}


def test_the_prefix_watch_stops_when_no_worker_holds_the_next_block() -> None:
    prompt = list(range(3, 67))  # 16 blocks of 4
    index = _index_with("http://a:1", prompt[:32])
    watch = index.prefix_watch([Endpoint("http://a:1", "decode"), Endpoint("http://gone:1", "decode")])
    assert watch(prompt[:16]) and watch(prompt[:32])
    assert not watch(prompt[:40])  # block 8 is held by nobody
    assert not index.prefix_watch([Endpoint("http://gone:1", "decode")])(prompt)
