"""Worker command lines for flag tests: the required flags, and argparse's refusal of a bad value."""
from __future__ import annotations

from pathlib import Path

import pytest

from inference.server.args import parse_args


def worker_argv(model: Path, role: str = "decode", *extra: str) -> list[str]:
    """`--model-path model --service-type role` followed by `extra`."""
    return ["--model-path", str(model), "--service-type", role, *extra]


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Parse `argv`, which must be refused the argparse way (exit status 2); returns its message."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err
