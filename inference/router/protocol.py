"""The router's public request formats: the seed's /generate and OpenAI's APIs.

Parsing turns a client's JSON into a GenerateRequest (400 `RouterError` naming the field on bad
input; the sampling fields are checked by the wire's rules, the ones the workers and the engine
apply, so clients get the message before any worker is involved); `answers.py` turns the client
events into JSON bodies and Server-Sent Events. Django-free: the views and the WebSocket consumer share it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from inference.router.choices_format import ChoiceFields, parse_choice_fields
from inference.router.errors import RouterError
from inference.router.events import GenerateRequest
from inference.router.response_format import parse_grammar
from inference.router.tool_calls import ToolChoice, parse_tools
from inference.wire.sampling import RULES, Sampling, SamplingError

Kind = Literal["generate", "completion", "chat"]

# Fields of the seed's /generate JSON. Unknown fields are refused there (typos such as
# "max_token" would otherwise be silently ignored); OpenAI endpoints ignore unknown fields as
# OpenAI-compatible servers do, because client libraries add new ones over time.
_GENERATE_FIELDS = {
    "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
    "stop_token_ids", "ignore_eos", "model", "input_ids",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens",
    "response_format", "guided_json", "guided_regex", "guided_choice",
}


def bad_request(message: str) -> RouterError:
    """A 400 `invalid_request_error`."""
    return RouterError(400, message, error_type="invalid_request_error")


# --------------------------------------------------------------------------------------------
# Field checks (the sampling fields by the wire's rules, inference/wire/sampling.py)
# --------------------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _get_bool(data: dict[str, Any], name: str, default: bool = False) -> bool:
    value = data.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {value!r}")
    return value


def _get_token_ids(data: dict[str, Any], name: str) -> list[int] | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise bad_request(f"'{name}' must be a list of non-negative integers")
    return list(value)


def parse_sampling(data: dict[str, Any], max_tokens_field: str = "max_tokens") -> Sampling:
    """The request's `Sampling` from a client's body; 400 naming the first bad field.

    temperature, top_p, top_k and min_p stay unset when the client left them out: the workers fill
    them from the model's generation_config.json (as vLLM does), then their own defaults.
    """
    values: dict[str, Any] = {}
    try:
        for name in _SAMPLING_FIELDS:
            value = data.get(max_tokens_field if name == "max_tokens" else name)
            if value is not None:
                values[name] = RULES[name](max_tokens_field if name == "max_tokens" else name, value)
    except SamplingError as exc:
        raise bad_request(exc.quoted()) from None
    sampling = Sampling(**values)
    sampling.grammar = parse_grammar(data)  # structured output: response_format / guided_* (400 if invalid)
    if sampling.min_tokens > sampling.max_tokens:
        raise bad_request(f"'min_tokens' must be at most '{max_tokens_field}' ({sampling.max_tokens}), "
                          f"got {sampling.min_tokens}")
    return sampling


# The sampling fields a client may set (`seed_offset` is the router's own, for migrations).
_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "min_p", "top_k", "seed", "stop", "stop_token_ids",
                    "ignore_eos", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                    "min_tokens")


# --------------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------------


@dataclass
class ParsedRequest:
    """A validated client request: what to run and how to answer."""

    kind: Kind
    request: GenerateRequest
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # n, logprobs, echo (choices_format.py; the plain answer when none is used).
    choices: ChoiceFields = field(default_factory=ChoiceFields)
    # Chat with tools: how the answer's text becomes tool calls (inference/router/tool_calls.py).
    tools: ToolChoice | None = None


def _require_object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    _check_unicode(data)
    return data


def _check_unicode(data: Any) -> None:
    """Refuse a lone surrogate anywhere in the body.

    JSON lets a client write "\\ud800", which Python decodes into a str that UTF-8 cannot encode:
    it would fail later, when the request is sent on to a worker (a 500). Iterative: bodies nest.
    """
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request("the request holds text that is not valid Unicode (a lone surrogate)") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _get_model(data: dict[str, Any]) -> str | None:
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string")
    return model or None


def parse_generate(data: Any) -> ParsedRequest:
    """The seed's /generate JSON: prompt, max_tokens, temperature, top_p, top_k, seed, stop, stream."""
    data = _require_object(data)
    unknown = sorted(set(data) - _GENERATE_FIELDS)
    if unknown:
        raise bad_request(f"unknown field(s): {', '.join(unknown)}")
    input_ids = _get_token_ids(data, "input_ids")
    prompt = data.get("prompt")
    if input_ids is None:
        if not isinstance(prompt, str) or not prompt:
            raise bad_request("'prompt' is required and must be a non-empty string")
    elif not input_ids:
        raise bad_request("'input_ids' must not be empty")
    return ParsedRequest(
        kind="generate",
        request=GenerateRequest(sampling=parse_sampling(data), prompt=prompt, input_ids=input_ids),
        stream=_get_bool(data, "stream"),
        model=_get_model(data),
    )


