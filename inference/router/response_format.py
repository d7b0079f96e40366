"""Structured output on the router: a client's `response_format` (OpenAI's `json_object` and
`json_schema`) or vLLM's `guided_json` / `guided_regex` / `guided_choice` turned into the wire's
`grammar` sampling field, checked by the grammar library before any worker is involved (400 naming the
problem: an invalid or unsatisfiable schema, an unknown format, a regex that does not parse).
"""
from __future__ import annotations

from typing import Any

from inference.router.errors import RouterError
from inference.wire.grammar import GrammarError, check_grammar

# vLLM's extensions to the OpenAI body, one constraint each.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice")


def _bad(message: str) -> RouterError:
    return RouterError(400, message, error_type="invalid_request_error")


def _json_schema_spec(response_format: dict[str, Any]) -> dict[str, Any]:
    inner = response_format.get("json_schema")
    if not isinstance(inner, dict):
        raise _bad("'response_format.json_schema' must be an object with 'name' and 'schema'")
    name = inner.get("name")
    if name is not None and not isinstance(name, str):
        raise _bad("'response_format.json_schema.name' must be a string")
    schema = inner.get("schema", {})
    if not isinstance(schema, dict):
        raise _bad("'response_format.json_schema.schema' must be a JSON Schema object")
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("'response_format.json_schema.strict' must be true or false")
    # The grammar enforces the schema whether or not `strict` is set: the output always validates.
    return {"type": "json_schema", "schema": schema}


def _from_response_format(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        raise _bad("'response_format' must be an object with a 'type'")
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return _json_schema_spec(value)
    raise _bad(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}")


def _from_guided(name: str, value: Any) -> dict[str, Any]:
    if name == "guided_json":
        if isinstance(value, str):
            import orjson

            try:
                value = orjson.loads(value)
            except orjson.JSONDecodeError:
                raise _bad("'guided_json' must be a JSON Schema (an object, or a string holding one)") from None
        if not isinstance(value, dict):
            raise _bad("'guided_json' must be a JSON Schema object")
        return {"type": "json_schema", "schema": value}
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise _bad("'guided_regex' must be a non-empty string")
        return {"type": "regex", "pattern": value}
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise _bad("'guided_choice' must be a non-empty list of non-empty strings")
    return {"type": "choice", "choices": list(value)}


def checked(spec: dict[str, Any], where: str) -> dict[str, Any]:
    """`spec` once the grammar library accepts it; a 400 saying which field is wrong and why."""
    try:
        check_grammar(spec)
    except GrammarError as exc:
        raise _bad(f"'{where}' is invalid: {exc}") from None
    return spec


def parse_grammar(data: dict[str, Any]) -> dict[str, Any] | None:
    """The wire grammar a request body asks for (None: free text); 400 naming the field and the
    problem for a malformed or invalid one, or for more than one constraint at once."""
    asked = [name for name in ("response_format", *GUIDED_FIELDS) if data.get(name) is not None]
    specs = []
    for name in asked:
        spec = _from_response_format(data[name]) if name == "response_format" else _from_guided(name, data[name])
        if spec is not None:
            schema_field = spec["type"] == "json_schema" and name == "response_format"
            where = "response_format.json_schema.schema" if schema_field else name
            specs.append((name, checked(spec, where)))
    if len(specs) > 1:
        raise _bad(f"only one of {', '.join(n for n, _ in specs)} may be given")
    return specs[0][1] if specs else None
