"""Shared fixtures: a tiny real model (random Llama with a trained tokenizer) and a log folder; the hooks
that make an interrupted run stop the processes it started (tests/support/run_guard.py)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Interrupted runs stop their processes: signal handlers, the session-end stop and the reaper.
from tests.support.run_guard import pytest_runtest_setup, pytest_sessionfinish, pytest_sessionstart  # noqa: F401

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint with a real tokenizer, built offline once per test session."""
    from inference.tools.model_prep import create_tiny_llama

    return create_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where end-to-end tests put the logs of the processes they start (shown on failure)."""
    path = Path(os.environ.get("TEST_ARTIFACTS", "")) if os.environ.get("TEST_ARTIFACTS") else None
    if path is None:
        return tmp_path_factory.mktemp("logs")
    path.mkdir(parents=True, exist_ok=True)
    return path
