"""The request that continues a migrated stream (inference/router/migration.py)."""
from __future__ import annotations

from inference.engine import SamplingParams
from inference.router.events import GenerateRequest
from inference.router.migration import resumed_request
from inference.wire import Sampling


def test_resumed_request_continues_prompt_budget_and_seed() -> None:
    """Prompt + emitted tokens, the remaining max_tokens, the seed counted on from the emitted tokens."""
    req = GenerateRequest(sampling=Sampling(max_tokens=10, temperature=0.8, seed=3), prompt="hi")
    resumed = resumed_request(req, [5, 6], [7, 8, 9], 1)
    assert resumed is not None
    assert resumed.input_ids == [5, 6, 7, 8, 9]
    assert resumed.sampling.to_json() == {"max_tokens": 7, "temperature": 0.8, "seed": 3, "stop": [],
                                          "stop_token_ids": [], "ignore_eos": False, "seed_offset": 3}
    assert resumed.request_id == f"{req.request_id}-m1"
    # What the router sends is what a worker accepts.
    SamplingParams.from_wire(Sampling.from_json(resumed.sampling.to_json())).validate()
    # A stream that had moved before goes on counting from where it was.
    again = resumed_request(resumed, [5, 6, 7, 8, 9], [1], 2)
    assert again is not None and (again.sampling.max_tokens, again.sampling.seed_offset) == (6, 4)


def test_nothing_left_to_resume() -> None:
    """All tokens already sent, or no prompt ids: nothing to continue."""
    req = GenerateRequest(sampling=Sampling(max_tokens=3), prompt="hi")
    assert resumed_request(req, [1], [2, 3, 4], 1) is None
    assert resumed_request(req, [], [2], 1) is None
