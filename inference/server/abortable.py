"""Work of a request that an abort may cancel: a task registered under the request id while it runs.

A prefill runs in a task of its own (not in the HTTP handler's), so that `POST /internal/abort` can
cancel it from another request. The registry tells an abort's cancellation apart from the handler's own
(a client that went away cancels the handler: that must propagate as a cancellation, not become a 409).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from inference.server.errors import WorkerError

T = TypeVar("T")


class AbortableTasks(Generic[T]):
    """Tasks of requests in progress by request id; `cancel` is what an abort calls."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[T]] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tasks

    def __len__(self) -> int:
        return len(self._tasks)

    def cancel(self, request_id: str) -> bool:
        """Cancel the request's task if it is still running; whether one was registered."""
        task = self._tasks.get(request_id)
        if task is not None and not task.done():
            task.cancel()
        return task is not None

    async def run(self, request_id: str, work: Coroutine[Any, Any, T], on_abort: Callable[[], None]) -> T:
        """Run `work` as the request's registered task and return its result.

        Cancelled by `cancel` (an abort): `on_abort()` (e.g. count the outcome), then 409 `aborted`.
        The caller itself cancelled: the cancellation propagates unchanged.
        """
        task = asyncio.ensure_future(work)
        self._tasks[request_id] = task
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                on_abort()
                raise WorkerError(409, f"prefill of {request_id} was aborted", "aborted") from None
            raise
        finally:
            if self._tasks.get(request_id) is task:
                del self._tasks[request_id]
