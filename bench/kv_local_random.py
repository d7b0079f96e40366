"""Local prefill on a workload it cannot help: random 64-token prompts, 64 tokens out, against always-remote.

One prefill and one decode worker, two routers over them: `remote` (today's path: every prompt to the
prefill worker) and `local` (ROUTER_LOCAL_PREFILL_TOKENS=128: a prompt with at most 128 tokens left to
compute is prefilled on the decode worker, which here is every one of them, uncached). Closed-loop
clients send streamed /generate requests with fresh random ids; the routers take turns in rounds so
that both see the same machine load. Reported: output tok/s and TTFT p50 per router, and the ratio
local / remote (issue 19: within 3 %).

    .venv/bin/python -m bench.kv_local_random
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench.common import (
    base_parser,
    log,
    median,
    parse_args,
    percentile,
    print_header,
    smollm2_dir,
    tiny_model_dir,
    write_result,
)

MODULE = "bench.kv_local_random"


async def _client(router: str, until: float, rng: random.Random, vocab: int, prompt_tokens: int,
                  max_tokens: int, out: dict[str, list[float]]) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        while time.monotonic() < until:  # closed loop, bounded by the round's length
            body = {"input_ids": [rng.randrange(3, vocab) for _ in range(prompt_tokens)], "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            start = time.perf_counter()
            first = None
            tokens = 0
            async with client.stream("POST", router + "/generate", json=body) as response:
                if response.status_code != 200:
                    out["errors"].append(float(response.status_code))
                    await response.aread()
                    continue
                async for line in response.aiter_lines():
                    if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                        continue
                    ids = json.loads(line[5:]).get("token_ids")
                    if isinstance(ids, list) and ids:
                        first = first if first is not None else time.perf_counter() - start
                        tokens += len(ids)
            out["tokens"].append(float(tokens))
            if first is not None:
                out["ttft"].append(first)


async def _round(router: str, seconds: float, clients: int, seed: int, vocab: int, prompt_tokens: int,
                 max_tokens: int) -> dict[str, Any]:
    out: dict[str, list[float]] = {"tokens": [], "ttft": [], "errors": []}
    started = time.monotonic()
    until = started + seconds
    await asyncio.gather(*(_client(router, until, random.Random(seed * 1000 + i), vocab, prompt_tokens, max_tokens,
                                   out) for i in range(clients)))
    wall = time.monotonic() - started
    return {"tok_s": sum(out["tokens"]) / wall, "ttft_p50_s": percentile(out["ttft"], 50),
            "requests": len(out["tokens"]), "errors": len(out["errors"])}


def main(argv: list[str] | None = None) -> int:
    """Alternate the two routers in rounds; print and write the medians and the ratio."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    if args.quick:
        args.rounds, args.seconds, args.clients = 1, 5.0, 4
    model = Path(args.model_dir or (None if args.quick else smollm2_dir()) or tiny_model_dir())
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    from tests.support.processes import Proc, start_router, start_worker

    procs: list[Proc] = []
    rows: dict[str, list[dict[str, Any]]] = {"remote": [], "local": []}
    load_before = os.getloadavg()
    try:
        extra = ["--batch-size", str(max(8, args.clients))]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start_worker, role, model, args.log_dir, extra=extra, name=f"klr-{role}")
                       for role in ("prefill", "decode")]
        started = [f.result() for f in futures if f.exception() is None]
        procs += [proc for proc, _ in started]
        for f in futures:
            f.result()
        (_, prefill), (_, decode) = started
        env = {"ROUTER_REQUEST_TIMEOUT_S": "300", "ROUTER_QUEUE_TIMEOUT_S": "300"}
        routers = {}
        for name, extra_env in (("remote", {}), ("local", {"ROUTER_LOCAL_PREFILL_TOKENS": "128"})):
            proc, url = start_router([prefill], [decode], args.log_dir, env={**env, **extra_env})
            procs.append(proc)
            routers[name] = url
        for k in range(args.rounds):
            for name in (("remote", "local") if k % 2 == 0 else ("local", "remote")):
                row = asyncio.run(_round(routers[name], args.seconds, args.clients, k, vocab, args.prompt_tokens,
                                         args.max_tokens))
                rows[name].append(row)
                log(f"round {k} {name}: {row}")
    finally:
        for proc in reversed(procs):
            proc.stop()
    load_after = os.getloadavg()
    summary = {name: {"tok_s": median([r["tok_s"] for r in rs]),
                      "ttft_p50_s": median([r["ttft_p50_s"] or 0 for r in rs]),
                      "errors": sum(r["errors"] for r in rs)} for name, rs in rows.items()}
    ratio = (summary["local"]["tok_s"] or 0) / (summary["remote"]["tok_s"] or 1)
    print_header(f"random {args.prompt_tokens}-in/{args.max_tokens}-out, {args.clients} clients ({model.name})")
    for name, s in summary.items():
        print(f"{name}: {s['tok_s']:.1f} tok/s, TTFT p50 {1000 * (s['ttft_p50_s'] or 0):.0f} ms, errors {s['errors']}")
    print(f"local / remote output tok/s: {ratio:.3f}; load average before {load_before}, after {load_after}")
    write_result(args.out_dir, "kv_local_random_quick" if args.quick else "kv_local_random", MODULE, argv,
                 {"model_dir": str(model), "rows": rows, "summary": summary, "ratio_tok_s": ratio,
                  "load_before": load_before, "load_after": load_after})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
