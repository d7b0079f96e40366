"""The prefill call: `POST /internal/prefill` and its answer.

The router sends the decode worker's descriptor (reused as is by every retry on another prefill
worker), the prompt's token ids and the parameters the decode worker resolved; the prefill worker
answers once the decode worker acknowledged the KV, with the first token and its timings, and,
when the request asked, the first token's log-probabilities and the prompt's (`wire.logprobs`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from inference.wire.logprobs import Logprob, LogprobsError, decode_positions, decode_prompt, encode_positions


@dataclass(slots=True)
class PrefillRequest:
    """What a prefill worker is asked to do for one reservation."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    descriptor: dict[str, Any]

    def encode(self) -> bytes:
        """The JSON body."""
        return orjson.dumps({"request_id": self.request_id, "prompt_token_ids": self.prompt_token_ids,
                             "sampling": self.sampling, "descriptor": self.descriptor})


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


@dataclass(slots=True)
class PrefillAnswer:
    """A prefill worker's answer; fields it did not send are None."""

    first_token: int | None = None
    kv_bytes: int | None = None
    prefill_s: float | None = None
    transfer_s: float | None = None
    first_logprobs: Logprob | None = None
    prompt_logprobs: list[Logprob | None] | None = None
    # The prompt tokens the prefill worker's engine reused from its prefix cache (did not compute).
    cached_tokens: int | None = None

    @classmethod
    def decode(cls, raw: bytes) -> PrefillAnswer:
        """Read an answer body; ValueError when it is not a JSON object."""
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            raise ValueError("prefill answer is not a JSON object")
        first, kv_bytes, cached = obj.get("first_token"), obj.get("kv_bytes"), obj.get("cached_tokens")
        try:
            first_lp = decode_positions(obj["first_logprobs"]) if obj.get("first_logprobs") else None
            prompt_lp = decode_prompt(obj["prompt_logprobs"]) if obj.get("prompt_logprobs") is not None else None
        except LogprobsError as exc:
            raise ValueError(f"prefill answer: {exc}") from None
        return cls(
            first_token=first if isinstance(first, int) and not isinstance(first, bool) else None,
            kv_bytes=kv_bytes if isinstance(kv_bytes, int) and not isinstance(kv_bytes, bool) else None,
            prefill_s=_number(obj.get("prefill_s")),
            transfer_s=_number(obj.get("transfer_s")),
            first_logprobs=first_lp[0] if first_lp else None,
            prompt_logprobs=prompt_lp,
            cached_tokens=cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None,
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object a prefill worker answers with."""
        out: dict[str, Any] = {"first_token": self.first_token, "kv_bytes": self.kv_bytes,
                               "prefill_s": self.prefill_s, "transfer_s": self.transfer_s}
        if self.cached_tokens is not None:
            out["cached_tokens"] = self.cached_tokens
        if self.first_logprobs is not None:
            out["first_logprobs"] = [self.first_logprobs.to_json()]
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = encode_positions(self.prompt_logprobs)
        return out
