#!/usr/bin/env bash
# Stops what platform/local_up.sh started: the router first (no new requests), then the agent (which
# stops its workers), then the controller.
cd "$(dirname "$0")/.."
RUN=var/run
for name in router agent controller decode prefill; do
  pidfile="$RUN/$name.pid"
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
    echo "stopped $name ($pid)"
  fi
  rm -f "$pidfile"
done
