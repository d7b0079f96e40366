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

    Not for use while another thread drives `step()`. Raises RuntimeError when the requests cannot make
    progress (e.g. the pool is held by transfers)."""
    plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
    ids = [f"gen-{engine.num_arrivals + 1}-{i}" for i in range(len(prompts))]
    results = {rid: CompletionResult(rid, [], "", None) for rid in ids}
    for rid, prompt, p in zip(ids, prompts, plist, strict=True):
        engine.add_request(rid, prompt, p)
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
