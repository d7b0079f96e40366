"""SIGTERM/SIGINT to an agent before its Celery worker handles them: remembered, so the agent still stops
its workers, instead of the default action (dying on the spot).

The agent's Celery worker installs its own handlers (a warm shutdown, after which the agent marks its node
OFFLINE and stops its workers) only once it starts consuming: seconds after the process started (Django
setup, registration, recovery of the node's workers), more on a loaded host. A signal in that window used
to end the agent at once, leaving every worker it had just adopted running with no agent (the soak's
`leftover_processes` when the platform was stopped right after an agent restart). `manage.py agent`
installs these handlers before Django is set up; the agent command checks `requested()` before it starts
consuming and registers `on_request` to hand a later signal to Celery until Celery's handlers replace these.

Django-free: manage.py imports it before settings are loaded.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType

_requested = threading.Event()
_callbacks: list[Callable[[], None]] = []
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _handle(signum: int, frame: FrameType | None) -> None:
    _requested.set()
    for callback in list(_callbacks):
        callback()


def install() -> None:
    """Remember SIGTERM and SIGINT instead of dying of them (main thread only; idempotent)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, _handle)


def requested() -> bool:
    """Whether a stop signal arrived since `install()`."""
    return _requested.is_set()


def on_request(callback: Callable[[], None]) -> None:
    """Call `callback` (in the signal handler: keep it tiny) on a stop signal from now on, and at once when one
    arrived already."""
    _callbacks.append(callback)
    if _requested.is_set():
        callback()


def reset() -> None:
    """Forget signals and callbacks (tests run several agents' start-ups in one process)."""
    _requested.clear()
    _callbacks.clear()
