"""Router CPU per request of the kv-aware choice against round-robin's, in process (thread CPU time).

Per request the kv-aware policy hashes the prompt's blocks (once per block size) and looks each
candidate's longest held prefix up in the index; round-robin only moves a cursor. Measured for a
1,000-token prompt (block size 16, the workers' default) over 2 and 4 candidates that hold half of
it, one choice for prefill and one for decode per request, alternating the two policies in rounds.

    .venv/bin/python -m bench.kv_policy_cost
"""
from __future__ import annotations

import random
import sys
import time

from bench.common import base_parser, log, median, parse_args, print_header, write_result

MODULE = "bench.kv_policy_cost"


def _per_request_us(policy_name: str, candidates: int, prompt_tokens: int, requests: int) -> float:
    """Thread CPU microseconds per request: one decode and one prefill choice, as the router makes them."""
    from inference.router.endpoint import Endpoint
    from inference.router.kv_index import CURRENT_PROMPT, KVIndex, PromptBlocks
    from inference.router.policies import KVAware, make_policy
    from inference.wire.kv_events import KVSnapshot, block_hashes

    rng = random.Random(1)
    prompt = [rng.randrange(3, 49000) for _ in range(prompt_tokens)]
    index = KVIndex()
    endpoints = {role: [Endpoint(f"http://10.0.0.{i}:800{n}", role) for i in range(candidates)]
                 for n, role in enumerate(("prefill", "decode"))}
    held = block_hashes(prompt[: prompt_tokens // 2], 16)
    for role_endpoints in endpoints.values():
        for e in role_endpoints:
            index.apply_snapshot(e.url, KVSnapshot(role=e.role, block_size=16, epoch="e", seq=0, hashes=held))
    policies = {role: make_policy(policy_name) for role in endpoints}
    for policy in policies.values():
        if isinstance(policy, KVAware):
            policy.configure(index, 1.0, 64.0)
    started = time.thread_time()
    for _ in range(requests):
        # As the router does: the decode choice hashes the client's ids; the prefill choice compares
        # the descriptor's ids with them and, equal, reuses their hashes.
        token = CURRENT_PROMPT.set(PromptBlocks(list(prompt)))
        policies["decode"].choose_where(endpoints["decode"], lambda e: True)
        descriptor_ids = list(prompt)
        current = CURRENT_PROMPT.get()
        if current is None or current.token_ids != descriptor_ids:
            CURRENT_PROMPT.set(PromptBlocks(descriptor_ids))
        policies["prefill"].choose_where(endpoints["prefill"], lambda e: True)
        CURRENT_PROMPT.reset(token)
    return (time.thread_time() - started) / requests * 1e6


def main(argv: list[str] | None = None) -> int:
    """Alternate the policies in rounds; print and write the medians."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    rounds, requests = (2, 200) if args.quick else (args.rounds, args.requests)
    rows = {}
    for candidates in (2, 4):
        samples: dict[str, list[float]] = {"round-robin": [], "kv-aware": []}
        for _ in range(rounds):
            for name in samples:
                samples[name].append(_per_request_us(name, candidates, args.prompt_tokens, requests))
        rows[candidates] = {name: median(values) for name, values in samples.items()}
        log(f"{candidates} candidates per role: {rows[candidates]}")
    print_header(f"router CPU per request, {args.prompt_tokens}-token prompt (prefill + decode choice)")
    for candidates, row in rows.items():
        print(f"{candidates} candidates: round-robin {row['round-robin']:.1f} us, kv-aware {row['kv-aware']:.1f} us, "
              f"+{(row['kv-aware'] or 0) - (row['round-robin'] or 0):.1f} us")
    write_result(args.out_dir, "kv_policy_cost_quick" if args.quick else "kv_policy_cost", MODULE, argv,
                 {"prompt_tokens": args.prompt_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
