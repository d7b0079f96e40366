"""Structured output and tool calls end to end with the official `openai` client, on the disaggregated
path (router + prefill worker + decode worker, real processes, tiny random model).

The prefill worker samples the first token under the grammar and the decode worker rebuilds the matcher
from the tokens so far, so every answer parses and validates though the weights are random. The tiny
model's ChatML template does not render tools: the decode worker gives it the Hermes tool prompt.
"""
from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.inference.conftest import OpenAIDeployment

pytestmark = pytest.mark.django_db(transaction=False, databases=[])
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "temperature": {"type": "integer", "minimum": -50, "maximum": 50},
        "conditions": {"enum": ["sunny", "rain", "snow"]},
        "alerts": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["city", "temperature", "conditions", "alerts"],
    "additionalProperties": False,
}
RESPONSE_FORMAT: Any = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_TOKENS = 200
MODEL = "tiny-llama"  # the router serves the checkpoint folder's name


@pytest.fixture(scope="module")
def client(openai_deployment: OpenAIDeployment) -> openai.OpenAI:
    """An OpenAI client on the shared deployment (one prefill, one decode worker and a router)."""
    return openai.OpenAI(base_url=openai_deployment.router + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed_call(stream: Any) -> tuple[list[str], str, str, list[str | None]]:
    """A chat stream's one tool call: the names its deltas carry, its arguments put together, the content
    streamed beside it and each chunk's finish reason."""
    names: list[str] = []
    arguments = content = ""
    reasons: list[str | None] = []
    for chunk in stream:
        if not chunk.choices:
            continue
        reasons.append(chunk.choices[0].finish_reason)
        content += chunk.choices[0].delta.content or ""
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.index == 0
            if delta.function and delta.function.name:
                names.append(delta.function.name)
            if delta.function and delta.function.arguments:
                arguments += delta.function.arguments
    return names, arguments, content, reasons


def test_json_schema_answers_validate_streamed_and_not(client: openai.OpenAI) -> None:
    for seed in range(6):
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                temperature=1.0, seed=seed, response_format=RESPONSE_FORMAT)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        assert choice.message.content is not None
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=1.0,
                                            seed=11, response_format=RESPONSE_FORMAT, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)
    # /v1/completions with json_object (a vLLM-style extra field through the client's extra_body).
    completion = client.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=MAX_TOKENS,
                                           temperature=0.8, seed=2, extra_body={"response_format": {
                                               "type": "json_object"}})
    assert isinstance(json.loads(completion.choices[0].text), dict)


def test_a_named_tool_gets_valid_arguments_streamed_and_not(client: openai.OpenAI) -> None:
    parameters = WEATHER["function"]["parameters"]
    for seed in range(3):
        answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=seed,
                                                temperature=1.0, tools=[WEATHER], tool_choice=NAMED)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert calls is not None and len(calls) == 1
        call = calls[0]
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), parameters)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=4,
                                            temperature=1.0, tools=[WEATHER], tool_choice=NAMED, stream=True)
    names, arguments, _, reasons = streamed_call(stream)
    assert names == ["get_weather"] and reasons[-1] == "tool_calls"
    jsonschema.validate(json.loads(arguments), parameters)


def test_required_tool_choice_and_a_follow_up_turn(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=1,
                                            temperature=1.0, tools=[WEATHER], tool_choice="required")
    calls = answer.choices[0].message.tool_calls
    assert calls, answer
    for call in calls:
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # The call and its result go back in the next turn (rendered into the prompt for the template).
    follow_up: Any = [*MESSAGES, answer.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 21}'}]
    again = client.chat.completions.create(model=MODEL, messages=follow_up, max_tokens=8, temperature=0,
                                           tools=[WEATHER], tool_choice="none")
    assert again.choices[0].message.tool_calls is None


def test_invalid_schema_and_tools_are_400_before_any_worker(client: openai.OpenAI) -> None:
    bad_format: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "strin"}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=bad_format)
    assert "response_format.json_schema.schema" in str(caught.value) and "Invalid type: strin" in str(caught.value)
    bad_tool: Any = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/$defs/missing"}}}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[bad_tool])
    assert "tools[0].function.parameters" in str(caught.value)


def test_auto_tool_choice_parses_the_models_tool_call_streamed_and_not(client: openai.OpenAI) -> None:
    # A random model calls no tool on its own: guided_choice makes its text one Hermes-format call (the
    # format the tool prompt asks for). The tool choice stays "auto": no grammar comes from the tools, and
    # the router finds the call in the model's free text with the parser a real model's output goes through.
    said = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    forced: Any = {"guided_choice": [said]}
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            tools=[WEATHER], tool_choice="auto", extra_body=forced)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    # The tools were rendered into the prompt (the decode worker's tool prompt) on this path.
    bare = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    assert answer.usage is not None and bare.usage is not None
    assert answer.usage.prompt_tokens > bare.usage.prompt_tokens + 20
    # Streamed: the call comes as tool_calls deltas (its name first, then the arguments), no content.
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                            tools=[WEATHER], tool_choice="auto", extra_body=forced, stream=True)
    names, arguments, content, reasons = streamed_call(stream)
    assert names == ["get_weather"] and reasons[-1] == "tool_calls" and not content.strip()
    assert json.loads(arguments) == {"city": "Paris", "days": 2}
    # Text without a call stays content under "auto".
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
                                           tools=[WEATHER], tool_choice="auto",
                                           extra_body={"guided_choice": ["It is sunny in Paris."]})
    assert plain.choices[0].message.content == "It is sunny in Paris."
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "stop"
