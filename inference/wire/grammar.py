"""Structured output's grammars as router and workers both judge them: a wire grammar spec (the
`grammar` sampling field) turned into llguidance's grammar text, and checked.

The router checks a request's grammar before dispatch (400 naming the problem); the workers compile the
same text into per-sequence matchers (inference/engine/grammar.py). llguidance is imported on first use:
it is Rust with no torch, so the router can use it too.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

# JSON without optional whitespace: what a schema-following answer needs, and a small model cannot wander
# off into endless blank lines (a schema may turn it on with {"x-guidance": {"whitespace_flexible": true}}).
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
# `json_object`: any JSON object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarError(ValueError):
    """A grammar the library cannot compile; the message says what is wrong."""


def grammar_source(spec: Mapping[str, Any]) -> str:
    """llguidance's grammar text for a wire grammar spec (not yet checked: see `check_grammar`)."""
    import llguidance

    kind = spec.get("type")
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(dict(spec["schema"]), defaults=JSON_DEFAULTS)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_DEFAULTS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(str(spec["pattern"]))
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(str(c)) for c in spec["choices"]))
    except (ValueError, TypeError, KeyError) as exc:  # e.g. a schema that is not JSON-serializable
        raise GrammarError(str(exc)) from None
    raise GrammarError(f"unknown grammar type {kind!r}")


def check_grammar(spec: Mapping[str, Any]) -> str:
    """The grammar text of `spec`; GrammarError naming the problem when llguidance refuses it
    (an invalid or unsatisfiable schema, an unknown format, a regex that does not parse)."""
    import llguidance

    source = grammar_source(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(source)
    if is_error:
        raise GrammarError(messages[0] if messages else "the grammar is invalid")
    return source
