"""What a worker reports about its recent load for the autoscaler (the extra fields of its /health).

The control plane samples /health every few seconds. An instantaneous reading of a prefill worker's
queue is almost always 0 even under overload: a prompt spends tens of milliseconds in the engine, so
a sample rarely catches one. This module keeps what a sample cannot see, measured by the worker itself
over a sliding window (WINDOW_S):

- `prompt_tokens_pending`: prompt tokens accepted for prefill and not yet computed (queued in the
  engine or being prefilled), right now (on a decode worker: the uncached tokens of its local prefills);
- `prefill_tokens_per_s`: the prompt tokens/s the worker sustains while busy (tokens computed over the
  seconds it had at least one prompt in flight, within the window; the whole lifetime until the
  window holds a finished prompt). `prompt_tokens_pending / prefill_tokens_per_s` is how long a new
  prompt would wait: the part of TTFT that more prefill workers remove;
- `busy_ratio`: the share of the last BUSY_WINDOW_S (10 s) during which the prefill engine had work
  (0..1; a shorter window than the others so that it follows a burst within one or two samples);
- `ttft_p90_s`, `itl_p90_s` and their sample counts: the 90th percentile of the latencies the worker
  observed within the window (a decode worker's TTFT runs from receipt to the first token streamed,
  so it covers prefill queueing, compute and the KV transfer; a prefill worker's covers its own part).

No Django here (inference.server must stay importable without it); one lock guards the state since
the event loop and engine threads both report.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

WINDOW_S = 30.0
BUSY_WINDOW_S = 10.0
# Latency observations kept per kind (bounded memory on a busy decode worker: ITL is per token).
MAX_LATENCIES = 4096
# A token rate measured over less busy time than this is too noisy to report.
MIN_BUSY_S_FOR_RATE = 0.05


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values` by nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


class LoadSignals:
    """A worker's pending prompt tokens, prefill busy time, sustained token rate and latency percentiles."""

    def __init__(
        self, window_s: float = WINDOW_S, busy_window_s: float = BUSY_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.busy_window_s = min(busy_window_s, window_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._pending_tokens = 0
        self._in_flight = 0
        self._busy_since: float | None = None
        self._busy: deque[tuple[float, float]] = deque()  # finished busy intervals (start, end)
        self._done: deque[tuple[float, int]] = deque()  # (finished at, prompt tokens computed)
        self._total_tokens = 0
        self._total_busy_s = 0.0
        self._latencies: dict[str, deque[tuple[float, float]]] = {
            "ttft": deque(maxlen=MAX_LATENCIES), "itl": deque(maxlen=MAX_LATENCIES),
        }

    # ------------------------------------------------------------------ reports
    def prefill_started(self, tokens: int) -> None:
        """A prompt of `tokens` tokens enters the prefill engine."""
        with self._lock:
            now = self._clock()
            self._pending_tokens += tokens
            self._in_flight += 1
            if self._busy_since is None:
                self._busy_since = now

    def prefill_finished(self, tokens: int, *, computed: bool) -> None:
        """The prompt left the engine (`computed`: its KV is ready; False: failed or aborted)."""
        with self._lock:
            now = self._clock()
            self._pending_tokens = max(0, self._pending_tokens - tokens)
            self._in_flight = max(0, self._in_flight - 1)
            if computed:
                self._done.append((now, tokens))
                self._total_tokens += tokens
            if self._in_flight == 0 and self._busy_since is not None:
                self._busy.append((self._busy_since, now))
                self._total_busy_s += now - self._busy_since
                self._busy_since = None
            self._trim(now)

    def observe(self, kind: str, seconds: float) -> None:
        """One latency observation: kind "ttft" or "itl"."""
        with self._lock:
            self._latencies[kind].append((self._clock(), seconds))

    # ------------------------------------------------------------------ readings
    def prefill_queue(self) -> tuple[int, float | None]:
        """(`prompt_tokens_pending`, `prefill_tokens_per_s`) as `snapshot` reads them, without the latency
        percentiles: what the worker's load line on its KV event stream carries, several times a second."""
        with self._lock:
            now = self._clock()
            self._trim(now)
            return self._pending_tokens, self._rate(now)

    def _rate(self, now: float) -> float | None:
        """Prompt tokens/s while busy within the window (the lifetime's when idle lately); None unmeasured."""
        busy_s = self._busy_seconds(now, self.window_s)
        window_tokens = sum(tokens for _, tokens in self._done)
        if window_tokens and busy_s >= MIN_BUSY_S_FOR_RATE:
            return window_tokens / busy_s
        if self._total_tokens and self._total_busy_s >= MIN_BUSY_S_FOR_RATE:
            return self._total_tokens / self._total_busy_s  # idle lately: the lifetime rate
        return None

    def _trim(self, now: float) -> None:
        start = now - self.window_s
        while self._busy and self._busy[0][1] < start:
            self._busy.popleft()
        while self._done and self._done[0][0] < start:
            self._done.popleft()

    def _busy_seconds(self, now: float, window_s: float) -> float:
        """Seconds of [now - window_s, now] with at least one prompt in flight."""
        start = now - window_s
        busy = sum(max(0.0, end - max(begin, start)) for begin, end in self._busy)
        if self._busy_since is not None:
            busy += now - max(self._busy_since, start)
        return busy

    def snapshot(self) -> dict[str, Any]:
        """The /health fields (module docstring); rates and percentiles are None until measured."""
        with self._lock:
            now = self._clock()
            self._trim(now)
            rate = self._rate(now)
            body: dict[str, Any] = {
                "prompt_tokens_pending": self._pending_tokens,
                "prefill_tokens_per_s": round(rate, 1) if rate is not None else None,
                "busy_ratio": round(min(1.0, self._busy_seconds(now, self.busy_window_s) / self.busy_window_s), 4),
            }
            start = now - self.window_s
            for kind, observed in self._latencies.items():
                recent = [value for at, value in observed if at >= start]
                p90 = percentile(recent, 0.9)
                body[f"{kind}_p90_s"] = round(p90, 6) if p90 is not None else None
                body[f"{kind}_samples"] = len(recent)
            return body
