"""Worker command lines for flag tests (the required flags, argparse's refusal of a bad value), and an
in-process prefill worker built from one."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.server.args import parse_args
from inference.server.prefill import PrefillWorker
from inference.server.worker import create_worker


def worker_argv(model: Path, role: str = "decode", *extra: str) -> list[str]:
    """`--model-path model --service-type role` followed by `extra`."""
    return ["--model-path", str(model), "--service-type", role, *extra]


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Parse `argv`, which must be refused the argparse way (exit status 2); returns its message."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@contextlib.contextmanager
def running_prefill_worker(model: Path, *extra: str) -> Iterator[PrefillWorker]:
    """An in-process prefill worker on 127.0.0.1 with `extra` flags, started and stopped around the block."""
    worker = create_worker(parse_args(worker_argv(model, "prefill", *extra, "--host", "127.0.0.1")))
    assert isinstance(worker, PrefillWorker)
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()
