"""`--speculative ngram` / `--num-speculative-tokens`: parsing, refusals naming the flag, the agent's
round trip, and real processes: a decode worker with the flag streams the same greedy tokens as one
without it, several tokens per line where proposals were accepted, and its KV pool is empty after.

The workers are driven through their internal API (decode → descriptor → prefill → stream), as the
router does."""
from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.server.args import ServerArgs, parse_args
from tests.support.copying_model import make_copying_model
from tests.support.processes import start_parallel, start_worker
from tests.support.worker_flags import refusal, worker_argv

pytestmark = pytest.mark.django_db(transaction=False, databases=[])


def test_flags_parse_and_round_trip(tiny_model_dir: Path) -> None:
    args = parse_args(worker_argv(tiny_model_dir, "decode", "--speculative", "ngram", "--num-speculative-tokens", "3"))
    assert args.speculative == "ngram" and args.num_speculative_tokens == 3
    assert parse_args(args.to_argv()) == args
    plain = parse_args(worker_argv(tiny_model_dir))
    assert plain.speculative is None and plain.num_speculative_tokens is None
    assert "--speculative" not in plain.to_argv()
    agent = ServerArgs.with_defaults(model_path=tiny_model_dir, service_type="decode")
    assert agent.speculative is None and parse_args(agent.to_argv()) == agent


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--speculative", "eagle"], "argument --speculative: invalid choice: 'eagle'"),
        (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be between 1"),
        (["--speculative", "ngram", "--num-speculative-tokens", "17"], "--num-speculative-tokens must be between 1"),
        (["--speculative", "ngram", "--num-speculative-tokens", "x"], "argument --num-speculative-tokens"),
        (["--num-speculative-tokens", "4"], "--num-speculative-tokens needs --speculative ngram"),
    ],
)
def test_bad_values_name_the_flag(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert message in refusal(worker_argv(tiny_model_dir, "decode", *extra), capsys)


@pytest.fixture(scope="module")
def spec_cluster(tiny_model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One prefill worker and two decode workers (plain, and --speculative ngram) on the copying model."""
    model = make_copying_model(tiny_model_dir, tmp_path_factory.mktemp("spec-flag") / "model")
    common = ["--context-length", "512", "--block-size", "8", "--num-kv-blocks", "128"]
    procs = []
    try:
        started = start_parallel({
            "prefill": partial(start_worker, "prefill", model, log_dir, extra=common, name="spec-prefill"),
            "plain": partial(start_worker, "decode", model, log_dir, extra=common, name="spec-plain"),
            "spec": partial(start_worker, "decode", model, log_dir, name="spec-decode", extra=[
                *common, "--speculative", "ngram", "--num-speculative-tokens", "4"]),
        })
        (prefill, prefill_url), (plain, plain_url), (spec, spec_url) = (
            started[name] for name in ("prefill", "plain", "spec"))
        procs += [prefill, plain, spec]
        yield {"prefill": prefill_url, "plain": plain_url, "spec": spec_url}
    finally:
        for p in reversed(procs):
            p.stop()


def stream(prefill: str, decode: str, request_id: str, prompt: str, sampling: dict[str, Any]) -> list[dict]:
    """One disaggregated request as the router runs it; every line of the decode stream after the
    descriptor."""
    body = {"request_id": request_id, "prompt": prompt, "sampling": sampling}
    with httpx.Client(timeout=120) as client, client.stream("POST", decode + "/internal/decode", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        lines = resp.iter_lines()
        first = json.loads(next(lines))
        assert first["type"] == "descriptor"
        answer = client.post(prefill + "/internal/prefill", json={
            "request_id": request_id, "prompt_token_ids": first["prompt_token_ids"],
            "sampling": sampling, "descriptor": first["descriptor"],
        })
        assert answer.status_code == 200, answer.text
        return [json.loads(line) for line in lines if line]


def test_decode_worker_with_the_flag_streams_the_same_greedy_tokens(spec_cluster: dict) -> None:
    info = httpx.get(spec_cluster["spec"] + "/info").json()
    assert info["speculative"] == "ngram" and info["num_speculative_tokens"] == 4
    assert httpx.get(spec_cluster["plain"] + "/info").json()["speculative"] is None
    sampling = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
    widest = 0
    for i, prompt in enumerate(["The quick brown fox", "Once upon a time there", "A B C D E F", "hello"]):
        runs = []
        for role in ("plain", "spec"):
            lines = stream(spec_cluster["prefill"], spec_cluster[role], f"{role}-{i}", prompt, sampling)
            assert lines[-1]["type"] == "done" and lines[-1]["usage"]["completion_tokens"] == 64, lines[-1]
            tokens = [t for line in lines if line["type"] == "token" for t in line["token_ids"]]
            text = "".join(line["text"] for line in lines if line["type"] == "token")
            runs.append((tokens, text))
            if role == "spec":
                widest = max(widest, *(len(line["token_ids"]) for line in lines if line["type"] == "token"))
        assert runs[0] == runs[1]
    assert widest > 1  # accepted proposals arrived as several tokens in one step's line
    for role in ("plain", "spec"):
        health = httpx.get(spec_cluster[role] + "/health").json()
        assert health["kv_usage"] == 0.0, health
