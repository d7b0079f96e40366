#!/usr/bin/env bash
# `make up`: the whole platform on this host with embedded defaults (SQLite, filesystem Celery broker
# unless DATABASE_URL/REDIS_URL are set): controller (Celery + beat), one agent, and the managed
# router of the demo deployment; the agent launches its prefill and decode workers.
# Logs and pid files go to var/run; `make down` stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8000}
MODEL_DIR=${MODEL_DIR:-model_cache/SmolLM2-135M-Instruct}
DEPLOYMENT=${DEPLOYMENT:-demo}
PY=.venv/bin/python
RUN=var/run
mkdir -p "$RUN"
bash platform/local_down.sh >/dev/null 2>&1 || true

start() {  # name, command...
  local name=$1; shift
  nohup "$@" >"$RUN/$name.log" 2>&1 &
  echo $! >"$RUN/$name.pid"
}

alive() { kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

fail() {  # name, message
  echo "$2; its log ($RUN/$1.log):" >&2; tail -20 "$RUN/$1.log" >&2; exit 1
}

$PY manage.py bootstrap_demo --model-path "$MODEL_DIR" --deployment "$DEPLOYMENT" \
  --router-url "http://127.0.0.1:$PORT" | tee "$RUN/bootstrap.txt"
start controller $PY manage.py controller
start agent $PY manage.py agent --name local --address 127.0.0.1
start router $PY -m inference.launch_router --deployment "$DEPLOYMENT" --listen-port "$PORT"

generates() {  # a one-token generation answers (with the first ROUTER_API_KEYS key when auth is on)
  local keys=${ROUTER_API_KEYS:-}
  local key=${keys%%,*}
  if [ "${ROUTER_REQUIRE_AUTH:-0}" = "1" ] && [ -z "$key" ]; then
    # Keys live in the database only: no key to try here, so wait for the router's readiness instead.
    curl -fsS "http://127.0.0.1:$PORT/health" 2>/dev/null | grep -q '"ready":true'
    return
  fi
  curl -fsS -X POST "http://127.0.0.1:$PORT/generate" -H "Content-Type: application/json" \
       ${key:+-H "Authorization: Bearer $key"} -d '{"prompt": "Hi", "max_tokens": 1}' >/dev/null 2>&1
}

echo "waiting for the agent to start the demo's prefill and decode workers (loading the model)..."
ready=""
for _ in $(seq 1 300); do
  for name in controller agent router; do alive "$name" || fail "$name" "$name exited"; done
  if generates; then ready=1; break; fi
  sleep 1
done
[ -n "$ready" ] || fail agent "the deployment did not answer within 300s (see also $RUN/controller.log)"

# The deployment's live charts page is addressed by its id.
# -v 0: Django's shell otherwise prints "N objects imported automatically" on stdout.
DEPLOYMENT_ID=$($PY manage.py shell -v 0 -c \
  "from inference.models import Deployment; print(Deployment.objects.get(name='$DEPLOYMENT').pk)" 2>/dev/null || true)

cat <<TXT

The platform is up.
  router + admin: http://127.0.0.1:$PORT      (admin console: http://127.0.0.1:$PORT/admin/)
  metrics (live charts of $DEPLOYMENT): http://127.0.0.1:$PORT/admin/inference/deployment/${DEPLOYMENT_ID:-?}/metrics/
  Prometheus metrics of the router: http://127.0.0.1:$PORT/metrics
$(sed 's/^/  /' "$RUN/bootstrap.txt")
Logs in $RUN/ (worker logs under var/logs/). Stop with: make down

Try:
  curl -X POST http://127.0.0.1:$PORT/generate -H "Content-Type: application/json" \\
       -d '{"prompt": "解释分布式推理架构的优势：", "max_tokens": 100}'
TXT

# Open mode said out loud: without ROUTER_REQUIRE_AUTH or ROUTER_API_KEYS anybody who reaches the port generates.
if [ -z "${ROUTER_API_KEYS:-}" ] && [ "${ROUTER_REQUIRE_AUTH:-0}" != "1" ]; then
  cat <<TXT

WARNING: the generation API is OPEN: any caller, with or without a key, can generate.
  Create an API key (with limits and a priority class) in the admin: http://127.0.0.1:$PORT/admin/inference/apikey/add/
  or with the REST API: curl -X POST http://127.0.0.1:$PORT/api/keys/ -H "Authorization: Token <your DRF token>" \\
       -H "Content-Type: application/json" -d '{"name": "my-app", "requests_per_minute": 60}'
  then restart with ROUTER_REQUIRE_AUTH=1 make up, and send: -H "Authorization: Bearer <secret>"
TXT
fi
