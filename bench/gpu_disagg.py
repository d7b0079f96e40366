"""Heterogeneous disaggregation: prefill worker on the GPU, decode worker on the CPU (the guide's layout).

Starts the two workers as real processes (``CUDA_VISIBLE_DEVICES=0`` for prefill, empty for decode),
drives ``concurrency`` requests at a time through their internal API as the router does (decode
reserves → prefill computes and writes the KV over TCP → decode streams), and reports output tok/s,
TTFT and time-per-output-token percentiles. Greedy outputs are compared with a colocated engine on the decode side's
device (CPU): KV computed on a GPU may differ from the CPU's in the last bits, so the count of equal
outputs is reported, not asserted.

Both workers get the same explicit ``--dtype`` (default float32): "auto" would resolve to bf16 on the
GPU and maybe fp32 on the CPU, and the KV layout (which carries the dtype) must match.

    python -m bench.gpu_disagg                          # prefill on cuda:0
    python -m bench.gpu_disagg --prefill-device cpu     # dry run without a GPU
"""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    base_parser,
    log,
    median,
    parse_args,
    percentile,
    synthetic_prompts,
    tiny_model_dir,
    write_result,
)

MODULE = "bench.gpu_disagg"


async def one_request(
    client: Any, decode: str, prefill: str, rid: str, prompt: list[int], max_tokens: int
) -> dict[str, Any]:
    """One disaggregated greedy request; returns its tokens and client-side timings."""
    sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    stamps: list[float] = []
    tokens: list[int] = []
    body = {"request_id": rid, "input_ids": prompt, "sampling": sampling}
    async with client.stream("POST", decode + "/internal/decode", json=body) as stream:
        if stream.status_code != 200:
            raise RuntimeError(f"decode answered {stream.status_code}: {(await stream.aread())[:300]!r}")
        lines = stream.aiter_lines()
        first = json.loads(await anext(lines))
        answer = await client.post(prefill + "/internal/prefill", json={
            "request_id": rid, "prompt_token_ids": first["prompt_token_ids"], "sampling": sampling,
            "descriptor": first["descriptor"],
        })
        if answer.status_code != 200:
            raise RuntimeError(f"prefill answered {answer.status_code}: {answer.text[:300]}")
        async for line in lines:
            if not line:
                continue
            event = json.loads(line)
            if event["type"] == "token" and event["token_ids"]:
                stamps.append(time.perf_counter())
                tokens += event["token_ids"]
            elif event["type"] == "error":
                raise RuntimeError(f"decode error: {event}")
    # Time per output token after the first: lines can arrive coalesced, so per-line gaps would lie.
    tpot = (stamps[-1] - stamps[0]) / (len(tokens) - 1) if len(tokens) > 1 else None
    return {"tokens": tokens, "ttft_s": stamps[0] - started if stamps else None, "tpot_s": tpot,
            "prefill": answer.json()}


async def drive(decode: str, prefill: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                tag: str) -> tuple[dict[str, Any], list[list[int]]]:
    """Run every prompt, `concurrency` in flight; returns the summary and the tokens per prompt."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300, trust_env=False,
                                 limits=httpx.Limits(max_connections=2 * concurrency + 4)) as client:
        async def run(i: int) -> dict[str, Any]:
            async with sem:
                return await one_request(client, decode, prefill, f"{tag}-{i}", prompts[i], max_tokens)

        started = time.perf_counter()
        results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
        elapsed = time.perf_counter() - started
    ttft = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    tpot = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    out_tokens = sum(len(r["tokens"]) for r in results)
    summary = {
        "concurrency": concurrency, "requests": len(prompts), "output_tokens": out_tokens,
        "seconds": elapsed, "tokens_per_s": out_tokens / elapsed,
        "ttft_p50_ms": 1000 * (median(ttft) or 0), "ttft_p99_ms": 1000 * (percentile(ttft, 99) or 0),
        "tpot_p50_ms": 1000 * (median(tpot) or 0), "tpot_p99_ms": 1000 * (percentile(tpot, 99) or 0),
        "prefill_s_p50": median([r["prefill"]["prefill_s"] for r in results]),
        "kv_transfer_s_p50": median([r["prefill"]["transfer_s"] for r in results]),
    }
    return summary, [r["tokens"] for r in results]


def main(argv: list[str] | None = None) -> int:
    """Start the pair, measure, compare with the colocated engine, write the JSON."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--prefill-device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--dtype", default="float32", help="--dtype of both workers (must resolve the same)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated requests in flight")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=32, help="requests per concurrency level (at least it)")
    p.add_argument("--decode-threads", type=int, default=4, help="torch threads of the CPU decode worker")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    from inference.engine import LLMEngine, SamplingParams
    from tests.support.processes import start_worker

    model_dir: Path = args.model_dir or tiny_model_dir()
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.quick:
        levels, args.requests, args.prompt_tokens, args.max_tokens = [1, 4], 4, 32, 8
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    prompts = synthetic_prompts(max(args.requests, max(levels)), args.prompt_tokens, vocab, seed=3)
    common = ["--dtype", args.dtype, "--context-length", str(args.prompt_tokens + args.max_tokens + 16),
              "--batch-size", str(max(levels)), "--block-size", "16"]
    gpu_env = {"CUDA_VISIBLE_DEVICES": "0" if args.prefill_device == "cuda" else ""}
    args.log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    try:
        prefill_proc, prefill = start_worker("prefill", model_dir, args.log_dir, env=gpu_env,
                                             extra=[*common, "--num-threads", "2"], name="gpu-prefill")
        procs.append(prefill_proc)
        decode_proc, decode = start_worker("decode", model_dir, args.log_dir,
                                           extra=[*common, "--num-threads", str(args.decode_threads)],
                                           name="cpu-decode")
        procs.append(decode_proc)
        import httpx

        info = {"prefill": httpx.get(prefill + "/info").json(), "decode": httpx.get(decode + "/info").json()}
        log(f"prefill on {info['prefill']['device']}, decode on {info['decode']['device']}, dtype {args.dtype}")
        rows = []
        disagg_tokens: list[list[int]] = []
        for c in levels:
            summary, tokens = asyncio.run(drive(decode, prefill, prompts[: max(args.requests, c)], args.max_tokens,
                                                c, f"c{c}"))
            rows.append(summary)
            disagg_tokens = tokens
            log(f"c={c}: {summary['tokens_per_s']:.0f} tok/s, TTFT p50 {summary['ttft_p50_ms']:.1f} ms, "
                f"TPOT p50 {summary['tpot_p50_ms']:.2f} ms")
    finally:
        for proc in reversed(procs):
            proc.stop()
    # The colocated baseline on the decode side's device, same dtype, same prompts.
    engine = LLMEngine(str(model_dir), block_size=16, max_num_seqs=max(levels), dtype=args.dtype,
                       max_model_len=args.prompt_tokens + args.max_tokens + 16)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    reference = [r.token_ids for r in engine.generate(prompts[: len(disagg_tokens)], params)]
    equal = sum(a == b for a, b in zip(reference, disagg_tokens, strict=True))
    log(f"greedy outputs equal to the colocated CPU engine: {equal}/{len(reference)}")
    result = {"model_dir": str(model_dir), "prefill_device": info["prefill"]["device"],
              "decode_device": info["decode"]["device"], "dtype": args.dtype, "rows": rows,
              "greedy_equal_to_colocated_cpu": f"{equal}/{len(reference)}"}
    path = write_result(args.out_dir, "gpu_disagg_quick" if args.quick else "gpu_disagg", MODULE, argv, result)
    print(f"result: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
