"""n > 1: the one final event sums the choices' completion tokens, counts the prompt once, and keeps the
prompt's cached tokens as the workers reported them (OpenAI's usage.prompt_tokens_details)."""
from __future__ import annotations

from typing import Any

from inference.router.choices import _combined
from inference.router.events import DoneEvent


def _done(index: int, completion: int, usage: dict[str, Any]) -> DoneEvent:
    return DoneEvent(request_id="r", finish_reason="length", timings={}, prefill="p", decode="d", index=index,
                     usage={"prompt_tokens": 40, "completion_tokens": completion, "total_tokens": 40 + completion,
                            **usage})


def test_the_prompts_cached_tokens_survive_the_combined_usage() -> None:
    details = {"prompt_tokens_details": {"cached_tokens": 32}}
    done = _combined([_done(1, 5, details), _done(0, 7, details)])
    assert done.usage == {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52, **details}
    assert [c.index for c in done.choices or []] == [0, 1]


def test_without_a_report_the_usage_has_no_details() -> None:
    done = _combined([_done(0, 3, {}), _done(1, 4, {})])
    assert done.usage == {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47}
