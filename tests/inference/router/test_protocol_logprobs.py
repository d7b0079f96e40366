"""n, logprobs, top_logprobs and echo: parsed into the wire's sampling, and answered in OpenAI's shapes
(checked with the official client's own response models), streamed and not."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs

from inference.router import RouterError
from inference.router.answers import SseFormatter, collect, final_body
from inference.router.events import DoneEvent, Event, TokenEvent
from inference.router.protocol import parse_chat, parse_completion
from inference.wire.logprobs import Logprob, decode_positions, encode_positions

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def lp(token: str, value: float, *top: tuple[str, float]) -> Logprob:
    return Logprob(token, value, list(top))


def done(index: int = 0, reason: str = "length", completion: int = 2) -> DoneEvent:
    return DoneEvent(request_id="req-x", finish_reason=reason,
                     usage={"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion},
                     timings={}, prefill="p", decode="d", index=index)


def events_of(n: int = 1, prompt: list[Logprob | None] | None = None) -> list[Event]:
    out: list[Event] = []
    for i in range(n):
        out.append(TokenEvent(text="Hel", token_ids=[1], logprobs=[lp("Hel", -0.5, ("Hel", -0.5), ("He", -1.5))],
                              prompt_logprobs=prompt, index=i))
        out.append(TokenEvent(text="lo", token_ids=[2], logprobs=[lp("lo", -0.25, ("lo", -0.25), ("l", -2.0))],
                              index=i))
    dones = [done(i) for i in range(n)]
    final = dones[0]
    if n > 1:
        final = DoneEvent(**{**{f: getattr(final, f) for f in final.__dataclass_fields__}, "choices": dones,
                             "usage": {"prompt_tokens": 3, "completion_tokens": 2 * n, "total_tokens": 3 + 2 * n}})
    out.append(final)
    return out


async def _iter(events: list[Event]) -> AsyncIterator[Event]:
    for event in events:
        yield event


def whole(parsed: Any, events: list[Event]) -> dict[str, Any]:
    return final_body(parsed, asyncio.run(collect(_iter(events))), "m")


def streamed(parsed: Any, events: list[Event]) -> list[dict[str, Any]]:
    formatter = SseFormatter(parsed, "m")
    raw = formatter.preamble() + b"".join(formatter.event(e)[0] for e in events)
    chunks = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


def test_parsing_sets_the_wire_fields() -> None:
    completion = parse_completion({"prompt": "hi", "logprobs": 3, "echo": True, "n": 2})
    assert completion.request.sampling.logprobs == 3 and completion.request.sampling.prompt_logprobs == 3
    assert completion.choices.n == 2 and completion.choices.echo and completion.choices.logprobs
    # echo alone with a text prompt needs no prompt log-probabilities (the prompt's text is known)...
    assert parse_completion({"prompt": "hi", "echo": True}).request.sampling.prompt_logprobs is None
    # ...but a prompt of token ids needs the tokens' texts from the prefill worker.
    assert parse_completion({"prompt": [1, 2], "echo": True}).request.sampling.prompt_logprobs == 0
    chat = parse_chat({**CHAT, "logprobs": True, "top_logprobs": 4})
    assert chat.request.sampling.logprobs == 4 and chat.request.sampling.prompt_logprobs is None
    assert parse_chat({**CHAT, "logprobs": True}).request.sampling.logprobs == 0
    plain = parse_chat({**CHAT, "logprobs": False})
    assert plain.request.sampling.logprobs is None and not plain.choices.rich
    assert "logprobs" not in plain.request.sampling.to_json()


def test_best_of_asks_the_sampled_tokens_logprobs_for_the_ranking_only() -> None:
    parsed = parse_completion({"prompt": "hi", "n": 2, "best_of": 4})
    assert (parsed.choices.n, parsed.choices.best_of) == (2, 4) and parsed.choices.rich
    assert parsed.request.sampling.logprobs == 0 and not parsed.choices.logprobs  # not shown
    asked = parse_completion({"prompt": "hi", "best_of": 3, "logprobs": 2})
    assert asked.request.sampling.logprobs == 2 and asked.choices.logprobs
    same = parse_completion({"prompt": "hi", "n": 2, "best_of": 2, "stream": True})  # best_of = n streams
    assert same.choices.best_of == 2 and same.request.sampling.logprobs is None
    assert parse_completion({"prompt": "hi"}).choices.best_of == 1


@pytest.mark.parametrize(
    ("parser", "body", "named"),
    [(parse_completion, {"prompt": "hi", "logprobs": 21}, "logprobs"),
     (parse_completion, {"prompt": "hi", "logprobs": True}, "logprobs"),
     (parse_completion, {"prompt": "hi", "echo": "yes"}, "echo"),
     (parse_completion, {"prompt": "hi", "n": 0}, "n"),
     (parse_completion, {"prompt": "hi", "n": 17}, "n"),
     (parse_completion, {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
     (parse_completion, {"prompt": "hi", "best_of": 17}, "best_of"),
     (parse_completion, {"prompt": "hi", "n": 2, "best_of": 3, "stream": True}, "best_of"),
     (parse_chat, {**CHAT, "best_of": 2, "stream": True}, "best_of"),
     (parse_chat, {**CHAT, "best_of": 2, "tools": [{"type": "function", "function": {"name": "f"}}]}, "best_of"),
     (parse_chat, {**CHAT, "top_logprobs": 2}, "top_logprobs"),
     (parse_chat, {**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
     (parse_chat, {**CHAT, "logprobs": 3}, "logprobs")],
)
def test_bad_fields_are_a_400_naming_them(parser: Any, body: dict[str, Any], named: str) -> None:
    with pytest.raises(RouterError) as info:
        parser(body)
    assert info.value.status == 400 and f"'{named}'" in info.value.message


def test_the_wire_form_round_trips() -> None:
    positions = [lp("a", -1.0, ("a", -1.0), ("b", -2.0)), lp("\u2028", -0.5)]
    assert decode_positions(json.loads(json.dumps(encode_positions(positions)))) == positions  # type: ignore[arg-type]


def test_completion_logprobs_whole_and_streamed() -> None:
    parsed = parse_completion({"prompt": "hi", "logprobs": 2})
    body = whole(parsed, events_of())
    Completion.model_validate(body)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs == {"tokens": ["Hel", "lo"], "token_logprobs": [-0.5, -0.25],
                        "top_logprobs": [{"Hel": -0.5, "He": -1.5}, {"lo": -0.25, "l": -2.0}], "text_offset": [0, 3]}
    chunks = streamed(parsed, events_of())
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    for part in parts:  # a streamed completion chunk's finish_reason is null: not a whole Completion
        Logprobs.model_validate(part)
    assert [p["text_offset"] for p in parts] == [[0], [3]]  # offsets run on across chunks


def test_completion_echo_puts_the_prompt_and_its_logprobs_first() -> None:
    parsed = parse_completion({"prompt": "Ab", "logprobs": 1, "echo": True})
    prompt: list[Logprob | None] = [Logprob("A", None, []), lp("b", -3.0, ("c", -0.1))]
    # The first prompt token's null log-probability is OpenAI's (and vLLM's) answer, though the
    # client's typed model says float: the client reads it leniently (the e2e test reads it so).
    body = whole(parsed, events_of(prompt=prompt))
    choice = body["choices"][0]
    assert choice["text"] == "AbHello"
    assert choice["logprobs"]["tokens"] == ["A", "b", "Hel", "lo"]
    assert choice["logprobs"]["token_logprobs"] == [None, -3.0, -0.5, -0.25]
    assert choice["logprobs"]["top_logprobs"][:2] == [None, {"c": -0.1}]
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 5]
    first = streamed(parsed, events_of(prompt=prompt))[0]["choices"][0]
    assert first["text"] == "AbHel"
    assert first["logprobs"]["tokens"] == ["A", "b", "Hel"]
    # A prompt of token ids echoes the texts of its tokens.
    by_ids = whole(parse_completion({"prompt": [5, 6], "echo": True}), events_of(prompt=prompt))
    assert by_ids["choices"][0]["text"] == "AbHello" and by_ids["choices"][0]["logprobs"] is None


def test_chat_logprobs_whole_and_streamed() -> None:
    parsed = parse_chat({**CHAT, "logprobs": True, "top_logprobs": 2})
    body = whole(parsed, events_of())
    ChatCompletion.model_validate(body)
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
                          "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108]},
                                           {"token": "He", "logprob": -1.5, "bytes": [72, 101]}]}
    chunks = streamed(parsed, events_of())
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    tokens = [e["token"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
              for e in c["choices"][0]["logprobs"]["content"]]
    assert tokens == ["Hel", "lo"]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_n_choices_carry_their_index_and_usage_counts_the_prompt_once(kind: str) -> None:
    parsed = parse_chat({**CHAT, "n": 3}) if kind == "chat" else parse_completion({"prompt": "hi", "n": 3})
    body = whole(parsed, events_of(3))
    (ChatCompletion if kind == "chat" else Completion).model_validate(body)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["logprobs"] is None for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    chunks = streamed(parsed, events_of(3))
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2]
    texts: dict[int, str] = {}
    for c in chunks:
        choice = c["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + (
            choice["delta"].get("content") or "" if kind == "chat" else choice["text"])
    assert texts == {0: "Hello", 1: "Hello", 2: "Hello"}
