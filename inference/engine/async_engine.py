"""AsyncEngine: drives `LLMEngine.step()` in a background thread and streams outputs to asyncio."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable

import torch

from inference.wire import delivery_trace

from .block_manager import block_hashes
from .config import ModelConfig
from .engine import LLMEngine
from .sampling_params import SamplingParams
from .sequence import RequestOutput, SequenceStatus
from .status import EngineStatus
from .step_log import StepLog
from .tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# Safety net for the idle wait while every running sequence is paused: a consumer that catches up
# wakes the thread at once; this bounds the wait should a wake-up ever be missed.
PAUSED_WAIT_S = 1.0


class _Stream:
    """Output channel of one request: an asyncio.Queue fed from the engine thread.

    A reserved request gets its channel before any event loop is known (reserve() may run in a plain
    thread); outputs are buffered until `stream()` binds the loop.

    Flow control: `backlog` counts outputs handed over and not yet taken by the consumer. When it
    reaches `window` (0: off), the request id joins `paused`, the set the scheduler consults, and the
    sequence stops decoding (it keeps its blocks); once the consumer is down to `window // 2`, it is
    removed again. Both changes happen under `lock`, so a pause and a resume never cross.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None,
        request_id: str = "",
        window: int = 0,
        paused: set[str] | None = None,
    ) -> None:
        """Bind to `loop` now, or later via `bind`; pause into `paused` past `window` outputs."""
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.buffer: list[RequestOutput] = []
        self.lock = threading.Lock()
        self.request_id = request_id
        self.window = window if paused is not None else 0
        self.paused_ids = paused if paused is not None else set()
        self.backlog = 0
        self.paused = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attach the consumer's loop (called on that loop) and flush buffered outputs into the queue."""
        with self.lock:
            self.loop = loop
            for out in self.buffer:
                self.queue.put_nowait(out)
            self.buffer.clear()

    def deliver(self, out: RequestOutput) -> None:
        """Hand an output to the consumer (from any thread); pause the sequence if the consumer is behind."""
        with self.lock:
            self.backlog += 1
            if self.window and not self.paused and not out.finished and self.backlog >= self.window:
                self.paused = True
                self.paused_ids.add(self.request_id)
            if self.loop is None:
                self.buffer.append(out)
                return
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
            except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
                pass

    def taken(self) -> bool:
        """The consumer took one output; True when that un-paused the sequence (wake the engine)."""
        with self.lock:
            self.backlog -= 1
            if self.paused and self.backlog <= self.window // 2:
                self.paused = False
                self.paused_ids.discard(self.request_id)
                return True
            return False


def _check_window(window: int) -> None:
    """Refuse a flow-control window that cannot work."""
    if window < 0 or window == 1:
        # A window of 1 would pause after every output and resume only at 0: no batching at all.
        raise ValueError("stream_window must be 0 (off) or at least 2")


def _error_output(request_id: str, message: str) -> RequestOutput:
    """A final output that fails a request."""
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error",
        num_prompt_tokens=0,
        num_output_tokens=0,
        error=message,
    )


