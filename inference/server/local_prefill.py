"""Per-request disaggregation, the decode worker's side: a prompt it can prefill itself, it does.

The router may add `local_prefill_max_tokens: N` to `POST /internal/decode`. When this worker's
prefix cache leaves at most N of the prompt's tokens to compute (a follow-up turn whose history it
holds, a short prompt), the hop to a prefill worker costs more than the work: the worker runs the
prompt in its own continuous batch (the engine runs colocated anyway) and answers a stream whose
descriptor says `{"local": true}`, so the router skips the prefill call. Otherwise it reserves
blocks and waits for the KV as always (decode.py). A `--service-type both` worker (colocated.py)
takes this path for every prompt, offered or not. The lines are the wire's, as in decode_stream.py.

The router may also say how deep the prefill pool's queue is (`remote_prefill`: the prompt tokens ahead
on the cheapest prefill worker and that worker's measured tokens/s). A prompt over the threshold is then
prefilled here too when that is sooner (`local_is_sooner`): when a burst of cold prompts would queue on
the prefill workers while this one has room.

The tokens a prompt leaves to compute are those its prefix cache does not hold at receipt, less the
leading blocks a local prefill queued here will compute first (pending_prefix.py): the engine computes a
burst's shared system prompt once, so the burst's other cold first turns have only their own tokens to
compute and, when those are few, are prefilled here as well.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inference.server.credit import StreamCredit
from inference.server.errors import bad_request, overloaded
from inference.server.requests import parse_sampling, prompt_token_ids
from inference.wire import delivery_trace
from inference.wire.stream import descriptor_line, done_line, error_line, token_line

if TYPE_CHECKING:
    from inference.server.decode import DecodeWorker

# The descriptor of a request prefilled on the decode worker itself: no KV to send.
LOCAL_DESCRIPTOR: dict[str, Any] = {"local": True}
# How long a local stream waits for the next engine output (or router credit) before giving up.
OUTPUT_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class RemoteQueue:
    """The prefill pool's queue as the router saw it: prompt tokens ahead on its cheapest prefill worker,
    and the tokens/s that worker reported (None: not measured yet)."""

    queue_tokens: int
    tokens_per_s: float | None


def remote_queue(body: dict[str, Any]) -> RemoteQueue | None:
    """The body's `remote_prefill` (None when the router sent none); 400 when malformed."""
    value = body.get("remote_prefill")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("'remote_prefill' must be an object")
    tokens, rate = value.get("queue_tokens"), value.get("tokens_per_s")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
        raise bad_request("'remote_prefill.queue_tokens' must be an integer >= 0")
    if rate is not None and (not isinstance(rate, int | float) or isinstance(rate, bool) or not rate > 0):
        raise bad_request("'remote_prefill.tokens_per_s' must be a number > 0 or null")
    return RemoteQueue(tokens, float(rate) if rate is not None else None)


def local_is_sooner(uncached: int, local_pending: int, running: int, local_rate: float | None,
                    remote: RemoteQueue) -> bool:
    """Whether prefilling `uncached` tokens here gives the first token sooner than the remote path.

    Here: the local prefills queued (`local_pending` tokens) and this prompt, plus a row per running
    decode for the step they share, at this worker's own measured prefill rate. Remote: the queue ahead
    on the cheapest prefill worker and the same prompt (as many tokens: its cache is not known here; a
    prefill worker holds no more of a conversation than its decode worker) at that worker's rate. A rate
    not measured yet is taken as the other side's; with neither measured both sides run alike and the
    tokens decide. Ties stay remote (the prefill pool exists to keep prefills off decode steps)."""
    local_rate = local_rate or remote.tokens_per_s
    remote_rate = remote.tokens_per_s or local_rate
    local_tokens = local_pending + uncached + running
    remote_tokens = remote.queue_tokens + uncached
    if local_rate is None or remote_rate is None:
        return local_tokens < remote_tokens
    return local_tokens / local_rate < remote_tokens / remote_rate


def local_limit(body: dict[str, Any]) -> int | None:
    """The body's `local_prefill_max_tokens` (None: the router did not offer local prefill); 400 when bad."""
    value = body.get("local_prefill_max_tokens")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise bad_request("'local_prefill_max_tokens' must be an integer >= 0")
    return value


