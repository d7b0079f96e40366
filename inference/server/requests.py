"""Parsing of the worker's internal request bodies into prompt tokens and sampling parameters."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference.engine import SamplingParams
from inference.engine.tokenizer import Tokenizer
from inference.server.errors import bad_request
from inference.wire.sampling import Sampling


def parse_sampling(data: Any, max_tokens_limit: int, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """SamplingParams from the JSON `sampling` object (the wire's `Sampling`, checked by its rules);
    400 naming the field on bad input.

    Fields the request leaves out (or null) take the model's `defaults` (its generation_config.json,
    see `load_sampling_defaults`), then SamplingParams' own.
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise bad_request("'sampling' must be a JSON object")
    try:
        params = SamplingParams.from_wire(Sampling.from_json(data), defaults)
        params.validate()  # the model's defaults too
    except (TypeError, ValueError, OverflowError) as exc:  # OverflowError: float() of a huge JSON integer
        raise bad_request(f"invalid sampling parameters: {exc}") from exc
    if params.max_tokens > max_tokens_limit:
        raise bad_request(f"max_tokens={params.max_tokens} exceeds this server's limit of {max_tokens_limit}")
    return params


def parse_token_ids(value: Any, vocab_size: int, field: str = "input_ids") -> list[int]:
    """A non-empty list of valid token ids."""
    if not isinstance(value, list) or not value:
        raise bad_request(f"'{field}' must be a non-empty list of token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in value):
        raise bad_request(f"'{field}' holds values that are not token ids in [0, {vocab_size})")
    return list(value)


def prompt_token_ids(body: dict[str, Any], tokenizer: Tokenizer | None, vocab_size: int) -> list[int]:
    """The prompt's token ids from `input_ids`, `prompt` (text) or `messages` (chat), in that order."""
    if body.get("input_ids") is not None:
        return parse_token_ids(body["input_ids"], vocab_size)
    if body.get("messages") is not None:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list of {role, content} objects")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
                raise bad_request("each message needs a string 'role' and a 'content'")
        if tokenizer is None:
            raise bad_request("this model has no tokenizer: send 'input_ids'")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise bad_request("'tools' must be a list of function tools")
        try:
            return tokenizer.apply_chat_template(messages, tools=tools or None)
        except Exception as exc:  # noqa: BLE001  template errors come in many types
            raise bad_request(f"cannot apply the chat template: {exc}") from exc
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("one of 'prompt', 'messages' or 'input_ids' is required")
    if not isinstance(prompt, str) or prompt == "":
        raise bad_request("'prompt' must be a non-empty string")
    try:
        prompt.encode("utf-8")  # a JSON "\ud800" escape decodes to a str the tokenizer cannot take
    except UnicodeEncodeError:
        raise bad_request("'prompt' is not valid Unicode text (it holds a lone surrogate)") from None
    if tokenizer is None:
        raise bad_request("this model has no tokenizer: send 'input_ids'")
    ids = tokenizer.encode(prompt)
    if not ids:
        raise bad_request("'prompt' encodes to no tokens")
    return ids