def _check_unsupported(data: dict[str, Any]) -> None:
    """Refuse OpenAI options this server cannot honour, instead of silently ignoring them."""
    if data.get("suffix"):
        raise bad_request("'suffix' is not supported")


def _stream_options(data: dict[str, Any], stream: bool) -> bool:
    options = data.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object")
    if not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true")
    return _get_bool(options, "include_usage")


def parse_completion(data: Any) -> ParsedRequest:
    """An OpenAI /v1/completions body (one prompt: a string or a list of token ids)."""
    data = _require_object(data)
    _check_unsupported(data)
    prompt = data.get("prompt")
    # OpenAI allows a batch (list of prompts); exactly one is supported.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    text: str | None = None
    input_ids: list[int] | None = None
    if isinstance(prompt, str) and prompt:
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        input_ids = list(prompt)
    else:
        raise bad_request("'prompt' must be a non-empty string or list of token ids (one prompt)")
    stream = _get_bool(data, "stream")
    sampling = parse_sampling(data)
    return ParsedRequest(
        kind="completion",
        request=GenerateRequest(sampling=sampling, prompt=text, input_ids=input_ids),
        stream=stream,
        include_usage=_stream_options(data, stream),
        model=_get_model(data),
        choices=parse_choice_fields(data, "completion", sampling, prompt_is_text=text is not None, stream=stream),
    )


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content: only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts")


def parse_chat(data: Any) -> ParsedRequest:
    """An OpenAI /v1/chat/completions body; `messages` go to the decode worker's chat template."""
    data = _require_object(data)
    _check_unsupported(data)
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of {role, content} objects")
    normalized: list[dict[str, Any]] = []
    for index, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise bad_request(f"messages[{index}] must be an object with a string 'role'")
        normalized.append({"role": msg["role"], "content": _message_text(msg.get("content"), index),
                           **tool_fields(msg, index)})
    field_name = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    stream = _get_bool(data, "stream")
    sampling = parse_sampling(data, field_name)
    tools = parse_tools(data)
    if tools is not None and tools.grammar() is not None:
        if sampling.grammar is not None:
            raise bad_request("'response_format' cannot be combined with a 'tool_choice' of required or a function")
        sampling.grammar = tools.grammar()  # valid arguments guaranteed
    choices = parse_choice_fields(data, "chat", sampling, stream=stream)
    if tools is not None and choices.rich:
        raise bad_request("'n' > 1, 'best_of' > 'n' and 'logprobs' are not supported together with 'tools'")
    return ParsedRequest(
        kind="chat",
        request=GenerateRequest(sampling=sampling, messages=normalized,
                                tools=tools.tools if tools is not None else None),
        stream=stream,
        include_usage=_stream_options(data, stream),
        model=_get_model(data),
        tools=tools,
        choices=choices,
    )


def tool_fields(msg: dict[str, Any], index: int) -> dict[str, Any]:
    """The tool-calling fields of a chat message, for the chat template: an assistant's `tool_calls`
    (arguments as objects, as templates expect), a tool answer's `tool_call_id` and `name`."""
    out: dict[str, Any] = {}
    for key in ("tool_call_id", "name"):
        if isinstance(msg.get(key), str):
            out[key] = msg[key]
    calls = msg.get("tool_calls")
    if calls is None:
        return out
    if not isinstance(calls, list):
        raise bad_request(f"messages[{index}].tool_calls must be a list")
    rendered = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"messages[{index}].tool_calls entries need a function with a 'name'")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = orjson.loads(arguments) if arguments else {}
            except orjson.JSONDecodeError:
                raise bad_request(f"messages[{index}].tool_calls arguments must be JSON") from None
        rendered.append({"id": call.get("id"), "type": "function",
                         "function": {"name": function["name"], "arguments": arguments}})
    out["tool_calls"] = rendered
    return out


PARSERS = {"generate": parse_generate, "completion": parse_completion, "chat": parse_chat}
