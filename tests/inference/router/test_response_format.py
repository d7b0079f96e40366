"""response_format / guided_* parsing on the router: the wire grammar it sends, and 400s that name the
field and the problem before any worker is involved."""
from __future__ import annotations

from typing import Any

import pytest

from inference.router.errors import RouterError
from inference.router.protocol import parse_chat, parse_completion, parse_generate

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]


def _grammar(body: dict[str, Any]) -> dict[str, Any] | None:
    return parse_chat({"messages": MESSAGES, **body}).request.sampling.grammar


def test_response_formats_become_wire_grammars() -> None:
    assert _grammar({}) is None
    assert _grammar({"response_format": {"type": "text"}}) is None
    assert _grammar({"response_format": {"type": "json_object"}}) == {"type": "json_object"}
    assert _grammar({"response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}}}) == {"type": "json_schema", "schema": SCHEMA}
    assert _grammar({"guided_regex": "[a-z]+"}) == {"type": "regex", "pattern": "[a-z]+"}
    assert _grammar({"guided_choice": ["yes", "no"]}) == {"type": "choice", "choices": ["yes", "no"]}
    assert _grammar({"guided_json": '{"type": "boolean"}'}) == {"type": "json_schema", "schema": {"type": "boolean"}}
    completion = parse_completion({"prompt": "x", "response_format": {"type": "json_object"}})
    assert completion.request.sampling.grammar == {"type": "json_object"}
    generate = parse_generate({"prompt": "x", "guided_choice": ["a", "b"]})
    assert generate.request.sampling.grammar == {"type": "choice", "choices": ["a", "b"]}
    # The grammar travels to the workers in the sampling JSON.
    sampling = parse_completion({"prompt": "x", "guided_regex": "a+"}).request.sampling
    assert sampling.to_json()["grammar"] == {"type": "regex", "pattern": "a+"}


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
         "'response_format.json_schema.schema' is invalid: Invalid type: foo"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "integer", "minimum": 3, "maximum": 1}}}}, "minimum (3) is greater than maximum (1)"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "$ref": "#/$defs/missing"}}}}, "does not exist"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "string", "format": "no-such-format"}}}}, "Unknown format"),
        ({"response_format": {"type": "json_schema"}}, "'response_format.json_schema' must be an object"),
        ({"response_format": {"type": "yaml"}}, "'response_format.type' must be"),
        ({"response_format": "json"}, "'response_format' must be an object"),
        ({"guided_regex": "a["}, "'guided_regex' is invalid"),
        ({"guided_choice": []}, "'guided_choice' must be a non-empty list"),
        ({"guided_json": "{not json"}, "'guided_json' must be a JSON Schema"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "only one of"),
    ],
)
def test_invalid_formats_are_400_naming_the_problem(body: dict[str, Any], expected: str) -> None:
    with pytest.raises(RouterError) as caught:
        _grammar(body)
    assert caught.value.status == 400 and expected in str(caught.value), str(caught.value)
