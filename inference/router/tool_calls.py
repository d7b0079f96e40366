"""Tool calling on the router: a chat request's `tools` and `tool_choice`, and the model's tool calls
turned into OpenAI's `tool_calls` (whole, or streamed as deltas).

The decode worker renders the tools with the model's chat template (a template that does not use them
gets the Hermes/Qwen tool prompt). What the model writes back depends on its tool choice:

* `auto`: free text, parsed for the common formats: Hermes/Qwen `<tool_call>{json}</tool_call>`,
  Mistral `[TOOL_CALLS][{json}, ...]`, Llama 3 JSON (`<|python_tag|>` and/or a bare
  `{"name": ..., "parameters": ...}` object, several separated by `;`). Text that holds none is content.
* a named function: structured output constrains the text to the function's `parameters` schema, so
  the text *is* the call's arguments (streamed as argument deltas as it is generated).
* `required`: structured output constrains the text to a JSON array of `{"name", "parameters"}` objects,
  one per call, each valid against its function's schema (vLLM's form).
* `none`: the tools are shown to the model, the text is content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from inference.router.errors import RouterError
from inference.router.response_format import checked

Mode = Literal["none", "auto", "required", "named"]
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
# Markers that start a tool call in `auto` mode (a streamed text holds back a tail that may start one).
MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


def _bad(message: str) -> RouterError:
    return RouterError(400, message, error_type="invalid_request_error")


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolChoice:
    """A chat request's tools (OpenAI's `{"type": "function", "function": {...}}` objects, checked) and
    how the model must use them."""

    tools: list[dict[str, Any]]
    mode: Mode = "auto"
    name: str | None = None

    def parameters(self, name: str) -> dict[str, Any]:
        """The parameters schema of function `name`."""
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return dict(tool["function"].get("parameters") or EMPTY_PARAMETERS)
        raise KeyError(name)

    def grammar(self) -> dict[str, Any] | None:
        """The wire grammar that guarantees valid calls (named and required), else None."""
        if self.mode == "named":
            assert self.name is not None
            return {"type": "json_schema", "schema": self.parameters(self.name)}
        if self.mode == "required":
            calls = [
                {"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "parameters": self.parameters(t["function"]["name"])},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for t in self.tools
            ]
            return {"type": "json_schema",
                    "schema": {"type": "array", "minItems": 1, "items": {"anyOf": calls}}}
        return None

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content and the calls of a whole generated text."""
        if self.mode == "named":
            assert self.name is not None
            return None, [ToolCall(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except ValueError:
                return text, []  # cut short by max_tokens: the text as it is
            return None, [ToolCall(i["name"], _dumps(i.get("parameters", {}))) for i in items if isinstance(i, dict)]
        if self.mode == "none":
            return text, []
        return parse_tool_calls(text)


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tool(index: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _bad(f"'{where}' must be an object of type 'function'")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad(f"'{where}.function' must be an object with a 'name'")
    name = function["name"]
    if not _NAME.match(name):
        raise _bad(f"'{where}.function.name' must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _bad(f"'{where}.function.description' must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise _bad(f"'{where}.function.parameters' must be a JSON Schema object")
    checked({"type": "json_schema", "schema": parameters}, f"{where}.function.parameters")
    out = {"name": name, "parameters": parameters}
    if description is not None:
        out["description"] = description
    return {"type": "function", "function": out}


def parse_tools(data: dict[str, Any]) -> ToolChoice | None:
    """The request's tools and tool choice (None without tools); 400 naming the field otherwise.
    The legacy `functions` / `function_call` are read as `tools` / `tool_choice`."""
    tools = data.get("tools")
    choice = data.get("tool_choice")
    if tools is None and data.get("functions") is not None:
        functions = data["functions"]
        tools = [{"type": "function", "function": f} for f in functions] if isinstance(functions, list) else functions
        call = data.get("function_call")
        choice = {"type": "function", "function": call} if isinstance(call, dict) else call
    if tools is None:
        if choice not in (None, "none"):
            raise _bad("'tool_choice' needs 'tools'")
        return None
    if not isinstance(tools, list) or not tools:
        raise _bad("'tools' must be a non-empty list of function tools")
    checked_tools = [_tool(i, t) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked_tools]
    if len(set(names)) != len(names):
        raise _bad("'tools' holds two functions with the same name")
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(checked_tools, choice or "auto")
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise _bad("'tool_choice' must be 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if function["name"] not in names:
        raise _bad(f"'tool_choice' names function {function['name']!r}, which is not in 'tools'")
    return ToolChoice(checked_tools, "named", function["name"])


# --------------------------------------------------------------------------------------------
# Parsers of the models' formats (auto)
# --------------------------------------------------------------------------------------------


def _call(obj: Any) -> ToolCall | None:
    """A call from a parsed JSON object: `name` + `arguments` (Hermes, Mistral) or `parameters` (Llama 3)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], _dumps(args))


def _json_values(text: str) -> list[Any]:
    """The JSON values written one after another in `text` (separated by whitespace, ',' or ';')."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    pos = 0
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        if pos >= len(text):
            break
        value, pos = decoder.raw_decode(text, pos)
        values.append(value)
    return values


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]] | None:
    """Hermes/Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, after
    optional content. None when `text` holds no such block."""
    if "<tool_call>" not in text:
        return None
    content, _, rest = text.partition("<tool_call>")
    calls: list[ToolCall] = []
    for block in re.findall(r"(.*?)(?:</tool_call>|$)", rest.replace("<tool_call>", "</tool_call>"), re.S):
        if not block.strip():
            continue
        try:
            call = _call(json.loads(block))
        except ValueError:
            return None
        if call is None:
            return None
        calls.append(call)
    return (content.strip() or None), calls


def parse_mistral(text: str) -> tuple[str | None, list[ToolCall]] | None:
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3+; a call may carry an `id`)."""
    if "[TOOL_CALLS]" not in text:
        return None
    content, _, rest = text.partition("[TOOL_CALLS]")
    try:
        values = _json_values(rest.replace("[TOOL_CALLS]", ","))
    except ValueError:
        return None
    items = [v for value in values for v in (value if isinstance(value, list) else [value])]
    calls = [_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return (content.strip() or None), [c for c in calls if c is not None]


def parse_llama3(text: str) -> tuple[str | None, list[ToolCall]] | None:
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` objects (after `<|python_tag|>`
    when the template keeps it), several separated by `;`. The whole text must be calls."""
    body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
    if not body.lstrip().startswith("{"):
        return None
    try:
        values = _json_values(body)
    except ValueError:
        return None
    calls = [_call(v) for v in values]
    if not calls or any(c is None for c in calls):
        return None
    return None, [c for c in calls if c is not None]


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """The content and calls of an `auto` generation, in whichever format the model wrote; text that is
    no complete call in any format stays content."""
    for parser in (parse_hermes, parse_mistral, parse_llama3):
        parsed = parser(text)
        if parsed is not None:
            return parsed
    return text, []


# --------------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------------


def _marker_prefix_len(text: str) -> int:
    """How many characters at the end of `text` could start a marker (held back from content)."""
    best = 0
    for marker in (*MARKERS, "{"):
        for n in range(min(len(marker), len(text)), 0, -1):
            if text.endswith(marker[:n]) and n > best:
                best = n
                break
    return best


class ToolCallStream:
    """A chat stream's deltas when the request has tools: `feed` each text piece, `finish` at the end;
    both return OpenAI `delta` objects to send (content and/or `tool_calls` entries with their index).

    Named function: the first delta opens the call (id, name, empty arguments), then every piece is an
    arguments delta. Required: the JSON array is collected and the calls sent whole at the end. Auto:
    content streams as it comes, except a tail that may start a call marker (or, at the very start, a
    Llama 3 `{`); from a marker on, the text is collected and parsed at the end.
    """

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self._buffer = ""
        self._collecting = choice.mode == "required"
        self._started = False
        self.called = False  # whether any tool call was sent (finish_reason "tool_calls")
        self._named = ToolCall(choice.name, "") if choice.mode == "named" and choice.name else None

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas for one generated text piece."""
        if self._named is not None:
            out: list[dict[str, Any]] = []
            if not self._started:
                self._started = self.called = True
                out.append({"tool_calls": [{"index": 0, **self._named.to_json()}]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if self.choice.mode == "none":
            return [{"content": text}] if text else []
        self._buffer += text
        if self._collecting:
            return []
        if any(m in self._buffer for m in MARKERS) or (not self._started and self._buffer.lstrip().startswith("{")):
            self._collecting = True
            cut = min((self._buffer.find(m) for m in MARKERS if m in self._buffer), default=0)
            content, self._buffer = self._buffer[:cut], self._buffer[cut:]
            return [{"content": content}] if content else []
        hold = _marker_prefix_len(self._buffer)
        if not self._started and self._buffer.strip() == "":
            return []  # leading whitespace may come before a Llama 3 call
        send, self._buffer = self._buffer[: len(self._buffer) - hold], self._buffer[len(self._buffer) - hold:]
        if send:
            self._started = True
            return [{"content": send}]
        return []

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still to send once the generation ended."""
        if self._named is not None or self.choice.mode == "none":
            return []
        text, self._buffer = self._buffer, ""
        if not text:
            return []
        if not self._collecting:
            return [{"content": text}]
        content, calls = self.choice.calls(text)
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        for index, call in enumerate(calls):
            out.append({"tool_calls": [{"index": index, **call.to_json()}]})
        self.called = bool(calls)
        return out


def message(choice: ToolChoice, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole generation, and whether it holds tool calls."""
    content, calls = choice.calls(text)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [c.to_json() for c in calls]
    return msg, bool(calls)
