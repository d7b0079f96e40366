"""Command-line flags of a worker, as in the deployment guide, validated into ServerArgs."""
from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# Torch-free (the engine package imports its parts lazily): the agent imports this module too.
from inference.engine.step_cost import AUTO_FACTOR, DEFAULT_MIXED_STEP_TARGET, TARGET_FORMS, parse_step_target

# A good --stream-window once the worker's send buffers are small (they are, with the flag on); off
# by default: on a busy 2-core machine it cost ~7% tokens/s for clients that read everything and did
# not clearly reduce hang-up waste (docs/benchmarks.md §8).
SUGGESTED_STREAM_WINDOW = 8

# vLLM's default share of the GPU (the engine's memory.DEFAULT_GPU_MEMORY_UTILIZATION; not imported
# from there because the agent imports this module, and importing the engine package loads torch).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9

# --num-speculative-tokens: default and bound (the engine's speculative.SpeculativeConfig checks the
# same bound; not imported from there for the same reason). 8, not 4: the step's row budget decides how
# many proposed tokens run, so K only caps the offer, and on SmolLM2 (AMD EPYC Zen 4, fifteenth session)
# K=8 beat K=4 in every workload and level (rewriting at 8 in flight 1.58x against 1.41x).
DEFAULT_SPECULATIVE_TOKENS = 8
MAX_SPECULATIVE_TOKENS = 16

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """`"2GiB"` → 2147483648; also plain byte counts, decimal units (`"1.5GB"`) and bare letters
    (`"512M"`, decimal). Raises ValueError for anything else or a size below one byte."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 2GiB, 512MiB, 1.5GB, 1073741824)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"{text!r} is less than one byte")
    return value


@dataclass
class ServerArgs:
    """A worker's validated configuration."""

    model_path: Path
    service_type: str
    host: str
    port: int
    rdma_device: str | None
    kv_transport: str
    kv_port: int
    kv_advertise_host: str | None
    context_length: int | None
    batch_size: int | None
    max_num_batched_tokens: int | None
    dtype: str
    prefix_caching: bool
    chunked_prefill: bool
    base_cpu_id: int | None
    num_threads: int | None
    max_sequence_length: int | None
    block_size: int
    num_kv_blocks: int | None
    kv_cache_memory_mb: int | None
    kv_cache_memory: int | None
    gpu_memory_utilization: float
    compile: bool
    kv_lease_timeout: float
    max_queue: int
    max_tokens_limit: int
    served_model_name: str | None
    shared_secret: str
    log_level: str
    # Decode: engine outputs a stream may have waiting before its sequence pauses (0: off).
    stream_window: int = 0
    nice: int = 0
    # Speculative decoding (decode steps): "ngram" or None (off), and the tokens proposed per step.
    speculative: str | None = None
    num_speculative_tokens: int | None = None
    # Mixed prefill: prompt tokens ride in the decode batch's forward (LLMEngine enable_mixed_prefill).
    mixed_prefill: bool = False
    # With mixed prefill: the time a mixed step keeps within on the measured step cost (step_cost.py).
    mixed_step_target: str = DEFAULT_MIXED_STEP_TARGET

    @property
    def kv_cache_bytes(self) -> int | None:
        """The KV pool size asked for (--kv-cache-memory, or --kv-cache-memory-mb), None when sized
        from memory."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        return self.kv_cache_memory_mb * 2**20 if self.kv_cache_memory_mb is not None else None

    @classmethod
    def with_defaults(cls, **values: Any) -> ServerArgs:
        """ServerArgs from `values` plus the parser's default for every field not given, unvalidated.

        The agent builds a worker's configuration with it (then `to_argv`), on a host where it checks
        nothing itself: the worker validates its flags when it starts. kv_transport "auto" is resolved as
        parse_args does; the shared secret comes from the environment (never from a flag).
        """
        names = {f.name for f in fields(cls)}
        merged: dict[str, Any] = {"shared_secret": os.environ.get("PLATFORM_SHARED_SECRET", "")}
        for action in build_parser()._actions:
            if action.dest in names:
                merged[action.dest] = action.default
            elif action.dest.startswith("no_") and action.dest[3:] in names:  # --no-X flags set X = False
                merged[action.dest[3:]] = not action.default
        merged.update(values)
        if merged.get("kv_transport") == "auto":
            merged["kv_transport"] = "rdma" if merged.get("rdma_device") else "tcp"
        merged["model_path"] = Path(merged["model_path"])
        return cls(**merged)

    def to_argv(self) -> list[str]:
        """The flags of this configuration: `parse_args(args.to_argv()) == args` (the one way a worker's
        command line is built). Every value that is set is written, defaults included, so the command
        line shows the whole configuration (and always --port, which adoption matches); switches only
        when on. The shared secret is not a flag: it travels in the environment."""
        values = vars(self)
        argv: list[str] = []
        for action in build_parser()._actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = max(action.option_strings, key=len)
            if action.nargs == 0:  # a switch: --X sets X, --no-X clears X
                if action.dest in values:
                    on = bool(values[action.dest])
                else:
                    on = action.dest.startswith("no_") and values.get(action.dest[3:]) is False
                argv += [flag] if on else []
            elif values.get(action.dest) is not None:
                argv += [flag, str(values[action.dest])]
        return argv


def _production() -> bool:
    """PLATFORM_PRODUCTION as config/env.py reads it (the worker does not import Django)."""
    value = os.environ.get("PLATFORM_PRODUCTION", "").strip().lower()
    return value in {"1", "true", "yes", "on"}


def _size(text: str) -> int:
    """argparse type of a byte size (`2GiB`, `512MiB`, `1073741824`); argparse names the flag."""
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    """The worker's argument parser (flags named as in the deployment guide)."""
    p = argparse.ArgumentParser(
        prog="python -m inference.launch_server",
        description="Run a prefill or decode worker of a disaggregated deployment.",
    )
    p.add_argument("--model-path", required=True, help="folder with config.json, safetensors and tokenizer")
    p.add_argument("--service-type", required=True, choices=["prefill", "decode", "both"],
                   help="prefill, decode, or both: a worker that prefills every prompt itself (no hop; list it "
                   "as a decode endpoint of the router)")
    p.add_argument("--port", type=int, default=30000, help="HTTP port (default 30000)")
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default 0.0.0.0)")
    p.add_argument("--rdma-device", default=None, help="RDMA device for KV transfer, e.g. mlx5_roce0")
    p.add_argument(
        "--kv-transport",
        choices=["auto", "tcp", "rdma"],
        default="auto",
        help="KV transport: rdma when --rdma-device is given, else tcp (auto); tcp is the fallback",
    )
    p.add_argument("--kv-port", type=int, default=0, help="decode: TCP port for KV writes (0: any free)")
    p.add_argument("--kv-advertise-host", default=None, help="decode: address prefill workers connect to")
    p.add_argument("--context-length", type=int, default=None, help="longest prompt accepted (tokens)")
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="max sequences in one batch: decode runs at most this many at once (the rest queue), "
        "prefill batches at most this many prompts (default: as many as the KV pool holds at 1,024 tokens "
        "each, at most 32 on a CPU and 256 on a GPU)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="max prompt tokens in one prefill batch (a longer prompt runs alone); "
        "default max(2048, min(context length, 8192))",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weights and KV cache dtype (default auto: bf16/fp16 on a GPU; on a CPU bf16 where measured "
        "faster, else float32). Both roles must resolve to the same dtype: set it explicitly when "
        "prefill and decode run on different hardware. float32 matches transformers exactly",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the KV blocks of prompt prefixes seen before (prefix caching is on by default)",
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="compute a prompt longer than --max-num-batched-tokens in one step instead of in chunks "
        "alternating with decode steps (chunked prefill is on by default)",
    )
    p.add_argument(
        "--mixed-prefill",
        action="store_true",
        help="run prompt tokens in the same forward as the running batch's decode rows, up to "
        "--max-num-batched-tokens prompt tokens per step on top of the rows (vLLM's chunked prefill; CPU "
        "with the decode kernel, with chunked prefill): streams get a token every step instead of waiting "
        "for a prefill step",
    )
    p.add_argument(
        "--mixed-step-target",
        default=DEFAULT_MIXED_STEP_TARGET,
        help=f"with --mixed-prefill: a mixed step takes the prompt tokens that keep it within this time on "
        f"the step cost the worker measures (a + b*rows + c*prompt tokens, fitted online), instead of "
        f"--max-num-batched-tokens (used until the cost is measured): {TARGET_FORMS} (auto: "
        f"{AUTO_FACTOR:g}x; default {DEFAULT_MIXED_STEP_TARGET})",
    )
    p.add_argument("--base-cpu-id", type=int, default=None, help="first CPU to pin the worker to")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads / CPUs pinned")
    p.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="longest prompt+output a sequence may reach; output is cut there (finish_reason=length)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (same on both roles)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks in the pool (exactly; recorded in the host's KV claims like any pool)")
    p.add_argument(
        "--kv-cache-memory",
        type=_size,
        default=None,
        help="KV pool size, e.g. 2GiB, 512MiB or bytes (default on a CPU: 40%% of the memory available after "
        "the weights load and not claimed by the pools other workers of this host are still allocating, so "
        "workers started together share the host; at most 16GiB, and no more than --batch-size sequences of "
        "the maximum length use; on a GPU it replaces --gpu-memory-utilization's sizing)",
    )
    p.add_argument("--kv-cache-memory-mb", type=int, default=None, help="KV pool size in MiB (older spelling)")
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="GPU: fraction (0-1] of the GPU's total memory for weights, activations and KV cache; the KV "
        "pool gets what a profiling forward at the largest batch leaves (as in vLLM; default 0.9)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model's norms, projections and MLPs (needs a C++ compiler on a CPU; the "
        "first requests wait for compilation; off by default)",
    )
    p.add_argument("--kv-lease-timeout", type=float, default=30.0, help="decode: seconds to wait for KV")
    p.add_argument("--max-queue", type=int, default=256, help="requests queued before answering 429")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens accepted")
    p.add_argument("--served-model-name", default=None, help="model name in /v1/models (default: folder)")
    p.add_argument(
        "--stream-window",
        type=int,
        default=0,
        help="flow control: a stream with this many engine outputs not yet sent pauses (keeps its KV) "
        "until it is down to half of them, so a stalled or gone client costs a few tokens, not the "
        f"whole answer (default 0: off; {SUGGESTED_STREAM_WINDOW} suits the small send buffers it brings, "
        "see inference/server/flow.py)",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="lower this worker's CPU priority by N (0-19; Linux nice, and its session's autogroup when it "
        "leads one, as agent-launched workers do), so that a router, agent and admin sharing the host's "
        "CPUs stay responsive: on a 2-core host it cut a hang-up's waste from ~20 to 7 tokens (default 0)",
    )
    p.add_argument(
        "--speculative",
        choices=["ngram"],
        default=None,
        help="speculative decoding without a draft model: ngram proposes the tokens that followed the latest "
        "match of the last 2-4 tokens in the request's own prompt and output, verified in the decode step's "
        "forward (greedy output identical, sampled output distributed as without it; a request whose "
        "proposals are mostly rejected stops proposing). Pays on answers that repeat their prompt (editing, "
        "summarising, code); default off",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        help=f"with --speculative: at most this many tokens proposed per request and step, 1-{MAX_SPECULATIVE_TOKENS} "
        f"(default {DEFAULT_SPECULATIVE_TOKENS})",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse and validate flags; problems exit with a message naming the flag (argparse's exit 2)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    model_path = Path(ns.model_path)
    if not (model_path / "config.json").is_file():
        parser.error(
            f"--model-path {model_path}: no config.json there "
            "(prepare one with `python manage.py prepare_model`)"
        )
    for flag, value, minimum in [
        ("--port", ns.port, 1),
        ("--batch-size", ns.batch_size, 1),
        ("--max-num-batched-tokens", ns.max_num_batched_tokens, 1),
        ("--block-size", ns.block_size, 1),
        ("--max-queue", ns.max_queue, 1),
        ("--max-tokens-limit", ns.max_tokens_limit, 1),
        ("--context-length", ns.context_length, 1),
        ("--max-sequence-length", ns.max_sequence_length, 2),
        ("--num-kv-blocks", ns.num_kv_blocks, 2),
        ("--kv-cache-memory-mb", ns.kv_cache_memory_mb, 1),
        ("--num-threads", ns.num_threads, 1),
        ("--base-cpu-id", ns.base_cpu_id, 0),
        ("--kv-port", ns.kv_port, 0),
    ]:
        if value is not None and value < minimum:
            parser.error(f"{flag} must be >= {minimum}, got {value}")
    if ns.port > 65535 or ns.kv_port > 65535:
        parser.error("--port and --kv-port must be <= 65535")
    if ns.kv_cache_memory is not None and ns.kv_cache_memory_mb is not None:
        parser.error("give --kv-cache-memory or --kv-cache-memory-mb, not both")
    if not 0.0 < ns.gpu_memory_utilization <= 1.0:
        parser.error(f"--gpu-memory-utilization must be in (0, 1], got {ns.gpu_memory_utilization}")
    if ns.kv_lease_timeout <= 0:
        parser.error("--kv-lease-timeout must be > 0")
    if ns.stream_window < 0 or ns.stream_window == 1:
        parser.error(f"--stream-window must be 0 (off) or >= 2, got {ns.stream_window}")
    if ns.num_speculative_tokens is not None:
        if ns.speculative is None:
            parser.error("--num-speculative-tokens needs --speculative ngram")
        if not 1 <= ns.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            parser.error(
                f"--num-speculative-tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                f"got {ns.num_speculative_tokens}"
            )
    try:
        parse_step_target(ns.mixed_step_target)
    except ValueError as exc:
        parser.error(str(exc))
    if not 0 <= ns.nice <= 19:
        parser.error(f"--nice must be between 0 and 19, got {ns.nice}")
    if ns.base_cpu_id is not None:
        cpus = os.cpu_count() or 1
        if ns.base_cpu_id >= cpus:
            parser.error(f"--base-cpu-id {ns.base_cpu_id}: this host has CPUs 0..{cpus - 1}")
    if (
        ns.context_length is not None
        and ns.max_sequence_length is not None
        and ns.max_sequence_length < 2
    ):
        parser.error("--max-sequence-length must be >= 2")
    transport = ns.kv_transport
    if transport == "auto":
        transport = "rdma" if ns.rdma_device else "tcp"
    if transport == "rdma" and not ns.rdma_device:
        parser.error("--kv-transport rdma needs --rdma-device (e.g. mlx5_roce0; list them with ibv_devices)")
    shared_secret = os.environ.get("PLATFORM_SHARED_SECRET", "")
    if _production() and not shared_secret:
        # Without the secret anyone who reaches the worker could run prompts on it and write into
        # its KV cache; production must not start that way (docs/security.md).
        parser.error(
            "PLATFORM_PRODUCTION=1 but PLATFORM_SHARED_SECRET is not set: a production worker accepts "
            "internal calls and KV transfers only from holders of the platform's shared secret; "
            "set the same PLATFORM_SHARED_SECRET on the router and every worker"
        )
    return ServerArgs(
        model_path=model_path,
        service_type=ns.service_type,
        host=ns.host,
        port=ns.port,
        rdma_device=ns.rdma_device,
        kv_transport=transport,
        kv_port=ns.kv_port,
        kv_advertise_host=ns.kv_advertise_host,
        context_length=ns.context_length,
        batch_size=ns.batch_size,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        dtype=ns.dtype,
        prefix_caching=not ns.no_prefix_caching,
        chunked_prefill=not ns.no_chunked_prefill,
        mixed_prefill=ns.mixed_prefill,
        mixed_step_target=ns.mixed_step_target,
        base_cpu_id=ns.base_cpu_id,
        num_threads=ns.num_threads,
        max_sequence_length=ns.max_sequence_length,
        block_size=ns.block_size,
        num_kv_blocks=ns.num_kv_blocks,
        kv_cache_memory_mb=ns.kv_cache_memory_mb,
        kv_cache_memory=ns.kv_cache_memory,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        compile=ns.compile,
        kv_lease_timeout=ns.kv_lease_timeout,
        max_queue=ns.max_queue,
        max_tokens_limit=ns.max_tokens_limit,
        served_model_name=ns.served_model_name,
        shared_secret=shared_secret,
        log_level=ns.log_level,
        stream_window=ns.stream_window,
        nice=ns.nice,
        speculative=ns.speculative,
        num_speculative_tokens=ns.num_speculative_tokens,
    )