async def open_local(
    worker: DecodeWorker, body: dict[str, Any], credit: StreamCredit | None
) -> AsyncIterator[bytes] | None:
    """The local stream of a request this worker should prefill itself; None when the remote path it
    is (no offer, or more uncached tokens than offered and the prefill pool's queue, if the router told
    it, no slower than prefilling here). Raises WorkerError (400/429) like open_decode."""
    limit = local_limit(body)
    remote = remote_queue(body)
    if limit is None and remote is None and not worker.prefills_every_prompt:
        return None
    ids = prompt_token_ids(body, worker.engine.tokenizer, worker.engine.config.vocab_size)
    cached = worker.engine.cached_tokens(ids)
    queued = worker.pending_prefixes
    hashes = queued.hashes(ids) if queued.enabled and not worker.prefills_every_prompt else []
    # Left to compute when the engine admits it: a queued local prefill's leading blocks count as cached.
    uncached = len(ids) - max(cached, queued.shared_tokens(hashes))
    if not worker.prefills_every_prompt and uncached > (limit or 0):
        if remote is None:
            return None
        pending, rate = worker.signals.prefill_queue()
        if not local_is_sooner(uncached, pending, worker.engine.status().running, rate, remote):
            return None
    request_id = str(body.get("request_id") or uuid.uuid4().hex)
    worker.refuse_if_aborted(request_id)
    params = parse_sampling(body.get("sampling"), worker.args.max_tokens_limit, worker.sampling_defaults)
    worker.check_prompt_length(len(ids))
    params = worker.clamp(params, len(ids))
    if worker.engine.status().waiting >= worker.args.max_queue:
        worker.metrics.outcome("rejected")
        raise overloaded(f"decode queue is full ({worker.args.max_queue} waiting); retry later")
    worker.metrics.prompt_tokens.inc(len(ids))
    worker.metrics.prefilled_prompt_tokens.inc(len(ids))
    worker.metrics.prefilled_cached_tokens.inc(cached)
    # Counted now, before the stream starts: the next request's decision here sees this prefill queued.
    worker.signals.prefill_started(uncached)
    queued.add(request_id, hashes)
    return _lines(worker, request_id, ids, params, credit, time.perf_counter(), uncached)


async def _lines(worker: DecodeWorker, request_id: str, ids: list[int], params: Any, credit: StreamCredit | None,
                 received_at: float, uncached: int) -> AsyncIterator[bytes]:
    """Descriptor (local), token lines within the router's credit, done; however it ends, the
    outcome is counted and an unfinished request aborted. The prefill's `uncached` tokens leave the
    worker's queue (`signals`) at the first token, or when the stream ends before it."""
    metrics = worker.metrics
    outcome, finished, sent, last_at, reused = "aborted", False, 0, None, 0
    prefilling = True
    try:
        yield descriptor_line(LOCAL_DESCRIPTOR, ids, params.to_dict())
        async for out in worker.engine.generate(request_id, ids, params):
            if credit is not None and not credit.allows(sent):
                async with asyncio.timeout(OUTPUT_TIMEOUT_S):
                    await credit.wait(sent)
            n = len(out.new_token_ids)
            if n:
                now = time.perf_counter()
                if last_at is None:
                    worker.signals.prefill_finished(uncached, computed=True)
                    worker.pending_prefixes.remove(request_id)  # its blocks are in the prefix cache now
                    prefilling = False
                    # What the engine reused when it scheduled the prompt (`cached` was at receipt).
                    reused = out.num_cached_tokens
                    metrics.prefilled_reused_tokens.inc(reused)
                    metrics.ttft.observe(now - received_at)
                    worker.signals.observe("ttft", now - received_at)
                else:
                    metrics.itl.observe((now - last_at) / n)
                    worker.signals.observe("itl", (now - last_at) / n)
                last_at = now
                sent += n
                metrics.generation_tokens.inc(n)
                if delivery_trace.TRACE is not None:  # the HTTP server writes the line as soon as it is yielded
                    delivery_trace.TRACE.mark("worker", request_id, n)
                yield token_line(out.new_token_ids, out.new_text)
            elif out.new_text:
                yield token_line([], out.new_text)
            if out.finished:
                finished = True
                if out.finish_reason in ("abort", "error"):
                    outcome = "aborted" if out.finish_reason == "abort" else "error"
                    yield error_line(f"request ended: {out.finish_reason}")
                    return
                outcome = "ok"
                metrics.e2e.observe(time.perf_counter() - received_at)
                usage = {"prompt_tokens": len(ids), "completion_tokens": sent, "cached_tokens": reused}
                yield done_line(str(out.finish_reason), usage,
                                {"local_prefill": True, "decode_s": round(time.perf_counter() - received_at, 6)})
                return
        outcome = "error"
        yield error_line("engine stream ended without finishing")
    except TimeoutError:
        outcome = "error"
        yield error_line(f"no credit from the router for {OUTPUT_TIMEOUT_S:.0f}s")
    finally:
        if prefilling:
            worker.signals.prefill_finished(uncached, computed=False)
            worker.pending_prefixes.remove(request_id)
        metrics.outcome(outcome)
        if not finished:
            await asyncio.shield(worker.in_background(worker.abort(request_id)))
