"""Structured output in the engine (tiny random model): the grammar's token masks make every generation
parse and validate, whatever the weights and seeds; rows without a grammar are untouched by their
constrained neighbours; a fresh matcher replaying the tokens so far (a decode worker after the prefill
worker's first token, a migrated stream) continues exactly as the unbroken run."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from inference.engine import LLMEngine, SamplingParams
from inference.wire.grammar import GrammarError

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
        "kind": {"anyOf": [{"const": "person"}, {"type": "null"}]},
    },
    "required": ["name", "age", "tags", "ok", "kind"],
    "additionalProperties": False,
}
GRAMMAR = {"type": "json_schema", "schema": SCHEMA}
MAX_TOKENS = 256  # the schema bounds every answer well under this (12 escaped characters at most per string)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    """The tiny random Llama, colocated."""
    return LLMEngine(str(tiny_model_dir), block_size=8, max_model_len=512)


def _prompt(engine: LLMEngine, text: str = "Describe a person as JSON:") -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(text)


def test_every_seed_parses_and_validates(engine: LLMEngine) -> None:
    seeds = range(40)
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.3, seed=s, grammar=GRAMMAR) for s in seeds]
    outs = engine.generate([_prompt(engine)] * len(params), params)
    texts = set()
    for out in outs:
        assert out.finish_reason == "stop", out.text  # the grammar completes, then only EOS is allowed
        jsonschema.validate(json.loads(out.text), SCHEMA)
        texts.add(out.text)
    assert len(texts) > 20  # sampled, not one forced answer


def test_greedy_json_object_regex_and_choice(engine: LLMEngine) -> None:
    prompt = _prompt(engine)
    obj = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                   grammar={"type": "json_object"}))[0]
    assert isinstance(json.loads(obj.text), dict)
    regex = engine.generate([prompt], SamplingParams(max_tokens=40, temperature=0.9, seed=3,
                                                     grammar={"type": "regex", "pattern": r"[0-9]{3}-[a-z]{2}"}))[0]
    assert regex.finish_reason == "stop" and len(regex.text) == 6 and regex.text[3] == "-", regex.text
    for seed in range(5):
        choice = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=1.0, seed=seed,
                                                          grammar={"type": "choice", "choices": ["yes", "no"]}))[0]
        assert choice.text in ("yes", "no")


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(engine: LLMEngine) -> None:
    prompt = _prompt(engine, "The platform separates prefill from decode")
    free = [SamplingParams(max_tokens=24, temperature=0.8, seed=s) for s in (1, 2)]
    alone = [o.token_ids for o in engine.generate([prompt] * 2, free)]
    mixed = engine.generate([prompt] * 4, [free[0], SamplingParams(max_tokens=MAX_TOKENS, grammar=GRAMMAR, seed=9),
                                           free[1], SamplingParams(max_tokens=MAX_TOKENS, grammar=GRAMMAR)])
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].text), SCHEMA)


@pytest.mark.parametrize("cut", [1, 7])
def test_a_fresh_matcher_replays_the_tokens_so_far(engine: LLMEngine, cut: int) -> None:
    """A migrated stream: the new prompt is prompt + the first `cut` tokens, `seed_offset` = cut; the
    new matcher takes those tokens first and the rest equals the unbroken run, token for token."""
    prompt = _prompt(engine)
    whole = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
                                                     grammar=GRAMMAR))[0]
    assert len(whole.token_ids) > cut
    moved = engine.generate([prompt + whole.token_ids[:cut]],
                            SamplingParams(max_tokens=MAX_TOKENS - cut, temperature=1.0, seed=5, seed_offset=cut,
                                           grammar=GRAMMAR))[0]
    assert whole.token_ids[:cut] + moved.token_ids == whole.token_ids


def test_invalid_grammars_are_refused_naming_the_problem(engine: LLMEngine) -> None:
    prompt = _prompt(engine)
    with pytest.raises(GrammarError, match="minimum"):
        engine.check_request(prompt, SamplingParams(grammar={"type": "json_schema", "schema": {
            "type": "integer", "minimum": 5, "maximum": 1}}))
    with pytest.raises(GrammarError, match="regex"):
        engine.check_request(prompt, SamplingParams(grammar={"type": "regex", "pattern": "a["}))
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar={"type": "yaml"}).validate()
