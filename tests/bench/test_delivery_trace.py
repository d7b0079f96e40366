"""bench.delivery_trace: the DELIVERY_TRACE rows of the workers, the router and the client joined per
request and token, and the hop that made a token late named by the first point whose gap outgrew the
engine's (inference/wire/delivery_trace.py writes the rows)."""
from __future__ import annotations

from pathlib import Path

from bench.delivery_trace import summary_of, token_times
from inference.wire.delivery_trace import DeliveryTrace, read_rows


def _rows(rid: str, engine: list[float], worker: list[float], router_in: list[float],
          router_out: list[tuple[float, int]], client: list[float]) -> list[tuple[float, str, str, int]]:
    rows = [(t, "engine", rid, 1) for t in engine] + [(t, "worker", rid, 1) for t in worker]
    rows += [(t, "router_in", rid, 1) for t in router_in] + [(t, "router_out", rid, n) for t, n in router_out]
    return rows + [(t, "client", "cmpl-" + rid.removeprefix("req-"), 1) for t in client]


def test_a_token_read_late_by_the_router_is_late_from_router_in_on(tmp_path: Path) -> None:
    """Steps of 50 ms; the router reads tokens 2 and 3 in one read and sends them as one event: from
    `router_in` on, token 2's gap is two steps (late) and token 3's none (together), while the engine and
    the worker have none late."""
    engine = [1.00, 1.05, 1.10, 1.15, 1.20]
    worker = [t + 0.001 for t in engine]
    router_in = [1.002, 1.052, 1.152, 1.152, 1.202]  # token 2's line read a step late, with token 3's
    router_out = [(1.003, 1), (1.053, 1), (1.153, 2), (1.203, 1)]
    client = [1.004, 1.054, 1.154, 1.204]
    rows = _rows("req-a", engine, worker, router_in, router_out, client)
    (tmp_path / "trace-1.tsv").write_text("".join(f"{t:.6f}\t{p}\t{r}\t{n}\n" for t, p, r, n in rows))
    summary = summary_of(tmp_path)
    points = summary["points"]
    assert summary["requests"] == 1 and summary["gaps"] == 4
    assert [points[p]["late"] for p in ("engine", "worker", "router_in", "router_out", "client")] == [0, 0, 1, 1, 1]
    assert points["client"]["together"] == 1 and points["engine"]["together"] == 0
    assert points["router_in"]["delay_ms_max"] == 51.0  # token 2: 1.152 against the worker's 1.101


def test_blank_events_reach_the_client_with_the_next_text() -> None:
    """An event without text (a partial character) is not a client event: its token is timed at the
    client by the next event with text; the OpenAI id (`cmpl-`) joins the router's (`req-`)."""
    rows = _rows("req-b", [2.0, 2.05, 2.10], [2.0, 2.05, 2.10], [2.0, 2.05, 2.10], [(2.0, 1), (2.1, 1)],
                 [2.001, 2.101])
    rows.append((2.05, "router_out_blank", "req-b", 1))
    joined = token_times(rows)
    assert joined["b"]["client"] == [2.001, 2.101, 2.101]
    assert joined["b"]["router_out"] == [2.0, 2.05, 2.1]


def test_requests_outside_the_span_are_left_out() -> None:
    """A point's summary counts the requests whose first engine output falls in its span (the warm-up's
    and the next point's are left out)."""
    rows = _rows("req-w", [0.5, 0.6], [0.5, 0.6], [0.5, 0.6], [(0.5, 1), (0.6, 1)], [0.5, 0.6])
    rows += _rows("req-m", [5.0, 5.1], [5.0, 5.1], [5.0, 5.1], [(5.0, 1), (5.1, 1)], [5.0, 5.1])
    rows += _rows("req-n", [9.0, 9.1], [9.0, 9.1], [9.0, 9.1], [(9.0, 1), (9.1, 1)], [9.0, 9.1])
    assert list(token_times(rows, since=1.0, until=8.0)) == ["m"]


def test_the_trace_writes_its_rows_in_batches_and_on_flush(tmp_path: Path) -> None:
    """Rows stay in memory until FLUSH_ROWS or flush(), then land in the process's file."""
    trace = DeliveryTrace(tmp_path / "t")
    trace.mark("engine", "req-x", 1, at=3.25)
    assert read_rows(tmp_path / "t") == []
    trace.flush()
    assert read_rows(tmp_path / "t") == [(3.25, "engine", "req-x", 1)]

