"""Parsing of the public request formats and the SSE they stream."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from inference.router import DoneEvent, ErrorEvent, Event, RouterError, TokenEvent
from inference.router.answers import SseFormatter, sse_event
from inference.router.protocol import parse_chat, parse_completion, parse_generate


def bad(parser: Any, body: Any) -> str:
    with pytest.raises(RouterError) as info:
        parser(body)
    assert info.value.status == 400 and info.value.error_type == "invalid_request_error"
    return info.value.message


def test_generate_defaults_and_sampling() -> None:
    parsed = parse_generate({"prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": "\n", "seed": 3})
    assert parsed.kind == "generate" and not parsed.stream
    assert parsed.request.prompt == "hi"
    # top_k, top_p and min_p are left out: the workers fill them from the model's generation_config.json.
    assert parsed.request.sampling.to_json() == {
        "max_tokens": 5, "temperature": 0.0, "seed": 3, "stop": ["\n"], "stop_token_ids": [], "ignore_eos": False,
    }
    explicit = parse_generate({"prompt": "hi", "temperature": 1, "top_p": 0.5, "top_k": 0, "min_p": 0}).request
    assert {k: getattr(explicit.sampling, k) for k in ("temperature", "top_p", "top_k", "min_p")} == {
        "temperature": 1.0, "top_p": 0.5, "top_k": 0, "min_p": 0.0,
    }
    assert parse_generate({"prompt": "hi", "stream": True}).stream
    assert parse_generate({"prompt": "hi", "min_p": 0.05}).request.sampling.min_p == 0.05


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": 3}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "min_p": 1.5}, "min_p"),
        ({"prompt": "x", "seed": 1.5}, "seed"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "max_token": 5}, "max_token"),
    ],
)
def test_generate_validation_names_the_field(body: dict[str, Any], field: str) -> None:
    assert f"{field}" in bad(parse_generate, body)


def test_generate_body_must_be_an_object() -> None:
    assert "JSON object" in bad(parse_generate, [1, 2])


def test_completion_prompt_forms() -> None:
    assert parse_completion({"prompt": "a"}).request.prompt == "a"
    assert parse_completion({"prompt": ["a"]}).request.prompt == "a"
    assert parse_completion({"prompt": [1, 2]}).request.input_ids == [1, 2]
    assert parse_completion({"prompt": [[1, 2]]}).request.input_ids == [1, 2]
    assert "prompt" in bad(parse_completion, {"prompt": ["a", "b"]})
    assert "'n'" in bad(parse_completion, {"prompt": "a", "n": 17})  # n and echo: test_protocol_logprobs.py
    assert "echo" in bad(parse_completion, {"prompt": "a", "echo": 1})
    assert "stream_options" in bad(parse_completion, {"prompt": "a", "stream_options": {"include_usage": True}})
    parsed = parse_completion({"prompt": "a", "stream": True, "stream_options": {"include_usage": True},
                               "model": "m", "user": "ignored"})
    assert parsed.stream and parsed.include_usage and parsed.model == "m"


def test_chat_messages() -> None:
    parsed = parse_chat({"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text", "text": "hi "},
                                                                   {"type": "text", "text": "there"}]}],
                         "max_completion_tokens": 7})
    assert parsed.request.messages == [{"role": "system", "content": "be brief"},
                                       {"role": "user", "content": "hi there"}]
    assert parsed.request.sampling.max_tokens == 7
    assert "messages" in bad(parse_chat, {"messages": []})
    assert "messages[0]" in bad(parse_chat, {"messages": [{"content": "x"}]})
    assert "text parts" in bad(parse_chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})


async def _events(items: list[Event]) -> AsyncIterator[Event]:
    for item in items:
        yield item


def _stream(kind: str, body: dict[str, Any], items: list[Event]) -> list[Any]:
    parsed = {"generate": parse_generate, "completion": parse_completion, "chat": parse_chat}[kind](body)
    source = _events(items)

    async def collect() -> list[bytes]:
        # What the gateway's streaming loop writes: the preamble, then each event until the last.
        formatter = SseFormatter(parsed, "m")
        out = [formatter.preamble()]
        async for event in source:
            chunk, last = formatter.event(event)
            out.append(chunk)
            if last:
                break
        return out

    # One chunk may carry several events (the last event and `[DONE]` go out in one write).
    chunks = [event + b"\n\n" for event in b"".join(asyncio.run(collect())).split(b"\n\n") if event]
    assert all(c.startswith(b"data: ") for c in chunks)
    assert chunks[-1] == b"data: [DONE]\n\n"
    return [json.loads(c[6:]) for c in chunks[:-1]]


DONE = DoneEvent(request_id="req-1", finish_reason="stop", usage={"prompt_tokens": 2, "completion_tokens": 2,
                 "total_tokens": 4}, timings={"ttft_s": 0.1, "e2e_s": 0.2, "prefill_s": 0.05,
                 "kv_transfer_s": 0.01}, prefill="http://p:1", decode="http://d:1")
TOKENS: list[Event] = [TokenEvent("Hel", [1]), TokenEvent("lo", [2])]


def test_generate_sse() -> None:
    events = _stream("generate", {"prompt": "x", "stream": True}, [*TOKENS, DONE])
    assert events[:2] == [{"text": "Hel", "token_ids": [1]}, {"text": "lo", "token_ids": [2]}]
    assert events[2]["finish_reason"] == "stop" and events[2]["usage"]["total_tokens"] == 4
    assert set(events[2]["timings"]) >= {"ttft_s", "e2e_s", "prefill_s", "kv_transfer_s"}


def test_chat_sse_with_usage() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "stream": True,
            "stream_options": {"include_usage": True}}
    events = _stream("chat", body, [*TOKENS, DONE])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["Hel", "lo"]
    assert events[3]["choices"][0]["finish_reason"] == "stop"
    assert events[4]["choices"] == [] and events[4]["usage"]["completion_tokens"] == 2
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)


def test_completion_sse_error_after_first_token() -> None:
    events = _stream("completion", {"prompt": "x", "stream": True}, [TOKENS[0], ErrorEvent("decode died")])
    assert events[0]["choices"][0]["text"] == "Hel" and "usage" not in events[0]
    assert events[1] == {"error": {"message": "decode died", "type": "backend_error"}}


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        ("generate", {"prompt": "x", "stream": True}),
        ("completion", {"prompt": "x", "stream": True, "model": "m"}),
        ("completion", {"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": True}),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": True,
                  "stream_options": {"include_usage": True}}),
    ],
)
def test_formatter_token_chunks_equal_the_general_encoding(kind: str, body: dict[str, Any]) -> None:
    """SseFormatter's pre-encoded token chunks are the JSON sse_event builds (text with quotes,
    backslashes and non-ASCII included); other events go through sse_event unchanged."""
    parsed = {"generate": parse_generate, "completion": parse_completion, "chat": parse_chat}[kind](body)
    formatter = SseFormatter(parsed, "model-x")
    events: list[Event] = [TokenEvent('say "hi"\\n é\u2028', [1, 2]), TokenEvent("", []), DONE]
    for event in events:
        fast, fast_last = formatter.event(event)
        slow, slow_last = sse_event(parsed, event, "model-x")
        assert fast_last == slow_last
        assert [json.loads(c[6:]) for c in fast.split(b"\n\n") if c.startswith(b"data: {")] == \
            [json.loads(c[6:]) for c in slow.split(b"\n\n") if c.startswith(b"data: {")]


@pytest.mark.parametrize("kind", ["generate", "completion", "chat"])
def test_sse_events_survive_a_splitlines_client(kind: str) -> None:
    """Issue 26: a token holding U+2028, U+2029 or U+0085 (JSON allows them raw; a random model emits
    them) must not cut its event where a client splits the stream like str.splitlines, as httpx's
    iter_lines/aiter_lines do. Every line such a client reads is a whole event with the same text."""
    texts = ["a\u2028b", "\u2029", "c\u0085d", "é — “quoted” \u2028\u2029\u0085"]
    body: dict[str, Any] = {"prompt": "x", "stream": True}
    if kind == "chat":
        body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    parsed = {"generate": parse_generate, "completion": parse_completion, "chat": parse_chat}[kind](body)
    formatter = SseFormatter(parsed, "model\u2028x")
    stream = formatter.preamble()
    for i, text in enumerate(texts):
        stream += formatter.event(TokenEvent(text, [i]))[0]
    stream += formatter.event(DONE)[0]
    lines = [line for line in stream.decode("utf-8").splitlines() if line]
    assert all(line.startswith("data: ") for line in lines)
    events = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    if kind == "generate":
        got = [e["text"] for e in events if "token_ids" in e]
    else:
        got = [e["choices"][0].get("text", e["choices"][0].get("delta", {}).get("content"))
               for e in events if e.get("choices") and e["choices"][0].get("token_ids") is not None]
        assert all(e["model"] == "model\u2028x" for e in events)
    assert got == texts
