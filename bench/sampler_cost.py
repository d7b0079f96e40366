"""Sampler cost of penalties and logit_bias, and of log-probabilities: one decode step's sampling with
and without them, side by side in one process (issue 23's targets: penalties at most 1.1x plain
sampling per step, logprobs=5 at most 1.05x).

`[32, 49152]` logits (SmolLM2's vocabulary), each row with a 512-token prompt and 256 generated
tokens; rounds alternate the configurations so that load from other jobs hits them alike. The
processed configuration sets frequency, presence and repetition penalties and a 10-token logit_bias
on every row (the worst case: every row pays); the logprobs configurations add what the model runner
does after sampling when every row asks `logprobs=5` (`logprobs.attach_sampled`: on a CPU with the
kernels built, each row's log-sum-exp and top-5 logits from csrc/row_logprobs.cpp; the `logprobs_torch`
configurations run the torch path instead, a log-softmax and a chunked top-5: the A/B of the kernel;
then the per-row entries). No model is run: the forward pass is the same with or without
them, so the sampler's time is what they add. Times are the sampling thread's CPU
time (`time.thread_time`; one torch thread, so torch works in it): on a shared machine wall time
mostly measures the other jobs.

    .venv/bin/python -m bench.sampler_cost
    .venv/bin/python -m bench.sampler_cost --quick
"""
from __future__ import annotations

import random
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from bench.common import base_parser, log, parse_args, write_result

MODULE = "bench.sampler_cost"


@dataclass
class History:
    """A request's tokens as the sampler reads them."""

    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    stop_ids: frozenset[int] | None = frozenset({0})
    # What `attach_sampled` reads and writes (the model runner passes its Sequences).
    params: Any = None
    chunk: int = 0
    pending_logprobs: list[Any] = field(default_factory=list)


def main(argv: list[str] | None = None) -> int:
    """Time `sample` per configuration; print and write the ratios against plain sampling."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--generated", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=10, help="sampled steps per configuration per round")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    import torch

    from inference.engine import SamplingParams, logprobs
    from inference.engine.cpu_kernels import load_kernels
    from inference.engine.logprobs import attach_sampled
    from inference.engine.sampler import sample

    torch.set_num_threads(args.threads)
    rounds, steps = (2, 2) if args.quick else (args.rounds, args.steps)
    rng = random.Random(0)
    histories = [History([rng.randrange(args.vocab) for _ in range(args.prompt)],
                         [rng.randrange(args.vocab) for _ in range(args.generated)]) for _ in range(args.batch)]
    logits = torch.randn(args.batch, args.vocab, generator=torch.Generator().manual_seed(0)) * 3
    bias = {rng.randrange(args.vocab): 5.0 for _ in range(10)}

    def penalized(params: SamplingParams) -> SamplingParams:
        return replace(params, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1, logit_bias=bias)

    temperature = SamplingParams(temperature=0.8)
    top_p = SamplingParams(temperature=0.8, top_p=0.95)
    greedy = SamplingParams(temperature=0.0)
    configs = {
        "temperature": temperature,
        "temperature+penalties": penalized(temperature),
        "top_p": top_p,
        "top_p+penalties": penalized(top_p),
        "greedy": greedy,
        "greedy+penalties": penalized(greedy),
        "temperature+logprobs": replace(temperature, logprobs=5),
        "top_p+logprobs": replace(top_p, logprobs=5),
        "temperature+logprobs_torch": replace(temperature, logprobs=5),
        "top_p+logprobs_torch": replace(top_p, logprobs=5),
    }
    load_kernels()  # as a CPU engine's model runner does at its start (None where they do not build)
    kernel_lookup = logprobs._row_kernel
    kernel = kernel_lookup(logits) is not None
    log(f"row_lse_topk kernel: {'yes' if kernel else 'no (torch path in both logprobs configurations)'}")
    times: dict[str, list[float]] = {name: [] for name in configs}
    # The logprobs' own part of each of their steps, timed apart too: the sampling before it is the same
    # code as the plain configuration's, whose run-to-run noise (mostly its Exp(1) draws) would
    # otherwise swamp a difference of a millisecond.
    added: dict[str, list[float]] = {name: [] for name in configs if configs[name].logprobs is not None}
    step_ids = list(range(args.batch))
    for _ in range(rounds):
        for name, params in configs.items():
            batch = [params] * args.batch
            for h in histories:
                h.params = params
            # The torch path of the logprobs: the kernel lookup answers None for these configurations.
            logprobs._row_kernel = (lambda _: None) if name.endswith("_torch") else kernel_lookup  # type: ignore[assignment]
            for _ in range(steps):
                started = time.thread_time()
                sampled = sample(logits, batch, step_ids, histories)
                if params.logprobs is not None:
                    sampled_at = time.thread_time()
                    attach_sampled(histories, logits, sampled, False)  # type: ignore[arg-type]
                    added[name].append((time.thread_time() - sampled_at) * 1000)
                times[name].append((time.thread_time() - started) * 1000)
            for h in histories:
                h.pending_logprobs.clear()
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {f"{base}+penalties / {base}": med[f"{base}+penalties"] / med[base]
              for base in ("temperature", "top_p", "greedy")}
    logprobs._row_kernel = kernel_lookup  # type: ignore[assignment]
    added_med = {k: statistics.median(v) for k, v in added.items()}
    for base in ("temperature", "top_p"):
        for kind in ("logprobs", "logprobs_torch"):
            ratios[f"{base}+{kind} / {base}"] = med[f"{base}+{kind}"] / med[base]
            # Plain sampling + the logprobs' own median time, over plain sampling.
            ratios[f"{base}+{kind} (added) / {base}"] = (med[base] + added_med[f"{base}+{kind}"]) / med[base]
    for base in ("temperature", "top_p", "greedy"):
        log(f"{base}: {med[base]:.2f} ms, with penalties {med[base + '+penalties']:.2f} ms, "
            f"ratio {ratios[f'{base}+penalties / {base}']:.3f}")
    for base in ("temperature", "top_p"):
        for kind in ("logprobs", "logprobs_torch"):
            log(f"{base}: with {kind}=5 {med[f'{base}+{kind}']:.2f} ms, ratio {ratios[f'{base}+{kind} / {base}']:.3f}; "
                f"the logprobs alone {added_med[f'{base}+{kind}']:.2f} ms, "
                f"ratio {ratios[f'{base}+{kind} (added) / {base}']:.3f}")
    result = {"clock": "thread CPU time", "row_lse_topk_kernel": kernel,
              "batch": args.batch, "vocab": args.vocab, "prompt_tokens": args.prompt,
              "generated_tokens": args.generated, "threads": args.threads, "step_ms": med, "ratios": ratios,
              "logprobs_ms": added_med, "raw_ms": times, "raw_logprobs_ms": added}
    name = "sampler_cost" + ("_quick" if args.quick else "")
    print(f"result: {write_result(args.out_dir, name, MODULE, argv, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
