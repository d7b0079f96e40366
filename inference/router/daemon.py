"""A router task that runs in a daemon thread of its own (the health checks, the KV event feed), so
that a saturated request loop never delays it: started once, stopped with a bounded wait."""
from __future__ import annotations

import threading


class DaemonTask:
    """A daemon thread running `_run`; subclasses look at `_stop` to end and may override `wake`."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def running(self) -> bool:
        """Whether the thread is alive and not asked to stop."""
        return self._thread.is_alive() and not self._stop.is_set()

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to stop, wake it, and wait for it (bounded)."""
        self._stop.set()
        self.wake()
        self._thread.join(timeout_s)

    def wake(self) -> None:
        """Cut the thread's current pause short (from any thread); nothing by default."""

    def _run(self) -> None:
        raise NotImplementedError
