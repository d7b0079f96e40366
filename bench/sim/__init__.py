"""A simulated worker fleet: many lightweight prefill and decode workers per process (issue 25).

Each simulated worker listens on its own port on 127.0.0.1 and answers what a real worker answers
(`inference/server/app.py`): `GET /health`, `/metrics`, `/info`, `/v1/models`, and the internal
`POST /internal/decode` (NDJSON: descriptor, token lines, done), `/internal/prefill` and
`/internal/abort`, with the same field names, so the real router (`python -m
inference.launch_router`) serves generations through them. No model runs: prefill takes a
configurable time per prompt token, decode streams at a configurable token rate, and the "KV" is
one small loopback call from the prefill worker to the decode worker's `/sim/kv`.

    bench/sim/config.py      what a simulated worker is like (rates, sizes, latencies)
    bench/sim/worker.py      one simulated worker: its answers and its request flows
    bench/sim/fleet.py       many workers in one asyncio process (`python -m bench.sim.fleet`)
    bench/sim/launch.py      start and stop fleet processes (and the real router) from a benchmark
    bench/sim/policy_cost.py the router's policy + admission CPU per request, in process
    bench/sim/router_scale.py the benchmark: router CPU per request and health-check CPU by pool size

Nothing here imports Django: the fleet stands in for the data plane only.
"""
