"""The router's tokenization equals the worker's: the same ids for text prompts and chat (system prompts,
tools, tool calls and answers, multi-turn, special-token text inside messages), built from the spec a
worker serves (`GET /internal/tokenizer`), with the real tokenizers of the test model and of SmolLM2
(when prepared)."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from bench.common import smollm2_dir
from inference.engine.tokenizer import Tokenizer
from inference.router.events import GenerateRequest
from inference.router.prompt_tokens import PromptTokenizer, TokenizerMismatch
from inference.server.tokenizer_spec import tokenizer_spec
from inference.wire.sampling import Sampling
from inference.wire.tokenizer import TokenizerSpec

TEXTS = [
    "Hello! How are you?",
    " leading space and trailing space ",
    "Numbers 12345 and 3.14159, code: def f(x): return x**2\n\n\tindented",
    "naïve café — 分布式推理架构的优势 🙂🚀",
    "literal special tokens <|im_start|>user\nhi<|im_end|> in text",
    "a" * 3000,
    "word " * 700,
]

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def _chats() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    system = {"role": "system", "content": "You are a helpful assistant. " * 20}
    turns: list[dict[str, Any]] = [system]
    chats: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = []
    for i, user in enumerate(["Hi!", "What is 2+2?", "And <|im_end|> as text?", "分布式 🙂 " * 30]):
        turns.append({"role": "user", "content": user})
        chats.append((copy.deepcopy(turns), None))
        turns.append({"role": "assistant", "content": f"Reply number {i}. " * (i + 1)})
    chats.append(([{"role": "user", "content": "no system prompt"}], None))
    chats.append(([{"role": "user", "content": "add 2 and 3"}], TOOLS))
    chats.append(([system, {"role": "user", "content": "add 2 and 3"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "5"},
                   {"role": "user", "content": "thanks"}], TOOLS))
    return chats


def _models(tiny_model_dir: Path) -> list[Path]:
    smollm = smollm2_dir()
    return [tiny_model_dir] + ([smollm] if smollm is not None else [])


def _pair(model: Path) -> tuple[Tokenizer, PromptTokenizer, TokenizerSpec]:
    worker = Tokenizer.from_pretrained(str(model))
    spec = tokenizer_spec(model.name, worker)
    assert spec is not None
    # Through JSON, as the router gets it.
    spec = TokenizerSpec.from_json(json.loads(json.dumps(spec.to_json())))
    return worker, PromptTokenizer(spec), spec


def test_text_and_chat_ids_equal_the_workers(tiny_model_dir: Path) -> None:
    for model in _models(tiny_model_dir):
        worker, router, _spec = _pair(model)
        assert router.piecewise, model  # byte-level BPE without a normalizer: the piece cache applies
        for text in TEXTS:
            assert router.text_ids(text) == worker.encode(text), (model, text[:40])
            assert router.text_ids(text) == worker.encode(text)  # from the cache, unchanged
        for messages, tools in _chats():
            expected = worker.apply_chat_template(messages, tools=tools)
            assert router.chat_ids(messages, tools) == expected, (model, messages[-1])
            # Twice: the second time every piece comes from the cache.
            assert router.chat_ids(messages, tools) == expected


def test_request_ids_leaves_what_the_worker_refuses_to_the_worker(tiny_model_dir: Path) -> None:
    worker, router, _spec = _pair(tiny_model_dir)
    sampling = Sampling.from_json({"max_tokens": 4})
    chat = GenerateRequest(sampling=sampling, messages=[{"role": "user", "content": "hi"}])
    assert router.request_ids(chat) == worker.apply_chat_template([{"role": "user", "content": "hi"}])
    text = GenerateRequest(sampling=sampling, prompt="hello there")
    assert router.request_ids(text) == worker.encode("hello there")
    # A message without content: the worker answers 400 naming the field, so it must see the messages.
    assert router.request_ids(GenerateRequest(sampling=sampling, messages=[{"role": "user"}])) is None
    assert router.request_ids(GenerateRequest(sampling=sampling, prompt="")) is None
    # A template that raises on a role it does not know: no ids, the worker reports the error.
    assert router.request_ids(GenerateRequest(sampling=sampling, messages=[{"role": 3, "content": "x"}])) is None


def test_a_tokenizer_that_differs_from_the_worker_is_refused(tiny_model_dir: Path) -> None:
    _worker, _router, spec = _pair(tiny_model_dir)
    wrong = TokenizerSpec(model=spec.model, tokenizer_json=spec.tokenizer_json, chat_template=spec.chat_template,
                          special_tokens=spec.special_tokens, probe_text_ids=spec.probe_text_ids[:-1],
                          probe_chat_ids=spec.probe_chat_ids)
    with pytest.raises(TokenizerMismatch, match="probe text"):
        PromptTokenizer(wrong)
    assert spec.probe_chat_ids is not None
    other_template = TokenizerSpec(model=spec.model, tokenizer_json=spec.tokenizer_json,
                                   chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
                                   special_tokens=spec.special_tokens, probe_text_ids=spec.probe_text_ids,
                                   probe_chat_ids=spec.probe_chat_ids)
    with pytest.raises(TokenizerMismatch, match="probe chat"):
        PromptTokenizer(other_template)


def test_spec_json_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="'model'"):
        TokenizerSpec.from_json({"tokenizer": "{}"})
    with pytest.raises(ValueError, match="'probe_text_ids'"):
        TokenizerSpec.from_json({"model": "m", "tokenizer": "{}", "special_tokens": {}, "probe_text_ids": ["x"]})
    with pytest.raises(ValueError, match="'chat_template'"):
        TokenizerSpec.from_json({"model": "m", "tokenizer": "{}", "chat_template": 3, "special_tokens": {},
                                 "probe_text_ids": []})
