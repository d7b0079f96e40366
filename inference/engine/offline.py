"""Offline generation: run a list of prompts through an engine to completion (tests, reference runs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .engine import LLMEngine


@dataclass
class CompletionResult:
    """A finished request as returned by the offline `LLMEngine.generate` helper."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None


def run_to_completion(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
) -> list[CompletionResult]:
    """Queue `prompts` and step `engine` until every one finished; results in the prompts' order.

    A wave of prompts is prefilled in as few steps as the budget allows (the scheduler's prefill-wave rule
    is off for the call, then restored). Not for use while another thread drives `step()`. Raises
    RuntimeError when the requests cannot make progress (e.g. the pool is held by transfers)."""
    plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
    ids = [f"gen-{engine.num_arrivals + 1}-{i}" for i in range(len(prompts))]
    results = {rid: CompletionResult(rid, [], "", None) for rid in ids}
    for rid, prompt, p in zip(ids, prompts, plist, strict=True):
        engine.add_request(rid, prompt, p)
    # The wave rule hands a serving worker's first tokens out in turn; here nobody sees a first token
    # before the whole batch ends, and each extra prefill step re-reads the weights and leaves the
    # wave's last prompts decoding in a thinner batch: with it, a 64 x 32-token wave's tok/s was 0.84-1.00x
    # (tiny model) and 0.84-1.03x (SmolLM2) of one step a wave (AMX Xeon, docs/benchmarks.md). vLLM
    # likewise gives its offline `LLM` class a larger step budget than its server (on a CPU 4,096 prompt
    # tokens a step against 2,048: vllm/engine/arg_utils.py, by `UsageContext`).
    wave_steps, engine.scheduler.prefill_wave_steps = engine.scheduler.prefill_wave_steps, 1
    try:
        return _step_until_done(engine, ids, results)
    finally:
        engine.scheduler.prefill_wave_steps = wave_steps


def _step_until_done(engine: LLMEngine, ids: list[str], results: dict[str, CompletionResult]
                     ) -> list[CompletionResult]:
    """Step `engine` until the requests `ids` finished, collecting their outputs into `results`."""
    remaining = set(ids)
    idle_steps = 0
    while remaining:
        outs = engine.step()
        # Three idle steps in a row mean nothing can be scheduled (e.g. the pool is held by
        # transfers); a prefill chunk produces no output but is progress.
        idle_steps = 0 if outs or engine.last_step_ran else idle_steps + 1
        if idle_steps > 2:
            raise RuntimeError(f"requests {sorted(remaining)} cannot make progress")
        for out in outs:
            res = results.get(out.request_id)
            if res is None:
                continue
            res.token_ids.extend(out.new_token_ids)
            res.text += out.new_text
            if out.finished:
                res.finish_reason = out.finish_reason
                remaining.discard(out.request_id)
    return [results[rid] for rid in ids]
