"""Real processes: sampling defaults come from the model's generation_config.json when a request
leaves them out, an explicit request value wins, and the prefill worker samples the first token with
the decode worker's resolved values (the router hands them over) even when its own folder differs.

Router + prefill + decode are started on copies of the tiny checkpoint whose generation_config.json
sets the sampling defaults; the reference is the same checkpoint run in this process.
"""
from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.engine import LLMEngine, SamplingParams
from tests.support.processes import start_parallel, start_router, start_worker

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

CONTEXT = 256
PROMPT = "Disaggregated inference separates prefill from decode so that"
MAX_TOKENS = 16


def model_copy(source: Path, dest: Path, **sampling: Any) -> Path:
    """A copy of the checkpoint whose generation_config.json also holds `sampling`."""
    shutil.copytree(source, dest)
    gen_path = dest / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen_path.write_text(json.dumps({**gen, **sampling}))
    return dest


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, log_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Decode's model says temperature 0; prefill's copy says temperature 5 (nearly uniform), so a
    first token sampled with prefill's own defaults would almost surely differ from greedy."""
    root = tmp_path_factory.mktemp("gencfg")
    # Same folder name in both: the router checks that prefill and decode serve the same model.
    decode_dir = model_copy(tiny_model_dir, root / "decode" / "tiny-llama", temperature=0.0)
    prefill_dir = model_copy(tiny_model_dir, root / "prefill" / "tiny-llama", temperature=5.0)
    procs = []
    try:
        common = ["--context-length", str(CONTEXT), "--block-size", "8"]
        started = start_parallel({
            "prefill": partial(start_worker, "prefill", prefill_dir, log_dir, extra=common, name="gencfg-prefill"),
            "decode": partial(start_worker, "decode", decode_dir, log_dir, extra=common, name="gencfg-decode"),
        })
        (prefill, prefill_url), (decode, decode_url) = started["prefill"], started["decode"]
        procs += [prefill, decode]
        router, router_url = start_router([prefill_url], [decode_url], log_dir)
        procs.append(router)
        yield {"prefill": prefill_url, "decode": decode_url, "router": router_url}
    finally:
        for p in reversed(procs):
            p.stop()


@pytest.fixture(scope="module")
def reference_engine(tiny_model_dir: Path) -> LLMEngine:
    """The checkpoint in this process; it reads no sampling defaults, so params are explicit here."""
    return LLMEngine(str(tiny_model_dir), block_size=8, max_model_len=CONTEXT)


def reference(engine: LLMEngine, params: SamplingParams) -> list[int]:
    assert engine.tokenizer is not None
    return engine.generate([engine.tokenizer.encode(PROMPT)], params)[0].token_ids


def generate(cluster: dict[str, str], **fields: Any) -> list[int]:
    r = httpx.post(cluster["router"] + "/generate",
                   json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, **fields}, timeout=120)
    assert r.status_code == 200, r.text
    tokens: list[int] = r.json()["tokens"]
    assert len(tokens) == MAX_TOKENS
    return tokens


def test_model_default_temperature_0_equals_explicit_greedy(cluster, reference_engine) -> None:
    greedy = reference(reference_engine, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert generate(cluster) == greedy  # no temperature in the request: the model's 0 applies
    assert generate(cluster, temperature=0) == greedy


def test_explicit_request_value_overrides_the_model_default(cluster, reference_engine) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    sampled = reference(reference_engine, params)
    greedy = reference(reference_engine, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert sampled != greedy  # else this test could not tell the two apart
    assert generate(cluster, temperature=0.9, top_p=0.95, seed=1234) == sampled


def test_decode_descriptor_carries_the_resolved_parameters(cluster) -> None:
    """What the router forwards to prefill: the decode model's defaults, the request's own values."""
    body = {"request_id": "gencfg-descriptor", "prompt": PROMPT, "sampling": {"max_tokens": 4, "top_k": 7}}
    with httpx.Client(timeout=60) as client, client.stream("POST", cluster["decode"] + "/internal/decode",
                                                             json=body) as stream:
        assert stream.status_code == 200
        first = json.loads(next(stream.iter_lines()))
        client.post(cluster["decode"] + "/internal/abort", json={"request_id": "gencfg-descriptor"})
    assert first["type"] == "descriptor"
    sampling = first["sampling"]
    assert sampling["temperature"] == 0.0 and sampling["top_k"] == 7 and sampling["top_p"] == 1.0
    assert sampling["max_tokens"] == 4
