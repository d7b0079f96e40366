"""Peer load generators: aiperf and guidellm against our router, beside our own load_test.

The same load for every client: ``/v1/completions`` streaming on the router, ``concurrency``
closed-loop clients, ``requests`` requests, prompts of about ``prompt_tokens`` tokens and
``output_tokens`` output tokens, greedy. Our ``load_test`` (``inference.tools.load_test.run_load``) runs
first, then each peer tool found in the separate venv ``bench/.venv-clients`` (``pip install aiperf
guidellm`` there; never in the project's venv). Peers run offline: ``HF_HUB_OFFLINE=1`` and the
local model folder as their tokenizer. A peer that is missing or fails is reported with the reason.

Differences that remain: load_test cannot send ``ignore_eos`` (a request may stop early at EOS,
which changes its token count but not TTFT/ITL); aiperf and guidellm build their own synthetic
prompts from the tokenizer, so prompt text differs while its length matches.

    .venv/bin/python -m bench.peer_clients            # SmolLM2, a few minutes
    .venv/bin/python -m bench.peer_clients --quick    # tiny model, seconds per client
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    ROOT,
    Platform,
    add_attach_args,
    base_parser,
    fmt,
    log,
    markdown_table,
    new_figure,
    note_shared_machine,
    parse_args,
    platform_processes,
    print_header,
    ratio,
    save_figure,
    smollm2_dir,
    text_of_tokens,
    tiny_model_dir,
    write_result,
)

MODULE = "bench.peer_clients"
CLIENTS_VENV = ROOT / "bench" / ".venv-clients"
PEERS = ("aiperf", "guidellm")


def run_load_test(plat: Platform, model_name: str, prompts: list[str], concurrency: int, requests: int,
                  output_tokens: int) -> dict[str, Any]:
    """Our own load generator on the same load; its `summarize` dict (ms percentiles)."""
    from inference.tools.load_test import LoadTestConfig, run_load, summarize

    config = LoadTestConfig(
        endpoint=plat.router_url + "/v1/completions", concurrency=concurrency, duration_s=600.0,
        max_requests=requests, max_tokens=output_tokens, prompts=prompts, model=model_name, temperature=0.0,
        timeout_s=300.0, progress=False,
    )
    started = time.perf_counter()
    records = asyncio.run(run_load(config))
    return summarize(records, time.perf_counter() - started)


def _peer_env(offline: bool) -> dict[str, str]:
    """Environment of a peer tool: no telemetry, no proxy for loopback, optionally HF offline mode."""
    env = {**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
           "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(key, None)
    if offline:
        env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return env


def _run_tool(cmd: list[str], timeout: float, workdir: Path, *, offline: bool) -> tuple[int, str]:
    """Run a peer tool; returns (exit status, tail of its combined output). 124 on timeout."""
    log("$ " + " ".join(cmd))
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=_peer_env(offline), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return 124, out[-3000:]
    return proc.returncode, (proc.stdout + proc.stderr)[-3000:]


def _not_ran(reason: str, command: list[str] | None = None) -> dict[str, Any]:
    return {"ran": False, "reason": reason, "command": " ".join(command) if command else None}


def run_aiperf(plat: Platform, model_name: str, model_dir: Path, load: dict[str, int], workdir: Path,
               timeout: float) -> dict[str, Any]:
    """aiperf profile on the router's /v1/completions; its JSON export parsed into our fields."""
    exe = CLIENTS_VENV / "bin" / "aiperf"
    if not exe.exists():
        return _not_ran(f"{exe.relative_to(ROOT)} not installed (python -m venv bench/.venv-clients && "
                        "bench/.venv-clients/bin/pip install aiperf)")
    out_dir = workdir / "aiperf"
    cmd = [
        str(exe), "profile", "--model", model_name, "--url", plat.router_url, "--endpoint-type", "completions",
        "--streaming", "--tokenizer", str(model_dir),
        "--isl", str(load["prompt_tokens"]), "--isl-stddev", "0",
        "--osl", str(load["output_tokens"]), "--osl-stddev", "0",
        "--concurrency", str(load["concurrency"]), "--request-count", str(load["requests"]),
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        # Count output tokens from the server's usage, not by re-tokenizing the text (a detokenized
        # stream does not always re-tokenize to the same count).
        "--use-server-token-count",
        "--artifact-dir", str(out_dir), "--ui-type", "none", "--random-seed", "1",
    ]
    # Not HF_HUB_OFFLINE: in offline mode aiperf 0.13 resolves --tokenizer only as a name in the hub
    # cache (snapshot_download(local_files_only=True)) and rejects a local folder with HFValidationError;
    # without it, an absolute folder path is loaded straight from disk (no network call; none exists here).
    rc, tail = _run_tool(cmd, timeout, workdir, offline=False)
    exports = sorted(out_dir.rglob("profile_export_aiperf.json")) if out_dir.exists() else []
    if rc != 0 or not exports:
        return _not_ran(f"aiperf exited {rc}: {tail}", cmd)
    data = json.loads(exports[0].read_text())
    return {"ran": True, "command": " ".join(cmd), **_aiperf_metrics(data), "export": exports[0].name}


