"""The Grafana dashboard (platform/grafana/dashboards/) against what real processes export, and the guide.

Every metric name a panel queries must be exported by the /metrics of a real router or worker
process (tiny model, loopback, after a few requests went through so that labelled series have
samples), with every label the query selects or groups by. Where Prometheus is installed (Debian's
`prometheus` package), a real Prometheus scrapes those processes with platform/prometheus/prometheus.yml
and evaluates every panel's query: valid PromQL, and data for each panel that has something to show.
And every item of the guide's monitoring list (section 九.1, "监控指标建议") has a panel that
queries the metric which measures it.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.processes import Proc, free_port, start_parallel, start_router, start_worker

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "platform" / "grafana" / "dashboards" / "disagg-platform.json"
PROMETHEUS_YML = ROOT / "platform" / "prometheus" / "prometheus.yml"
PROMETHEUS = shutil.which("prometheus")

# The guide's monitoring list, item by item → the panels that show it, and a metric each must query.
GUIDE_ITEMS: dict[str, dict[str, str]] = {
    "prefill: GPU utilisation (GPU利用率)": {"GPU utilisation": "worker_gpu_utilization_ratio"},
    "prefill: GPU memory (显存占用)": {"GPU memory": "worker_gpu_memory_bytes"},
    "prefill: network throughput (网络吞吐量)": {
        "KV transfer bytes/s": "worker_kv_transfer_bytes_total",
        "KV transfer time p90": "worker_kv_transfer_seconds_bucket",
    },
    "decode: CPU utilisation (CPU利用率)": {"CPU utilisation": "worker_cpu_utilization_ratio"},
    "decode: memory (内存占用)": {"Memory (RSS)": "process_resident_memory_bytes"},
    "decode: request queue depth (请求队列深度)": {"Queue depth": "worker_queue_depth"},
    "router: dispatch latency (请求分发延迟)": {"Router dispatch overhead p50 / p99": "router_dispatch_seconds_bucket"},
    "router: error rate (错误率)": {"Error rate": "router_requests_total"},
    "router: balance across workers and nodes (节点负载均衡情况)": {
        "Per-worker share of requests": "router_worker_selections_total",
        "Per-node share of requests": "worker_requests_total",
    },
    "router: its process_* series (memory, CPU, file descriptors)": {
        "Memory (RSS)": "process_resident_memory_bytes",
        "Process CPU (cores)": "process_cpu_seconds_total",
        "Router open file descriptors": "process_open_fds",
    },
}

# Labels Prometheus adds to every series of a target (platform/prometheus: file_sd labels, job,
# instance) and the histogram bucket label.
TARGET_LABELS = {"component", "deployment", "role", "node", "worker", "job", "instance", "le"}
# PromQL words that look like label names in `by (...)` or before `=`.
PROMQL_WORDS = {"by", "ignoring", "group_left", "on", "sum", "max", "min", "avg", "rate", "histogram_quantile"}
# Series a CPU-only worker never exports: only a worker whose PyTorch initialised CUDA has GPU memory.
GPU_ONLY = {"worker_gpu_memory_bytes"}
# Declared (# TYPE) but without samples until their event: a 429 needs a saturated router
# (tests/inference/gateway/test_admission.py provokes and checks it).
EVENT_ONLY = {"router_rejected_total"}
# Panels with nothing to show here: no 429 happened, and a CPU-only machine has no GPU memory.
MAY_BE_EMPTY = {"429 responses per second"} | (set() if torch.cuda.is_available() else {"GPU memory"})
SCRAPE_WAIT_S = 60.0  # for the first rates over two scrapes (1 s apart), on a busy machine
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "summary": ("_count", "_sum")}


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every target of every panel."""
    data = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in data["panels"] for target in panel["targets"]]


