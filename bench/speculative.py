"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side in one process.

Two engines over the same checkpoint (one torch thread, prefix caching off so every round computes
the same thing), one with `SpeculativeConfig(num_speculative_tokens=K)`, measured alternately in
each round (the order flips every round), on three greedy workloads:

- repetitive: chat requests that ask the model to rewrite a given paragraph, fixing mistakes (the
  answer repeats most of the prompt: what prompt lookup is for);
- story: chat requests for a short story (natural text that does not repeat its prompt: automatic
  off has to keep the cost of failed proposals small);
- random: prompts of random token ids (the model's answer to them tends to loop).

Each at 1 in flight (4 requests one after another) and at 8 in flight (8 requests at once). Reported
per workload and level: output tok/s of each engine, the ratio speculative / plain per round and its median, the
acceptance rate, and whether the greedy tokens were identical (they must be). The speculative engine
budgets its verify rows on the step cost it measures (the default); `--ab-tile 8` adds a third engine
with the fixed rule (proposals only fill the batch's last tile of 8 rows), measured in the same
rotation, for an A/B of the two budgets. At the end, the step cost per row count the speculative
engine learned (ms, the curve its budget decided on).

    flock /tmp/bench.lock .venv/bin/python -m bench.speculative   # SmolLM2 if prepared, 3 rounds
    .venv/bin/python -m bench.speculative --quick                 # tiny model, one short round
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from bench import common

MODULE = "bench.speculative"

# Paragraphs the repetitive workload asks to rewrite (a few spelling slips each, so the answer is an
# edit of the text rather than a copy the model might refuse to make).
PARAGRAPHS = [
    "The capital of France is Paris. Paris sits on the river Seine and is known for its musems, its cafes and "
    "the tall iron tower built for the world fair of 1889. Many travellers arrive by train and walk along the "
    "river in the evening.",
    "A language model reads text as a sequence of tokens and predicts the next token, one step at a time. "
    "During prefill the model procesess the whole prompt in parallel and stores the keys and values of every "
    "layer in a cache.",
    "To bake bread, mix four cups of flour with water, salt and a little yeast. Knead the dough for ten minutes "
    "until it is smooth, cover the bowl and let it rise for two hours in a warm place before you bake it.",
    "The weather today is cold and windy, with rain expected in the afternon. Tomorrow will be sunny and warmer, "
    "although clouds may return over the weekend. Farmers hope for a dry week to bring in the harvest.",
    "Our team meets every Monday at nine to plan the week. Each person says what they finished, what they will "
    "work on next and what is blocking them, and the meeting ends after fifteen minutes at most.",
    "The library opens at eight in the morning and closes at six in the evening. Books can be borrowed for "
    "three weeks, and a book that comes back late costs ten cents for every day it is overdue.",
    "To reset your password, open the settings page, choose security and press the button that says reset. "
    "You will recieve an email with a link that is valid for one hour; follow it and enter a new password.",
    "The train to the coast leaves from platform four every hour. The journey takes two hours and a half, and "
    "the last train back to the city leaves the coast at ten in the evening on weekdays.",
]
INSTRUCTION = "Rewrite this text, fixing any mistakes:\n\n"
# Free writing: answers that do not repeat their prompt (natural text, unlike random token ids, which
# small models answer with loops that prompt lookup predicts).
STORIES = ["a fox who learns to swim", "a lighthouse keeper on a stormy night", "a robot that paints",
           "two friends lost in a market", "a city under the sea", "the last train of the year",
           "a baker who cannot smell", "a map found in an old book"]


def chat_prompts(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """One user message each, in the chat template (plain text when there is none)."""
    if tokenizer.has_chat_template:
        return [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return [tokenizer.encode(t + "\n\n") for t in texts]


def measure(engine: Any, prompts: list[list[int]], level: int, params: Any) -> tuple[float, list[list[int]]]:
    """Output tok/s with `level` requests in flight (1: one after another) and the tokens."""
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), level):
        tokens += [r.token_ids for r in engine.generate(prompts[i : i + level], params)]
    elapsed = time.perf_counter() - start
    return sum(map(len, tokens)) / elapsed, tokens


def main(argv: Sequence[str] | None = None) -> int:
    """Run the comparison and print one table per workload."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = common.base_parser(__doc__ or "")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--num-speculative-tokens", type=int, default=8, help="K (default 8, the worker's)")
    p.add_argument("--prompt-lookup-min", type=int, default=None,
                   help="shortest n-gram matched (default: SpeculativeConfig's)")
    p.add_argument("--max-tokens", type=int, default=160, help="output tokens per request at most (default 160)")
    p.add_argument("--dtype", default="auto", help="engine dtype (default auto: bf16 where measured faster)")
    p.add_argument("--levels", default="1,8", help="requests in flight (default 1,8)")
    p.add_argument("--workloads", default="repetitive,story,random", help="which workloads (default all three)")
    p.add_argument("--name", default="", help="result file name (default speculative)")
    p.add_argument("--ab-tile", type=int, default=0,
                   help="also an engine with the fixed row_tile rule of this many rows (default 0: none)")
    args = common.parse_args(p, argv)
    import torch

    from inference.engine import LLMEngine, SamplingParams, SpeculativeConfig

    torch.set_num_threads(args.threads)
    model = args.model_dir or (None if args.quick else common.smollm2_dir()) or common.tiny_model_dir()
    levels = [int(x) for x in args.levels.split(",")]
    rounds = 1 if args.quick else args.rounds
    max_tokens = 24 if args.quick else args.max_tokens
    k = args.num_speculative_tokens
    lookup = {} if args.prompt_lookup_min is None else {"prompt_lookup_min": args.prompt_lookup_min}
    engine_kw = {"max_num_seqs": max(levels), "max_model_len": 1024, "dtype": args.dtype,
              "enable_prefix_caching": False, "num_blocks": 64 * max(levels)}
    engines = {"plain": LLMEngine(str(model), **engine_kw),
               "spec": LLMEngine(str(model), speculative=SpeculativeConfig(num_speculative_tokens=k, **lookup),
                                  **engine_kw)}
    if args.ab_tile:
        tiled = SpeculativeConfig(num_speculative_tokens=k, row_tile=args.ab_tile, **lookup)
        engines["tile"] = LLMEngine(str(model), speculative=tiled, **engine_kw)
    sides = list(engines)
    tokenizer = engines["plain"].tokenizer
    assert tokenizer is not None, "the benchmark needs a checkpoint with a tokenizer"
    n_prompts = max(levels)
    workloads = {
        "repetitive": (chat_prompts(tokenizer, [INSTRUCTION + PARAGRAPHS[i % len(PARAGRAPHS)]
                                                for i in range(n_prompts)]),
                       SamplingParams(max_tokens=max_tokens, temperature=0.0)),
        "story": (chat_prompts(tokenizer, [f"Write a short story about {STORIES[i % len(STORIES)]}."
                                           for i in range(n_prompts)]),
                  SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)),
        "random": (common.synthetic_prompts(n_prompts, 64, engines["plain"].config.vocab_size, seed=3),
                   SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)),
    }
    workloads = {w: workloads[w] for w in args.workloads.split(",")}
    for eng in engines.values():  # warm-up: kernels, allocator, first-step caches
        eng.generate(workloads[next(iter(workloads))][0][:2], SamplingParams(max_tokens=8, temperature=0.0))
    specs = [s for s in sides if s != "plain"]
    results: dict[str, dict[int, dict[str, Any]]] = {
        w: {lv: {**{s: [] for s in sides}, **{f"ratio_{s}": [] for s in specs}, **{f"accept_{s}": [] for s in specs},
                 "identical": True} for lv in levels} for w in workloads}
    for rnd in range(rounds):
        order = sides[rnd % len(sides):] + sides[: rnd % len(sides)]  # each side first in turn
        for name, (prompts, params) in workloads.items():
            for level in levels:
                cell = results[name][level]
                batch = prompts[: max(level, min(4, len(prompts)))]  # 1 in flight: 4 requests in a row
                got: dict[str, tuple[float, list[list[int]]]] = {}
                for side in order:
                    spec = engines[side].speculator
                    before = (spec.num_proposed, spec.num_accepted) if spec else (0, 0)
                    got[side] = measure(engines[side], batch, level, params)
                    cell[side].append(got[side][0])
                    if spec is not None:
                        proposed, accepted = spec.num_proposed - before[0], spec.num_accepted - before[1]
                        cell[f"accept_{side}"].append(accepted / proposed if proposed else 0.0)
                for side in specs:
                    cell[f"ratio_{side}"].append(got[side][0] / got["plain"][0])
                    cell["identical"] = cell["identical"] and got["plain"][1] == got[side][1]
                common.log(f"round {rnd + 1} {name} c{level}: " + ", ".join(
                    f"{side} {got[side][0]:.1f}" for side in sides) + " tok/s; " + ", ".join(
                    f"{side} {cell[f'ratio_{side}'][-1]:.2f}x (accepted {cell[f'accept_{side}'][-1]:.0%})"
                    for side in specs) + f"; load {os.getloadavg()[0]:.1f}")
    for name in workloads:
        common.print_header(f"{name}: speculative (K={k}) vs plain, {model.name}, {engines['plain'].dtype}, "
                            f"load {os.getloadavg()[0]:.1f}")
        rows = []
        for level in levels:
            cell = results[name][level]
            for side in specs:
                rows.append([level, side, f"{common.median(cell['plain']):.1f}", f"{common.median(cell[side]):.1f}",
                             f"{common.median(cell[f'ratio_{side}']):.2f}",
                             ", ".join(f"{r:.2f}" for r in cell[f"ratio_{side}"]),
                             f"{100 * (common.median(cell[f'accept_{side}']) or 0):.0f} %",
                             "yes" if cell["identical"] else "NO"])
        print(common.markdown_table(["in flight", "budget", "plain tok/s", "spec tok/s", "ratio (median)", "per round",
                                     "accepted", "greedy identical"], rows))
    learned = engines["spec"].speculator
    assert learned is not None
    top = max(levels) * (k + 1)
    curve = {r: 1e3 * c for r in range(1, top + 1) if (c := learned.costs.measured(r)) is not None}
    print("learned step cost (ms per row count): " + ", ".join(f"{r}: {c:.1f}" for r, c in curve.items()))
    name = args.name or ("speculative_quick" if args.quick else "speculative")
    path = common.write_result(args.out_dir, name, MODULE, argv, {
        "model": str(model), "dtype": str(engines["plain"].dtype), "num_speculative_tokens": k,
        "prompt_lookup_min": SpeculativeConfig(**lookup).prompt_lookup_min,
        "rounds": rounds, "max_tokens": max_tokens, "levels": levels, "ab_tile": args.ab_tile,
        "results": results, "learned_step_ms": curve,
    })
    common.log(f"wrote {path}")
    return 0 if all(results[w][lv]["identical"] for w in workloads for lv in levels) else 1


if __name__ == "__main__":
    raise SystemExit(main())
