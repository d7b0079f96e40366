"""Every benchmark runs in its --quick mode and writes a well-formed result (timings are not checked:
performance is only measured by `make bench`, as ratios within one run)."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench import (
    cpu_limits,
    disagg_itl,
    engine_throughput,
    engine_vs_vllm,
    kv_transfer,
    peer_clients,
    router_overhead,
    run_all,
    serve_vs_vllm,
)
from bench.common import Platform, platform_processes


@pytest.fixture(scope="module")
def plat(tiny_model_dir: Path, log_dir: Path) -> Iterator[Platform]:
    """One router + prefill + decode on the tiny model, shared by the process-based benchmarks."""
    with platform_processes(tiny_model_dir, log_dir, prefill_extra=["--base-cpu-id", "0"],
                            decode_extra=["--base-cpu-id", "1"]) as platform:
        yield platform


def _attach(p: Platform) -> list[str]:
    return ["--router-url", p.router_url, "--prefill-url", p.prefill_url, "--decode-url", p.decode_url,
            "--router-pid", str(p.router_pid)]


def _run(module: Any, name: str, tmp_path: Path, *extra: str) -> dict[str, Any]:
    assert module.main(["--quick", "--out-dir", str(tmp_path), "--img-dir", str(tmp_path), *extra]) == 0
    result = json.loads((tmp_path / f"{name}_quick.json").read_text())
    assert result["benchmark"] == f"{name}_quick"
    assert result["command"].startswith(".venv/bin/python -m bench.")
    assert result["machine"]["cpus"] >= 1
    png = Path(result["plot"])
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return result


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_engine_throughput_quick(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = _run(engine_throughput, "engine_throughput", tmp_path, "--model-dir", str(tiny_model_dir))
    # One entry per measured dtype (default: float32 and auto, which may resolve to float32 too).
    assert len(result["models"]) == 2 and result["models"][0]["dtype"] == "float32"
    for model in result["models"]:
        assert [r["concurrency"] for r in model["engine"]] == [1, 4]
        assert all(r["output_tokens"] == r["requests"] * model["max_tokens"] for r in model["engine"])
        assert all(_positive(r["ratio_vs_hf_sequential"]) for r in model["engine"])
        assert all(_positive(s["step_over_forward"]) and _positive(s["hf_forward_ms"])
                   for s in model["step_vs_forward"])
    assert result["vllm"] == {"attempted": False}


def test_serve_vs_vllm_quick(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Our path is measured through the router in each layout asked for, with the workers' step timings;
    a missing vLLM venv is reported, not a crash."""
    argv = ["--quick", "--out-dir", str(tmp_path), "--model-dir", str(tiny_model_dir),
            "--vllm-venv", str(tmp_path / "no-venv"), "--layout", "both-per-cpu,decode-per-cpu,both-mixed,both-cost",
            "--prefix-len", "32", "--step-log", str(tmp_path / "steps")]
    assert serve_vs_vllm.main(argv) == 0
    result = json.loads((tmp_path / "serve_vs_vllm_quick.json").read_text())
    assert result["layouts"] == ["both-per-cpu", "decode-per-cpu", "both-mixed", "both-cost"]
    assert result["prefix_len"] == 32 and result["router_policy"] == "least-connections"
    assert result["step_target"] == "auto"
    for layout, ours in result["rounds"][0]["ours"].items():
        assert [r["concurrency"] for r in ours] == [1, 4], layout
        assert all(r["errors"] == 0 and _positive(r["output_tok_s"]) and _positive(r["ttft_p99_ms"])
                   and _positive(r["itl_p99_ms"]) for r in ours), layout
        assert all(r["output_tokens"] == r["requests"] * result["output_len"] for r in ours)
        # Every request's prefill and its 15 decode steps were logged by the workers.
        assert all(r["steps"]["prefill_steps"] >= 1 and r["steps"]["decode_steps"] >= 15 for r in ours), layout
    # The colocated workers interleave: never two prefill steps back to back while streams decode.
    assert all(r["steps"]["longest_prefill_run"] <= 1 for r in result["rounds"][0]["ours"]["both-per-cpu"])
    assert result["rounds"][0]["vllm"]["available"] is False and "setup_venvs" in result["rounds"][0]["vllm"]["reason"]


def test_kv_transfer_quick(tmp_path: Path, tiny_model_dir: Path, plat: Platform) -> None:
    result = _run(kv_transfer, "kv_transfer", tmp_path, "--model-dir", str(tiny_model_dir), *_attach(plat))
    assert [r["size_mib"] for r in result["bandwidth"]] == [1, 4]
    assert all(_positive(r["tcp_gib_s"]) and _positive(r["memcpy_gib_s"]) for r in result["bandwidth"])
    rows = result["ttft"]["rows"]
    assert [r["prompt_tokens"] for r in rows] == [32, 64]
    assert all(r["kv_bytes"] > 0 and 0 < r["transfer_share_of_ttft"] < 1 for r in rows)


