"""Per-request sampling and stopping parameters: the engine's form of the wire's `Sampling`.

The rules every field must follow are the wire's (inference/wire/sampling.py), so the router, the
workers and the engine judge a value alike; this module adds the engine's defaults and the model's
(generation_config.json).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from inference.wire.sampling import MODEL_DEFAULT_FIELDS, Sampling, SamplingError, check, logit_bias_json

# The sampling fields a model's generation_config.json may set as defaults, as vLLM reads them
# (vLLM also reads repetition_penalty, which this engine does not implement; `do_sample` is
# ignored by vLLM too: a checkpoint that wants greedy decoding says temperature 0).
GENERATION_CONFIG_SAMPLING_FIELDS: tuple[str, ...] = MODEL_DEFAULT_FIELDS


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1.0 disables nucleus sampling;
    min_p 0.0 disables min-p (drop tokens less likely than `min_p` times the most likely one).
    With `seed` set, output token i is sampled with a generator seeded from (seed, i), so a prefill
    worker and a decode worker continue one deterministic stream. `seed_offset` is the number of
    output tokens produced before this request took the stream over (a router migrating a stream
    to another decode worker sets it): its first token is output token `seed_offset` of the seed's
    sequence, so a seeded stream continues exactly as an unbroken run would.

    Logits processors (`logits_processors.py`): `frequency_penalty` / `presence_penalty` (OpenAI's,
    over the generated tokens: the output, and after a migration the prompt's last `seed_offset`
    tokens, which were generated), `repetition_penalty` (vLLM's, over prompt and output; 1 = off),
    `logit_bias` (token id -> added to its logit), `min_tokens` (EOS and `stop_token_ids` masked
    until that many tokens were generated, `seed_offset` included), and `grammar` (structured output,
    the wire's spec: the tokens follow it, masked by `grammar.py`).

    Log-probabilities (`logprobs.py`), raw (the log-softmax of the model's logits, before processors,
    temperature and filters, as vLLM's default): `logprobs` N gives each sampled token's and its N
    most likely alternatives (None: none); `prompt_logprobs` N the same for every prompt token of a
    sequence's first prefill (its prefix is then computed, not read from the prefix cache).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
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

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (argmax)."""
        return self.temperature == 0.0

    @property
    def has_processors(self) -> bool:
        """Whether a logits processor (penalty, bias, min_tokens, grammar) changes this request's logits."""
        return bool(
            self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
            or self.logit_bias or self.min_tokens or self.grammar is not None
        )

    def validate(self) -> None:
        """Raise ValueError (the wire's `SamplingError`) naming the first invalid field."""
        for f in fields(self):
            check(f.name, getattr(self, f.name))

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dictionary (lists copied; `logit_bias` keyed by token ids as strings)."""
        out = asdict(self)
        out["logit_bias"] = logit_bias_json(self.logit_bias)
        return out

    @classmethod
    def from_wire(cls, sampling: Sampling, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The engine's parameters for a request's wire `Sampling` (already checked field by field):
        model-default fields it leaves unset take `defaults` (the model's), then the engine's own."""
        values = {f.name: getattr(sampling, f.name) for f in fields(cls)}
        for name in MODEL_DEFAULT_FIELDS:
            if values[name] is None:
                default = (defaults or {}).get(name)
                if default is None:
                    del values[name]
                else:
                    values[name] = default
        return cls(**values)

    @classmethod
    def from_dict(cls, data: dict[str, Any], defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """Build from a dictionary; unknown keys raise ValueError naming them, a bare string `stop` is
        accepted as a one-element list (the OpenAI API allows both). Call `validate()` afterwards.

        `defaults` (the model's, from `load_sampling_defaults`) fill the fields that `data` leaves out
        or sets to null; a value in `data` always wins.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(unknown)}")
        kwargs = {k: v for k, v in (defaults or {}).items() if k in known}
        kwargs.update({k: v for k, v in data.items() if v is not None or k == "seed"})
        stop = kwargs.get("stop")
        if isinstance(stop, str):
            kwargs["stop"] = [stop]
        for key in ("stop", "stop_token_ids"):
            if key in kwargs and isinstance(kwargs[key], tuple):
                kwargs[key] = list(kwargs[key])
        if "logit_bias" in kwargs:
            # JSON keys are strings; a bad value is left for validate() to name.
            try:
                kwargs["logit_bias"] = check("logit_bias", kwargs["logit_bias"])
            except SamplingError:
                pass
        for key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            # JSON clients send 1 for 1.0; keep the dataclass types honest.
            if key in kwargs and _is_number(kwargs[key]):
                kwargs[key] = float(kwargs[key])
        return cls(**kwargs)


def sampling_defaults_from_generation_config(generation_config: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling defaults a parsed generation_config.json sets (only the fields it holds).

    Raises ValueError naming the field when one is not a valid sampling value, so that a worker
    fails at start rather than on every request that relies on the default.
    """
    found = {
        k: generation_config[k] for k in GENERATION_CONFIG_SAMPLING_FIELDS if generation_config.get(k) is not None
    }
    # Validate by building the parameters these defaults give an empty request.
    SamplingParams.from_dict({}, found).validate()
    return {k: float(v) if k != "top_k" and _is_number(v) else v for k, v in found.items()}


def load_sampling_defaults(model_path: str | os.PathLike[str]) -> dict[str, Any]:
    """The sampling defaults of the checkpoint folder's generation_config.json ({} without one).

    Raises ValueError naming the file when it is not JSON or holds an invalid sampling value.
    """
    path = os.path.join(os.fspath(model_path), "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return sampling_defaults_from_generation_config(data)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path}: {exc}") from exc


def _is_number(value: Any) -> bool:
    """True for int/float but not bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)
