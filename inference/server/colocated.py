"""`--service-type both`: a worker that prefills and decodes, so a one-host deployment needs no hop.

It is a decode worker (the engine runs prefill and decode in one continuous batch anyway) that
prefills every prompt itself, whether or not the router offers local prefill: its stream's
descriptor says `{"local": true}` and the router makes no prefill call (inference/server/local_prefill.py).
A router whose pool has no prefill endpoints offers every prompt to its decode workers for the same
effect, so `both` workers are listed as decode endpoints. Its KV port stays open: a router that
still sends a prefill worker's KV (a mixed pool) is served too.
"""
from __future__ import annotations

from inference.server.decode import DecodeWorker


class ColocatedWorker(DecodeWorker):
    """A decode worker that prefills every prompt it is given (role `both`)."""

    role = "both"
    prefills_every_prompt = True
