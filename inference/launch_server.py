"""`python -m inference.launch_server`: start one prefill or decode worker (flags as in the guide).

    CUDA_VISIBLE_DEVICES=0 python -m inference.launch_server --model-path ./model_cache/prefill_weights \
        --service-type prefill --port 30000 --rdma-device mlx5_roce0 --context-length 4096 --batch-size 32
"""
from __future__ import annotations

import asyncio
import logging
import signal
import sys
from types import FrameType

import uvicorn

from inference.server.args import parse_args
from inference.server.errors import StartupError
from inference.server.flow import bounded_http_protocol


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    """Exit as a process killed by `signum` is reported (128 + signum), running the exit handlers."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    """Parse flags, load the model, open the KV port, serve HTTP until stopped."""
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    log = logging.getLogger("inference.launch_server")
    # Imported after parsing so that --help and flag errors answer without loading torch.
    from inference.server.app import create_app
    from inference.server.decode import DecodeWorker
    from inference.server.resources import lower_priority
    from inference.server.worker import create_worker

    lower_priority(args.nice)  # before any thread starts: they inherit it
    try:
        worker = create_worker(args)
        worker.start()
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    log.info(
        "%s worker for %s on %s:%d (device %s, CPUs %s, %d KV blocks)",
        args.service_type, worker.model_name, args.host, args.port, worker.device, worker.cpus,
        worker.engine.status().kv_blocks,
    )
    if isinstance(worker, DecodeWorker):
        log.info("KV transfers accepted on port %d (%s)", worker.receiver.port, args.kv_transport)
    # With flow control on, the worker's connections get small send buffers too, so that a
    # stream's send waits as soon as its reader falls behind (inference/server/flow.py).
    http: type[asyncio.Protocol] | str = bounded_http_protocol() if args.stream_window else "auto"
    config = uvicorn.Config(
        create_app(worker), host=args.host, port=args.port, log_level=args.log_level, access_log=False,
        timeout_graceful_shutdown=5, http=http,
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises the SIGTERM it shut down on, with the handler it found: the default one would kill
    # the process without running its exit handlers, and the KV pool's claim in the host's registry
    # (host_memory.py) would outlive the worker until another worker pruned it.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        server.run()
    except OSError as exc:
        print(f"error: cannot serve on --port {args.port}: {exc}", file=sys.stderr)
        worker.stop()
        return 1
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