class AsyncEngine:
    """Runs an `LLMEngine` in a daemon thread.

    The thread loops `step()` while there is work and sleeps on an Event otherwise. `generate()` and
    `stream()` never block the event loop: new requests, aborts and releases go through an inbox the
    engine thread drains before each step. `reserve()` and `kv_received()` return results, so they
    take the engine lock directly (blocking for at most one step); call them from a worker thread
    (e.g. `asyncio.to_thread`) when that matters.

    Flow control: a request whose consumer has `stream_window` outputs not taken yet is paused (left
    out of decode steps, keeping its blocks and batch slot) until the consumer is down to half of
    that, so a decode worker never generates far ahead of what its streams deliver (a client that
    stops reading, or hangs up, costs at most about a window of tokens). The engine thread never waits
    for a consumer: it only reads the paused set when planning a step. `stream_window=0` (the default)
    turns it off (workers: `--stream-window`, where 8 is suggested).
    """

    def __init__(
        self, engine: LLMEngine, *, idle_poll_s: float = 0.02, stream_window: int = 0
    ) -> None:
        """Wrap `engine` and start the stepping thread."""
        _check_window(stream_window)
        self.engine = engine
        self.idle_poll_s = idle_poll_s
        self.stream_window = stream_window
        # Request ids whose consumer is behind; written under each stream's lock, read by the
        # scheduler (membership only) on the engine thread.
        self._paused: set[str] = set()
        engine.pause_with(self._paused)
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._inbox: list[Callable[[], None]] = []
        self._inbox_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------ public API

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prefill_only: bool = False,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add a request and yield its outputs until the finished one. Invalid requests raise
        ValueError before the first yield; leaving the iteration early aborts the request."""
        prompt = self.engine.check_request(prompt_token_ids, params)
        stream = self._open(request_id, asyncio.get_running_loop())

        def add() -> None:
            self.engine.add_request(request_id, prompt, params, prefill_only=prefill_only)

        self._submit(add, request_id)
        async for out in self._consume(request_id, stream):
            yield out

    def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, stream_window: int | None = None
    ) -> list[int]:
        """Decode side: reserve blocks for the prompt KV (see `LLMEngine.reserve`); outputs start after
        `kv_received` and are read with `stream()`. `stream_window` overrides the engine's flow-control
        window for this request (a consumer that paces itself, e.g. by its router's credit, needs one
        even where the engine's default is off). Raises NoFreeBlocks / ValueError."""
        _check_window(stream_window if stream_window is not None else self.stream_window)
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request {request_id!r} already exists")
            self._streams[request_id] = self._new_stream(request_id, None, stream_window)
        try:
            return self.engine.reserve(request_id, prompt_token_ids, params)
        except BaseException:
            self._close(request_id)
            raise

    def kv_received(self, request_id: str, first_token_id: int) -> None:
        """The reserved request's KV arrived: it joins the decode batch (see `LLMEngine.kv_received`)."""
        self.engine.kv_received(request_id, first_token_id)
        self._wake.set()

    async def stream(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Yield the outputs of a reserved request until the finished one (leaving early aborts it)."""
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"unknown request {request_id!r} (reserve it first)")
        stream.bind(asyncio.get_running_loop())
        async for out in self._consume(request_id, stream):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort a request (non-blocking; its blocks are freed before the next step)."""
        self._submit(lambda: self.engine.abort(request_id), None)

    def release(self, request_id: str) -> None:
        """Free the blocks a prefill-only request kept for its KV transfer (non-blocking)."""
        self._submit(lambda: self.engine.release(request_id), None)

    def has_stream(self, request_id: str) -> bool:
        """Whether a consumer channel exists for the request."""
        with self._streams_lock:
            return request_id in self._streams

    @property
    def is_running(self) -> bool:
        """Whether the stepping thread is alive."""
        return self._thread.is_alive()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the thread and fail every request still streaming."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        with self._streams_lock:
            streams = list(self._streams.items())
        for request_id, stream in streams:
            stream.deliver(_error_output(request_id, "engine shut down"))

    # ------------------------------------------------------------------------------------ queries
    # What a worker reads of the engine, so that it never reaches into the engine's parts.

    @property
    def config(self) -> ModelConfig:
        """The model's configuration (vocabulary size, context length)."""
        return self.engine.config

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer (None for a folder without one)."""
        return self.engine.tokenizer

    def status(self) -> EngineStatus:
        """Queue, batch and KV pool figures now (see `LLMEngine.status`)."""
        return self.engine.status()

    @property
    def kv_pool(self) -> torch.Tensor:
        """The KV block tensor the KV transports read and write in place."""
        return self.engine.kv_pool

    def kv_layout(self) -> dict[str, object]:
        """The KV layout both sides of a transfer must agree on."""
        return self.engine.kv_layout()

    def reserved_hits(self, request_id: str) -> int:
        """Blocks of a reserved request that were cached here already (takes the engine lock: call it
        off the event loop, like `reserve`)."""
        return self.engine.reserved_hits(request_id)

    def cached_tokens(self, prompt_token_ids: list[int]) -> int:
        """Tokens of the prompt whose KV this engine's prefix cache holds now (the blocks a request
        admitted now would reuse; a moment later the cache may differ). Reads without the engine lock:
        lookups of a dict the engine thread may change are atomic under the GIL."""
        engine = self.engine
        if not engine.scheduler.enable_prefix_caching:
            return 0
        size = engine.block_size
        usable = max(len(prompt_token_ids) - 1, 0) // size * size
        return len(engine.block_manager.lookup(block_hashes(prompt_token_ids[:usable], size))) * size

    def is_live(self, request_id: str) -> bool:
        """Whether the engine holds the request (queued, reserved, running or prefilled)."""
        return self.engine.get_sequence(request_id) is not None

    def is_computing(self, request_id: str) -> bool:
        """Whether the request is in the running batch (not queued for a slot)."""
        seq = self.engine.get_sequence(request_id)
        return seq is not None and seq.status is SequenceStatus.RUNNING

    # ------------------------------------------------------------------------------------ internals

    def _open(self, request_id: str, loop: asyncio.AbstractEventLoop) -> _Stream:
        """Create the channel of a new request (duplicate ids are refused)."""
        with self._streams_lock:
            if request_id in self._streams:
                raise ValueError(f"request {request_id!r} already exists")
            stream = self._new_stream(request_id, loop)
            self._streams[request_id] = stream
            return stream

    def _new_stream(
        self, request_id: str, loop: asyncio.AbstractEventLoop | None, window: int | None = None
    ) -> _Stream:
        """A channel with `window` (default: this engine's flow-control window)."""
        return _Stream(loop, request_id, self.stream_window if window is None else window, self._paused)

    def _close(self, request_id: str) -> None:
        """Drop a request's channel."""
        with self._streams_lock:
            self._streams.pop(request_id, None)

    async def _consume(self, request_id: str, stream: _Stream) -> AsyncGenerator[RequestOutput, None]:
        """Yield from a channel until the final output; abort the request if the consumer leaves early."""
        finished = False
        try:
            while True:
                out = await stream.queue.get()
                if stream.taken():
                    self._wake.set()  # the sequence was paused and may decode again
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._close(request_id)
            if finished:
                self._paused.discard(request_id)
            else:
                # Stays paused until the abort is applied (same inbox, in order): no step in between.
                def abort() -> None:
                    self.engine.abort(request_id)
                    self._paused.discard(request_id)

                self._submit(abort, None)

    def _submit(self, action: Callable[[], None], request_id: str | None) -> None:
        """Queue an engine mutation for the stepping thread; a failure fails `request_id`'s stream."""

        def run() -> None:
            try:
                action()
            except Exception as exc:  # a bad request must not take the engine thread down
                logger.warning("engine request %s failed: %s", request_id, exc)
                if request_id is not None:
                    self._dispatch([_error_output(request_id, str(exc))])

        with self._inbox_lock:
            self._inbox.append(run)
        self._wake.set()

    def _drain_inbox(self) -> None:
        """Apply queued mutations in submission order."""
        with self._inbox_lock:
            actions, self._inbox = self._inbox, []
        for action in actions:
            action()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their channels (outputs nobody listens to are dropped)."""
        if not outputs:
            return
        trace = delivery_trace.TRACE
        if trace is not None:  # DELIVERY_TRACE: the step's end, per output (off by default)
            now = time.time()
            for out in outputs:
                trace.mark("engine", out.request_id, len(out.new_token_ids), now)
        with self._streams_lock:
            targets = [(self._streams.get(out.request_id), out) for out in outputs]
        for stream, out in targets:
            if stream is not None:
                stream.deliver(out)

    def _run(self) -> None:
        """The stepping loop."""
        engine = self.engine
        steps = StepLog.from_env()  # ENGINE_STEP_LOG: per-step timings for tail analysis (off by default)
        while not self._stopping:
            self._wake.clear()
            self._drain_inbox()
            if not engine.has_work():
                self._wake.wait()
                continue
            started = time.time()
            try:
                outputs = engine.step()
                if steps is not None and engine.last_step_ran:
                    steps.record(started, engine.scheduler.last_plan)
            except Exception as exc:
                # step() already turns forward-pass errors into error outputs; reaching here means the
                # engine state itself is broken, so fail everything rather than spin on the same error.
                logger.exception("engine step raised; failing all requests")
                try:
                    outputs = engine.fail_all(f"engine error: {exc}")
                except Exception:
                    logger.exception("could not fail requests cleanly")
                    outputs = []
            self._dispatch(outputs)
            if not outputs and not engine.last_step_ran:
                if engine.num_queued or engine.num_running == 0:
                    # Waiting requests that cannot be admitted yet (blocks held by transfers): poll slowly.
                    self._wake.wait(self.idle_poll_s)
                else:
                    # Every running sequence is paused: a consumer catching up (or any new work) wakes us.
                    self._wake.wait(PAUSED_WAIT_S)
