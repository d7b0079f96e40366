"""vLLM's offline ``LLM`` API measured in-process: the child that bench/engine_vs_vllm.py runs with the
Python of bench/.venv-vllm (``-P``, so the repository is not importable: stdlib + vllm only).

    bench/.venv-vllm/bin/python -P bench/vllm_offline_child.py CONFIG.json

CONFIG: {"model", "dtype", "prompts" (token-id lists: the warm-up's and the greedy check's),
"wave_prompts" (per concurrency, the token-id lists of its waves in order), "max_tokens", "concurrency" (list), "waves",
"rounds", "max_model_len", "max_num_seqs"}. Prints one line ``RESULT {json}``: per concurrency the
output tokens/s of each round. Each wave is one ``LLM.generate`` call of exactly `concurrency` prompts
(greedy, ``ignore_eos``), so the batch is as wide as ours in the same benchmark.

Prefill mode (bench/prefill_vs_vllm.py): CONFIG has "cases" instead ({"name", "warmup" (token-id lists),
"sets" (lists of token-id lists, each set new to the engine)}) and optionally "max_num_batched_tokens";
each set is one ``LLM.generate`` call with ``max_tokens=1`` (the prompts' prefill and one sampled
token), timed whole; RESULT has per case the seconds of each set.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any


def main() -> int:
    """Load the model once, then time the waves of every concurrency for every round."""
    with open(sys.argv[1]) as f:
        cfg: dict[str, Any] = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    extra = {"max_num_batched_tokens": cfg["max_num_batched_tokens"]} if "max_num_batched_tokens" in cfg else {}
    llm = LLM(model=cfg["model"], dtype=cfg["dtype"], max_model_len=cfg["max_model_len"],
              max_num_seqs=cfg["max_num_seqs"], seed=0, **extra)
    load_s = time.perf_counter() - started
    if "cases" in cfg:
        print("RESULT " + json.dumps({"load_s": load_s, "cases": prefill_cases(llm, cfg["cases"])}), flush=True)
        return 0
    params = SamplingParams(temperature=0.0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    rounds: list[dict[str, Any]] = []
    for _ in range(cfg["rounds"]):
        row: dict[str, Any] = {}
        for c in cfg["concurrency"]:
            waves = max(1, math.ceil(cfg["waves_min_requests"] / c))
            tokens = 0
            t = time.perf_counter()
            for w in range(waves):
                wave = [TokensPrompt(prompt_token_ids=p) for p in cfg["wave_prompts"][str(c)][w * c:(w + 1) * c]]
                for out in llm.generate(wave, params, use_tqdm=False):
                    tokens += len(out.outputs[0].token_ids)
            elapsed = time.perf_counter() - t
            row[str(c)] = {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}
        rounds.append(row)
    first = llm.generate(prompts[:4], params, use_tqdm=False)
    print("RESULT " + json.dumps({"load_s": load_s, "rounds": rounds,
                                  "greedy_tokens": [list(o.outputs[0].token_ids) for o in first]}), flush=True)
    return 0


def prefill_cases(llm: Any, cases: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Seconds of one ``generate(max_tokens=1)`` call per set of prompts of each case (after one
    warm-up call of the case's shape on prompts of its own)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    out: dict[str, list[float]] = {}
    for case in cases:
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in case["warmup"]], params, use_tqdm=False)
        times = []
        for prompts in case["sets"]:
            batch = [TokensPrompt(prompt_token_ids=p) for p in prompts]
            t = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
        out[case["name"]] = times
    return out


if __name__ == "__main__":
    sys.exit(main())
