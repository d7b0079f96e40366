"""Regressions for the bugs the fuzzers found (docs/security.md, "Bugs found"), checked in-process.

Each was a 500 (or a dead thread) on input a client controls; each must now be a clean refusal.
"""
from __future__ import annotations

import json
import time

import pytest
import torch

from inference.engine import SamplingParams
from inference.engine.sampler import sample
from inference.kv_transfer import TransferDescriptor
from inference.kv_transfer.tcp import _same
from inference.router import RouterError
from inference.router.protocol import parse_chat, parse_completion, parse_generate
from inference.server.errors import WorkerError
from inference.server.requests import parse_sampling, prompt_token_ids
from tests.support.asgi import asgi_request

HUGE = 10**400  # a JSON integer no float can hold


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324])
def test_tiny_temperature_samples_greedily_instead_of_failing_the_batch(temperature: float) -> None:
    logits = torch.randn(512) * 10
    params = SamplingParams(temperature=temperature, top_k=5, top_p=0.5, seed=1)
    assert sample(logits[None, :], [params], [0])[0] == int(logits.argmax())


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_router_refuses_numbers_too_large_for_a_float(field: str) -> None:
    with pytest.raises(RouterError) as refused:
        parse_generate({"prompt": "hi", field: HUGE})
    assert refused.value.status == 400 and field in refused.value.message


@pytest.mark.parametrize(
    "parse,body",
    [
        (parse_generate, {"prompt": "a\ud800"}),
        (parse_generate, {"prompt": "hi", "stop": ["\udfff"]}),
        (parse_completion, {"prompt": "\ud800"}),
        (parse_chat, {"messages": [{"role": "user", "content": "\ud800"}]}),
        (parse_chat, {"messages": [{"role": "\udbff", "content": "hi"}]}),
        (parse_chat, {"messages": [{"role": "user", "content": "hi"}], "unknown": {"\ud800": 1}}),
    ],
)
def test_router_refuses_lone_surrogates(parse: object, body: dict[str, object]) -> None:
    with pytest.raises(RouterError) as refused:
        parse(body)  # type: ignore[operator]
    assert refused.value.status == 400


def test_router_refuses_deep_nesting_as_400() -> None:
    depth = 100_000
    body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    response = asgi_request("POST", "/generate", body, {"content-type": "application/json"})
    assert response["status"] == 400
    assert b"not valid JSON" in response["body"]


def test_worker_refuses_numbers_too_large_for_a_float() -> None:
    with pytest.raises(WorkerError) as refused:
        parse_sampling({"temperature": HUGE}, max_tokens_limit=32)
    assert refused.value.status == 400


def test_worker_refuses_a_prompt_with_a_lone_surrogate() -> None:
    class Tokenizer:
        def encode(self, text: str) -> list[int]:
            text.encode("utf-8")  # what the real (Rust) tokenizer chokes on
            return [1]

    with pytest.raises(WorkerError) as refused:
        prompt_token_ids({"prompt": "a\ud800"}, Tokenizer(), 512)  # type: ignore[arg-type]
    assert refused.value.status == 400


def _descriptor(**changes: object) -> dict[str, object]:
    base: dict[str, object] = {
        "request_id": "r", "transport": "tcp", "host": "127.0.0.1", "port": 5000, "block_ids": [0],
        "num_tokens": 3, "layout": {"num_layers": 1, "block_size": 8, "num_kv_heads": 1, "head_dim": 4,
                                    "dtype": "float32"},
        "lease_expires_at": time.time() + 5, "token": "t",
    }
    base.update(changes)
    return base


@pytest.mark.parametrize(
    "changes",
    [
        {"layout": {"num_layers": 1, "block_size": 0, "num_kv_heads": 1, "head_dim": 4, "dtype": "float32"}},
        {"lease_expires_at": 1e300},  # overflowed the socket timeout later (OverflowError, a 500)
        {"lease_expires_at": float("nan")},
        {"lease_expires_at": HUGE},
        {"port": float("inf")},
        {"num_tokens": float("inf")},
    ],
)
def test_descriptor_refuses_what_crashed_prefill(changes: dict[str, object]) -> None:
    data = json.loads(json.dumps(_descriptor(**changes)))  # as it arrives: Infinity/NaN literals included
    with pytest.raises(ValueError):
        TransferDescriptor.from_dict(data)


def test_kv_secret_comparison_takes_any_header_value() -> None:
    assert _same("secret", "secret")
    assert not _same("s\u00e9cret", "secret")  # was a TypeError that killed the receiving thread
    assert not _same(["secret"], "secret")
    assert not _same(None, "secret")
