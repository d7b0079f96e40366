"""One simulated worker: the answers of a real one (inference/server/worker.py) without a model.

Decode: validate, reserve blocks (the KV pool is a counter), hand out a descriptor, wait under a
lease for the prefill worker's KV (`kv_received`), then stream `max_tokens` token lines at the
configured rate within the router's credit, and a done line with usage and timings. Prefill: wait
the configured time per prompt token, deliver the "KV" (the first token) to the decode worker the
descriptor names, answer with the first token and timings. Errors are the real worker's
(`WorkerError`: 400 bad input, 429 full, 409 aborted or lease lost), so the router's retries and
pass-through see what they would in production.
"""
from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bench.sim.config import SimConfig
from bench.sim.prefix_cache import SimPrefixCache
from inference.server.abortable import AbortableTasks
from inference.server.credit import StreamCredit
from inference.server.errors import WorkerError, bad_request, overloaded
from inference.server.kv_events import KVEventSource
from inference.server.load import LoadSignals
from inference.server.metrics import WorkerMetrics
from inference.wire import PrefillAnswer, Sampling
from inference.wire.kv_events import WorkerLoad
from inference.wire.sampling import field_names
from inference.wire.stream import descriptor_line, done_line, error_line, token_line

# The engine's own defaults of the model-default fields (SamplingParams in inference/engine, not
# imported: it pulls the engine and torch into a process that only simulates); a simulated model
# has no generation_config.json of its own.
ENGINE_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_k": -1, "top_p": 1.0, "min_p": 0.0}
# How long a decode stream waits for the router's credit before giving up (the real worker's bound).
CREDIT_TIMEOUT_S = 120.0
# Delivers a prefill's KV to the decode worker a descriptor names; returns the bytes "sent".
KVDelivery = Callable[[dict[str, Any], int], Awaitable[int]]


@dataclass(eq=False)
class _Reservation:
    """A decode request's blocks, and the KV it waits for."""

    request_id: str
    prompt_ids: list[int]
    sampling: dict[str, Any]
    blocks: int
    token: str
    received_at: float
    lease_expires_at: float
    kv: asyncio.Event = field(default_factory=asyncio.Event)
    first_token: int | None = None
    kv_bytes: int = 0
    aborted: bool = False


def resolve_sampling(data: Any, max_tokens_limit: int) -> dict[str, Any]:
    """The request's sampling checked by the wire's rules (as the real worker checks it), with the
    defaults filled in (the real worker's resolved `SamplingParams.to_dict()` shape); 400 naming the
    field on bad input."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise bad_request("'sampling' must be a JSON object")
    try:
        sampling = Sampling.from_json(data)
    except (TypeError, ValueError, OverflowError) as exc:  # SamplingError is a ValueError
        raise bad_request(f"invalid sampling parameters: {exc}") from exc
    if sampling.max_tokens > max_tokens_limit:
        raise bad_request(f"max_tokens={sampling.max_tokens} exceeds this server's limit of {max_tokens_limit}")
    resolved = {name: getattr(sampling, name) for name in field_names()}
    for name, default in ENGINE_DEFAULTS.items():
        if resolved[name] is None:
            resolved[name] = default
    return resolved


def token_ids(value: Any, vocab_size: int, name: str) -> list[int]:
    """A non-empty list of token ids in [0, vocab_size); 400 otherwise."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{name}' must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value):
        raise bad_request(f"'{name}' holds values that are not token ids in [0, {vocab_size})")
    return list(value)


def prompt_ids(body: dict[str, Any], vocab_size: int) -> list[int]:
    """The prompt's ids from `input_ids`, `messages` or `prompt`; text is "tokenized" one id per byte."""
    if body.get("input_ids") is not None:
        return token_ids(body["input_ids"], vocab_size, "input_ids")
    text: Any = body.get("prompt")
    if body.get("messages") is not None:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise bad_request("'messages' must be a non-empty list of {role, content} objects")
        text = "\n".join(f"{m.get('role')}: {m.get('content')}" for m in messages)
    if text is None:
        raise bad_request("one of 'prompt', 'messages' or 'input_ids' is required")
    if not isinstance(text, str) or not text:
        raise bad_request("'prompt' must be a non-empty string")
    return [3 + b % (vocab_size - 3) for b in text.encode("utf-8", errors="replace")]


