"""Prometheus and Grafana files (issue 10, item 3): the file_sd targets the management command writes
from real database rows, the scrape config that reads them, and a dashboard whose every PromQL
metric name is one a real RouterMetrics or WorkerMetrics registry exports."""
from __future__ import annotations

import fnmatch
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.core.management import CommandError, call_command

from inference.gateway.tenancy import class_metrics
from inference.models import RouterEndpoint
from inference.router.metrics import RouterMetrics
from inference.server.metrics import WorkerMetrics
from tests.support.control_plane import make_deployment, make_node, make_worker

ROOT = Path(__file__).resolve().parents[3]
PROMETHEUS_YML = ROOT / "platform" / "prometheus" / "prometheus.yml"
DASHBOARD = ROOT / "platform" / "grafana" / "dashboards" / "disagg-platform.json"
DEFAULT_OUT = "platform/prometheus/targets/targets.json"


# ------------------------------------------------------------------------------ targets command
@pytest.fixture
def rows() -> dict[str, Any]:
    chat = make_deployment(name="chat")
    other = make_deployment(name="batch")
    gpu = make_node(name="gpu-1", address="10.0.0.5")
    cpu = make_node(name="cpu-1", address="10.0.0.6")
    return {
        "prefill": make_worker(chat, gpu, role="prefill", port=30001),
        "decode": make_worker(chat, cpu, role="decode", port=30002),
        "draining": make_worker(chat, cpu, role="decode", port=30003, status="draining"),
        "stopped": make_worker(chat, cpu, role="decode", port=30004, status="stopped"),
        "pending": make_worker(chat, cpu, role="decode", port=30005, status="pending"),
        "other": make_worker(other, cpu, role="decode", port=30006),
        "router": RouterEndpoint.objects.create(deployment=chat, url="http://10.0.0.5:8000/"),
        "disabled": RouterEndpoint.objects.create(deployment=other, url="http://10.0.0.6:8001", enabled=False),
    }


@pytest.mark.django_db
def test_command_writes_every_scraped_worker_and_router(rows: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "targets" / "targets.json"
    stdout = io.StringIO()
    call_command("prometheus_targets", "--out", str(out), stdout=stdout)
    assert "wrote 4 worker and 1 router target(s)" in stdout.getvalue()
    groups = json.loads(out.read_text())
    assert groups[0] == {"targets": ["10.0.0.5:8000"],
                         "labels": {"component": "router", "deployment": "chat", "__scheme__": "http"}}
    workers = {g["targets"][0]: g["labels"] for g in groups[1:]}
    assert workers == {
        "10.0.0.6:30006": {"component": "worker", "deployment": "batch", "role": "decode", "node": "cpu-1",
                           "worker": str(rows["other"].pk)},
        "10.0.0.6:30002": {"component": "worker", "deployment": "chat", "role": "decode", "node": "cpu-1",
                           "worker": str(rows["decode"].pk)},
        "10.0.0.6:30003": {"component": "worker", "deployment": "chat", "role": "decode", "node": "cpu-1",
                           "worker": str(rows["draining"].pk)},
        "10.0.0.5:30001": {"component": "worker", "deployment": "chat", "role": "prefill", "node": "gpu-1",
                           "worker": str(rows["prefill"].pk)},
    }
    assert not list(out.parent.glob(".*.tmp"))  # written through a temporary file, renamed into place


@pytest.mark.django_db
def test_command_filters_by_deployment_and_names_a_bad_one(rows: dict[str, Any]) -> None:
    stdout = io.StringIO()
    call_command("prometheus_targets", "--out", "-", "--deployment", "batch", stdout=stdout)
    groups = json.loads(stdout.getvalue())
    assert [g["targets"] for g in groups] == [["10.0.0.6:30006"]]  # its router is disabled
    with pytest.raises(CommandError, match="--deployment: no deployment named nope"):
        call_command("prometheus_targets", "--out", "-", "--deployment", "nope")


@pytest.mark.django_db
def test_command_names_an_unwritable_out(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CommandError, match="--out"):
        call_command("prometheus_targets", "--out", str(blocker / "targets.json"))


def test_scrape_config_reads_the_default_targets_file() -> None:
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "disagg" and job["metrics_path"] == "/metrics"
    patterns = [p for sd in job["file_sd_configs"] for p in sd["files"]]
    relative = Path(DEFAULT_OUT).relative_to("platform/prometheus").as_posix()
    assert any(fnmatch.fnmatch(relative, p) for p in patterns)


# ---------------------------------------------------------------------------------- dashboard
def exported_series() -> dict[str, set[str]]:
    """Series name → its label names, for everything the real router and worker registries export."""
    series: dict[str, set[str]] = {}
    router = RouterMetrics()
    # The per-key-class series join the router's registry with its first generation request.
    tenants = class_metrics(router.registry)
    for registry in (router.registry, WorkerMetrics("decode", "m").registry):
        for family in registry.collect():
            suffixes = {"counter": ["_total", "_created"], "histogram": ["_bucket", "_count", "_sum", "_created"],
                        "gauge": [""]}.get(family.type, [""])
            labels: set[str] = set()
            for sample in family.samples:
                labels |= set(sample.labels)
            documented = getattr(family, "_labelnames", ()) or ()
            for suffix in suffixes:
                series[family.name + suffix] = labels | set(documented)
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    # Labelled metrics have no samples until used: take their label names from the collectors.
    for metric in (router.requests, router.rejected, router.selections, router.failures, tenants.requests,
                   tenants.tokens, tenants.limited):
        for suffix in ("_total", "_created"):
            series[metric._name + suffix] |= set(metric._labelnames)  # noqa: SLF001
    return series


def dashboard_exprs() -> list[tuple[str, str]]:
    data = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in data["panels"] for target in panel["targets"]]


