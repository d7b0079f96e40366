"""Which hop of the token delivery path makes a token late (issue 19): the DELIVERY_TRACE files joined.

The workers, the router and `bench.serve_vs_vllm`'s client (run with `--delivery-trace DIR`) each write
per-token timestamps (inference/wire/delivery_trace.py) at five points: `engine` (the step's end),
`worker` (its line written), `router_in` (the line taken by the router), `router_out` (the event sent to
the client), `client` (the event received). Joined per request and token, each point's inter-token
gaps are set against the engine's gap of the same token (the step that made it, and any time between
steps): a gap over `LATE_FACTOR` x the engine's is a token that reached that point late. The first
point where those counts rise is the hop that adds the late steps; each hop's own delay (from the
point before) is given too.

    .venv/bin/python -m bench.delivery_trace var/trace/both-cost-1733400000   # a summary as JSON
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import median, percentile
from inference.wire.delivery_trace import read_rows

POINTS = ("engine", "worker", "router_in", "router_out", "client")
# A gap this many times the engine's gap of the same token is a late token at that point.
LATE_FACTOR = 1.5


def _key(request_id: str) -> str:
    """The request id as every point names it (the client sees the OpenAI id, `cmpl-<hex>`)."""
    for prefix in ("chatcmpl-", "cmpl-", "req-"):
        if request_id.startswith(prefix):
            return request_id[len(prefix):]
    return request_id


def token_times(rows: list[tuple[float, str, str, int]], since: float = 0.0,
                until: float = float("inf")) -> dict[str, dict[str, list[float]]]:
    """Per request (of those whose first engine row is in [`since`, `until`)), per point, one time per
    token. The client's events carry no token count: each takes the count of the router's text event
    of the same rank (a request whose counts of events differ has no client times)."""
    by_request: dict[str, dict[str, list[tuple[float, int]]]] = defaultdict(lambda: defaultdict(list))
    for t, point, rid, n in rows:
        by_request[_key(rid)][point].append((t, n))
    joined: dict[str, dict[str, list[float]]] = {}
    for rid, points in by_request.items():
        for marks in points.values():
            marks.sort()
        engine = points.get("engine")
        if not engine or not since <= engine[0][0] < until:
            continue
        out: dict[str, list[float]] = {}
        for point in ("engine", "worker", "router_in"):
            out[point] = [t for t, n in points.get(point, []) for _ in range(n)]
        # router_out: text and blank events in order; the client's events match the text ones.
        sent = sorted(points.get("router_out", []) + [(t, -n) for t, n in points.get("router_out_blank", [])])
        out["router_out"] = [t for t, n in sent for _ in range(abs(n))]
        text_events = points.get("router_out", [])
        client = points.get("client", [])
        if len(client) == len(text_events):
            times: list[float] = []
            blank, rank = 0, 0
            for _, n in sent:
                if n < 0:  # a blank event's tokens reach the client with the next event that has text
                    blank += -n
                    continue
                times += [client[rank][0]] * (blank + n)  # the client's event of the same rank
                blank, rank = 0, rank + 1
            out["client"] = times + times[-1:] * blank  # trailing blanks: with the last event, as near as known
        joined[rid] = out
    return joined


def summarize(joined: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    """Per point: its gaps (p50, p99), the late ones (over LATE_FACTOR x the engine's gap of the same
    token), and the delay added since the point before (p50, p99, max), over every token after a
    request's first whose engine time is known."""
    gaps: dict[str, list[float]] = defaultdict(list)
    late: dict[str, int] = defaultdict(int)
    delay: dict[str, list[float]] = defaultdict(list)
    counted = 0
    for points in joined.values():
        engine = points["engine"]
        for k in range(1, len(engine)):
            step = engine[k] - engine[k - 1]
            counted += 1
            for i, point in enumerate(POINTS):
                times = points.get(point) or []
                if len(times) != len(engine):
                    continue
                gap = times[k] - times[k - 1]
                gaps[point].append(gap)
                if gap > LATE_FACTOR * step:
                    late[point] += 1
                if i:
                    before = points.get(POINTS[i - 1]) or []
                    if len(before) == len(engine):
                        delay[point].append(times[k] - before[k])
    summary: dict[str, Any] = {"requests": len(joined), "gaps": counted, "late_factor": LATE_FACTOR, "points": {}}
    for point in POINTS:
        values = gaps.get(point, [])
        nonzero = [g for g in values if g > 1e-4]  # tokens that came in one event: one gap, as the client counts
        summary["points"][point] = {
            "gaps": len(values),
            "late": late.get(point, 0),
            "late_share": round(late.get(point, 0) / len(values), 4) if values else None,
            "gap_ms_p50": _ms(median(nonzero)),
            "gap_ms_p99": _ms(percentile(nonzero, 99)),
            "together": len(values) - len(nonzero),
            "delay_ms_p50": _ms(median(delay.get(point, []))),
            "delay_ms_p99": _ms(percentile(delay.get(point, []), 99)),
            "delay_ms_max": _ms(max(delay.get(point, []), default=None)),
        }
    return summary


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 2)


def summary_of(folder: Path, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
    """The summary of the requests traced under `folder` whose first token came in [`since`, `until`)."""
    return summarize(token_times(read_rows(folder), since, until))


def main(argv: list[str] | None = None) -> int:
    """Print the summary of the trace folder named on the command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print(__doc__)
        return 2
    print(json.dumps(summary_of(Path(args[0])), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
