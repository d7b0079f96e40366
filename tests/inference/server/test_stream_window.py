"""`--stream-window`: the decode worker's flow-control window (AsyncEngine.stream_window)."""
from __future__ import annotations

from pathlib import Path

import pytest

from inference.server.args import ServerArgs, parse_args
from tests.support.worker_flags import refusal, worker_argv


def test_stream_window_parses_round_trips_and_defaults(tiny_model_dir: Path) -> None:
    """Default 0 (off); a window is carried by the agent's command line."""
    assert parse_args(worker_argv(tiny_model_dir)).stream_window == 0
    args = parse_args(worker_argv(tiny_model_dir, "decode", "--stream-window", "8"))
    assert args.stream_window == 8
    assert parse_args(args.to_argv()) == args
    assert ServerArgs.with_defaults(model_path=tiny_model_dir, service_type="decode").stream_window == 0


@pytest.mark.parametrize("value", ["1", "-2"])
def test_stream_window_refuses_one_and_negatives(tiny_model_dir: Path, value: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A window of 1 could never batch two steps of a stream; the error names the flag."""
    assert "--stream-window" in refusal(worker_argv(tiny_model_dir, "decode", "--stream-window", value), capsys)