class SimWorker:
    """A prefill or decode worker at `port`, answering like inference.server.worker.Worker."""

    def __init__(self, role: str, port: int, config: SimConfig, deliver: KVDelivery, host: str = "127.0.0.1") -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, not {role!r}")
        self.role = role
        self.port = port
        self.host = host
        # Set by the fleet's fault control: "unhealthy" or "silent" health checks (None: normal).
        self.fault: str | None = None
        self.config = config
        self.deliver = deliver
        self.metrics = WorkerMetrics(role, config.model)
        self.signals = LoadSignals()
        self.started_at = time.time()
        self.used_blocks = 0
        self.streaming = 0  # decode streams past their KV (the "batch" and its queue)
        self._reservations: dict[str, _Reservation] = {}
        self._prefills: AbortableTasks[dict[str, Any]] = AbortableTasks()
        self._aborted: set[str] = set()
        # The prompts' blocks, as the engine's prefix cache would hold them, and the real event stream of it.
        self.prefix = SimPrefixCache(config.kv_blocks, config.block_size)
        self.kv_events = KVEventSource(self.prefix.log, role, config.block_size, load=self.load)

    # ------------------------------------------------------------------ status
    def load(self) -> WorkerLoad:
        """The stream's load line (inference/server/core.py `Worker.load`)."""
        health = self.health()
        pending, rate = self.signals.prefill_queue()
        return WorkerLoad(running=health["running"], waiting=health["queue_depth"] + health["reserved"],
                          prompt_tokens_pending=pending, prefill_tokens_per_s=round(rate, 1) if rate else None,
                          kv_usage=health["kv_usage"])

    def health(self) -> dict[str, Any]:
        """The real health answer's fields (inference/server/worker.py `Worker.health`)."""
        cfg = self.config
        running = min(self.streaming, cfg.batch_size) if self.role == "decode" else len(self._prefills)
        queued = max(0, self.streaming - cfg.batch_size) if self.role == "decode" else 0
        body: dict[str, Any] = {
            "status": "healthy",
            "cpu_utilization": round(min(1.0, running / cfg.batch_size), 3),
            "role": self.role, "model": cfg.model, "queue_depth": queued, "running": running,
            "reserved": len(self._reservations) - self.streaming if self.role == "decode" else 0,
            "batch_size": cfg.batch_size, "kv_usage": round(self.used_blocks / cfg.kv_blocks, 4),
            "kv_blocks": cfg.kv_blocks, "kv_bytes": cfg.kv_blocks * cfg.block_nbytes,
        }
        if self.role == "decode":
            body["stream_credit"] = True
        body.update(self.signals.snapshot())
        return body

    def info(self) -> dict[str, Any]:
        """The real /info fields."""
        cfg = self.config
        info: dict[str, Any] = {
            "role": self.role, "model": cfg.model, "model_path": f"/sim/{cfg.model}",
            "context_length": cfg.context_length, "max_sequence_length": cfg.context_length,
            "block_size": cfg.block_size, "num_kv_blocks": cfg.kv_blocks, "kv_transport": "tcp",
            "max_tokens_limit": cfg.max_tokens_limit, "batch_size": cfg.batch_size, "max_queue": cfg.max_queue,
            "dtype": cfg.dtype, "prefix_caching": True, "chunked_prefill": False, "mixed_prefill": False,
            "mixed_step_target": None, "speculative": None,
            "num_speculative_tokens": None, "device": "sim", "cpus": [],
            "started_at": self.started_at,
        }
        if self.role == "decode":
            info["kv_port"] = self.port
        return info

    def render_metrics(self) -> bytes:
        """Prometheus text with the real worker's families (the same WorkerMetrics), gauges refreshed."""
        health = self.health()
        m = self.metrics
        m.queue_depth.set(health["queue_depth"])
        m.reserved.set(health["reserved"])
        m.running.set(health["running"])
        m.kv_usage.set(health["kv_usage"])
        m.cpu_utilization.set(health["cpu_utilization"])
        return m.render()

    # ------------------------------------------------------------------ abort
    def refuse_if_aborted(self, request_id: str) -> None:
        """409 `aborted` for a request whose abort came first."""
        if request_id in self._aborted:
            self.metrics.outcome("aborted")
            raise WorkerError(409, f"request {request_id} was aborted before it arrived", "aborted")

    def abort(self, request_id: str) -> None:
        """End whatever of `request_id` lives here (idempotent); remembered for late arrivals."""
        if len(self._aborted) > 10000:  # a bounded tombstone set: the oldest ids matter least
            self._aborted.clear()
        self._aborted.add(request_id)
        reservation = self._reservations.get(request_id)
        if reservation is not None:
            reservation.aborted = True
            reservation.kv.set()
        self._prefills.cancel(request_id)

    # ------------------------------------------------------------------ decode
    async def open_decode(self, body: dict[str, Any], credit: StreamCredit | None = None) -> AsyncIterator[bytes]:
        """Validate and reserve; the NDJSON lines of the request (descriptor first), built by the wire."""
        cfg = self.config
        received_at = time.perf_counter()
        request_id = str(body.get("request_id") or uuid.uuid4().hex)
        self.refuse_if_aborted(request_id)
        sampling = resolve_sampling(body.get("sampling"), cfg.max_tokens_limit)
        ids = prompt_ids(body, cfg.vocab_size)
        if len(ids) >= cfg.context_length:
            raise bad_request(f"prompt has {len(ids)} tokens, leaving no room to generate within "
                              f"--max-sequence-length {cfg.context_length}")
        sampling["max_tokens"] = min(sampling["max_tokens"], cfg.context_length - len(ids))
        if len(self._reservations) - self.streaming >= cfg.max_queue:
            self.metrics.outcome("rejected")
            raise overloaded(f"decode queue is full ({cfg.max_queue} waiting); retry later")
        blocks = math.ceil((len(ids) + sampling["max_tokens"]) / cfg.block_size)
        if self.used_blocks + blocks > cfg.kv_blocks:
            self.metrics.outcome("rejected")
            raise overloaded(f"KV cache is full (need {blocks} blocks, {cfg.kv_blocks - self.used_blocks} free); "
                             "retry later")
        if request_id in self._reservations:
            raise bad_request(f"request {request_id} is already in progress here")
        self.used_blocks += blocks
        self.prefix.admit(ids)
        now = time.time()
        reservation = _Reservation(request_id, ids, sampling, blocks, uuid.uuid4().hex, received_at,
                                   now + cfg.kv_lease_timeout_s)
        self._reservations[request_id] = reservation
        self.metrics.prompt_tokens.inc(len(ids))
        return self._decode_events(reservation, credit)

    def descriptor(self, r: _Reservation) -> dict[str, Any]:
        """The transfer descriptor's fields (`TransferDescriptor.to_dict`), pointing at this worker."""
        cfg = self.config
        prompt_blocks = math.ceil(len(r.prompt_ids) / cfg.block_size)
        return {
            "request_id": r.request_id, "transport": "tcp", "host": self.host, "port": self.port,
            "block_ids": list(range(prompt_blocks)), "num_tokens": len(r.prompt_ids),
            "layout": cfg.layout(), "lease_expires_at": r.lease_expires_at, "token": r.token, "rdma": None,
            "lease_s": cfg.kv_lease_timeout_s, "lease_cap_at": r.lease_expires_at, "first_block": 0,
        }

    def kv_received(self, request_id: str, token: str, first_token: int, nbytes: int) -> bool:
        """The prefill worker's KV arrived; False when nothing here waits for it (lease lost, aborted)."""
        r = self._reservations.get(request_id)
        if r is None or r.aborted or r.token != token or r.kv.is_set():
            return False
        r.first_token = first_token
        r.kv_bytes = nbytes
        self.metrics.kv_transfer_bytes.inc(nbytes)
        r.kv.set()
        return True

    async def _decode_events(self, r: _Reservation, credit: StreamCredit | None) -> AsyncIterator[bytes]:
        cfg = self.config
        outcome = "aborted"
        streaming = False
        try:
            if cfg.reserve_s:
                await asyncio.sleep(cfg.reserve_s)
            yield descriptor_line(self.descriptor(r), r.prompt_ids, r.sampling)
            try:
                await asyncio.wait_for(r.kv.wait(), timeout=cfg.kv_lease_timeout_s)
            except TimeoutError:
                outcome = "kv_timeout"
                yield error_line(f"no KV for {r.request_id} within the {cfg.kv_lease_timeout_s:g}s lease",
                                 "kv_timeout", holder=None, renewals=0)
                return
            if r.aborted or r.first_token is None:
                return
            streaming = True
            self.streaming += 1
            kv_wait = time.perf_counter() - r.received_at
            started = last = time.perf_counter()
            step = 1.0 / cfg.decode_tokens_per_s
            token = r.first_token
            max_tokens = r.sampling["max_tokens"]
            for sent in range(max_tokens):  # bounded by max_tokens; each wait is bounded
                if sent:
                    await asyncio.sleep(step)
                    token = (token * 31 + 17) % cfg.vocab_size
                if credit is not None and not credit.allows(sent):
                    async with asyncio.timeout(CREDIT_TIMEOUT_S):
                        await credit.wait(sent)
                if r.aborted:
                    yield error_line("request ended: abort")
                    return
                now = time.perf_counter()
                if sent == 0:
                    self.metrics.ttft.observe(now - r.received_at)
                    self.signals.observe("ttft", now - r.received_at)
                else:
                    self.metrics.itl.observe(now - last)
                    self.signals.observe("itl", now - last)
                last = now
                self.metrics.generation_tokens.inc()
                yield token_line([token], f" t{token}")
            outcome = "ok"
            self.metrics.e2e.observe(time.perf_counter() - r.received_at)
            yield done_line("length", {"prompt_tokens": len(r.prompt_ids), "completion_tokens": max_tokens},
                            {"kv_wait_s": round(kv_wait, 6), "decode_s": round(time.perf_counter() - started, 6),
                             "kv_transfer_s": cfg.kv_transfer_s, "kv_bytes": r.kv_bytes})
        except TimeoutError:
            outcome = "error"
            yield error_line(f"no credit from the router for {CREDIT_TIMEOUT_S:.0f}s")
        finally:
            if streaming:
                self.streaming -= 1
            self._reservations.pop(r.request_id, None)
            self.used_blocks -= r.blocks
            self.metrics.outcome(outcome)

    # ------------------------------------------------------------------ prefill
    async def prefill(self, body: dict[str, Any]) -> dict[str, Any]:
        """Compute (wait) the prompt, deliver its KV to the decode worker, answer like the real one."""
        request_id = body.get("request_id")
        if not isinstance(request_id, str) or not request_id:
            raise bad_request("'request_id' must be a non-empty string")
        self.refuse_if_aborted(request_id)
        ids = token_ids(body.get("prompt_token_ids"), self.config.vocab_size, "prompt_token_ids")
        resolve_sampling(body.get("sampling"), self.config.max_tokens_limit)
        descriptor = body.get("descriptor")
        if not isinstance(descriptor, dict) or not {"host", "port", "request_id", "token"} <= set(descriptor):
            raise bad_request("invalid 'descriptor': host, port, request_id and token are required")
        if descriptor.get("num_tokens") != len(ids):
            raise bad_request(f"descriptor covers {descriptor.get('num_tokens')} tokens but the prompt has {len(ids)}")
        if float(descriptor.get("lease_expires_at", 0)) <= time.time():
            raise WorkerError(409, f"the decode lease of {request_id} has expired", "lease_expired")
        return await self._prefills.run(request_id, self._prefill(ids, descriptor),
                                        lambda: self.metrics.outcome("aborted"))

    async def _prefill(self, ids: list[int], descriptor: dict[str, Any]) -> dict[str, Any]:
        cfg = self.config
        started = time.perf_counter()
        self.signals.prefill_started(len(ids))
        computed = False
        uncached = len(ids) - self.prefix.admit(ids)  # a cached prefix costs nothing, as on the engine
        try:
            await asyncio.sleep(cfg.prefill_base_s + uncached / cfg.prefill_tokens_per_s)
            computed = True
        finally:
            self.signals.prefill_finished(len(ids), computed=computed)
        prefill_s = time.perf_counter() - started
        self.metrics.ttft.observe(prefill_s)
        self.signals.observe("ttft", prefill_s)
        self.metrics.prompt_tokens.inc(len(ids))
        first_token = sum(ids) % cfg.vocab_size
        sent_at = time.perf_counter()
        nbytes = await self.deliver(descriptor, first_token)
        transfer_s = time.perf_counter() - sent_at
        self.metrics.kv_transfer_bytes.inc(nbytes)
        self.metrics.kv_transfer_seconds.observe(transfer_s)
        self.metrics.e2e.observe(time.perf_counter() - started)
        self.metrics.outcome("ok")
        return PrefillAnswer(first_token, nbytes, round(prefill_s, 6), round(transfer_s, 6)).to_json()
