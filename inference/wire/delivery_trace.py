"""Per-token timestamps along the token delivery path, for finding which hop delays a token (issue 19).

Off unless the environment names a folder in `DELIVERY_TRACE` (then `TRACE` is a `DeliveryTrace`, else
None: every call site is one `if TRACE is not None` per token when off). Each process appends rows to
`<folder>/trace-<pid>.tsv`: wall-clock time (s), point, request id, tokens. The points, in path order:

- `engine`: the engine thread hands a step's output to the request's channel (async_engine.py);
- `worker`: the worker's event loop yields the output's token line to its HTTP server, which writes it
  at once (inference/server: decode_stream.py, local_prefill.py);
- `router_in`: the router takes a token line it read from the worker (inference/router/run.py);
- `router_out`: the router has sent a token event to its client (inference/gateway/consumers.py);
- `client`: the benchmark's client received an event with text (bench/serve_vs_vllm.py).

Rows are buffered and written `FLUSH_ROWS` at a time, at exit, and by the router at each request's end
(its gunicorn processes end by a signal, without exit hooks), so the traced process pays a list append per
token and a file write per few hundred tokens. `bench/delivery_trace.py` joins the files.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path

ENV = "DELIVERY_TRACE"
# Rows kept in memory before a write (about 20 KB).
FLUSH_ROWS = 512


class DeliveryTrace:
    """Buffered trace rows of one process (see the module docstring); safe from any thread."""

    def __init__(self, folder: Path) -> None:
        """Append to `<folder>/trace-<pid>.tsv` (the pid at each write: a forked child writes its own)."""
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._rows: list[tuple[float, str, str, int]] = []
        self._lock = threading.Lock()
        atexit.register(self.flush)

    @classmethod
    def from_env(cls) -> DeliveryTrace | None:
        """A DeliveryTrace when `DELIVERY_TRACE` names a folder, else None."""
        folder = os.environ.get(ENV)
        return cls(Path(folder)) if folder else None

    def mark(self, point: str, request_id: str, tokens: int, at: float | None = None) -> None:
        """`tokens` tokens of `request_id` passed `point` now (or at `time.time()` value `at`)."""
        with self._lock:
            self._rows.append((time.time() if at is None else at, point, request_id, tokens))
            full = len(self._rows) >= FLUSH_ROWS
        if full:
            self.flush()

    def flush(self) -> None:
        """Write the buffered rows."""
        with self._lock:
            rows, self._rows = self._rows, []
            if not rows:
                return
            with open(self.folder / f"trace-{os.getpid()}.tsv", "a") as out:
                out.writelines(f"{t:.6f}\t{point}\t{rid}\t{n}\n" for t, point, rid, n in rows)


def read_rows(folder: Path) -> list[tuple[float, str, str, int]]:
    """Every row of every process's file under `folder`, in no particular order."""
    rows = []
    for path in sorted(folder.glob("trace-*.tsv")):
        for line in path.read_text().splitlines():
            fields = line.split("\t")
            if len(fields) == 4:
                rows.append((float(fields[0]), fields[1], fields[2], int(fields[3])))
    return rows


TRACE: DeliveryTrace | None = DeliveryTrace.from_env()
