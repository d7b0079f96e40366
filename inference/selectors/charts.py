"""Presentation of the metric series: each field's label and unit, and the charts the metrics page draws.

The admin's metrics page and `GET /api/deployments/{id}/metrics/` return these with the series
(inference.selectors.metrics), so the page needs no knowledge of the sample models.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Fields of MetricSample (one sample per role) the charts and the API return, with a label and unit.
SERIES_FIELDS: dict[str, dict[str, str]] = {
    "ttft_s": {"label": "Time to first token", "unit": "s"},
    "itl_s": {"label": "Inter-token latency", "unit": "s"},
    "throughput_tps": {"label": "Throughput", "unit": "tokens/s"},
    "queue_depth": {"label": "Queue depth", "unit": "requests"},
    "load": {"label": "Load", "unit": "ratio"},
    "cpu_utilization": {"label": "CPU utilisation", "unit": "ratio"},
    "gpu_utilization": {"label": "GPU utilisation", "unit": "ratio"},
    "running": {"label": "Running requests", "unit": "requests"},
    "kv_usage": {"label": "KV cache usage", "unit": "ratio"},
    "workers": {"label": "Workers", "unit": "workers"},
    "rss_bytes": {"label": "Resident memory (RSS)", "unit": "bytes"},
    "gpu_memory_bytes": {"label": "GPU memory", "unit": "bytes"},
    "kv_transfer_bytes_per_s": {"label": "KV transfer", "unit": "bytes/s"},
    "kv_transfer_s": {"label": "KV transfer time", "unit": "s"},
    "prefix_cache_hit_ratio": {"label": "Prefix-cache hit rate", "unit": "ratio"},
}

# Fields of WorkerSample (one sample per worker).
WORKER_FIELDS: dict[str, dict[str, str]] = {
    **{k: v for k, v in SERIES_FIELDS.items() if k != "workers"},
    "requests_per_s": {"label": "Requests sent by the router", "unit": "requests/s"},
    "request_share": {"label": "Share of the role's requests", "unit": "ratio"},
}

# Fields of RouterSample (what the router measured, as its clients see it).
ROUTER_FIELDS: dict[str, dict[str, str]] = {
    "requests_per_s": {"label": "Requests", "unit": "requests/s"},
    "error_rate": {"label": "Error rate (failed / all)", "unit": "ratio"},
    "rejected_per_s": {"label": "Rejected (429)", "unit": "requests/s"},
    "tokens_per_s": {"label": "Tokens streamed", "unit": "tokens/s"},
    "dispatch_p50_s": {"label": "Dispatch p50", "unit": "s"},
    "dispatch_p90_s": {"label": "Dispatch p90", "unit": "s"},
    "queue_wait_p50_s": {"label": "Queue wait p50", "unit": "s"},
    "queue_wait_p90_s": {"label": "Queue wait p90", "unit": "s"},
    "ttft_p50_s": {"label": "Client TTFT p50", "unit": "s"},
    "ttft_p90_s": {"label": "Client TTFT p90", "unit": "s"},
    "itl_p50_s": {"label": "Client ITL p50", "unit": "s"},
    "itl_p90_s": {"label": "Client ITL p90", "unit": "s"},
    "e2e_p50_s": {"label": "Request time p50", "unit": "s"},
    "e2e_p90_s": {"label": "Request time p90", "unit": "s"},
    "inflight": {"label": "In flight", "unit": "requests"},
    "queued": {"label": "Queued in the router", "unit": "requests"},
    "decode_slots": {"label": "Decode slots", "unit": "requests"},
    "prompt_tokens_per_s": {"label": "Prompt tokens", "unit": "tokens/s"},
    "cached_prompt_tokens_per_s": {"label": "Prompt tokens cached", "unit": "tokens/s"},
    "prompt_cached_ratio": {"label": "Prompt tokens cached (share)", "unit": "ratio"},
    "local_prefills_per_s": {"label": "Prefilled on the decode worker", "unit": "requests/s"},
    "remote_prefills_per_s": {"label": "Prefilled by a prefill worker", "unit": "requests/s"},
}


def _chart(chart_id: str, title: str, unit: str, source: str, fields: Sequence[str], **extra: Any) -> dict[str, Any]:
    return {"id": chart_id, "title": title, "unit": unit, "source": source, "fields": list(fields), **extra}


# What the CPU chart measures: a worker reports how busy the cores it is pinned to are (psutil, per core),
# whatever runs on them, so an idle worker whose cores other processes use reads busy.
CPU_NOTE = (
    "busy share of the cores each worker is pinned to, counting every process on them (not the worker's own "
    "CPU time): an idle worker reads high when its cores are shared"
)

# What the router's per-request decisions and the workers' reports on them mean (README, router section).
PREFILL_WHERE_NOTE = (
    "a decode worker prefills a prompt itself when few of its tokens are left to compute or the prefill "
    "workers' queue would be slower (the deployment's local prefill tokens); remote otherwise"
)
PROMPT_CACHED_NOTE = (
    "share of the finished requests' prompt tokens that came from a worker's prefix cache, as the workers "
    "reported them (what clients get as usage.prompt_tokens_details.cached_tokens)"
)

# The charts of the metrics page, in order. `source`: "router" (one line per field of the router's
# series), "role" (one line per role, or per worker when the page's toggle says so and the chart has
# `per_worker`), "worker" (one line per worker, always). `needs_gpu`: a chart that only GPU workers fill, which
# the page replaces by "no GPU" when no worker reported a value; `note`: what the chart measures, under its title.
CHARTS: list[dict[str, Any]] = [
    _chart("router_overhead", "Router overhead (dispatch latency)", "s", "router",
           ["dispatch_p50_s", "dispatch_p90_s"]),
    _chart("client_ttft", "Client TTFT (at the router)", "s", "router", ["ttft_p50_s", "ttft_p90_s"]),
    _chart("client_itl", "Client ITL (at the router)", "s", "router", ["itl_p50_s", "itl_p90_s"]),
    _chart("error_rate", "Error rate (failed / all requests)", "ratio", "router", ["error_rate"]),
    _chart("rejected", "Requests and 429s per second", "requests/s", "router", ["requests_per_s", "rejected_per_s"]),
    _chart("router_queue", "Router queue and in flight", "requests", "router", ["queued", "inflight", "decode_slots"]),
    _chart("prefill_where", "Where prompts are prefilled", "requests/s", "router",
           ["local_prefills_per_s", "remote_prefills_per_s"], note=PREFILL_WHERE_NOTE),
    _chart("prompt_cached", "Prompt tokens no worker computed", "ratio", "router", ["prompt_cached_ratio"],
           note=PROMPT_CACHED_NOTE),
    _chart("request_share", "Share of requests per worker", "ratio", "worker", ["request_share"]),
    _chart("load", "Load", "ratio", "role", ["load"], per_worker=True),
    _chart("ttft", "Time to first token (workers)", "s", "role", ["ttft_s"], per_worker=True),
    _chart("itl", "Inter-token latency (workers)", "s", "role", ["itl_s"], per_worker=True),
    _chart("throughput", "Throughput", "tokens/s", "role", ["throughput_tps"], per_worker=True),
    _chart("queue_depth", "Queue depth (workers)", "requests", "role", ["queue_depth"], per_worker=True),
    _chart("kv_usage", "KV cache usage", "ratio", "role", ["kv_usage"], per_worker=True),
    _chart("cpu_utilization", "CPU utilisation of the pinned cores", "ratio", "role", ["cpu_utilization"],
           per_worker=True, note=CPU_NOTE),
    _chart("gpu_utilization", "GPU utilisation", "ratio", "role", ["gpu_utilization"], per_worker=True,
           needs_gpu=True),
    _chart("rss", "Resident memory (RSS)", "bytes", "role", ["rss_bytes"], per_worker=True),
    _chart("gpu_memory", "GPU memory", "bytes", "role", ["gpu_memory_bytes"], per_worker=True, needs_gpu=True),
    _chart("kv_transfer", "KV transfer", "bytes/s", "role", ["kv_transfer_bytes_per_s"], per_worker=True),
    _chart("kv_transfer_time", "KV transfer time (mean)", "s", "role", ["kv_transfer_s"], per_worker=True),
    _chart("prefix_cache", "Prefix-cache hit rate", "ratio", "role", ["prefix_cache_hit_ratio"], per_worker=True),
    _chart("workers", "Workers", "workers", "role", ["workers"]),
]
