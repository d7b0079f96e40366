"""A stop signal to an agent before Celery handles it is remembered and handed on, not fatal."""
from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from inference.agent import stop_signals


@pytest.fixture
def installed() -> Iterator[None]:
    """The handlers installed in this (test) process, and the previous ones back afterwards."""
    previous = {sig: signal.getsignal(sig) for sig in stop_signals.SIGNALS}
    stop_signals.reset()
    stop_signals.install()
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    stop_signals.reset()


def test_sigterm_is_remembered_and_handed_to_callbacks_registered_before_or_after(installed: None) -> None:
    early: list[str] = []
    stop_signals.on_request(lambda: early.append("early"))
    assert not stop_signals.requested()
    os.kill(os.getpid(), signal.SIGTERM)  # the process survives it
    assert stop_signals.requested() and early == ["early"]
    late: list[str] = []
    stop_signals.on_request(lambda: late.append("late"))  # registered after the signal: called at once
    assert late == ["late"]


def test_sigint_counts_too(installed: None) -> None:
    os.kill(os.getpid(), signal.SIGINT)
    assert stop_signals.requested()
