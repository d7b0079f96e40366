"""The prefill call of an attempt: `POST /internal/prefill` to each prefill worker at most once.

The decode worker's descriptor is reused as is by every retry; a prefill worker that fails is
excluded for the rest of the request (`Establishment.failed_prefill`) and named in its error. A
prefill worker that could not write into the decode worker (`DecodePeerFailure`) or found its lease
gone (`LeaseExpired`) ends the attempt instead: the establishment starts over.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from inference.router.endpoint import Endpoint
from inference.router.failures import (
    TRANSPORT_ERRORS,
    BackendFailure,
    Busy,
    DecodePeerFailure,
    LeaseExpired,
    WorkerFailure,
    raise_for_status,
)
from inference.router.health import describe_exception
from inference.router.kv_index import CURRENT_PROMPT, PREDICTED_UNCACHED, PromptBlocks
from inference.wire.prefill import PrefillAnswer, PrefillRequest
from inference.wire.stream import DescriptorLine

if TYPE_CHECKING:
    from inference.router.attempt import Attempt
    from inference.router.establish import Establishment

logger = logging.getLogger(__name__)


async def prefill(est: Establishment, attempt: Attempt, descriptor: DescriptorLine) -> None:
    """Get the prompt prefilled into the decode worker's blocks, trying each prefill worker once.

    Prefill workers that fail are remembered for the rest of the request. When none is left
    this raises the final RouterError (a prefill failure says nothing about the decode worker,
    so there is no point in starting over with another one).
    """
    pool = est.client.pool
    body = PrefillRequest(
        request_id=attempt.request_id,
        prompt_token_ids=descriptor.prompt_token_ids,
        # The decode worker's resolved parameters (its model's generation_config.json defaults
        # filled in), so that prefill samples the first token with the same values as decode.
        sampling=descriptor.sampling if descriptor.sampling is not None else est.req.sampling.to_json(),
        descriptor=descriptor.descriptor,  # reused as is by every retry
    ).encode()
    tried: list[Endpoint] = list(est.failed_prefill)
    # The prompt as the decode worker tokenized it: a `kv-aware` policy finds who holds its prefix.
    current = CURRENT_PROMPT.get()  # the client's ids, when it sent ids: hashed already, reused if equal
    if current is None or current.token_ids != descriptor.prompt_token_ids:
        CURRENT_PROMPT.set(PromptBlocks(descriptor.prompt_token_ids))  # this task's own context
    for _ in range(len(pool.endpoints("prefill"))):  # each prefill endpoint at most once
        PREDICTED_UNCACHED.set(0)
        pin = est.req.pin  # a later choice of n > 1: choice 0's prefill worker holds the prompt's KV
        prefill = pin.prefill_in(pool.in_rotation("prefill"), lambda e: e not in tried) if pin is not None else None
        if prefill is None:
            prefill = pool.choose("prefill", exclude=tried)
        if prefill is None:
            break
        if time.monotonic() >= est.deadline:
            raise est.timeout_error()
        tried.append(prefill)
        if await _prefill_on(est, prefill, attempt, body):
            return
    raise est.exhausted()

async def _prefill_on(est: Establishment, prefill: Endpoint, attempt: Attempt, body: bytes) -> bool:
    """One prefill worker's try: True when it delivered, False when the next one should try."""
    client, pool = est.client, est.client.pool
    attempt.prefill = prefill
    client.metrics.selections.labels("prefill", prefill.url).inc()
    prefill.acquire()
    # The tokens a kv-aware choice predicted this prefill computes count in the worker's queue meanwhile.
    pending = PREDICTED_UNCACHED.get()
    prefill.prefill_sent(pending)
    try:
        attempt.prefill_answer = await _post_prefill(est, prefill, body)
    except DecodePeerFailure:
        pool.record_success(prefill)
        raise  # the decode worker failed: `run` starts over with another one
    except BackendFailure as exc:
        logger.warning("prefill %s failed for %s: %s", prefill.url, attempt.request_id, exc.message)
        client.record_failure(prefill, exc.message)
        est.failed_prefill.append(prefill)
        est.failures.append(WorkerFailure(prefill.url, "prefill", exc.message))
        # A prefill that timed out may still be working: tell it to stop, in the background.
        client.spawn(client.abort([prefill.url], attempt.request_id))
        attempt.prefill = None
        return False
    except Busy as exc:
        est.busy.append(WorkerFailure(prefill.url, "prefill", f"busy: {exc.message}"))
        attempt.prefill = None
        return False
    except LeaseExpired as exc:
        # Not this worker's fault (it answered; an earlier one took the lease's time).
        pool.record_success(prefill)
        exc.message = f"prefill worker {prefill.url} found the decode lease expired: {exc.message}"
        raise
    finally:
        prefill.release()
        prefill.prefill_done(pending)
    pool.record_success(prefill)
    return True

async def _post_prefill(est: Establishment, prefill: Endpoint, body: bytes) -> PrefillAnswer:
    """POST /internal/prefill; the answer comes once the decode worker acknowledged the KV."""
    client = est.client
    wait = client.remaining(est.deadline)
    try:
        async with asyncio.timeout(wait):
            response = await client.pool.upstream().post(f"{prefill.url}/internal/prefill", body,
                                                         connect_timeout_s=client.connect_timeout_s)
            async with response:
                raw = await response.read()
                status = response.status
    except TimeoutError:
        raise BackendFailure(f"no prefill answer within {wait:.1f}s") from None
    except TRANSPORT_ERRORS as exc:
        raise BackendFailure(describe_exception(exc)) from exc
    if status != 200:
        raise_for_status(status, raw, "prefill")
    try:
        return PrefillAnswer.decode(raw)
    except ValueError as exc:
        raise BackendFailure(str(exc)) from None
