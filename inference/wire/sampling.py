"""Sampling parameters as they travel from the router to the workers, validated by one set of rules.

The router parses a client's fields into a `Sampling` (400 naming the field), sends it to the
decode worker as JSON (`to_json`), and the worker reads it back (`from_json`) with the same rules
before the engine's `SamplingParams` is built from it (model defaults filled in for the fields the
client left out). `SamplingParams.validate()` applies these rules too, so a value is judged the same
wherever it is checked.

A rule returns the normalized value or raises `SamplingError`, whose text starts with the field's
name (`str(error)`); `quoted()` is the router's form of the same message (`'top_p' must be ...`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

DEFAULT_MAX_TOKENS = 16
# A client may give this many stop strings at most (each is searched in every new text).
MAX_STOP = 16
# The fields a model's generation_config.json may default (as vLLM reads them); a client that
# leaves one out gets the model's value, then the engine's.
MODEL_DEFAULT_FIELDS: tuple[str, ...] = ("temperature", "top_p", "top_k", "min_p")


class SamplingError(ValueError):
    """A sampling field with a value no worker accepts; the message names the field first."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name} {problem}")
        self.field = name
        self.problem = problem

    def quoted(self) -> str:
        """The message with the field's name quoted, as the router's 400s put it."""
        return f"'{self.field}' {self.problem}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(name: str, value: Any, rule: str) -> float:
    number = math.inf
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # a JSON integer too large for a float (1 followed by 400 zeros)
            pass
    if not math.isfinite(number):
        raise SamplingError(name, f"must be {rule}, got {value!r}")
    return number


