"""Where a request's first choice ran, so that its other choices (`n` > 1) go to the same workers.

The choices of one request share a prompt. Choice 0 runs alone up to its first token (choices.py);
by then its prompt's KV is in its decode worker's prefix cache (registered on arrival) and its prefill
worker's. The other choices carry the same `Pin`: their admission takes choice 0's decode worker when
it is in rotation and has a free slot, and their prefill goes to choice 0's prefill worker first, so
their prefills compute only the prompt's last, partial block and move only its KV. When the pinned
worker is gone, unhealthy, full or already failed this choice, the choice is routed as any request.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inference.router.attempt import Attempt
    from inference.router.endpoint import Endpoint


@dataclass(eq=False)
class Pin:
    """The decode and prefill endpoints choice 0 got its first token from (None until it did; prefill
    stays None when the decode worker prefilled the prompt itself)."""

    decode: Endpoint | None = None
    prefill: Endpoint | None = None
    recorded: bool = False

    def record(self, attempt: Attempt) -> None:
        """Remember `attempt`'s workers, once: the first choice to get its first token sets the pin."""
        if not self.recorded:
            self.decode, self.prefill, self.recorded = attempt.decode, attempt.prefill, True

    def decode_in(self, rotation: Sequence[Endpoint], accept: Callable[[Endpoint], bool]) -> Endpoint | None:
        """The pinned decode endpoint when it is among `rotation` and `accept` takes it (a free slot,
        not tried yet), else None (the caller routes as usual)."""
        return _pinned(self.decode, rotation, accept)

    def prefill_in(self, rotation: Sequence[Endpoint], accept: Callable[[Endpoint], bool]) -> Endpoint | None:
        """The pinned prefill endpoint when it is among `rotation` and `accept` takes it, else None."""
        return _pinned(self.prefill, rotation, accept)


def _pinned(endpoint: Endpoint | None, rotation: Sequence[Endpoint], accept: Callable[[Endpoint], bool]
            ) -> Endpoint | None:
    # Identity: a pool that was given new endpoints holds new objects, and the pin then routes as usual.
    if endpoint is None or not any(e is endpoint for e in rotation) or not accept(endpoint):
        return None
    return endpoint
