"""The prefill call: `POST /internal/prefill` and its answer.

The router sends the decode worker's descriptor (reused as is by every retry on another prefill
worker), the prompt's token ids and the parameters the decode worker resolved; the prefill worker
answers once the decode worker acknowledged the KV, with the first token and its timings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson


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

    @classmethod
    def decode(cls, raw: bytes) -> PrefillAnswer:
        """Read an answer body; ValueError when it is not a JSON object."""
        try:
            obj = orjson.loads(raw)
        except orjson.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            raise ValueError("prefill answer is not a JSON object")
        first, kv_bytes = obj.get("first_token"), obj.get("kv_bytes")
        return cls(
            first_token=first if isinstance(first, int) and not isinstance(first, bool) else None,
            kv_bytes=kv_bytes if isinstance(kv_bytes, int) and not isinstance(kv_bytes, bool) else None,
            prefill_s=_number(obj.get("prefill_s")),
            transfer_s=_number(obj.get("transfer_s")),
        )

    def to_json(self) -> dict[str, Any]:
        """The JSON object a prefill worker answers with."""
        return {"first_token": self.first_token, "kv_bytes": self.kv_bytes, "prefill_s": self.prefill_s,
                "transfer_s": self.transfer_s}
