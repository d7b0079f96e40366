#!/usr/bin/env bash
# Starts router + one prefill + one decode worker on this host in the background (used by `make up`).
# Logs and pid files go to var/run; `make down` stops them.
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8000}
PREFILL_PORT=${PREFILL_PORT:-30000}
DECODE_PORT=${DECODE_PORT:-30001}
MODEL_DIR=${MODEL_DIR:-model_cache/smollm2-135m-instruct}
PY=.venv/bin/python
RUN=var/run
mkdir -p "$RUN"
bash platform/local_down.sh >/dev/null 2>&1 || true

start() {  # name, command...
  local name=$1; shift
  nohup "$@" >"$RUN/$name.log" 2>&1 &
  echo $! >"$RUN/$name.pid"
}

wait_http() {  # url, name, seconds
  local url=$1 name=$2 limit=$3
  for _ in $(seq 1 "$limit"); do
    if curl -fsS "$url" >/dev/null 2>&1; then return 0; fi
    if ! kill -0 "$(cat "$RUN/$name.pid")" 2>/dev/null; then
      echo "$name exited; its log ($RUN/$name.log):" >&2; tail -20 "$RUN/$name.log" >&2; exit 1
    fi
    sleep 1
  done
  echo "$name did not become healthy within ${limit}s; see $RUN/$name.log" >&2; exit 1
}

# Two cores: prefill on CPU 0, decode on CPU 1 where the host has them.
CPUS=$(nproc)
PIN_P=(); PIN_D=()
if [ "$CPUS" -ge 2 ]; then PIN_P=(--base-cpu-id 0 --num-threads 1); PIN_D=(--base-cpu-id 1 --num-threads 1); fi

CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} start prefill $PY -m inference.launch_server \
  --model-path "$MODEL_DIR" --service-type prefill --port "$PREFILL_PORT" --context-length 2048 \
  --batch-size 8 "${PIN_P[@]}"
CUDA_VISIBLE_DEVICES="" start decode $PY -m inference.launch_server \
  --model-path "$MODEL_DIR" --service-type decode --port "$DECODE_PORT" --context-length 2048 \
  --max-sequence-length 2048 "${PIN_D[@]}"
wait_http "http://127.0.0.1:$PREFILL_PORT/health" prefill 180
wait_http "http://127.0.0.1:$DECODE_PORT/health" decode 180
start router $PY -m inference.launch_router \
  --prefill-endpoint "http://127.0.0.1:$PREFILL_PORT" --decode-endpoint "http://127.0.0.1:$DECODE_PORT" \
  --listen-port "$PORT" --load-balance-strategy round-robin
wait_http "http://127.0.0.1:$PORT/health" router 60

cat <<TXT

The platform is up: router http://127.0.0.1:$PORT  (prefill :$PREFILL_PORT, decode :$DECODE_PORT)
Logs in $RUN/. Stop with: make down

Try:
  curl -X POST http://127.0.0.1:$PORT/generate -H "Content-Type: application/json" \\
       -d '{"prompt": "Explain the advantages of disaggregated inference:", "max_tokens": 100}'
TXT
