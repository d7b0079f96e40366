"""Usage per API key, deployment and minute: counted in the router process, written to the database.

A router adds each request's outcome and tokens to an in-memory table keyed by (key, deployment,
minute); the table is written (added to the rows, atomically per row, so any number of router processes
sum up) at most ROUTER_USAGE_FLUSH_S after its first entry, from a thread, never on a request's path.
Requests of callers that are not database keys are not recorded per key (their totals are in the
router's Prometheus series). A failed write is logged and its counts kept for the next one.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from datetime import UTC, datetime

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from inference.actions.api_keys import UsageDelta, record_usage

logger = logging.getLogger(__name__)

# Pending rows kept at most (a database down for long must not grow the router's memory without bound).
_MAX_PENDING_ROWS = 100_000


class UsageRecorder:
    """This process's usage counts not yet written; `add` from the event loop, writes in a thread."""

    def __init__(self, flush_s: float) -> None:
        self.flush_s = flush_s
        self._pending: dict[tuple[int, str, int], UsageDelta] = {}
        self._lock = threading.Lock()
        self._scheduled = False
        self.tasks: set[asyncio.Task[int]] = set()

    def add(self, key_id: int, deployment: str, at: float, *, requests: int = 0, prompt_tokens: int = 0,
            completion_tokens: int = 0, errors: int = 0, rejected: int = 0, user: str | None = None) -> None:
        """Count what one request did (at epoch time `at`) for the key on the deployment."""
        row = (key_id, deployment, int(at // 60))
        with self._lock:
            counts = self._pending.get(row)
            if counts is None:
                if len(self._pending) >= _MAX_PENDING_ROWS:
                    return
                counts = self._pending[row] = UsageDelta()
            counts.add(UsageDelta(requests, prompt_tokens, completion_tokens, errors, rejected,
                                  {user[:256]} if user else set()))
        self._schedule()

    def _schedule(self) -> None:
        if self._scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (sync callers, tests): `flush_now` writes
        self._scheduled = True
        loop.call_later(self.flush_s, self._start_flush)

    def _start_flush(self) -> None:
        self._scheduled = False
        task = asyncio.ensure_future(sync_to_async(self.flush_now, thread_sensitive=False)())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def flush_now(self) -> int:
        """Write every pending count (thread side); returns the rows written. Failed rows are kept."""
        with self._lock:
            pending, self._pending = self._pending, {}
        written = 0
        if not pending:
            return 0
        close_old_connections()
        for (key_id, deployment, minute), counts in pending.items():
            try:
                record_usage(key_id, deployment, datetime.fromtimestamp(minute * 60, tz=UTC), counts)
                written += 1
            except Exception:  # noqa: BLE001  database down: keep the counts for the next write
                logger.warning("usage write failed; kept for the next one", exc_info=True)
                self._restore((key_id, deployment, minute), counts)
        return written

    def _restore(self, row: tuple[int, str, int], counts: UsageDelta) -> None:
        with self._lock:
            self._pending.setdefault(row, UsageDelta()).add(counts)


_recorder: UsageRecorder | None = None
_recorder_lock = threading.Lock()


def usage_recorder() -> UsageRecorder:
    """This process's recorder (ROUTER_USAGE_FLUSH_S from settings)."""
    global _recorder
    with _recorder_lock:
        if _recorder is None:
            from django.conf import settings

            _recorder = UsageRecorder(float(settings.ROUTER_USAGE_FLUSH_S))
        return _recorder
