"""What the logits processors and the grammar matchers read of a request: its token history.

Its own module because both `logits_processors.py` (penalties) and `grammar.py` (matchers that
replay the generated tokens) need it, and the processors call the grammar's masks.
"""
from __future__ import annotations

from typing import Protocol

from .sampling_params import SamplingParams


class TokenHistory(Protocol):
    """What the processors read of a request (the engine's `Sequence` is one)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids: frozenset[int] | None


def generated_ids(history: TokenHistory, params: SamplingParams) -> list[int]:
    """The tokens this request generated: its output, after a migration preceded by the prompt's last
    `seed_offset` tokens (the new worker's prompt is the old prompt + the tokens already streamed)."""
    offset = min(params.seed_offset, len(history.prompt_token_ids))
    if not offset:
        return history.output_token_ids
    return history.prompt_token_ids[-offset:] + history.output_token_ids
