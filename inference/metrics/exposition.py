"""The Prometheus text of workers and routers, parsed; what two scrapes of it differ by.

Workers' counters and gauges (COUNTERS, GAUGES) and the router's series (histograms, gauges, selections per
worker) become plain dicts that the collector stores and subtracts: counter deltas (a counter that went down
counts from zero again), quantiles of histogram bucket deltas (interpolated as Prometheus'
histogram_quantile does) and each worker's share of its role's requests. No database, no HTTP.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

# Sample names in the worker's Prometheus text → our keys.
COUNTERS = {
    "worker_time_to_first_token_seconds_sum": "ttft_sum",
    "worker_time_to_first_token_seconds_count": "ttft_count",
    "worker_inter_token_latency_seconds_sum": "itl_sum",
    "worker_inter_token_latency_seconds_count": "itl_count",
    "worker_generation_tokens_total": "generation_tokens",
    "worker_prompt_tokens_total": "prompt_tokens",
    "worker_kv_transfer_bytes_total": "kv_bytes",
    "worker_kv_transfer_seconds_sum": "kv_transfer_sum",
    "worker_kv_transfer_seconds_count": "kv_transfer_count",
}
GAUGES = {
    "worker_queue_depth": "queue_depth",
    "worker_running_requests": "running",
    "worker_reserved_requests": "reserved",
    "worker_kv_cache_usage_ratio": "kv_usage",
    "worker_cpu_utilization_ratio": "cpu_utilization",
    "worker_gpu_utilization_ratio": "gpu_utilization",
    "worker_prefix_cache_hit_ratio": "prefix_cache_hit_ratio",
    "worker_gpu_memory_bytes": "gpu_memory_bytes",
    "process_resident_memory_bytes": "rss_bytes",
}

# The router's histograms (inference/router/metrics.py) → our keys.
ROUTER_HISTOGRAMS = {
    "router_dispatch_seconds": "dispatch",
    "router_queue_wait_seconds": "queue_wait",
    "router_ttft_seconds": "ttft",
    "router_itl_seconds": "itl",
    "router_e2e_seconds": "e2e",
}
ROUTER_GAUGES = {"router_inflight": "inflight", "router_queued": "queued", "router_decode_slots": "decode_slots"}
QUANTILES = (("p50", 0.5), ("p90", 0.9))
# Threads scraping at once; each request is bounded by the scrape timeout anyway.


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """(counters, gauges) from a worker's Prometheus text; samples of one name are summed over labels.

    Only the lines of the wanted samples are read (`name{labels} value [timestamp]`: the value follows
    the name or the labels' last brace): the collector parses one text per worker per round, and
    prometheus_client's full parser took 1.9 ms of CPU for a worker's 143 lines, most of a round's CPU
    at 1,000 workers (tests check both parsers agree on a real worker's text). ValueError on a wanted
    sample whose value is not a number.
    """
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        end = brace if brace != -1 and (space == -1 or brace < space) else space
        name = line[:end] if end != -1 else line
        target = counters if name in COUNTERS else gauges if name in GAUGES else None
        if target is None:
            continue
        rest = line[line.rindex("}") + 1 :] if end == brace else line[end:]
        fields = rest.split()
        if not fields:
            raise ValueError(f"no value in metrics line {line!r}")
        key = COUNTERS.get(name) or GAUGES[name]
        target[key] = target.get(key, 0.0) + float(fields[0])
    return counters, gauges


# ------------------------------------------------------------------------------------------- router
def parse_router_metrics(text: str) -> dict[str, Any]:
    """The router's cumulative series from its Prometheus text (JSON-safe, stored between scrapes)::

        {"requests": {outcome: n}, "rejected": n, "tokens": n,
         "prompt_tokens": n, "cached_prompt_tokens": n, "prefill_where": {"local": n, "remote": n},
         "selections": {role: {url: n}}, "failures": {role: {url: n}},
         "histograms": {key: {"buckets": {le: cumulative n}, "sum": s, "count": n}},
         "gauges": {"inflight": n, "queued": n, "decode_slots": n}, "started": epoch s}

    Requests are summed over endpoints, rejections over reasons; "started" is when the router's
    histograms were created (their `_created` samples), so a restarted router is told apart.
    """
    state: dict[str, Any] = {
        "requests": {}, "rejected": 0.0, "tokens": 0.0, "prompt_tokens": 0.0, "cached_prompt_tokens": 0.0,
        "prefill_where": {}, "selections": {}, "failures": {}, "histograms": {}, "gauges": {},
    }  # fmt: skip
    for family in text_string_to_metric_families(text):
        histogram = ROUTER_HISTOGRAMS.get(family.name)
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if histogram is not None:
                entry = state["histograms"].setdefault(histogram, {"buckets": {}, "sum": 0.0, "count": 0.0})
                if name.endswith("_bucket"):
                    entry["buckets"][labels["le"]] = entry["buckets"].get(labels["le"], 0.0) + value
                elif name.endswith("_sum"):
                    entry["sum"] += value
                elif name.endswith("_count"):
                    entry["count"] += value
            elif name.endswith("_created") and name.removesuffix("_created") in ROUTER_HISTOGRAMS:
                # When the router process made the histogram (the text format lists it as a gauge).
                state["started"] = min(value, state.get("started", value))
            elif name == "router_requests_total":
                outcome = labels.get("outcome", "")
                state["requests"][outcome] = state["requests"].get(outcome, 0.0) + value
            elif name == "router_rejected_total":
                state["rejected"] += value
            elif name == "router_generation_tokens_total":
                state["tokens"] += value
            elif name == "router_prompt_tokens_total":
                state["prompt_tokens"] += value
            elif name == "router_cached_prompt_tokens_total":
                state["cached_prompt_tokens"] += value
            elif name == "router_prefill_where_total":
                where = labels.get("where", "")
                state["prefill_where"][where] = state["prefill_where"].get(where, 0.0) + value
            elif name in ("router_worker_selections_total", "router_worker_failures_total"):
                key = "selections" if name == "router_worker_selections_total" else "failures"
                per_url = state[key].setdefault(labels.get("role", ""), {})
                url = labels.get("url", "").rstrip("/")
                per_url[url] = per_url.get(url, 0.0) + value
            elif name in ROUTER_GAUGES:
                state["gauges"][ROUTER_GAUGES[name]] = value
    return state


def counter_delta(current: float, before: float | None, reset: bool) -> float:
    """Counter increase since `before`; after a reset (or for a series new since then) all of it."""
    if reset or before is None or current < before:
        return current
    return current - before


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """The q-quantile of observations given cumulative bucket counts [(upper bound, count)], as
    Prometheus' histogram_quantile: linear within the bucket holding the rank (the first bucket
    starts at 0); a rank in the +Inf bucket answers the highest finite bound. None without data."""
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    total = ordered[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    running = 0.0
    for upper, count in ordered:
        count = max(count, running)  # cumulative counts never go down
        running = count
        if count >= rank and count > below:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def router_changes(previous: Mapping[str, Any] | None, current: Mapping[str, Any]) -> dict[str, Any] | None:
    """What happened between two router scrapes (each `parse_router_metrics(...) | {"at": epoch s}`):
    the fields of a RouterSample plus "selections" {role: {url: Δ}}; None without a usable previous
    scrape (then only the gauges are known)."""
    if not previous or not isinstance(previous.get("at"), int | float):
        return None
    dt = float(current["at"]) - float(previous["at"])
    if dt <= 0:
        return None
    before_total = sum(previous.get("requests", {}).values())
    now_total = sum(current["requests"].values())
    # The router restarted (its counters started from zero again): another start time, or fewer requests.
    reset = now_total < before_total or previous.get("started") != current.get("started")
    requests = {
        outcome: counter_delta(value, previous.get("requests", {}).get(outcome), reset)
        for outcome, value in current["requests"].items()
    }
    finished = sum(requests.values())
    out: dict[str, Any] = {
        "interval_s": dt,
        "requests_per_s": finished / dt,
        "error_rate": requests.get("failed", 0.0) / finished if finished > 0 else None,
        "rejected_per_s": counter_delta(current["rejected"], previous.get("rejected"), reset) / dt,
        "tokens_per_s": counter_delta(current["tokens"], previous.get("tokens"), reset) / dt,
    }
    # Scrapes stored before these series existed lack them: read as absent (0), never a KeyError.
    prompt = counter_delta(current.get("prompt_tokens", 0.0), previous.get("prompt_tokens"), reset)
    cached = counter_delta(current.get("cached_prompt_tokens", 0.0), previous.get("cached_prompt_tokens"), reset)
    out["prompt_tokens_per_s"] = prompt / dt
    out["cached_prompt_tokens_per_s"] = cached / dt
    out["prompt_cached_ratio"] = cached / prompt if prompt > 0 else None
    where_before = previous.get("prefill_where") or {}
    for where in ("local", "remote"):
        n = counter_delta((current.get("prefill_where") or {}).get(where, 0.0), where_before.get(where), reset)
        out[f"{where}_prefills_per_s"] = n / dt
    for key in ROUTER_HISTOGRAMS.values():
        now_h = current["histograms"].get(key) or {"buckets": {}, "count": 0.0}
        before_h = (previous.get("histograms") or {}).get(key) or {}
        fresh = reset or float(now_h["count"]) < float(before_h.get("count", 0.0))
        deltas = [
            (float(le), counter_delta(count, (before_h.get("buckets") or {}).get(le), fresh))
            for le, count in now_h["buckets"].items()
        ]
        for name, q in QUANTILES:
            out[f"{key}_{name}_s"] = histogram_quantile(q, deltas)
    selections: dict[str, dict[str, float]] = {}
    for role, per_url in current["selections"].items():
        before_role = (previous.get("selections") or {}).get(role, {})
        selections[role] = {url: counter_delta(n, before_role.get(url), reset) for url, n in per_url.items()}
    out["selections"] = selections
    return out


def worker_share(selections: Mapping[str, Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """{role: {url: share of the role's requests}} from selection deltas (roles without any left out)."""
    shares: dict[str, dict[str, float]] = {}
    for role, per_url in selections.items():
        total = sum(per_url.values())
        if total > 0:
            shares[role] = {url: n / total for url, n in sorted(per_url.items())}
    return shares
