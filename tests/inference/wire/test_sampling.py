"""The wire's sampling parameters: one set of rules for router, workers and engine."""
from __future__ import annotations

from typing import Any

import pytest

from inference.engine import SamplingParams
from inference.wire import Sampling, SamplingError


def test_round_trip_leaves_unset_model_defaults_out() -> None:
    sampling = Sampling.from_json({"max_tokens": 5, "temperature": 0, "stop": "\n", "seed": None})
    assert sampling == Sampling(max_tokens=5, temperature=0.0, stop=["\n"])
    assert sampling.to_json() == {"max_tokens": 5, "temperature": 0.0, "seed": None, "stop": ["\n"],
                                  "stop_token_ids": [], "ignore_eos": False}
    assert Sampling.from_json(sampling.to_json()) == sampling


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", 0), ("max_tokens", True), ("temperature", -1), ("temperature", float("inf")),
     ("temperature", 10**400), ("top_p", 0), ("top_k", -2), ("min_p", 1.5), ("seed", 1.5), ("stop", [1]),
     ("stop", ["a"] * 17), ("stop_token_ids", [-1]), ("ignore_eos", "yes"), ("seed_offset", -1)],
)
def test_a_bad_value_names_its_field_everywhere(field: str, value: Any) -> None:
    with pytest.raises(SamplingError) as info:
        Sampling.from_json({field: value})
    assert str(info.value).startswith(f"{field} must") or str(info.value).startswith(f"{field} may")
    assert info.value.quoted().startswith(f"'{field}' ")
    # The engine judges the same value by the same rule.
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value}).validate()


def test_unknown_fields_are_named() -> None:
    with pytest.raises(ValueError, match="bogus"):
        Sampling.from_json({"bogus": 1})


def test_engine_parameters_fill_model_defaults_then_their_own() -> None:
    params = SamplingParams.from_wire(Sampling(max_tokens=4, top_p=0.5), {"temperature": 0.6, "top_p": 0.9})
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.min_p) == (4, 0.6, 0.5, -1, 0.0)
    params.validate()


def test_a_continued_stream_keeps_its_budget_and_seed_position() -> None:
    sampling = Sampling(max_tokens=10, seed=7, seed_offset=2)
    assert sampling.continued(4) == Sampling(max_tokens=6, seed=7, seed_offset=6)
    assert sampling.continued(10) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("frequency_penalty", 3), ("presence_penalty", -2.5), ("repetition_penalty", 0.0),
     ("logit_bias", {"1": 200}), ("logit_bias", {"a": 1}), ("min_tokens", -1)],
)
def test_processor_fields_are_judged_alike_by_router_worker_and_engine(field: str, value: Any) -> None:
    with pytest.raises(SamplingError) as info:
        Sampling.from_json({field: value})
    assert info.value.field == field
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(**{field: value}).validate()


def test_processor_fields_round_trip_with_token_ids_as_json_strings() -> None:
    sampling = Sampling.from_json({"logit_bias": {"3": 1, "40": -100}, "min_tokens": 2, "repetition_penalty": 1.2,
                                   "frequency_penalty": 0.1, "presence_penalty": 0.2})
    assert sampling.logit_bias == {3: 1.0, 40: -100.0}
    wire = sampling.to_json()
    assert wire["logit_bias"] == {"3": 1.0, "40": -100.0}
    assert Sampling.from_json(wire) == sampling
    params = SamplingParams.from_wire(sampling)
    assert params.has_processors and params.to_dict()["logit_bias"] == {"3": 1.0, "40": -100.0}
    assert SamplingParams.from_dict(params.to_dict()) == params


def test_a_continued_stream_keeps_its_processors() -> None:
    # The new worker's prompt ends with the tokens already streamed, and `seed_offset` says how many:
    # frequency and presence penalties count them, min_tokens counts them as generated.
    sampling = Sampling(max_tokens=10, min_tokens=5, frequency_penalty=1.0, logit_bias={4: 2.0})
    continued = sampling.continued(3)
    assert continued == Sampling(max_tokens=7, min_tokens=5, frequency_penalty=1.0, logit_bias={4: 2.0}, seed_offset=3)
