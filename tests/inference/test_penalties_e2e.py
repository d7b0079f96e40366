"""Penalties, logit_bias and min_tokens end to end with real processes: router + prefill + decode.

The prefill worker samples the first token and the decode worker the rest: both must apply the same
processors, so a disaggregated run equals the colocated engine token for token, and a large bias on
one token makes every generated token that token, the first one included.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.engine import LLMEngine, SamplingParams
from tests.inference.conftest import OpenAIDeployment

pytestmark = pytest.mark.django_db(transaction=False, databases=[])
CONTEXT = 256
PROMPT = "Disaggregated inference separates prefill from decode so that"
FORCED = 42  # an ordinary token of the tiny model's vocabulary (not EOS)


@pytest.fixture(scope="module")
def cluster(openai_deployment: OpenAIDeployment) -> str:
    """The shared deployment's router: one prefill, one decode and a router, all real processes."""
    return openai_deployment.router


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    """The same checkpoint colocated in this process."""
    return LLMEngine(str(tiny_model_dir), block_size=8, max_model_len=CONTEXT, dtype="float32")


def _sse(router: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", router + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_a_large_logit_bias_makes_every_token_that_token(cluster: str, engine: LLMEngine) -> None:
    bias = {str(FORCED): 100}
    body = httpx.post(cluster + "/generate", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                                                   "logit_bias": bias}, timeout=120).json()
    assert body["tokens"] == [FORCED] * 12 and body["finish_reason"] == "length"
    # OpenAI completions, streamed: the first token (sampled by the prefill worker) is forced too.
    chunks = _sse(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                               "logit_bias": bias})
    streamed = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert streamed == [FORCED] * 6
    # Chat, not streamed, sampled (not greedy): a bias of 100 leaves nothing else a chance.
    answer = httpx.post(cluster + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 1.0, "logit_bias": bias,
    }, timeout=120)
    assert answer.status_code == 200, answer.text
    assert engine.tokenizer is not None
    assert answer.json()["choices"][0]["message"]["content"] == engine.tokenizer.decode([FORCED] * 5)


@pytest.mark.parametrize(
    "fields",
    [
        {"temperature": 0, "repetition_penalty": 1.8},
        {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"temperature": 0.9, "seed": 77, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
         "logit_bias": {"7": 3.0, "9": -50}},
        {"temperature": 0, "min_tokens": 20, "repetition_penalty": 0.7},
    ],
)
def test_disaggregated_processors_equal_the_colocated_engine(cluster: str, engine: LLMEngine,
                                                             fields: dict[str, Any]) -> None:
    body = httpx.post(cluster + "/generate", json={"prompt": PROMPT, "max_tokens": 24, **fields}, timeout=120)
    assert body.status_code == 200, body.text
    params = SamplingParams.from_dict({"max_tokens": 24, **fields})
    assert engine.tokenizer is not None
    expected = engine.generate([engine.tokenizer.encode(PROMPT)], params)[0].token_ids
    assert body.json()["tokens"] == expected
    if "min_tokens" in fields:
        assert len(expected) >= fields["min_tokens"]


def test_bad_values_are_refused_before_any_worker(cluster: str) -> None:
    for field, value in (("frequency_penalty", 5), ("logit_bias", {"3": 500}), ("repetition_penalty", 0)):
        r = httpx.post(cluster + "/v1/completions", json={"prompt": PROMPT, field: value}, timeout=30)
        assert r.status_code == 400 and f"'{field}'" in r.json()["error"]["message"], r.text
    # A token id the model does not have is the decode worker's 400.
    r = httpx.post(cluster + "/v1/completions", json={"prompt": PROMPT, "logit_bias": {"99999999": 1}}, timeout=30)
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"], r.text
