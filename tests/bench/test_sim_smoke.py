"""The simulated worker fleet (bench/sim) behind the real router: generations go through, the answers
have the real workers' shapes, the benchmark's --quick mode writes a well-formed result, and every
process started is gone afterwards."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from bench.sim import router_scale
from bench.sim.config import SimConfig
from bench.sim.launch import sim_platform
from tests.support.processes import start_worker

# Fast simulated workers: a stream of 40 tokens takes 0.1 s.
FAST = SimConfig(decode_tokens_per_s=400.0)


def _tree(pid: int) -> list[int]:
    """`pid` and its live descendants (gunicorn's worker under the router's master)."""
    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _sse_events(text: str) -> list[Any]:
    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def test_generation_through_the_real_router(log_dir: Path) -> None:
    """Two fleet processes (so the prefill → decode "KV" crosses processes too) and the router."""
    started: list[int] = []
    with sim_platform(2, 4, log_dir, FAST, shards=2) as plat:
        started += plat.fleet.pids + _tree(plat.router_pid)
        assert len(plat.fleet.decode) == 4 and len(plat.fleet.prefill) == 2
        with httpx.Client(base_url=plat.router_url, timeout=30, trust_env=False) as client:
            seen_decode, seen_prefill = set(), set()
            for i in range(8):  # round-robin: every decode and prefill worker serves
                answer = client.post("/generate", json={"input_ids": [5 + i, 6, 7, 8] * 8, "max_tokens": 6,
                                                        "temperature": 0, "ignore_eos": True})
                assert answer.status_code == 200, answer.text
                body = answer.json()
                assert len(body["tokens"]) == 6 and body["finish_reason"] == "length"
                assert body["usage"] == {"prompt_tokens": 32, "completion_tokens": 6, "total_tokens": 38}
                assert body["kv_bytes"] == 2 * FAST.block_nbytes and body["timings"]["prefill_s"] > 0
                seen_decode.add(body["decode"])
                seen_prefill.add(body["prefill"])
            assert seen_decode == set(plat.fleet.decode) and seen_prefill == set(plat.fleet.prefill)
            # Streamed, longer than the router's credit (16): acknowledgements must keep it going.
            stream = client.post("/generate", json={"prompt": "hello simulated fleet", "max_tokens": 40,
                                                    "stream": True})
            assert stream.status_code == 200
            events = _sse_events(stream.text)
            assert events[-1] == "[DONE]"
            tokens = [t for e in events[:-1] if isinstance(e, dict) for t in e.get("token_ids", [])]
            assert len(tokens) == 40 and events[-2]["usage"]["completion_tokens"] == 40
            # The simulated worker's 400 (unknown sampling field) passes through the router.
            bad = client.post("/generate", json={"input_ids": [1, 2, 3], "max_tokens": 2, "warp": 9})
            assert 400 <= bad.status_code < 500, bad.text
            status = client.get("/health").json()
            assert status["ready"] and status["decode_slots"] == 4 * (FAST.batch_size + FAST.batch_size // 4)
            # A client that hangs up mid-stream (of 10 s): the router aborts, the simulated worker frees
            # its blocks at once.
            with client.stream("POST", "/generate", json={"input_ids": [7] * 16, "max_tokens": 4000,
                                                          "stream": True}) as hung_up:
                assert hung_up.status_code == 200
                next(hung_up.iter_lines())
        deadline = time.monotonic() + 4
        busy = [1]
        while any(busy) and time.monotonic() < deadline:  # bounded
            busy = [httpx.get(url + "/health", timeout=10).json()["kv_usage"] for url in plat.fleet.decode]
            time.sleep(0.2)
        assert not any(busy), busy
        hits = plat.fleet.stats()
        assert hits["decode"] >= 9 and hits["prefill"] >= 9 and hits["health"] >= 6 and hits.get("kv", 0) >= 1
    assert started and all(_gone(pid) for pid in started), [p for p in started if not _gone(p)]


def test_a_kv_aware_router_follows_the_simulated_prefix_caches(log_dir: Path) -> None:
    """The simulated workers serve the real KV event stream over their simulated prefix caches: the
    router's index learns what a request's decode worker now holds, and routes the prompt's follow-ups
    there; a prefill over a held prefix is as fast as its uncached tokens."""
    with sim_platform(1, 3, log_dir, FAST, policy="kv-aware") as plat:
        with httpx.Client(base_url=plat.router_url, timeout=30, trust_env=False) as client:
            prompt = [5 + i % 97 for i in range(20 * FAST.block_size)]
            body = {"input_ids": prompt, "max_tokens": 2, "ignore_eos": True}
            first = client.post("/generate", json=body)
            assert first.status_code == 200, first.text
            holder = first.json()["decode"]
            deadline = time.monotonic() + 10
            held = 0
            while held < 19 and time.monotonic() < deadline:  # bounded: the stream polls every 20 ms
                workers = client.get("/router/status").json()["kv"]["index"]["workers"]
                held = workers.get(holder, {}).get("blocks", 0)
                time.sleep(0.05)
            assert held == 19, held  # every full block of the prompt but the one with its last token
            for i in range(4):
                answer = client.post("/generate", json={**body, "input_ids": prompt + [7, i]})
                assert answer.status_code == 200 and answer.json()["decode"] == holder, answer.text
        assert plat.fleet.stats()["kv_events"] >= 4  # the router subscribed to every worker


def test_shapes_match_a_real_worker(tiny_model_dir: Path, log_dir: Path) -> None:
    """/health and /info carry the real decode worker's keys, /metrics its metric families."""

    def families(text: str) -> set[str]:
        return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}

    proc, url = start_worker("decode", tiny_model_dir, log_dir)
    try:
        real = {path: httpx.get(url + path, timeout=30) for path in ("/health", "/info", "/metrics")}
    finally:
        proc.stop()
    with sim_platform(1, 1, log_dir, FAST) as plat:
        sim_url = plat.fleet.decode[0]
        sim = {path: httpx.get(sim_url + path, timeout=30) for path in ("/health", "/info", "/metrics")}
    assert set(sim["/health"].json()) == set(real["/health"].json())
    assert set(sim["/info"].json()) == set(real["/info"].json())
    assert families(sim["/metrics"].text) == families(real["/metrics"].text)