def _without_strings(expr: str) -> str:
    """The expression without label values and range selectors, which are not names."""
    return re.sub(r"\[[^\]]*\]", "", re.sub(r'"[^"]*"', '""', expr))


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (every selector carries a `{...}` matcher here)."""
    return set(re.findall(r"\b[a-z_][a-z0-9_]*(?=\s*\{)", _without_strings(expr)))


def label_names(expr: str) -> set[str]:
    """The labels an expression matches on or groups by."""
    stripped = _without_strings(expr)
    used = set(re.findall(r"\b([a-z_][a-z0-9_]*)\s*(?:=~|!~|!=|=)", stripped))
    for group in re.findall(r"\b(?:by|ignoring|on)\s*\(([^)]*)\)", stripped):
        used |= {label.strip() for label in group.split(",") if label.strip()}
    return used - PROMQL_WORDS


def scrape(url: str) -> tuple[set[str], dict[str, set[str]]]:
    """A real /metrics page: the series it declares (with their suffixes), and the label names of the
    series that have samples."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    assert response.status_code == 200, url
    declared: set[str] = set()
    sampled: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(response.text):
        declared |= {family.name, *(family.name + suffix for suffix in _SUFFIXES.get(family.type, ()))}
        for sample in family.samples:
            sampled.setdefault(sample.name, set()).update(sample.labels)
    return declared | set(sampled), sampled


@pytest.fixture(scope="module")
def deployment(tiny_model_dir: Path, log_dir: Path) -> Iterator[dict[str, str]]:
    """Real processes: a prefill worker (on the GPU when this machine has one), a CPU decode worker and
    a router in front of them; a plain and a streamed generation went through. Their URLs by component."""
    procs: list[Proc] = []
    gpu_env = {"CUDA_VISIBLE_DEVICES": "0"} if torch.cuda.is_available() else None
    try:
        workers = start_parallel({
            "prefill": partial(start_worker, "prefill", tiny_model_dir, log_dir, env=gpu_env),
            "decode": partial(start_worker, "decode", tiny_model_dir, log_dir),
        })
        (prefill, prefill_url), (decode, decode_url) = workers["prefill"], workers["decode"]
        procs += [prefill, decode]
        router, router_url = start_router([prefill_url], [decode_url], log_dir)
        procs.append(router)
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{router_url}/generate", json=body, timeout=120).status_code == 200
        with httpx.stream("POST", f"{router_url}/generate", json={**body, "stream": True}, timeout=120) as response:
            assert response.status_code == 200
            assert any(line.startswith("data: [DONE]") for line in response.iter_lines())
        # One client error, so that the error-rate panel has a series.
        assert httpx.post(f"{router_url}/generate", json={**body, "max_tokens": -1}, timeout=60).status_code == 400
        yield {"router": router_url, "prefill": prefill_url, "decode": decode_url}
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_every_dashboard_metric_is_exported_by_a_real_router_or_worker(deployment: dict[str, str]) -> None:
    exported: set[str] = set()
    labels: dict[str, set[str]] = {}
    for url in deployment.values():
        declared, sampled = scrape(url)
        exported |= declared
        for name, names in sampled.items():
            labels.setdefault(name, set()).update(names)
    # The router's own process series (what its memory panel reads), not only the workers'.
    router_declared, _ = scrape(deployment["router"])
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds"} <= router_declared

    queries = dashboard_queries()
    queried = set().union(*(metric_names(expr) for _, expr in queries))
    missing = queried - exported
    assert missing <= (set() if torch.cuda.is_available() else GPU_ONLY), f"not exported: {sorted(missing)}"
    unsampled = queried - set(labels) - missing
    assert unsampled <= EVENT_ONLY, f"declared but never sampled after traffic: {sorted(unsampled)}"

    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: no metric selector in {expr}"
        checkable = names - missing - EVENT_ONLY
        if not checkable:
            continue
        known = TARGET_LABELS | set().union(*(labels[name] for name in checkable))
        unknown = label_names(expr) - known
        assert not unknown, f"{title}: labels {sorted(unknown)} are on none of {sorted(checkable)}: {expr}"


