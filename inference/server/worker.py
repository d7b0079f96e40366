"""A worker of the role its flags ask for: `create_worker(args)` builds a `PrefillWorker` (a KV sender),
a `DecodeWorker` (a KV receiver) or a `ColocatedWorker` (`both`: a decode worker that prefills every
prompt itself), all on the shared `WorkerCore` (engine, health, metrics, aborts).

Decode (decode.py): reserve blocks → hand out a transfer descriptor → wait (under a lease) for a
prefill worker to write the prompt's KV → continue generation in the continuous batch, streaming tokens.
Prefill (prefill.py): run the prompt (batched with other prefills), sample the first token, write the KV
blocks into the decode worker's reserved blocks, answer with the first token and timings.
"""
from __future__ import annotations

from inference.server.args import ServerArgs
from inference.server.colocated import ColocatedWorker
from inference.server.decode import DecodeWorker
from inference.server.prefill import FAULT_PREFILL_DELAY_ENV, PrefillWorker

Worker = PrefillWorker | DecodeWorker  # a ColocatedWorker is a DecodeWorker


def create_worker(args: ServerArgs) -> Worker:
    """Load the model and build the worker of `--service-type` (StartupError naming the flag at fault)."""
    if args.service_type == "both":
        return ColocatedWorker(args)
    if args.service_type == "decode":
        return DecodeWorker(args)
    return PrefillWorker(args)


__all__ = ["FAULT_PREFILL_DELAY_ENV", "DecodeWorker", "PrefillWorker", "Worker", "create_worker"]