def _aiperf_metrics(data: dict[str, Any]) -> dict[str, Any]:
    """Our fields from aiperf's profile export (metrics keyed by tag, each with unit and percentiles)."""
    metrics = data.get("records", data)

    def get(tag: str, stat: str) -> float | None:
        m = metrics.get(tag)
        if not isinstance(m, dict):
            return None
        value = m.get(stat)
        if value is None:
            return None
        unit = str(m.get("unit", "ms"))
        return float(value) / 1e6 if unit == "ns" else float(value)

    return {
        "ttft_ms_p50": get("time_to_first_token", "p50"), "ttft_ms_p99": get("time_to_first_token", "p99"),
        "itl_ms_p50": get("inter_token_latency", "p50"), "itl_ms_p99": get("inter_token_latency", "p99"),
        "e2e_ms_p50": get("request_latency", "p50"),
        "output_tokens_per_s": get("output_token_throughput", "avg"),
        "requests_per_s": get("request_throughput", "avg"),
        "requests": get("request_count", "avg"),
    }


def run_guidellm(plat: Platform, model_name: str, model_dir: Path, load: dict[str, int], workdir: Path,
                 timeout: float) -> dict[str, Any]:
    """guidellm benchmark (concurrent profile) on the router; its JSON report parsed into our fields."""
    exe = CLIENTS_VENV / "bin" / "guidellm"
    if not exe.exists():
        return _not_ran(f"{exe.relative_to(ROOT)} not installed (python -m venv bench/.venv-clients && "
                        "bench/.venv-clients/bin/pip install guidellm)")
    out = workdir / "guidellm.json"
    # guidellm 0.8 takes its configuration as typed objects; a scenario file is the plain way to pass
    # them. backend.model is the local folder, which is also where its tokenizer is loaded from.
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": plat.router_url, "model": str(model_dir),
                    "request_format": "/v1/completions", "stream": True, "timeout": 300},
        "profile": {"kind": "concurrent", "streams": [load["concurrency"]]},
        "constraints": [{"kind": "max_requests", "count": load["requests"]}],
        "data": [{"kind": "synthetic_text", "prompt_tokens": load["prompt_tokens"],
                  "output_tokens": load["output_tokens"]}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }}
    scenario_path = workdir / "guidellm_scenario.json"
    scenario_path.write_text(json.dumps(scenario, indent=2))
    cmd = [str(exe), "run", "--scenario", str(scenario_path), "--disable-progress"]
    rc, tail = _run_tool(cmd, timeout, workdir, offline=True)
    if rc != 0 or not out.exists():
        return _not_ran(f"guidellm exited {rc}: {tail}", cmd)
    return {"ran": True, "command": " ".join(cmd), "scenario": scenario["spec"],
            **_guidellm_metrics(json.loads(out.read_text()))}


def _guidellm_metrics(report: dict[str, Any]) -> dict[str, Any]:
    """Our fields from guidellm's report (first benchmark; its metrics hold distributions per status)."""
    bench = (report.get("benchmarks") or [{}])[0]
    metrics = bench.get("metrics", {})

    def get(name: str, stat: str, scale: float = 1.0) -> float | None:
        dist = (metrics.get(name) or {}).get("successful") or {}
        if stat in ("p50", "p99"):
            value = (dist.get("percentiles") or {}).get(stat)
        else:
            value = dist.get(stat)
        return None if value is None else float(value) * scale

    return {
        "ttft_ms_p50": get("time_to_first_token_ms", "p50"), "ttft_ms_p99": get("time_to_first_token_ms", "p99"),
        "itl_ms_p50": get("inter_token_latency_ms", "p50"), "itl_ms_p99": get("inter_token_latency_ms", "p99"),
        "e2e_ms_p50": get("request_latency", "p50", 1000.0),
        "output_tokens_per_s": get("output_tokens_per_second", "mean"),
        "requests_per_s": get("requests_per_second", "mean"),
        "requests": (metrics.get("request_totals") or {}).get("successful"),
    }


