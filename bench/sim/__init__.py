"""A simulated worker fleet: many lightweight prefill and decode workers per process (issue 25).

Each simulated worker listens on its own port on 127.0.0.1 and answers what a real worker answers
(`inference/server/app.py`): `GET /health`, `/metrics`, `/info`, `/v1/models`, and the internal
`POST /internal/decode` (NDJSON: descriptor, token lines, done), `/internal/prefill` and
`/internal/abort`, with the same field names (the sampling rules and stream lines come from
`inference.wire`, the contract the real workers use), so the real router (`python -m
inference.launch_router`) serves generations through them. No model runs: prefill takes a
configurable time per prompt token, decode streams at a configurable token rate, and the "KV" is
one small loopback call from the prefill worker to the decode worker's `/sim/kv`.

    bench/sim/config.py      what a simulated worker is like (rates, sizes, latencies)
    bench/sim/worker.py      one simulated worker: its answers and its request flows
    bench/sim/fleet.py       many workers in one asyncio process (`python -m bench.sim.fleet`)
    bench/sim/launch.py      start and stop fleet processes (and the real router) from a benchmark
    bench/sim/policy_cost.py the router's policy + admission CPU per request, in process
    bench/sim/health_cost.py the router's health checks' CPU per check, in process
    bench/sim/request_cost.py the router core's CPU per request, in process
    bench/sim/footprint.py   the fleet's own memory, start time and CPU per answer
    bench/sim/router_scale.py the benchmark: router CPU per request and health-check CPU by pool size

A fleet process also answers a control API (any of its ports): `POST /sim/workers` starts or stops
workers at run time, `POST /sim/fault` makes one's health checks fail, `GET /sim/stats` counts the
requests served; `--host 127.0.0.N` gives each fleet process (a simulated node) its own address.

Nothing here imports Django: the fleet stands in for the data plane only.
"""
