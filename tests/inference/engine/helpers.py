"""Small helpers shared by the engine tests."""
from __future__ import annotations

from dataclasses import dataclass, field

from inference.engine import LLMEngine, RequestOutput, SamplingParams


@dataclass
class Collected:
    """Everything one request produced."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    deltas: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    outputs: list[RequestOutput] = field(default_factory=list)


def absorb(results: dict[str, Collected], outputs: list[RequestOutput]) -> None:
    """Fold step outputs into per-request results."""
    for out in outputs:
        res = results.setdefault(out.request_id, Collected())
        res.outputs.append(out)
        res.token_ids.extend(out.new_token_ids)
        res.text += out.new_text
        if out.new_text:
            res.deltas.append(out.new_text)
        if out.finished:
            res.finish_reason = out.finish_reason


def drain(
    engine: LLMEngine, results: dict[str, Collected] | None = None, max_steps: int = 5000
) -> dict[str, Collected]:
    """Step until the engine has no work left."""
    results = {} if results is None else results
    for _ in range(max_steps):
        if not engine.has_work():
            return results
        absorb(results, engine.step())
    raise AssertionError("engine did not finish")


def prefill_into(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> None:
    """Reserve on `decode`, prefill on `prefill`, copy the block bytes and hand over the first token.
    Blocks the decode engine already holds for this prompt's prefix (prefix caching) are not copied,
    as a prefill worker does not send them."""
    dst = decode.reserve(rid, prompt, params)
    hits = decode.reserved_hits(rid)
    prefill.add_request(rid, prompt, params, prefill_only=True)
    first: int | None = None
    src: list[int] = []
    while first is None:
        for out in prefill.step():
            if out.request_id == rid and out.finished:
                first, src = out.new_token_ids[0], list(out.block_ids or [])
    decode.kv_cache.data[dst[hits:]] = prefill.kv_cache.data[src[hits:]]
    prefill.release(rid)
    decode.kv_received(rid, first)
