#!/usr/bin/env bash
# Stops what platform/local_up.sh started (router first, so no request is sent to a stopping worker).
cd "$(dirname "$0")/.."
RUN=var/run
for name in router decode prefill; do
  pidfile="$RUN/$name.pid"
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$pid" 2>/dev/null || true
    echo "stopped $name ($pid)"
  fi
  rm -f "$pidfile"
done