def test_disagg_itl_quick(tmp_path: Path, tiny_model_dir: Path, plat: Platform) -> None:
    result = _run(disagg_itl, "disagg_itl", tmp_path, "--model-dir", str(tiny_model_dir), "--duration-s", "3",
                  *_attach(plat))
    configs = {c["config"]: c for c in result["configs"]}
    assert set(configs) == {"colocated-1core", "disaggregated"}
    for c in configs.values():
        assert c["errors"] == 0 and c["short"]["count"] >= 1 and c["long"]["count"] >= 1
        assert _positive(c["short"]["itl_ms"]["p99"]) and 0 <= c["slo_met"] <= c["requests"]


def test_router_overhead_quick(tmp_path: Path, tiny_model_dir: Path, plat: Platform) -> None:
    result = _run(router_overhead, "router_overhead", tmp_path, "--model-dir", str(tiny_model_dir), *_attach(plat))
    (lat,) = result["latency"]
    for path in ("router", "direct"):
        assert lat[path]["requests"] == 6 and _positive(lat[path]["p50_ms"])
    assert lat["router"]["cpu_ms_per_request"]["router"] >= 0
    assert {(t["path"], t["concurrency"]) for t in result["throughput"]} == {("router", 2), ("direct", 2)}
    assert all(t["errors"] == 0 and t["requests"] > 0 for t in result["throughput"])


def test_peer_clients_quick(tmp_path: Path, tiny_model_dir: Path, plat: Platform) -> None:
    result = _run(peer_clients, "peer_clients", tmp_path, "--model-dir", str(tiny_model_dir), *_attach(plat))
    load = result["load_test"]
    assert load["ok"] == load["requests"] > 0 and _positive(load["ttft_ms"]["p50"])
    for tool in ("aiperf", "guidellm"):
        entry = result["peers"][tool]
        # Either it ran and reported numbers, or the result says why not.
        assert entry["ran"] is True and _positive(entry["ttft_ms_p50"]) or entry["ran"] is False and entry["reason"]


def test_run_all_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run_all.main(["--only", "no_such_benchmark"])
    assert "unknown benchmark" in capsys.readouterr().err
    assert run_all.build_command("kv_transfer", True, Path("o"), Path("i"), [])[-1] == "--quick"


def test_relay_floor_quick(tmp_path: Path) -> None:
    from bench import relay_floor

    assert relay_floor.main(["--quick", "--out-dir", str(tmp_path), "--gap-ms", "1"]) == 0
    result = json.loads((tmp_path / "relay_floor_quick.json").read_text())
    assert result["command"].startswith(".venv/bin/python -m bench.relay_floor")
    (entry,) = result["results"]
    # Not a timing check: CPU time comes in 10 ms ticks, so a --quick difference may read 0 or a hair below.
    assert entry["gap_ms"] == 1.0 and math.isfinite(entry["median_us_per_token"])


def test_stream_drill_quick(tmp_path: Path) -> None:
    """Its own processes: the kill drill loses nothing; the hang-up drill reports every field."""
    from bench import stream_drill

    cpus = os.sched_getaffinity(0)
    split = ["--split-cpus"] if len(cpus) >= 2 else []
    assert stream_drill.main(["--quick", *split, "--out-dir", str(tmp_path), "--log-dir", str(tmp_path / "logs")]) == 0
    assert os.sched_getaffinity(0) == cpus  # --split-cpus pinned this process for the drill only
    result = json.loads((tmp_path / "stream_drill_quick.json").read_text())
    assert result["split_cpus"] is bool(split)
    kill, hangup = result["kill"], result["hangup"]
    assert kill["lost"] == 0 and kill["completed"] == kill["streams"] == 12
    assert kill["equal_to_unbroken"] == 12
    assert hangup["hangups"] == 20
    assert 0 <= hangup["delivered_before_hang_up"] <= hangup["ran_to_completion"] <= 20
    assert hangup["ran_on_after_hang_up"] == hangup["ran_to_completion"] - hangup["delivered_before_hang_up"]
    assert 0 < hangup["tokens_generated"] <= 20 * 200


def test_serve_vs_vllm_counts_a_connection_failure_as_a_failed_request() -> None:
    """A request whose connection fails is one error in the results, not the end of the run."""
    import asyncio

    import aiohttp

    from tests.support.processes import free_port

    port = free_port()  # nothing listens on it

    async def one() -> dict[str, Any]:
        async with aiohttp.ClientSession() as session:
            return await serve_vs_vllm._one(session, f"http://127.0.0.1:{port}", "m", [1, 2, 3], 4)

    result = asyncio.run(one())
    assert result["ok"] is False and "ClientConnectorError" in result["error"]


