"""Shared fixtures: a tiny real model (random Llama with a trained tokenizer) and a log folder."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

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
