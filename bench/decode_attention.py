"""CPU decode attention: the engine's batched-matmul path against its earlier token-major gather and
torch SDPA, alternating in one engine.

One engine (SmolLM2 if prepared, else the tiny model), a running batch of 32 with mixed contexts
(one 1,024-token sequence among 31 of 64): rounds of `--steps` decode steps with each attention
implementation in turn; the result is the median step time of each and their ratio.

    .venv/bin/python -m bench.decode_attention --dtype bfloat16
    .venv/bin/python -m bench.decode_attention --quick
"""
from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

from bench.common import base_parser, log, parse_args, smollm2_dir, tiny_model_dir, write_result

MODULE = "bench.decode_attention"


def main(argv: list[str] | None = None) -> int:
    """Alternate the two attention paths on one running batch; print and write the ratio."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    import torch

    from inference.engine import LLMEngine, SamplingParams
    from inference.engine import model as model_module

    torch.set_num_threads(args.threads)
    path = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_model_dir()
    long_len = 128 if args.quick else 1024
    engine = LLMEngine(str(path), block_size=16, max_num_seqs=32, max_model_len=long_len + 200, dtype=args.dtype)
    rng = random.Random(1)
    vocab = engine.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(long_len)]]
    prompts += [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(31)]
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while engine.num_running < 32:
        engine.step()
    attention = model_module.Attention
    current = attention._decode_cpu

    def gather_token_major(self: Any, bk: Any, kv_cache: Any, layer_offset: int, dtype: Any) -> tuple[Any, Any]:
        """Keys and values `[n, max_k, kv_heads, head_dim]` as gathered before the head-major layout."""
        n = bk.end - bk.start
        rows = bk.gather_rows + layer_offset
        shape = (n, bk.max_k, self.num_kv_heads, self.head_dim)
        keys = kv_cache.rows.index_select(0, rows).view(shape).to(dtype)
        return keys, kv_cache.rows.index_select(0, rows + kv_cache.block_size).view(shape).to(dtype)

    def via_sdpa(self: Any, q: Any, bk: Any, kv_cache: Any, layer_offset: int) -> Any:
        keys, values = gather_token_major(self, bk, kv_cache, layer_offset, q.dtype)
        return self._sdpa(q.reshape(q.shape[0], 1, self.num_heads, self.head_dim), keys, values, attn_mask=bk.mask)

    def token_major_matmul(self: Any, q: Any, bk: Any, kv_cache: Any, layer_offset: int) -> Any:
        """The matmul path before keys were gathered head-major (the permutes copy K and V)."""
        keys, values = gather_token_major(self, bk, kv_cache, layer_offset, q.dtype)
        n = q.shape[0]
        qg = q.reshape(n, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float() * self.scale
        if bk.mask is not None:
            scores = scores + bk.mask
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values.transpose(1, 2)).reshape(n, self.q_size)

    impls = {"matmul": current, "matmul_token_major": token_major_matmul, "sdpa": via_sdpa}
    times: dict[str, list[float]] = {name: [] for name in impls}
    rounds = 1 if args.quick else args.rounds
    try:
        for _ in range(rounds):
            for name, impl in impls.items():
                attention._decode_cpu = impl  # type: ignore[method-assign]
                for _ in range(args.steps):
                    started = time.perf_counter()
                    engine.step()
                    times[name].append((time.perf_counter() - started) * 1000)
    finally:
        attention._decode_cpu = current  # type: ignore[method-assign]
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"model_dir": str(path), "dtype": str(engine.dtype).removeprefix("torch."),
              "step_ms": med, "sdpa_over_matmul": med["sdpa"] / med["matmul"],
              "token_major_over_head_major": med["matmul_token_major"] / med["matmul"], "raw_ms": times}
    log(f"{result['dtype']}: step matmul {med['matmul']:.1f} ms, token-major matmul "
        f"{med['matmul_token_major']:.1f} ms, sdpa {med['sdpa']:.1f} ms, sdpa/matmul {result['sdpa_over_matmul']:.2f}")
    name = f"decode_attention_{result['dtype']}" + ("_quick" if args.quick else "")
    print(f"result: {write_result(args.out_dir, name, MODULE, argv, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
