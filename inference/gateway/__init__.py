"""How the router is hosted: Channels consumers over the Django-free core in `inference.router`.

- `consumers`: the public HTTP API (generation, OpenAI, /health, /router/status, /metrics);
- `websocket`: ws/generate;
- `routing`: their paths, put in front of Django by config/asgi.py;
- `service`: the process's router (pool, admission, metrics, client) built once from settings;
- `follow`: managed mode, the pool following a deployment's RUNNING workers in the database;
- `auth`: who a request is from (database API keys, ROUTER_API_KEYS or DRF tokens), checked by the consumers
  and the ws middleware; `api_keys`: the process's snapshot of the database keys (`Tenant`s);
- `tenancy`: a generation's tenant side (scope, limits, priority class, tokens, usage, per-class series);
  `quotas`: the per-key counters (Redis, or per process); `redis_batch`: their script calls, pipelined;
- `limits`: the body size limit in front of the Django views on the same port.
"""