def test_every_item_of_the_guides_monitoring_list_has_a_panel() -> None:
    queries = dashboard_queries()
    by_title: dict[str, set[str]] = {}
    for title, expr in queries:
        by_title.setdefault(title, set()).update(metric_names(expr))
    for item, panels in GUIDE_ITEMS.items():
        for title, metric in panels.items():
            assert title in by_title, f"{item}: no panel {title!r}"
            assert metric in by_title[title], f"{item}: panel {title!r} does not query {metric}"
    # Each panel is one Prometheus panel with a unique id, on the dashboard's datasource variable.
    data = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in data["panels"]]
    assert len(ids) == len(set(ids))
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in data["panels"])
    # The router's process series are its own: one panel selects the router component only.
    assert 'component="router"' in "".join(expr for title, expr in queries if title == "Router open file descriptors")


def test_query_parsing_finds_names_and_labels() -> None:
    """The helpers the checks above rest on read names and labels, not label values or ranges."""
    expr = ('sum by (role, url) (rate(router_worker_selections_total{deployment=~"$deployment",x="a_b{c}"}'
            '[$__rate_interval])) / ignoring(url) group_left sum by (role) (rate(worker_requests_total{}[5m]))')
    assert metric_names(expr) == {"router_worker_selections_total", "worker_requests_total"}
    assert label_names(expr) == {"role", "url", "deployment", "x"}


def _file_sd_groups(deployment: dict[str, str]) -> list[dict[str, Any]]:
    """The targets as `manage.py prometheus_targets` writes them (component, deployment, role, node,
    worker labels) for the three processes."""
    groups = [{"targets": [deployment["router"].removeprefix("http://")],
               "labels": {"component": "router", "deployment": "test"}}]
    for number, role in enumerate(("prefill", "decode"), start=1):
        groups.append({"targets": [deployment[role].removeprefix("http://")],
                       "labels": {"component": "worker", "deployment": "test", "role": role,
                                  "node": "local", "worker": str(number)}})
    return groups


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    """Evaluate an instant query; fail on a PromQL error."""
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert answer["status"] == "success", (expr, answer)
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


@pytest.fixture
def prometheus(deployment: dict[str, str], tmp_path: Path, log_dir: Path) -> Iterator[str]:
    """A real Prometheus with the project's scrape config (its file_sd pointed at this test's targets and
    scraping every second), scraping the deployment's router and workers."""
    if PROMETHEUS is None:
        pytest.skip("Prometheus is not installed: apt-get install prometheus (Debian package)")
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"]["scrape_interval"] = "1s"
    (job,) = config["scrape_configs"]
    job["file_sd_configs"] = [{"files": [str(tmp_path / "targets.json")], "refresh_interval": "1s"}]
    (tmp_path / "targets.json").write_text(json.dumps(_file_sd_groups(deployment)))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    proc = Proc(f"prometheus-{port}", [
        PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
    ], log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(f"{url}/-/ready", timeout=60)
        yield url
    finally:
        proc.stop()


def test_prometheus_evaluates_every_panel_query(prometheus: str) -> None:
    deadline = time.monotonic() + SCRAPE_WAIT_S
    # Every target scraped, and each twice: a rate needs two points of the same target, and the
    # targets' scrapes are offset from one another (waiting on the router's alone left the workers'
    # rates empty on a busy host).
    every_rate = 'rate(process_cpu_seconds_total{job="disagg"}[1m])'
    while time.monotonic() < deadline:
        if len(_query(prometheus, 'up{job="disagg"} == 1')) == 3 and len(_query(prometheus, every_rate)) == 3:
            break
        time.sleep(1)
    assert len(_query(prometheus, 'up{job="disagg"} == 1')) == 3, _query(prometheus, "up")
    assert len(_query(prometheus, every_rate)) == 3, _query(prometheus, every_rate)

    empty: set[str] = set()
    for title, expr in dashboard_queries():
        # Grafana's variables as the dashboard fills them: every deployment, a rate window of a minute.
        concrete = expr.replace("$__rate_interval", "1m").replace("$deployment", ".*")
        if not _query(prometheus, concrete):
            empty.add(title)
    panels_with_data = {title for title, _ in dashboard_queries()} - empty
    assert empty <= MAY_BE_EMPTY, f"panels without data: {sorted(empty)}"
    assert {"GPU utilisation", "CPU utilisation", "Per-node share of requests", "Process CPU (cores)",
            "Router open file descriptors", "Error rate"} <= panels_with_data