def test_request_gflop_counts_projections_head_and_attention(tiny_model_dir: Path) -> None:
    """A request's FLOP: every fed token through the projections, the LM head once per output token,
    and causal attention over the positions each fed token sees (checked by hand on the tiny model)."""
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    weights = cpu_limits.weight_elements(tiny_model_dir)
    # 3 prompt tokens, 2 output tokens: 4 tokens are fed (the last output token never is), attending
    # to 1 + 2 + 3 + 4 = 10 positions in all; the LM head runs for the 2 output tokens.
    expected = 2 * weights["linear"] * 4 + 2 * weights["lm_head"] * 2 + 4 * layers * heads * head_dim * 10
    assert math.isclose(cpu_limits.request_gflop(tiny_model_dir, 3, 2), expected / 1e9, rel_tol=1e-12)
    assert cpu_limits.request_gflop(tiny_model_dir, 32, 32) > cpu_limits.request_gflop(tiny_model_dir, 32, 8)


def test_engine_vs_vllm_compute_shares(tiny_model_dir: Path) -> None:
    """The ceiling is the peak over vLLM's GFLOP/s in the same round: a round where vLLM reached half
    the peak leaves any engine at most a 2x lead, and 1.5x then needs 75 % of the peak."""
    per_request = cpu_limits.request_gflop(tiny_model_dir, 32, 8)
    tps_at_half_peak = 0.5 * 100.0 / per_request * 8  # vLLM's tok/s at 50 GFLOP/s against a 100 peak
    result: dict[str, Any] = {"prompt_tokens": 32, "max_tokens": 8, "rows": [
        {"concurrency": 8, "ours_tokens_per_s": [tps_at_half_peak * 1.2], "vllm_tokens_per_s": [tps_at_half_peak]}]}
    engine_vs_vllm.add_compute_shares(result, tiny_model_dir, 100.0)
    row = result["rows"][0]
    assert math.isclose(row["vllm_peak_share"][0], 0.5) and math.isclose(row["ours_peak_share"][0], 0.6)
    assert math.isclose(row["ceiling_ratio"][0], 2.0) and math.isclose(row["target_needs_peak_share"][0], 0.75)


def test_cpu_limits_quick(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The roofline probe counts exactly the weights a Llama decode step reads, and its shares follow from
    the measured tok/s, bandwidth and peak."""
    assert cpu_limits.main(["--quick", "--out-dir", str(tmp_path), "--model-dir", str(tiny_model_dir)]) == 0
    result = json.loads((tmp_path / "cpu_limits_quick.json").read_text())
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (h // cfg["num_attention_heads"])
    assert result["weights"]["linear"] == layers * (2 * h * h + 2 * h * kv + 3 * h * inter)
    assert result["weights"]["lm_head"] == cfg["vocab_size"] * h
    assert _positive(result["read_bandwidth"]["gb_per_s"]) and _positive(result["gemm_peak"]["gflops"])
    # The peak is the fastest GEMM probed: torch.mm and, where oneDNN packs this dtype, the engine's linear.
    peak = result["gemm_peak"]
    assert "torch.mm" in peak["gflops_per_kernel"] and peak["gflops"] == max(peak["gflops_per_kernel"].values())
    assert peak["gflops_per_kernel"][peak["kernel"]] == peak["gflops"]
    assert [r["batch"] for r in result["decode"]] == [1, 4]
    bytes_per_weight = 4 if result["dtype"] == "float32" else 2
    for row in result["decode"]:
        assert row["output_tokens"] == row["requests"] * 8
        elements = result["weights"]["linear"] + result["weights"]["lm_head"]
        expected_gbs = elements * bytes_per_weight * row["tokens_per_s"] / row["batch"] / 1e9
        assert math.isclose(row["weight_gb_per_s"], expected_gbs, rel_tol=1e-9)
        assert math.isclose(row["bandwidth_share"], expected_gbs / result["read_bandwidth"]["gb_per_s"], rel_tol=1e-9)
        assert math.isclose(row["compute_share"], 2 * elements * row["tokens_per_s"] / 1e9
                            / result["gemm_peak"]["gflops"], rel_tol=1e-9)
        # The steady decode step: its shares follow from the step time alone (batch tokens per step).
        steady_gbs = elements * bytes_per_weight * 1e3 / row["steady_step_ms"] / 1e9
        assert _positive(row["steady_step_ms"])
        assert math.isclose(row["steady"]["weight_gb_per_s"], steady_gbs, rel_tol=1e-9)
        assert math.isclose(row["steady"]["bandwidth_share"], steady_gbs / result["read_bandwidth"]["gb_per_s"],
                            rel_tol=1e-9)


def test_paged_attention_quick(tmp_path: Path) -> None:
    """The kernel against itself (`--base self`: building a revision's copy takes ~30 s, which the real
    runs pay): a well-formed result whose two sides agree."""
    from bench import paged_attention

    assert paged_attention.main(["--quick", "--base", "self", "--out-dir", str(tmp_path), "--shapes", "smollm2",
                                 "--dtypes", "float32"]) == 0
    data = json.loads((tmp_path / "paged_attention.json").read_text())
    assert data["command"].startswith(".venv/bin/python -m bench.paged_attention")
    point = data["points"][0]
    assert point["shape"] == "smollm2" and point["dtype"] == "float32" and point["ours_us"] > 0
    assert point["max_abs_diff"] == 0.0 and point["base_us"] > 0
