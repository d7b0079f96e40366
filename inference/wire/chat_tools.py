"""Tools in a chat prompt for a model whose chat template does not render them.

transformers' `apply_chat_template(tools=...)` hands the tools to the template; a template that never
reads `tools` (SmolLM2's, plain ChatML) would silently drop them. Such a prompt gets Qwen2.5's tool
prompt (the Hermes format) in its system message instead, so the model is told the functions and the
`<tool_call>{json}</tool_call>` form the router parses (inference/router/tool_calls.py).
"""
from __future__ import annotations

import json
from typing import Any

TOOL_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_renders_tools(template: str) -> bool:
    """Whether a chat template reads the `tools` variable."""
    return "tools" in template


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the tool prompt appended to the system message (or a new first one); an
    assistant's tool calls and a tool's answers written as Hermes text, which any template renders."""
    prompt = TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    out: list[dict[str, Any]] = []
    for m in messages:
        content = m.get("content") or ""
        if m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>\n" + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]},
                                             ensure_ascii=False) + "\n</tool_call>"
                for c in m["tool_calls"]
            )
            content = f"{content}\n{calls}" if content else calls
        if m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": content})
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out
