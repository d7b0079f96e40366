"""Prefill side of a progress-following lease: renew the decode worker's lease while working.

A `LeaseKeeper` runs next to one prefill request from the moment the worker accepts it until its KV
send has finished. Each time a third of the lease has passed since the last grant it renews the lease
(`lease.request_renewal`) with the stage the request is in, so a fast prefill sends no renewal at all
and a slow one keeps its blocks for as long as it makes progress (up to the decode worker's cap).
When the decode worker refuses (the lease already ran out, the request was aborted, the cap is
reached) or cannot be reached until the lease has run out, the keeper declares the lease lost and
`guard()` stops the work it protects: computing a prompt nobody will receive is wasted.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from inference.kv_transfer.base import KVTransferError, TransferDescriptor
from inference.kv_transfer.lease import RENEW_FRACTION, LeaseLost, request_renewal

logger = logging.getLogger(__name__)

T = TypeVar("T")

# One renewal round trip may take at most this long (a decode worker that slow is retried).
_MAX_RENEW_TIMEOUT_S = 5.0


class LeaseKeeper:
    """Keeps one descriptor's lease alive while the prefill worker makes progress on it."""

    def __init__(
        self, descriptor: TransferDescriptor, *, secret: str, holder: str, stage: Callable[[], str]
    ) -> None:
        self.descriptor = descriptor
        self._secret = secret
        self._holder = holder
        self._stage = stage
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.renewals = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin renewing (a descriptor from a decode worker without renewals is left alone)."""
        if self.descriptor.renewable() and self._task is None:
            self._task = asyncio.ensure_future(self._run())

    def stop(self) -> None:
        """Stop renewing: the KV send has finished (or the request ended); the lease may lapse."""
        if self._task is not None:
            self._task.cancel()

    async def guard(self, work: Awaitable[T]) -> T:
        """Await `work`; if the lease is lost first, cancel it and raise LeaseLost."""
        task = asyncio.ensure_future(work)
        lost = asyncio.ensure_future(self.lost.wait())
        try:
            await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()  # an abort: the work goes with the request
            raise
        finally:
            lost.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task  # let it clean up (leaving the engine's stream aborts the sequence)
        raise LeaseLost(self.lost_reason)

    def _lose(self, reason: str) -> None:
        self.lost_reason = reason
        self.lost.set()
        logger.warning("lease of %s lost: %s", self.descriptor.request_id, reason)

    async def _run(self) -> None:
        descriptor = self.descriptor
        interval = descriptor.lease_s * RENEW_FRACTION
        timeout = max(min(interval, _MAX_RENEW_TIMEOUT_S), 0.05)
        while True:
            # Due once `interval` has passed since the last grant (at once if the router was slow).
            await asyncio.sleep(max(descriptor.lease_remaining() - (descriptor.lease_s - interval), 0.0))
            try:
                await asyncio.to_thread(
                    request_renewal,
                    descriptor,
                    secret=self._secret,
                    stage=self._stage(),
                    holder=self._holder,
                    timeout=timeout,
                )
            except LeaseLost as exc:
                self._lose(str(exc))
                return
            except KVTransferError as exc:
                if descriptor.lease_remaining() <= 0:
                    self._lose(f"could not renew it before it ran out: {exc}")
                    return
                logger.warning("lease renewal of %s failed (retrying): %s", descriptor.request_id, exc)
                await asyncio.sleep(min(interval / 2, max(descriptor.lease_remaining(), 0.0)))
                continue
            self.renewals += 1
