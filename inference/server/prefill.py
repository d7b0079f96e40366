"""The prefill worker: run the prompt (batched with other prefills), sample the first token, write the
KV blocks into the decode worker's reserved blocks, answer with the first token and timings.

Its KV sender is built with it and never absent. While it works it keeps the decode worker's lease
alive (`LeaseKeeper`), reporting its progress (`PrefillRun.stage`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from inference.engine import SamplingParams
from inference.kv_transfer import KVTransferError, TransferDescriptor, TransferStats
from inference.kv_transfer.keeper import LeaseKeeper
from inference.kv_transfer.lease import LeaseLost
from inference.server.abortable import AbortableTasks
from inference.server.args import ServerArgs
from inference.server.core import WorkerCore
from inference.server.errors import StartupError, WorkerError, bad_request
from inference.server.logprobs import LogprobRenderer
from inference.server.requests import parse_sampling, parse_token_ids
from inference.server.transport import build_sender
from inference.wire.logprobs import Logprob
from inference.wire.prefill import PrefillAnswer

logger = logging.getLogger(__name__)

# Test-only fault injection (docs/internals.md): a prefill worker started with this variable set
# sleeps that many seconds between computing the prompt and sending its KV, so that tests can kill
# or stall it mid-transfer reproducibly. Never set it in production.
FAULT_PREFILL_DELAY_ENV = "PLATFORM_FAULT_PREFILL_DELAY_S"


def fault_prefill_delay_s() -> float:
    """The injected delay before each KV send, from PLATFORM_FAULT_PREFILL_DELAY_S (0: none)."""
    raw = os.environ.get(FAULT_PREFILL_DELAY_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError as exc:
        raise StartupError(f"{FAULT_PREFILL_DELAY_ENV}={raw!r} is not a number of seconds") from exc
    return max(value, 0.0)


@dataclass
class PrefillRun:
    """One prefill request: what it computes and where its KV goes, and how far it got."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    descriptor: TransferDescriptor
    started: float
    phase: str = "accepted"
    first_token: int = 0
    block_ids: tuple[int, ...] = ()
    prefill_s: float = 0.0
    # When the request asked: the first token's log-probabilities and the prompt's (echo).
    first_logprobs: Logprob | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    # The prompt tokens the engine reused from its prefix cache when it scheduled the prompt.
    cached_tokens: int = 0


