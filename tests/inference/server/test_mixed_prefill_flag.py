"""`--mixed-prefill`: parsing, the agent's round trip, and the engine it loads mixes prefill into
decode steps (on a CPU with the decode kernel, with chunked prefill)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from inference.server.args import ServerArgs, parse_args
from inference.server.core import load_engine
from tests.support.worker_flags import worker_argv

pytestmark = pytest.mark.django_db(transaction=False, databases=[])


def test_flag_parses_and_round_trips(tiny_model_dir: Path) -> None:
    args = parse_args(worker_argv(tiny_model_dir, "both", "--mixed-prefill"))
    assert args.mixed_prefill
    assert parse_args(args.to_argv()) == args
    plain = parse_args(worker_argv(tiny_model_dir, "both"))
    assert not plain.mixed_prefill and "--mixed-prefill" not in plain.to_argv()
    agent = ServerArgs.with_defaults(model_path=tiny_model_dir, service_type="both")
    assert not agent.mixed_prefill and parse_args(agent.to_argv()) == agent


def test_engine_mixes_only_with_the_flag_and_chunked_prefill(tiny_model_dir: Path) -> None:
    common = ["--num-kv-blocks", "64", "--context-length", "256"]
    mixed = load_engine(parse_args(worker_argv(tiny_model_dir, "both", "--mixed-prefill", *common)),
                        torch.device("cpu"))
    assert mixed.scheduler.enable_mixed_prefill == mixed.runner.can_mix
    off = load_engine(parse_args(worker_argv(tiny_model_dir, "both", *common)), torch.device("cpu"))
    assert not off.scheduler.enable_mixed_prefill
    unchunked = load_engine(
        parse_args(worker_argv(tiny_model_dir, "both", "--mixed-prefill", "--no-chunked-prefill", *common)),
        torch.device("cpu"),
    )
    assert not unchunked.scheduler.enable_mixed_prefill
