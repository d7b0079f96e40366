"""Typed contracts between the router and the workers (Django-free and torch-free).

- `sampling`: the sampling parameters and their validation rules, written once (router, workers and
  the engine's `SamplingParams` use them);
- `stream`: the decode stream's NDJSON lines (descriptor, token, done, error);
- `prefill`: the prefill request and its answer.
"""
from __future__ import annotations

from inference.wire.prefill import PrefillAnswer, PrefillRequest
from inference.wire.sampling import Sampling, SamplingError
from inference.wire.stream import DecodeLine, DescriptorLine, DoneLine, ErrorLine, OtherLine, TokenLine, WireError

__all__ = [
    "DecodeLine",
    "DescriptorLine",
    "DoneLine",
    "ErrorLine",
    "OtherLine",
    "PrefillAnswer",
    "PrefillRequest",
    "Sampling",
    "SamplingError",
    "TokenLine",
    "WireError",
]
