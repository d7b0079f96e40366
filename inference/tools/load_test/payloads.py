"""Request generation: the built-in prompts and the JSON body of one streaming request per API kind."""

from __future__ import annotations

from typing import Any

from inference.tools.load_test.endpoints import ApiKind

#: Built-in prompts: varied lengths and topics so that prefill cost is not one constant.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Hello, my name is",
    "The capital of France is",
    "Write a short poem about the sea.",
    "Explain in simple terms how a transformer neural network processes a sentence.",
    "List three tips for staying productive when working from home.",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "Translate to French: The weather is nice today and I would like to go for a walk.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "What are the main differences between TCP and UDP? Answer briefly.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "The three primary colors are",
    "Q: If a train travels 120 km in 1.5 hours, what is its average speed?\nA:",
)


def request_body(
    kind: ApiKind, prompt: str, *, max_tokens: int, temperature: float | None, model: str | None
) -> dict[str, Any]:
    """The JSON body of one streaming request in the endpoint's format.

    ``model`` is sent to the OpenAI endpoints only (our ``/generate`` serves one model per router).
    """
    body: dict[str, Any]
    if kind == "generate":
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    else:
        body = {"max_tokens": max_tokens, "stream": True}
        # Ask for the usage chunk: the only exact output token count OpenAI streams carry.
        body["stream_options"] = {"include_usage": True}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if model:
            body["model"] = model
    if temperature is not None:
        body["temperature"] = temperature
    return body