def _max_tokens(name: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise SamplingError(name, f"must be an integer >= 1, got {value!r}")
    return int(value)


def _temperature(name: str, value: Any) -> float:
    rule = "a finite number >= 0"
    number = _finite(name, value, rule)
    if number < 0:
        raise SamplingError(name, f"must be {rule}, got {value!r}")
    return number


def _top_p(name: str, value: Any) -> float:
    number = _finite(name, value, "in (0, 1]")
    if not 0.0 < number <= 1.0:
        raise SamplingError(name, f"must be in (0, 1], got {value!r}")
    return number


def _min_p(name: str, value: Any) -> float:
    number = _finite(name, value, "in [0, 1]")
    if not 0.0 <= number <= 1.0:
        raise SamplingError(name, f"must be in [0, 1], got {value!r}")
    return number


def _top_k(name: str, value: Any) -> int:
    if not _is_int(value) or value < -1:
        raise SamplingError(name, f"must be an integer >= 1, or -1/0 to disable, got {value!r}")
    return int(value)


def _seed(name: str, value: Any) -> int | None:
    if value is not None and not _is_int(value):
        raise SamplingError(name, f"must be an integer or null, got {value!r}")
    return value


def _stop(name: str, value: Any) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise SamplingError(name, "must be a non-empty string or a list of non-empty strings")
    if len(value) > MAX_STOP:
        raise SamplingError(name, f"may hold at most {MAX_STOP} strings")
    return list(value)


def _token_ids(name: str, value: Any) -> list[int]:
    if isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise SamplingError(name, "must be a list of non-negative integers")
    return list(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise SamplingError(name, f"must be true or false, got {value!r}")
    return value


def _seed_offset(name: str, value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise SamplingError(name, f"must be an integer >= 0, got {value!r}")
    return int(value)


# OpenAI's ranges: penalties in [-2, 2], a logit bias in [-100, 100] on at most 300 tokens.
PENALTY_LIMIT = 2.0
LOGIT_BIAS_LIMIT = 100.0
MAX_LOGIT_BIAS = 300


def _penalty(name: str, value: Any) -> float:
    rule = f"in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}]"
    number = _finite(name, value, rule)
    if not -PENALTY_LIMIT <= number <= PENALTY_LIMIT:
        raise SamplingError(name, f"must be {rule}, got {value!r}")
    return number


def _repetition_penalty(name: str, value: Any) -> float:
    rule = "a finite number > 0 (1 = off)"
    number = _finite(name, value, rule)
    if number <= 0:
        raise SamplingError(name, f"must be {rule}, got {value!r}")
    return number


def _token_key(name: str, key: Any) -> int:
    """A logit_bias key: a token id as JSON writes it (a string of digits), or an int."""
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12:
        return int(key)
    if _is_int(key) and key >= 0:
        return int(key)
    raise SamplingError(name, f"keys must be token ids (strings of digits), got {key!r}")


def _logit_bias(name: str, value: Any) -> dict[int, float]:
    if not isinstance(value, Mapping):
        raise SamplingError(name, "must be an object mapping token ids to numbers in [-100, 100]")
    if len(value) > MAX_LOGIT_BIAS:
        raise SamplingError(name, f"may hold at most {MAX_LOGIT_BIAS} tokens")
    out: dict[int, float] = {}
    rule = f"in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]"
    for key, bias in value.items():
        token = _token_key(name, key)
        number = math.inf
        if isinstance(bias, int | float) and not isinstance(bias, bool):
            number = float(bias) if abs(bias) <= 1e300 else math.inf  # no OverflowError on huge ints
        if not -LOGIT_BIAS_LIMIT <= number <= LOGIT_BIAS_LIMIT:
            raise SamplingError(name, f"values must be numbers {rule}, got {bias!r} for token {key!r}")
        out[token] = number
    return out


# OpenAI allows at most 20 alternatives per position (`top_logprobs`; completions' `logprobs` said 5).
MAX_LOGPROBS = 20


def _logprobs(name: str, value: Any) -> int | None:
    if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
        raise SamplingError(name, f"must be an integer in [0, {MAX_LOGPROBS}] or null, got {value!r}")
    return value


# Structured output: the grammar kinds a request may name (the router builds them from `response_format`,
# `guided_regex`, `guided_choice` and tool choices; the engine compiles them: inference/engine/grammar.py).
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice")


def _grammar(name: str, value: Any) -> dict[str, Any] | None:
    """The shape of a grammar spec; whether the schema or regex compiles is the grammar library's call."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, Mapping) else None
    if kind not in GRAMMAR_KINDS:
        raise SamplingError(name, f"must be an object whose 'type' is one of {', '.join(GRAMMAR_KINDS)}")
    if kind == "json_schema" and not isinstance(value.get("schema"), Mapping):
        raise SamplingError(name, "of type json_schema needs a 'schema' object")
    if kind == "regex" and not (isinstance(value.get("pattern"), str) and value["pattern"]):
        raise SamplingError(name, "of type regex needs a non-empty 'pattern' string")
    choices = value.get("choices")
    if kind == "choice" and not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
        raise SamplingError(name, "of type choice needs a non-empty list of strings 'choices'")
    return dict(value)


def _min_tokens(name: str, value: Any) -> int:
    if not _is_int(value) or value < 0:
        raise SamplingError(name, f"must be an integer >= 0, got {value!r}")
    return int(value)


# One rule per field: (name, value) -> the normalized value, or SamplingError.
RULES: dict[str, Callable[[str, Any], Any]] = {
    "max_tokens": _max_tokens,
    "temperature": _temperature,
    "top_k": _top_k,
    "top_p": _top_p,
    "min_p": _min_p,
    "seed": _seed,
    "stop": _stop,
    "stop_token_ids": _token_ids,
    "ignore_eos": _flag,
    "seed_offset": _seed_offset,
    "frequency_penalty": _penalty,
    "presence_penalty": _penalty,
    "repetition_penalty": _repetition_penalty,
    "logit_bias": _logit_bias,
    "min_tokens": _min_tokens,
    "grammar": _grammar,
    "logprobs": _logprobs,
    "prompt_logprobs": _logprobs,
}

# The fields that change the logits before sampling (logits processors), with the value that
# leaves them off; `to_json` sends them only when set.
PROCESSOR_DEFAULTS: dict[str, Any] = {
    "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logit_bias": {}, "min_tokens": 0,
    "grammar": None,
}


def check(name: str, value: Any) -> Any:
    """`value` normalized by the rule of field `name` (SamplingError when it breaks it)."""
    return RULES[name](name, value)


@dataclass(slots=True)
class Sampling:
    """A request's sampling parameters on the wire.

    The model-default fields (`MODEL_DEFAULT_FIELDS`) are None when the client left them out: the
    decode worker fills them from its model's generation_config.json, then the engine's defaults,
    and hands the resolved values to the prefill worker. `seed_offset` is how many output tokens
    came before this request took a stream over (a migrated stream's seeded sampler goes on there).

    Logits processors (applied by the engine's sampler on both workers): `frequency_penalty` and
    `presence_penalty` (OpenAI's, over the generated tokens), `repetition_penalty` (vLLM's, over
    prompt and generated tokens; 1 = off), `logit_bias` (token id -> bias added to its logit) and
    `min_tokens` (EOS and stop token ids masked until that many tokens were generated), and
    `grammar` (structured output: the tokens must follow a JSON schema, any JSON object, a regex or
    one of a list of strings; `GRAMMAR_KINDS`).

    Log-probabilities (raw: the log-softmax of the model's logits before any processor, temperature
    or filter): `logprobs` None = none, N = each sampled token's plus its N most likely alternatives;
    `prompt_logprobs` the same for every prompt token (computed by the prefill worker; `echo`).
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed_offset: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    grammar: dict[str, Any] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Sampling:
        """Read the JSON object; a field that is absent or null keeps its default. SamplingError
        for a bad value, ValueError naming unknown fields."""
        unknown = sorted(set(data) - RULES.keys())
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        return cls(**{name: check(name, value) for name, value in data.items() if value is not None})

    def to_json(self) -> dict[str, Any]:
        """The JSON object: model-default fields only when set, `seed_offset` and the logits
        processors only when not off."""
        out: dict[str, Any] = {"max_tokens": self.max_tokens}
        for name in MODEL_DEFAULT_FIELDS:
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        out.update(seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)
        if self.seed_offset:
            out["seed_offset"] = self.seed_offset
        for name, off in PROCESSOR_DEFAULTS.items():
            value = getattr(self, name)
            if value != off:
                out[name] = logit_bias_json(value) if name == "logit_bias" else value
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def continued(self, emitted: int) -> Sampling | None:
        """The parameters that go on with a stream after `emitted` output tokens (a migration): the
        rest of `max_tokens`, the seeded sequence from output token `emitted`; None when no token
        is left to generate."""
        remaining = self.max_tokens - emitted
        if remaining < 1:
            return None
        # The prompt's log-probabilities were reported by the first worker: not again.
        return replace(self, max_tokens=remaining, seed_offset=self.seed_offset + emitted, prompt_logprobs=None)


def logit_bias_json(bias: Mapping[int, float]) -> dict[str, float]:
    """`logit_bias` as JSON holds it (token ids as strings)."""
    return {str(token): value for token, value in bias.items()}


def field_names() -> tuple[str, ...]:
    """The wire's sampling fields, in declaration order."""
    return tuple(f.name for f in fields(Sampling))