def test_router_scale_quick(tmp_path: Path, log_dir: Path) -> None:
    argv = ["--quick", "--sizes", "4", "--idle-s", "2.5", "--requests", "6", "--out-dir", str(tmp_path),
            "--log-dir", str(log_dir)]
    assert router_scale.main(argv) == 0
    result = json.loads((tmp_path / "sim_router_scale_quick.json").read_text())
    assert result["benchmark"] == "sim_router_scale_quick"
    assert result["command"].startswith(".venv/bin/python -m bench.sim.router_scale")
    assert result["machine"]["cpu_model"] is not None and len(result["machine"]["load_avg_at_end"]) == 3
    (row,) = result["router"]
    assert row["decode_endpoints"] == 4 and row["prefill_endpoints"] == 1
    assert row["ok"] == 6 and row["errors"] == 0
    assert row["health_checks_per_s"] > 0 and math.isfinite(row["router_cpu_ms_per_request"])
    assert {r["policy"] for r in result["policy_admission"]} == set(router_scale.POLICIES)
    assert all(r["cpu_us_per_request_median"] > 0 for r in result["policy_admission"])
    profile = result["health_profile"]
    assert profile["endpoints"] == 5 and profile["cpu_us_per_check"] > 0
    assert profile["aiohttp_cpu_us_per_check"] > 0
    assert profile["profile_top_own_time"] and result["policy_profile"]["top_own_time"]
    assert row["fleet_idle_cpu_share"] >= 0
    assert result["router_policy"] == "kv-aware" and row["kv_event_subscriptions"] >= 5  # each worker's stream
    (core,) = result["core_request_cost"]
    assert core["decode_endpoints"] == 4 and core["ok"] == 6 and core["cpu_us_per_request"] > 0
    fp = result["fleet_footprint"]
    assert fp["workers"] == 30 and fp["rss_mib"] > 0 and fp["health_bytes"] > 100 and fp["metrics_bytes"] > 1000
    assert set(result["verdict"]) >= {"policy_admission_target_met", "health_target_met"}


@pytest.mark.parametrize("argv", [["--sizes", "0"], ["--idle-s", "0"], ["--requests", "0"]])
def test_router_scale_refuses_bad_flags(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        router_scale.main(["--quick", *argv])
    assert "--" in capsys.readouterr().err


def test_workers_added_stopped_and_faulted_at_run_time(log_dir: Path) -> None:
    """Simulated nodes on their own loopback addresses; the control API starts and stops workers and
    makes one's health fail, which takes it out of the real router's rotation."""
    with sim_platform(2, 2, log_dir, FAST, shards=2, hosts=["127.0.0.2", "127.0.0.3"]) as plat:
        fleet = plat.fleet
        assert {u.split("//")[1].split(":")[0] for u in fleet.decode} == {"127.0.0.2", "127.0.0.3"}
        added = fleet.control(1, "workers", {"role": "decode", "count": 3})["started"]
        assert len(added) == 3 and all(u.startswith("http://127.0.0.3:") for u in added)
        for url in added:
            health = httpx.get(url + "/health", timeout=10).json()
            assert health["status"] == "healthy" and health["role"] == "decode" and health["stream_credit"] is True
        assert fleet.control(1, "workers", {"stop": added[:2]})["stopped"] == added[:2]
        with pytest.raises(httpx.ConnectError):
            httpx.get(added[0] + "/health", timeout=5)
        with pytest.raises(httpx.HTTPStatusError):
            fleet.control(1, "workers", {"role": "router", "count": 1})
        victim = fleet.decode[0]
        shard = 0 if victim.startswith("http://127.0.0.2:") else 1
        fleet.control(shard, "fault", {"url": victim, "fault": "unhealthy"})
        assert httpx.get(victim + "/health", timeout=10).status_code == 503
        deadline = time.monotonic() + 15
        healthy = True
        while healthy and time.monotonic() < deadline:  # the router checks every 2 s
            status = httpx.get(plat.router_url + "/health", timeout=10).json()
            healthy = next(e["healthy"] for e in status["decode"] if e["url"] == victim)
            time.sleep(0.3)
        assert not healthy
        with httpx.Client(base_url=plat.router_url, timeout=30, trust_env=False) as client:
            for _ in range(3):  # every request goes to the other decode worker
                answer = client.post("/generate", json={"input_ids": [9] * 20, "max_tokens": 3})
                assert answer.status_code == 200 and answer.json()["decode"] != victim