class PrefillWorker(WorkerCore):
    """A prefill worker: the core plus its KV sender and the prefills in progress (abortable)."""

    role = "prefill"

    def __init__(self, args: ServerArgs) -> None:
        """Load the engine and build the KV sender over its pool."""
        super().__init__(args)
        self.sender = build_sender(args, self.engine, self.layout, self.rdma_device)
        # Prefills in progress by request id, so that /internal/abort can cancel them.
        self._prefill_tasks: AbortableTasks[dict[str, Any]] = AbortableTasks()
        self.fault_prefill_delay_s = fault_prefill_delay_s()
        self.logprob_texts = LogprobRenderer(self.engine.tokenizer)
        if self.fault_prefill_delay_s:
            logger.warning(
                "fault injection active: every KV send waits %.1fs first (%s; tests only)",
                self.fault_prefill_delay_s, FAULT_PREFILL_DELAY_ENV,
            )

    # ------------------------------------------------------------------ aborts
    async def abort_role_part(self, request_id: str) -> bool:
        """A prefill in progress is cancelled (its blocks are freed once a KV send under way is done)."""
        if request_id in self._prefill_tasks:
            logger.info("abort of %s: cancelling its prefill", request_id)
        return self._prefill_tasks.cancel(request_id)

    def has_pending(self, request_id: str) -> bool:
        """Whether a prefill of the request is registered here."""
        return request_id in self._prefill_tasks

    # ------------------------------------------------------------------ requests
    async def prefill(self, body: dict[str, Any]) -> dict[str, Any]:
        """Run the prompt, write its KV into the decode worker's blocks, answer with the first token.

        The work runs in its own task, registered under the request id, so that
        `POST /internal/abort` can cancel it (409 `aborted`; the router has gone by then).
        """
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise bad_request("'request_id' must be a non-empty string")
        self.refuse_if_aborted(request_id)
        run = self._parse(request_id, body)
        return await self._prefill_tasks.run(request_id, self._prefill(run), lambda: self.metrics.outcome("aborted"))

    def _parse(self, request_id: str, body: dict[str, Any]) -> PrefillRun:
        """The request's prompt, parameters and descriptor, checked against this worker (400/409)."""
        started = time.perf_counter()
        ids = parse_token_ids(body.get("prompt_token_ids"), self.engine.config.vocab_size, "prompt_token_ids")
        params = parse_sampling(body.get("sampling"), self.args.max_tokens_limit, self.sampling_defaults)
        try:
            descriptor = TransferDescriptor.from_dict(body.get("descriptor"))
        except ValueError as exc:
            raise bad_request(f"invalid 'descriptor': {exc}") from exc
        if descriptor.num_tokens != len(ids):
            raise bad_request(
                f"descriptor covers {descriptor.num_tokens} tokens but the prompt has {len(ids)}"
            )
        if descriptor.transport != self.sender.transport:
            raise bad_request(
                f"decode asked for the {descriptor.transport} transport; this prefill worker uses "
                f"{self.args.kv_transport} (--kv-transport)"
            )
        self.check_prompt_length(len(ids))
        if descriptor.lease_remaining() <= 0:
            raise WorkerError(409, f"the decode lease of {request_id} has expired", "lease_expired")
        # The first token is sampled here with the request's own parameters (seeded streams continue
        # on the decode side), but only one token: decode owns the rest.
        return PrefillRun(request_id, ids, dataclasses.replace(params, max_tokens=1), descriptor, started)

    async def _prefill(self, run: PrefillRun) -> dict[str, Any]:
        """Compute and send under the lease's keeper; the answer with the first token and timings."""
        # Renews the decode worker's lease from now until the KV send has finished, so the blocks
        # stay reserved however long a valid prompt takes; a lost lease stops the work.
        keeper = LeaseKeeper(
            run.descriptor, secret=self.args.shared_secret, holder=self._holder(), stage=lambda: self._stage(run)
        )
        keeper.start()
        send: asyncio.Future[TransferStats] | None = None
        try:
            await self._compute_within_lease(run, keeper)
            run.phase = "sending"
            # Shielded: cancelling (an abort) must not free the source blocks while the send thread
            # still reads them; the finally below defers the release until that thread is done.
            send = asyncio.ensure_future(asyncio.to_thread(
                self.sender.send, run.descriptor, list(run.block_ids), run.first_token,
                max(run.descriptor.lease_cap_remaining(), 0.01),
            ))
            try:
                stats = await asyncio.shield(send)
            except KVTransferError as exc:
                self.metrics.outcome("transfer_failed")
                raise WorkerError(502, f"KV transfer failed: {exc}", "kv_transfer_error") from exc
        finally:
            keeper.stop()
            if send is not None and not send.done():
                send.add_done_callback(lambda done: self._release_after_send(run.request_id, done))
            else:
                await asyncio.to_thread(self.engine.release, run.request_id)
        self.metrics.kv_transfer_bytes.inc(stats.nbytes)
        self.metrics.kv_transfer_seconds.observe(stats.seconds)
        self.metrics.e2e.observe(time.perf_counter() - run.started)
        self.metrics.outcome("ok")
        answer = PrefillAnswer(run.first_token, stats.nbytes, round(run.prefill_s, 6), round(stats.seconds, 6),
                               run.first_logprobs, run.prompt_logprobs, run.cached_tokens)
        return answer.to_json()

    def _stage(self, run: PrefillRun) -> str:
        """The progress renewals report; while computing, the engine says queued or running."""
        if run.phase != "computing":
            return run.phase
        return "computing" if self.engine.is_computing(run.request_id) else "queued"

    async def _compute_within_lease(self, run: PrefillRun, keeper: LeaseKeeper) -> None:
        """Compute the prompt (and the injected fault delay) within the lease's hard cap; 504 past the
        cap, 409 `lease_expired` when the lease is lost before the send may start."""
        request_id = run.request_id
        try:
            # Bounded by the lease's hard cap (just the lease for a decode worker without renewals).
            async with asyncio.timeout(max(run.descriptor.lease_cap_remaining(), 0.01)):
                run.phase = "computing"
                await keeper.guard(self._compute_prompt(run))
                run.phase = "prefilled"
                if self.fault_prefill_delay_s:
                    logger.warning(
                        "fault injection: delaying the KV send of %s by %.1fs", request_id, self.fault_prefill_delay_s
                    )
                    await keeper.guard(asyncio.sleep(self.fault_prefill_delay_s))
        except TimeoutError as exc:
            self.metrics.outcome("timeout")
            raise WorkerError(504, f"prefill of {request_id} outlived the decode lease's cap", "timeout") from exc
        except LeaseLost as exc:
            # The decode worker has freed the blocks: the router retries with a fresh reservation.
            self.metrics.outcome("timeout")
            raise WorkerError(409, f"the decode lease of {request_id} was lost: {exc}", "lease_expired") from exc
        if run.descriptor.lease_remaining() <= 0 or keeper.lost.is_set():
            self.metrics.outcome("timeout")
            raise WorkerError(409, f"the decode lease of {request_id} expired before the KV send", "lease_expired")

    async def _compute_prompt(self, run: PrefillRun) -> None:
        """Run the prompt in the engine (batched with other prefills): its first token and KV blocks."""
        n = len(run.prompt_token_ids)
        cached = self.engine.cached_tokens(run.prompt_token_ids)
        self.metrics.prefilled_prompt_tokens.inc(n)
        self.metrics.prefilled_cached_tokens.inc(cached)
        # The queue and rate the worker reports count the tokens to compute, as the router's own count of the
        # prefills it sent since (their predicted uncached tokens) and a decode worker's local prefills do:
        # counted whole, a worker holding long histories looked ~5x as busy as it was to the kv-aware cost,
        # which then sent a conversation's next turn away from the worker that held it.
        uncached = n - cached
        self.signals.prefill_started(uncached)
        computed = False
        first_token: int | None = None
        block_ids: list[int] = []
        try:
            outputs = self.engine.generate(run.request_id, run.prompt_token_ids, run.params, prefill_only=True)
            async for out in outputs:
                if out.new_token_ids:
                    first_token = out.new_token_ids[0]
                if out.logprobs:
                    run.first_logprobs = self.logprob_texts.position(out.logprobs[0])
                if out.prompt_logprobs is not None:
                    run.prompt_logprobs = self.logprob_texts.prompt(out.prompt_logprobs, run.prompt_token_ids)
                if out.finished:
                    if out.finish_reason != "prefilled":
                        raise WorkerError(500, f"prefill ended with {out.finish_reason}", "engine_error")
                    block_ids = list(out.block_ids or [])
                    # What the engine reused when it scheduled the prompt (`cached` above is at receipt).
                    self.metrics.prefilled_reused_tokens.inc(out.num_cached_tokens)
                    run.cached_tokens = out.num_cached_tokens
            if first_token is None or not block_ids:
                raise WorkerError(500, "prefill produced no first token", "engine_error")
            computed = True
        finally:
            self.signals.prefill_finished(uncached, computed=computed)
        run.first_token, run.block_ids = first_token, tuple(block_ids)
        run.prefill_s = time.perf_counter() - run.started
        self.metrics.ttft.observe(run.prefill_s)
        self.signals.observe("ttft", run.prefill_s)
        self.metrics.prompt_tokens.inc(n)

    def _holder(self) -> str:
        """How this prefill worker names itself in lease renewals (the decode worker quotes it)."""
        host = self.args.host if self.args.host not in ("", "0.0.0.0", "::") else socket.gethostname()
        return f"http://{host}:{self.args.port}"

    def _release_after_send(self, request_id: str, send: asyncio.Future[TransferStats]) -> None:
        """Free an aborted prefill's blocks once its KV send thread has finished with them."""
        if not send.cancelled() and send.exception() is not None:  # retrieved, so asyncio does not warn
            logger.info("KV send of aborted %s ended with: %s", request_id, send.exception())
        self.engine.release(request_id)
