"""The router accepts penalties, logit_bias and min_tokens and refuses bad values with a 400 naming them."""
from __future__ import annotations

from typing import Any

import pytest

from inference.engine import SamplingParams
from inference.router import RouterError
from inference.router.protocol import parse_chat, parse_completion, parse_generate
from inference.server.requests import parse_sampling
from inference.wire import Sampling

FIELDS = {"frequency_penalty": 0.5, "presence_penalty": -1.25, "repetition_penalty": 1.1,
          "logit_bias": {"50256": -100, "7": 2.5}, "min_tokens": 3}


@pytest.mark.parametrize(
    ("parser", "body"),
    [(parse_completion, {"prompt": "hi"}), (parse_generate, {"prompt": "hi"}),
     (parse_chat, {"messages": [{"role": "user", "content": "hi"}]})],
)
def test_the_fields_are_accepted_and_reach_the_workers_parameters(parser: Any, body: dict[str, Any]) -> None:
    sampling = parser({**body, **FIELDS, "max_tokens": 8}).request.sampling
    assert sampling == Sampling(max_tokens=8, frequency_penalty=0.5, presence_penalty=-1.25, repetition_penalty=1.1,
                                logit_bias={50256: -100.0, 7: 2.5}, min_tokens=3)
    # What the router sends is what the decode worker (and, through the descriptor, the prefill
    # worker) reads back into the engine's parameters.
    wire = sampling.to_json()
    assert wire["logit_bias"] == {"50256": -100.0, "7": 2.5}
    params = parse_sampling(wire, 100)
    assert params.logit_bias == {50256: -100.0, 7: 2.5} and params.min_tokens == 3
    assert params.frequency_penalty == 0.5 and params.presence_penalty == -1.25 and params.repetition_penalty == 1.1
    again = parse_sampling(params.to_dict(), 100)  # the descriptor line's resolved parameters
    assert again == params


def test_penalties_left_at_their_off_values_are_not_sent() -> None:
    sampling = parse_completion({"prompt": "hi", "frequency_penalty": 0, "presence_penalty": 0,
                                 "repetition_penalty": 1, "logit_bias": {}, "min_tokens": 0}).request.sampling
    assert not ({"frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias", "min_tokens"}
                & set(sampling.to_json()))
    assert not SamplingParams.from_wire(sampling).has_processors


@pytest.mark.parametrize(
    ("field", "value"),
    [("frequency_penalty", 2.5), ("frequency_penalty", "1"), ("presence_penalty", -2.01),
     ("presence_penalty", float("nan")), ("repetition_penalty", 0), ("repetition_penalty", -1.0),
     ("logit_bias", {"5": 101}), ("logit_bias", {"5": -100.5}), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}),
     ("logit_bias", {"5": True}), ("logit_bias", [1, 2]), ("logit_bias", {str(i): 1 for i in range(301)}),
     ("logit_bias", {"5": 10**400}), ("min_tokens", -1), ("min_tokens", 1.5)],
)
def test_bad_values_are_a_400_naming_the_field(field: str, value: Any) -> None:
    for parser, body in ((parse_completion, {"prompt": "hi"}),
                         (parse_chat, {"messages": [{"role": "user", "content": "hi"}]})):
        with pytest.raises(RouterError) as info:
            parser({**body, field: value})
        assert info.value.status == 400 and info.value.message.startswith(f"'{field}' "), info.value.message


def test_min_tokens_above_max_tokens_is_refused() -> None:
    with pytest.raises(RouterError) as info:
        parse_completion({"prompt": "hi", "max_tokens": 4, "min_tokens": 5})
    assert info.value.status == 400 and "'min_tokens'" in info.value.message and "'max_tokens'" in info.value.message
    with pytest.raises(RouterError) as info:
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2, "min_tokens": 3})
    assert "'max_completion_tokens'" in info.value.message
