"""The worker's tokenizer as a router needs it to compute the worker's own prompt ids.

`GET /internal/tokenizer` on any worker with a tokenizer answers a `TokenizerSpec`: the backend
tokenizer's JSON exactly as the engine runs it (class-specific post-processing included), the chat
template, the special tokens the template sees, and the ids the worker itself computed for the probe
text and the probe chat below. A router builds its tokenizer from the spec and uses it only when it
reproduces both probes, so a router whose libraries render or split differently falls back to
sending the text (the worker tokenizes) instead of routing by wrong ids.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import orjson

# Words, digits, punctuation, accents, CJK and an emoji: what splits differently when a pre-tokenizer
# or normalizer differs.
PROBE_TEXT = "Hello, world! 1234 naïve café — 分布式推理 🙂  two  spaces\nnew line"
# A system prompt, a turn with a tool call and its answer, and tools: every path of the chat rendering
# (the template's own, the Hermes tool prompt for templates that do not render tools).
PROBE_MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_0", "content": "{\"celsius\": 21}"},
    {"role": "user", "content": "And 分布式 🙂?"},
]
PROBE_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]


def _ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"'{name}' must be a list of token ids")
    return value


@dataclass(frozen=True)
class TokenizerSpec:
    """What a router needs to tokenize like the worker (text prompts and chat), with the worker's own
    ids for the probes. `chat_template`: a template, named templates (transformers' dict form) or None."""

    model: str
    tokenizer_json: str
    chat_template: str | dict[str, str] | None
    special_tokens: dict[str, Any]
    probe_text_ids: list[int]
    # None when the model has no chat template (chat requests then stay text: the worker answers 400).
    probe_chat_ids: list[int] | None

    @property
    def digest(self) -> str:
        """A short hash of everything that decides the ids (two workers of one model agree on it)."""
        payload = orjson.dumps([self.tokenizer_json, self.chat_template, self.special_tokens],
                               option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(payload).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        """The JSON answer of `GET /internal/tokenizer`."""
        return {"model": self.model, "digest": self.digest, "tokenizer": self.tokenizer_json,
                "chat_template": self.chat_template, "special_tokens": self.special_tokens,
                "probe_text_ids": self.probe_text_ids, "probe_chat_ids": self.probe_chat_ids}

    @classmethod
    def from_json(cls, obj: Any) -> TokenizerSpec:
        """Parse an answer; ValueError naming the field that is wrong."""
        if not isinstance(obj, dict):
            raise ValueError("the tokenizer answer must be a JSON object")
        model, tokenizer = obj.get("model"), obj.get("tokenizer")
        if not isinstance(model, str) or not model:
            raise ValueError("'model' must be a non-empty string")
        if not isinstance(tokenizer, str) or not tokenizer:
            raise ValueError("'tokenizer' must be the backend tokenizer's JSON as a string")
        template = obj.get("chat_template")
        if not (template is None or isinstance(template, str) or (
                isinstance(template, dict) and all(isinstance(v, str) for v in template.values()))):
            raise ValueError("'chat_template' must be a string, an object of named strings or null")
        special = obj.get("special_tokens")
        if not isinstance(special, dict):
            raise ValueError("'special_tokens' must be an object")
        chat = obj.get("probe_chat_ids")
        return cls(model=model, tokenizer_json=tokenizer, chat_template=template, special_tokens=special,
                   probe_text_ids=_ids(obj.get("probe_text_ids"), "probe_text_ids"),
                   probe_chat_ids=None if chat is None else _ids(chat, "probe_chat_ids"))
