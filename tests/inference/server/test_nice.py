"""`--nice`: a worker below the router and control plane sharing its host's CPUs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from inference.server.args import parse_args
from tests.support.processes import start_worker
from tests.support.worker_flags import refusal, worker_argv

pytestmark = pytest.mark.django_db(transaction=False, databases=[])


def test_nice_parses_round_trips_and_defaults_to_zero(tiny_model_dir: Path) -> None:
    assert parse_args(worker_argv(tiny_model_dir)).nice == 0
    args = parse_args(worker_argv(tiny_model_dir, "decode", "--nice", "10"))
    assert args.nice == 10 and parse_args(args.to_argv()) == args


@pytest.mark.parametrize("value", ["-1", "20"])
def test_nice_out_of_range_names_the_flag(tiny_model_dir: Path, value: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert "--nice" in refusal(worker_argv(tiny_model_dir, "decode", "--nice", value), capsys)


def test_a_worker_started_with_nice_runs_every_thread_and_its_session_below(tiny_model_dir: Path,
                                                                             log_dir: Path) -> None:
    proc, _url = start_worker("decode", tiny_model_dir, log_dir, extra=["--nice", "7"], name="nice-decode")
    try:
        pid = proc.popen.pid
        threads = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
        assert len(threads) > 1  # the engine thread and the server's are there by now
        assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in threads} == {7}
        autogroup = Path(f"/proc/{pid}/autogroup")
        if autogroup.exists():  # kernels with autogroups: the worker leads its session (start_new_session)
            assert autogroup.read_text().split()[-1] == "7"
    finally:
        proc.stop()