def _tables(result: dict[str, Any]) -> str:
    lt = result["load_test"]
    base = {"ttft_ms_p50": lt["ttft_ms"]["p50"], "itl_ms_p50": lt["itl_ms"]["p50"],
            "output_tokens_per_s": lt["output_tokens_per_s"]}
    rows = [["load_test (ours)", lt["ok"], fmt(lt["ttft_ms"]["p50"], 1), fmt(lt["ttft_ms"]["p99"], 1),
             fmt(lt["itl_ms"]["p50"], 2), fmt(lt["itl_ms"]["p99"], 2), fmt(lt["output_tokens_per_s"], 1),
             fmt(lt["requests_per_s"]), "1.00 / 1.00 / 1.00", "ran"]]
    for tool in PEERS:
        e = result["peers"][tool]
        if not e["ran"]:
            rows.append([tool, "-", "-", "-", "-", "-", "-", "-", "-", "did not run (see below)"])
            continue
        rel = " / ".join(fmt(ratio(e[k], base[k])) for k in ("ttft_ms_p50", "itl_ms_p50", "output_tokens_per_s"))
        rows.append([tool, fmt(e["requests"], 0), fmt(e["ttft_ms_p50"], 1), fmt(e["ttft_ms_p99"], 1),
                     fmt(e["itl_ms_p50"], 2), fmt(e["itl_ms_p99"], 2), fmt(e["output_tokens_per_s"], 1),
                     fmt(e["requests_per_s"]), rel, "ran"])
    table = markdown_table(["client", "requests", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
                            "output tok/s", "req/s", "TTFT / ITL / tok/s × load_test", "status"], rows)
    peers = result["peers"]
    notes = [f"- {tool}: {peers[tool]['reason'][:1500]}" for tool in PEERS if not peers[tool]["ran"]]
    return table + ("\n\n" + "\n".join(notes) if notes else "")


def _plot(result: dict[str, Any], img_dir: Path, name: str) -> Path:
    fig, axes = new_figure(12, 4, ncols=3)
    lt = result["load_test"]
    clients = {"load_test": {"ttft_ms_p50": lt["ttft_ms"]["p50"], "itl_ms_p50": lt["itl_ms"]["p50"],
                             "output_tokens_per_s": lt["output_tokens_per_s"]}}
    clients |= {t: e for t, e in result["peers"].items() if e["ran"]}
    for ax, (key, title) in zip(axes, (("ttft_ms_p50", "TTFT p50 (ms)"), ("itl_ms_p50", "ITL p50 (ms)"),
                                       ("output_tokens_per_s", "output tokens/s")), strict=True):
        ax.bar(list(clients), [c.get(key) or 0 for c in clients.values()], color=["tab:blue", "tab:orange",
                                                                               "tab:green"][: len(clients)])
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle("same load, measured by three clients")
    return save_figure(fig, img_dir, name)


def main(argv: list[str] | None = None) -> int:
    """Run load_test and each peer on the same load, print the table, write JSON and the plot."""
    p = base_parser(__doc__.splitlines()[0])
    add_attach_args(p)
    p.add_argument("--peer-timeout-s", type=float, default=None, help="bound on each peer run (default 600, quick 180)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.quick:
        model = args.model_dir or tiny_model_dir()
        load = {"concurrency": 2, "requests": 6, "prompt_tokens": 16, "output_tokens": 8}
        timeout = args.peer_timeout_s or 180.0
    else:
        model = args.model_dir or smollm2_dir() or tiny_model_dir()
        load = {"concurrency": 4, "requests": 48, "prompt_tokens": 64, "output_tokens": 32}
        timeout = args.peer_timeout_s or 600.0
    model = model.resolve()  # the peers run in their own working directory
    from inference.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.maybe_from_pretrained(str(model))
    if tokenizer is None:
        raise SystemExit(f"{model} has no tokenizer: the peers need one")
    prompts = [text_of_tokens(tokenizer, load["prompt_tokens"], seed=i) for i in range(8)]
    result: dict[str, Any] = {"note": note_shared_machine(), "model": model.name, "load": load,
                              "endpoint": "/v1/completions (stream)"}
    workdir = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    try:
        with platform_processes(model, args.log_dir, prefill_extra=["--base-cpu-id", "0"],
                                decode_extra=["--base-cpu-id", str(1 % (os.cpu_count() or 1))], attach=args) as plat:
            import httpx

            model_name = httpx.get(plat.router_url + "/v1/models", timeout=30).json()["data"][0]["id"]
            result["served_model"] = model_name
            # Warm-up so the first client does not pay first-call costs the others do not.
            run_load_test(plat, model_name, prompts[:1], 1, 2, 2)
            lt = run_load_test(plat, model_name, prompts, load["concurrency"], load["requests"], load["output_tokens"])
            result["load_test"] = lt
            log(f"load_test: TTFT p50 {fmt(lt['ttft_ms']['p50'])} ms, ITL p50 {fmt(lt['itl_ms']['p50'])} ms")
            result["peers"] = {
                "aiperf": run_aiperf(plat, model_name, model, load, workdir, timeout),
                "guidellm": run_guidellm(plat, model_name, model, load, workdir, timeout),
            }
            for tool, e in result["peers"].items():
                log(f"{tool}: " + ("ran" if e["ran"] else f"did not run: {e['reason'][:300]}"))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    name = "peer_clients_quick" if args.quick else "peer_clients"
    print_header("peer load generators")
    print(_tables(result))
    plot = _plot(result, args.img_dir, name)
    path = write_result(args.out_dir, name, MODULE, argv, result | {"plot": str(plot)})
    print(f"\nresult: {path}\nplot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
