"""Tool calling on the router: tools and tool_choice checked (400s naming the field), the grammar that
guarantees valid calls, the models' formats parsed into OpenAI tool calls, and the streamed deltas."""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import llguidance
import pytest

from inference.router.answers import Collected, SseFormatter, final_body
from inference.router.errors import RouterError
from inference.router.events import DoneEvent, TokenEvent
from inference.router.protocol import ParsedRequest, parse_chat
from inference.router.tool_calls import (
    ToolCallStream,
    parse_hermes,
    parse_llama3,
    parse_mistral,
    parse_tool_calls,
    parse_tools,
)
from inference.wire.grammar import check_grammar

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME: Any = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


def _chat(**body: Any) -> ParsedRequest:
    return parse_chat({"messages": MESSAGES, **body})


def test_hermes_qwen_format() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    parsed = parse_hermes(text)
    assert parsed is not None
    content, calls = parsed
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert parse_hermes("no call here") is None


def test_mistral_format() -> None:
    parsed = parse_mistral('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, '
                           '{"name": "get_time", "arguments": {}}]')
    assert parsed is not None
    assert [(c.name, json.loads(c.arguments)) for c in parsed[1]] == [
        ("get_weather", {"city": "Rome", "days": 2}), ("get_time", {})]
    assert parse_mistral("[TOOL_CALLS] not json") is None


def test_llama3_json_format() -> None:
    parsed = parse_llama3('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                          '{"name": "get_time", "parameters": {}}')
    assert parsed is not None
    assert [(c.name, json.loads(c.arguments)) for c in parsed[1]] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    bare = parse_llama3('{"name": "get_time", "parameters": {}}')
    assert bare is not None and bare[1][0].name == "get_time"
    assert parse_llama3('{"answer": 42}') is None


def test_plain_text_stays_content() -> None:
    assert parse_tool_calls("The weather is fine.") == ("The weather is fine.", [])
    assert parse_tool_calls("<tool_call>{broken") == ("<tool_call>{broken", [])


def test_tools_and_tool_choice_are_checked() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tools": "x"}, "'tools' must be a non-empty list"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "'tools[0].function.name'"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
         "'tools[0].function.parameters' is invalid: Invalid type: nope"),
        ({"tools": [WEATHER, WEATHER]}, "same name"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}}, "not in 'tools'"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "'tool_choice' must be"),
        ({"tool_choice": "required"}, "'tool_choice' needs 'tools'"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "cannot be combined"),
    ]
    for body, expected in cases:
        with pytest.raises(RouterError) as caught:
            _chat(**body)
        assert caught.value.status == 400 and expected in str(caught.value), (body, str(caught.value))


def test_named_and_required_choices_constrain_the_output() -> None:
    named = _chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.request.sampling.grammar == {"type": "json_schema", "schema": WEATHER["function"]["parameters"]}
    assert named.request.tools is not None and len(named.request.tools) == 2
    assert named.request.decode_body("r")["tools"] == named.request.tools
    required = _chat(tools=[WEATHER, TIME], tool_choice="required")
    grammar = required.request.sampling.grammar
    assert grammar is not None
    schema = grammar["schema"]
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Paris"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)  # city is required
    check_grammar(grammar)  # llguidance compiles it
    auto = _chat(tools=[WEATHER])
    assert auto.request.sampling.grammar is None and auto.tools is not None and auto.tools.mode == "auto"


def test_the_required_grammar_only_accepts_valid_calls() -> None:
    tools = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    assert tools is not None
    grammar = tools.grammar()
    assert grammar is not None
    source = check_grammar(grammar)
    tokenizer = llguidance.LLTokenizer("byte")  # bytes as tokens: feeds any text
    good = b'[{"name":"get_weather","parameters":{"city":"Paris","days":3}}]'
    matcher = llguidance.LLMatcher(tokenizer, source)
    assert matcher.consume_tokens(list(good)) and matcher.is_accepting()
    wrong = b'[{"name":"get_weather","parameters":{"town"'
    assert llguidance.LLMatcher(tokenizer, source).validate_tokens(list(wrong)) < len(wrong)


def test_final_body_holds_tool_calls() -> None:
    done = DoneEvent("r", "stop", {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}, {}, "p", "d")
    named = _chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    body = final_body(named, Collected('{"city":"Paris"}', [], done), "m")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    auto = _chat(tools=[WEATHER])
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert final_body(auto, Collected(text, [], done), "m")["choices"][0]["message"]["tool_calls"][0]["function"][
        "name"] == "get_weather"
    plain = final_body(auto, Collected("Sunny.", [], done), "m")["choices"][0]
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": "Sunny."}


def _events(formatter: SseFormatter, pieces: list[str]) -> list[dict[str, Any]]:
    out = b"".join(formatter.event(TokenEvent(p, [1]))[0] for p in pieces)
    out += formatter.event(DoneEvent("r", "stop", {}, {}, "p", "d"))[0]
    return [json.loads(line[6:]) for line in out.decode().split("\n") if line.startswith("data: {")]


def test_streamed_deltas() -> None:
    named = SseFormatter(_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                               stream=True), "m")
    chunks = _events(named, ['{"ci', 'ty":"Pa', 'ris"}'])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:] if d.get("tool_calls"))
    assert json.loads(args) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    auto = SseFormatter(_chat(tools=[WEATHER], stream=True), "m")
    pieces = ["Let me ", "look. <tool", '_call>\n{"name": "get_weather", ',
              '"arguments": {"city": "Oslo"}}\n</tool_call>']
    deltas = [c["choices"][0]["delta"] for c in _events(auto, pieces)]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if d.get("tool_calls")]
    assert content.strip() == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    text_only = ToolCallStream(parse_tools({"tools": [WEATHER]}) or pytest.fail())
    streamed = [d for p in ["Sun", "ny and ", "warm."] for d in text_only.feed(p)] + text_only.finish()
    assert "".join(d["content"] for d in streamed) == "Sunny and warm." and not text_only.called