# file_sd labels every series gets, plus the histogram bucket label.
TARGET_LABELS = {"component", "deployment", "role", "node", "worker", "le", "job", "instance"}
_FUNCTIONS = {"histogram_quantile", "sum", "max", "rate", "by", "ignoring", "group_left", "on", "min", "avg"}
# Only a worker whose PyTorch initialised CUDA exports it: checked on real GPU workers by
# tests/platform/test_grafana_dashboard.py, absent from a registry in this (CPU) process.
GPU_ONLY = {"worker_gpu_memory_bytes"}


def test_every_dashboard_metric_is_exported_by_a_real_registry() -> None:
    series = exported_series()
    assert "router_dispatch_seconds_bucket" in series and "process_resident_memory_bytes" in series
    for title, expr in dashboard_exprs():
        stripped = re.sub(r'"[^"]*"', '""', expr)  # label values are not names
        stripped = re.sub(r"\[[^\]]*\]", "", stripped)  # range selectors
        names = set(re.findall(r"\b[a-z_][a-z0-9_]*(?=\s*\{)", stripped))
        assert names, f"{title}: no metric selector in {expr}"
        names -= GPU_ONLY
        if not names:  # a panel of GPU-only series
            continue
        for name in names:
            assert name in series, f"{title}: {name} is not exported by the router or the workers"
        # Every label the query selects or groups by exists on the series (or is a target label).
        known = TARGET_LABELS | set().union(*(series[n] for n in names))
        used = set(re.findall(r"\b([a-z_]+)\s*(?:=~|!=|=)", stripped))
        for group in re.findall(r"(?:by|ignoring)\s*\(([^)]*)\)", stripped):
            used |= {label.strip() for label in group.split(",") if label.strip()}
        assert used - _FUNCTIONS <= known, f"{title}: unknown labels {sorted(used - known)} in {expr}"


def test_dashboard_has_the_panels_the_guide_monitors() -> None:
    data = json.loads(DASHBOARD.read_text())
    titles = {panel["title"] for panel in data["panels"]}
    assert {"Router dispatch overhead p50 / p99", "Error rate", "429 responses per second",
            "Per-worker share of requests", "Client TTFT p50 / p90", "Client ITL p50 / p90", "Queue depth",
            "KV cache usage", "Throughput (tokens/s)", "Memory (RSS)", "KV transfer bytes/s"} <= titles
    by_title = dict(dashboard_exprs())
    assert "router_dispatch_seconds_bucket" in by_title["Router dispatch overhead p50 / p99"]
    assert "router_worker_selections_total" in by_title["Per-worker share of requests"]
    # Provisioning-ready: a fixed uid, and the datasource as a variable (no instance-specific uid).
    assert data["uid"] == "disagg-platform"
    assert {v["name"] for v in data["templating"]["list"]} == {"datasource", "deployment"}
    assert all(panel["datasource"]["uid"] == "${datasource}" for panel in data["panels"])
    ids = [panel["id"] for panel in data["panels"]]
    assert len(ids) == len(set(ids))
