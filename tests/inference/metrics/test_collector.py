"""inference.metrics.collector: router and per-worker samples from real /metrics texts.

Unit checks use a real RouterMetrics (the router's own registry) rendered to text; the end-to-end
checks scrape a real router process (over the stand-in cluster of tests/inference/conftest.py, and
over real tiny-model workers under a burst that the router answers partly with 429s).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.utils import timezone

from inference.metrics import collector, exposition
from inference.models import MetricSample, RouterEndpoint, RouterSample, Worker, WorkerSample
from inference.router.metrics import RouterMetrics
from inference.server.metrics import WorkerMetrics
from tests.inference.conftest import SATURABLE_TOKENS
from tests.inference.router.stand_ins import Cluster
from tests.support.control_plane import make_deployment, make_node, make_worker
from tests.support.http_stub import QuietHandler, serving
from tests.support.processes import start_router


def _state(metrics: RouterMetrics, at: float) -> dict[str, Any]:
    return {**exposition.parse_router_metrics(metrics.render().decode()), "at": at}


# ----------------------------------------------------------------------------------------- units
def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = [(0.1, 0.0), (0.5, 10.0), (1.0, 10.0), (float("inf"), 10.0)]
    assert exposition.histogram_quantile(0.5, buckets) == pytest.approx(0.3)  # halfway through (0.1, 0.5]
    assert exposition.histogram_quantile(0.9, buckets) == pytest.approx(0.46)
    assert exposition.histogram_quantile(0.5, [(0.1, 4.0), (float("inf"), 4.0)]) == pytest.approx(0.05)  # from 0
    # Ranks in the +Inf bucket answer the highest finite bound.
    assert exposition.histogram_quantile(0.9, [(0.1, 1.0), (float("inf"), 10.0)]) == pytest.approx(0.1)
    assert exposition.histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert exposition.histogram_quantile(0.5, []) is None


def test_router_changes_from_a_real_router_registry() -> None:
    metrics = RouterMetrics()
    metrics.bind_gauges(lambda: 3, lambda: 1, lambda: 8)
    metrics.requests.labels("generate", "ok").inc(10)
    metrics.dispatch.observe(0.0001)
    before = _state(metrics, 1000.0)

    # Ten seconds later: 16 more requests of which 4 failed and 2 were rejected (429), plus 3 more
    # rejections counted by reason; dispatch 0.3–0.4 ms for 12, 3–4 ms for 4.
    metrics.requests.labels("generate", "ok").inc(10)
    metrics.requests.labels("chat", "failed").inc(4)
    metrics.requests.labels("chat", "rejected").inc(2)
    metrics.rejected.labels("queue_timeout").inc(2)
    metrics.rejected.labels("queue_full").inc(3)
    for _ in range(12):
        metrics.dispatch.observe(0.0003)
    for _ in range(4):
        metrics.dispatch.observe(0.003)
    for value in (0.2, 0.2, 0.3, 4.0):
        metrics.ttft.observe(value)
    metrics.itl.observe(0.015)
    metrics.tokens.inc(500)
    for url, n in (("http://d1:1", 6), ("http://d2:2", 2)):
        metrics.selections.labels("decode", url).inc(n)
    metrics.selections.labels("prefill", "http://p1:1").inc(8)
    # 1,000 prompt tokens finished, 600 of them cached; 6 prompts prefilled remotely, 2 on decode workers.
    metrics.prompt_tokens.inc(1000)
    metrics.cached_prompt_tokens.inc(600)
    metrics.prefill_where.labels("remote").inc(6)
    metrics.prefill_where.labels("local").inc(2)
    after = _state(metrics, 1010.0)
    json.dumps(after)  # stored as JSON between scrapes

    changes = exposition.router_changes(before, after)
    assert changes is not None
    assert changes["interval_s"] == 10.0
    assert changes["requests_per_s"] == pytest.approx(1.6)
    assert changes["error_rate"] == pytest.approx(4 / 16)
    assert changes["rejected_per_s"] == pytest.approx(0.5)
    assert changes["tokens_per_s"] == pytest.approx(50.0)
    # 12 of 16 in (0.2 ms, 0.5 ms]: p50 at rank 8 → 0.2 + 0.3 × 8/12 ms; p90 (rank 14.4) in (2 ms, 5 ms].
    assert changes["dispatch_p50_s"] == pytest.approx(0.0002 + 0.0003 * 8 / 12)
    assert 0.002 < changes["dispatch_p90_s"] <= 0.005
    assert 0.1 < changes["ttft_p50_s"] <= 0.25 and 2.5 < changes["ttft_p90_s"] <= 5.0
    assert 0.01 < changes["itl_p50_s"] <= 0.02
    assert changes["queue_wait_p50_s"] is None and changes["e2e_p90_s"] is None  # nothing observed
    assert exposition.worker_share(changes["selections"]) == {
        "decode": {"http://d1:1": 0.75, "http://d2:2": 0.25}, "prefill": {"http://p1:1": 1.0},
    }
    assert after["gauges"] == {"inflight": 3.0, "queued": 1.0, "decode_slots": 8.0}
    assert changes["prompt_tokens_per_s"] == pytest.approx(100.0)
    assert changes["cached_prompt_tokens_per_s"] == pytest.approx(60.0)
    assert changes["prompt_cached_ratio"] == pytest.approx(0.6)
    assert (changes["remote_prefills_per_s"], changes["local_prefills_per_s"]) == pytest.approx((0.6, 0.2))

    # Nothing since: rates 0, no error rate and no quantiles (nothing finished or observed).
    idle = exposition.router_changes(after, {**after, "at": 1015.0})
    assert idle is not None
    assert (idle["requests_per_s"], idle["rejected_per_s"], idle["error_rate"]) == (0.0, 0.0, None)
    assert idle["dispatch_p50_s"] is None
    assert idle["prompt_cached_ratio"] is None and idle["local_prefills_per_s"] == 0.0
    # A scrape stored before the prompt-token and prefill-where series existed reads them as absent.
    legacy = {k: v for k, v in after.items() if k not in ("prompt_tokens", "cached_prompt_tokens", "prefill_where")}
    from_legacy = exposition.router_changes(legacy, {**after, "at": 1020.0})
    assert from_legacy is not None and from_legacy["prompt_tokens_per_s"] == pytest.approx(100.0)

    # No previous scrape, or no time between them: no deltas.
    assert exposition.router_changes(None, after) is None
    assert exposition.router_changes(after, {**after, "at": 1010.0}) is None


def test_a_restarted_router_counts_from_zero() -> None:
    old = RouterMetrics()
    old.requests.labels("generate", "ok").inc(100)
    old.dispatch.observe(0.01)
    before = _state(old, 1000.0)
    new = RouterMetrics()  # the restarted process: a fresh registry, fewer requests than before
    new.requests.labels("generate", "ok").inc(30)
    new.requests.labels("generate", "failed").inc(10)
    for _ in range(40):
        new.dispatch.observe(0.0004)
    changes = exposition.router_changes(before, _state(new, 1010.0))
    assert changes is not None
    assert changes["requests_per_s"] == pytest.approx(4.0) and changes["error_rate"] == pytest.approx(0.25)
    assert 0.0002 < changes["dispatch_p90_s"] <= 0.0005  # the new histogram's, not a negative difference

    # More requests than before the restart: only the start time (histograms' _created) tells.
    state = {"requests": {"ok": 150.0}, "rejected": 0.0, "tokens": 0.0, "selections": {}, "histograms": {},
             "gauges": {}}
    restarted = exposition.router_changes({**state, "requests": {"ok": 100.0}, "started": 1.0, "at": 1000.0},
                                         {**state, "started": 2.0, "at": 1010.0})
    same = exposition.router_changes({**state, "requests": {"ok": 100.0}, "started": 1.0, "at": 1000.0},
                                    {**state, "started": 1.0, "at": 1010.0})
    assert restarted is not None and restarted["requests_per_s"] == 15.0
    assert same is not None and same["requests_per_s"] == 5.0


# --------------------------------------------------------------------------- a stand-in worker
@pytest.fixture
def fake_worker() -> Iterator[tuple[int, dict[str, Any]]]:
    """A worker whose /metrics is a real WorkerMetrics' text (or an error) and /health a given answer."""
    metrics = WorkerMetrics("decode", "m")
    state: dict[str, Any] = {"metrics": metrics, "metrics_status": 200,
                             "health": {"status": "healthy", "role": "decode", "queue_depth": 1, "running": 3,
                                        "kv_usage": 0.5, "cpu_utilization": 0.25}}

    class Handler(QuietHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/metrics":
                status, body = state["metrics_status"], state["metrics"].render()
            else:
                status, body = 200, json.dumps(state["health"]).encode()
            self.reply(status, body)

    with serving(Handler) as port:
        yield port, state


@pytest.mark.django_db
def test_worker_sample_from_real_worker_metrics(fake_worker: tuple[int, dict[str, Any]]) -> None:
    port, state = fake_worker
    metrics: WorkerMetrics = state["metrics"]
    node = make_node(last_heartbeat=timezone.now())
    deployment = make_deployment(batch_size=8)
    worker = make_worker(deployment, node, role="decode", port=port)
    # What the worker's render_metrics sets from its engine (its /health says the same).
    for gauge, value in ((metrics.queue_depth, 1), (metrics.running, 3), (metrics.kv_usage, 0.5),
                         (metrics.cpu_utilization, 0.25), (metrics.prefix_cache_hit_ratio, 0.4)):
        gauge.set(value)
    metrics.kv_transfer_bytes.inc(1000)
    now = timezone.now()
    collector.collect(now=now)
    first = WorkerSample.objects.get(worker_id=worker.pk)
    assert first.name == f"decode #{worker.pk} @ {node.name}:{port}" and first.url == worker.url
    assert first.load == pytest.approx(0.5)  # (running 3 + queue 1) / batch 8
    assert (first.queue_depth, first.running, first.kv_usage, first.cpu_utilization) == (1, 3, 0.5, 0.25)
    assert first.rss_bytes is not None and first.rss_bytes > 10 * 2**20  # process_resident_memory_bytes
    assert first.gpu_memory_bytes is None and first.gpu_utilization is None  # a CPU worker
    assert first.prefix_cache_hit_ratio == pytest.approx(0.4)
    assert first.kv_transfer_bytes_per_s is None and first.throughput_tps is None  # no previous scrape
    assert first.request_share is None  # no router registered

    # 4 MB of KV in four transfers of 5 ms, 100 tokens: rates over the real time between scrapes.
    previous = dict(Worker.objects.get(pk=worker.pk).last_metrics)
    previous["at"] -= 10.0
    Worker.objects.filter(pk=worker.pk).update(last_metrics=previous)
    metrics.kv_transfer_bytes.inc(4_000_000)
    for _ in range(4):
        metrics.kv_transfer_seconds.observe(0.005)
    metrics.generation_tokens.inc(100)
    collector.collect(now=now + timezone.timedelta(seconds=5))
    second = WorkerSample.objects.filter(worker_id=worker.pk).order_by("-at").first()
    assert second is not None
    assert second.kv_transfer_bytes_per_s == pytest.approx(400_000, rel=0.05)
    assert second.kv_transfer_s == pytest.approx(0.005)
    assert second.throughput_tps == pytest.approx(10, rel=0.05)
    role = MetricSample.objects.filter(deployment=deployment, role="decode").order_by("-at").first()
    assert role is not None
    assert role.kv_transfer_bytes_per_s == pytest.approx(400_000, rel=0.05) and role.kv_transfer_s == 0.005
    assert role.rss_bytes == second.rss_bytes and role.prefix_cache_hit_ratio == pytest.approx(0.4)

    # /metrics failing: the /health answer still gives a sample, and RSS comes from the node's agent.
    state["metrics_status"] = 500
    node.last_metrics = {"workers": {str(worker.pk): {"pid": 4242, "rss_bytes": 123_456_789}}}
    node.save(update_fields=["last_metrics"])
    collector.collect(now=now + timezone.timedelta(seconds=10))
    third = WorkerSample.objects.filter(worker_id=worker.pk).order_by("-at").first()
    assert third is not None and third.rss_bytes == 123_456_789 and third.load == pytest.approx(0.5)
    assert third.kv_transfer_bytes_per_s is None


@pytest.mark.django_db
def test_an_unreachable_router_is_noted_and_the_workers_still_sampled(fake_worker: tuple[int, Any]) -> None:
    port, _ = fake_worker
    deployment = make_deployment()
    make_worker(deployment, make_node(), role="decode", port=port)
    router = RouterEndpoint.objects.create(deployment=deployment, url="http://127.0.0.1:1")  # nothing listens
    assert collector.collect() == 2
    router.refresh_from_db()
    assert "ConnectError" in router.last_error and router.last_metrics is None
    assert not RouterSample.objects.exists()
    assert WorkerSample.objects.filter(deployment=deployment).count() == 1


# ------------------------------------------------------------------ a real router over stand-ins
@pytest.fixture(scope="module")
def stand_in_router(cluster: Cluster, log_dir: Path) -> Iterator[str]:
    """A real router process (static endpoints) in front of the module's stand-in workers."""
    proc, url = start_router(cluster.prefill_urls, cluster.decode_urls, log_dir)
    try:
        yield url
    finally:
        proc.stop()


@pytest.mark.django_db
def test_router_sample_from_a_real_router(stand_ins: Cluster, stand_in_router: str) -> None:
    node = make_node(address="127.0.0.1")
    deployment = make_deployment()
    workers = {
        url: make_worker(deployment, node, role=role, port=int(url.rsplit(":", 1)[1]))
        for role, urls in (("prefill", stand_ins.prefill_urls), ("decode", stand_ins.decode_urls))
        for url in urls
    }
    RouterEndpoint.objects.create(deployment=deployment, url=stand_in_router)
    started = timezone.now()
    collector.collect(now=started)
    assert RouterSample.objects.get().requests_per_s is None  # the first scrape: gauges only

    with httpx.Client(base_url=stand_in_router, timeout=30) as client:
        for i in range(8):
            assert client.post("/generate", json={"prompt": f"hello {i}", "max_tokens": 4}).status_code == 200
        for stand_in in stand_ins.decode:
            stand_in.behavior = "http500"
        failed = client.post("/generate", json={"prompt": "fails", "max_tokens": 4})
        assert failed.status_code == 502
    collector.collect(now=started + timezone.timedelta(seconds=5))

    sample = RouterSample.objects.order_by("-at").first()
    assert sample is not None and sample.interval_s and sample.interval_s > 0
    assert sample.error_rate == pytest.approx(1 / 9)
    assert sample.requests_per_s == pytest.approx(9 / sample.interval_s)
    assert sample.rejected_per_s == 0.0
    assert sample.dispatch_p50_s is not None and 0 < sample.dispatch_p50_s < 0.25  # the router's own time
    assert sample.dispatch_p90_s is not None and sample.dispatch_p90_s >= sample.dispatch_p50_s
    assert sample.ttft_p50_s is not None and sample.e2e_p90_s is not None
    assert sample.decode_slots is not None and sample.inflight == 0
    # Round robin: each decode stand-in took 4 of the 8 requests and one attempt of the failed one.
    assert sample.worker_share == {
        "decode": {url: 0.5 for url in stand_ins.decode_urls},
        "prefill": {url: 0.5 for url in stand_ins.prefill_urls},
    }
    for url, worker in workers.items():
        latest = WorkerSample.objects.filter(worker_id=worker.pk).order_by("-at").first()
        assert latest is not None and latest.request_share == pytest.approx(0.5), url
        assert latest.requests_per_s is not None and latest.requests_per_s > 0
        assert latest.load is not None  # from the stand-in's /health (it has no /metrics)


# ------------------------------------------------------------- real workers under a burst
@pytest.fixture(scope="module")
def real_cluster(saturable_deployment: dict[str, str]) -> dict[str, str]:
    """A real prefill and decode worker (tiny model, decode --batch-size 2) and a router whose short
    queue turns a burst partly into 429s."""
    return saturable_deployment


@pytest.mark.django_db
@pytest.mark.timeout(180)
def test_collect_after_a_burst_on_real_workers(real_cluster: dict[str, Any]) -> None:
    node = make_node(address="127.0.0.1")
    deployment = make_deployment(batch_size=2)
    prefill = make_worker(deployment, node, role="prefill", port=int(real_cluster["prefill"].rsplit(":", 1)[1]))
    decode = make_worker(deployment, node, role="decode", port=int(real_cluster["decode"].rsplit(":", 1)[1]))
    RouterEndpoint.objects.create(deployment=deployment, url=real_cluster["router"])
    started = timezone.now()
    collector.collect(now=started)

    body = {"prompt": "tell me a long story", "max_tokens": SATURABLE_TOKENS, "ignore_eos": True, "temperature": 0}

    def post(_: int) -> int:
        return httpx.post(real_cluster["router"] + "/generate", json=body, timeout=60).status_code

    with ThreadPoolExecutor(max_workers=16) as pool:
        codes = list(pool.map(post, range(16)))
    assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
    collector.collect(now=started + timezone.timedelta(seconds=5))

    sample = RouterSample.objects.order_by("-at").first()
    assert sample is not None and sample.interval_s
    assert sample.rejected_per_s == pytest.approx(codes.count(429) / sample.interval_s)
    assert sample.error_rate == 0.0  # a 429 is a rejection, not a failure
    assert sample.dispatch_p50_s is not None and sample.queue_wait_p90_s is not None
    assert sample.ttft_p90_s is not None and sample.itl_p50_s is not None and sample.itl_p90_s is not None
    assert sample.worker_share == {"prefill": {real_cluster["prefill"]: 1.0}, "decode": {real_cluster["decode"]: 1.0}}
    # Every answered request was prefilled by the prefill worker (no local prefill configured), and its
    # prompt tokens counted with the cached share the workers reported.
    answered = codes.count(200)
    assert sample.remote_prefills_per_s is not None  # a retried prompt is counted again
    assert sample.remote_prefills_per_s * sample.interval_s == pytest.approx(answered) or \
        sample.remote_prefills_per_s * sample.interval_s > answered
    assert sample.local_prefills_per_s == 0.0
    assert sample.prompt_tokens_per_s and sample.prompt_tokens_per_s > 0
    assert sample.prompt_cached_ratio is not None and 0.0 <= sample.prompt_cached_ratio < 1.0

    for worker in (prefill, decode):
        latest = WorkerSample.objects.filter(worker_id=worker.pk).order_by("-at").first()
        assert latest is not None
        assert latest.request_share == 1.0 and latest.requests_per_s and latest.requests_per_s > 0
        # The KV moved from prefill to decode: both count its bytes and time.
        assert latest.kv_transfer_bytes_per_s and latest.kv_transfer_bytes_per_s > 0, worker.role
        assert latest.kv_transfer_s is not None and latest.kv_transfer_s > 0
        assert latest.rss_bytes and latest.rss_bytes > 50 * 2**20  # torch and the model are loaded
        assert latest.gpu_memory_bytes is None  # CUDA_VISIBLE_DEVICES="": CPU workers
        assert latest.prefix_cache_hit_ratio is not None
    decode_sample = WorkerSample.objects.filter(worker_id=decode.pk).order_by("-at").first()
    assert decode_sample is not None and decode_sample.throughput_tps and decode_sample.throughput_tps > 0
    role = MetricSample.objects.filter(deployment=deployment, role="decode").order_by("-at").first()
    assert role is not None and role.kv_transfer_bytes_per_s and role.rss_bytes


@pytest.mark.django_db
def test_the_demo_registers_its_router(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: Any) -> None:
    """`make up` passes the router's URL to bootstrap_demo, so the demo's metrics page has router series."""
    from django.core.management import call_command
    from django.core.management.base import CommandError

    settings.VAR_DIR = tmp_path
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("PLATFORM_ADMIN_PASSWORD", "demo-password")
    for _ in range(2):  # idempotent
        call_command("bootstrap_demo", "--model-path", str(tmp_path), "--router-url", "http://127.0.0.1:8000/",
                     stdout=open("/dev/null", "w"))  # noqa: SIM115
    assert list(RouterEndpoint.objects.values_list("deployment__name", "url", "enabled")) == [
        ("demo", "http://127.0.0.1:8000", True)
    ]
    with pytest.raises(CommandError):
        call_command("bootstrap_demo", "--model-path", str(tmp_path), "--router-url", "not a url",
                     stdout=open("/dev/null", "w"))  # noqa: SIM115
