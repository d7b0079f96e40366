"""`--dtype` resolution: explicit names, and a deterministic "auto"."""
from __future__ import annotations

import pytest
import torch

from inference.engine import LLMEngine
from inference.engine.dtypes import MIN_BF16_HIDDEN, cpu_has_native_bf16, resolve_dtype

from .conftest import TinyModel

CPU = torch.device("cpu")


def test_explicit_names_and_errors() -> None:
    assert resolve_dtype("float32", CPU) is torch.float32
    assert resolve_dtype("bfloat16", CPU) is torch.bfloat16
    assert resolve_dtype("float16", CPU) is torch.float16
    assert resolve_dtype(torch.float16, CPU) is torch.float16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int8", CPU)


def test_auto_on_cpu_follows_the_cpu_and_model_size() -> None:
    big = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", CPU, MIN_BF16_HIDDEN) is big
    assert resolve_dtype("auto", CPU, MIN_BF16_HIDDEN - 1) is torch.float32
    # Same answer every time: both roles of a deployment must agree.
    assert {resolve_dtype("auto", CPU, 576) for _ in range(5)} == {big}


def test_engine_kv_cache_follows_the_model_dtype(llama: TinyModel) -> None:
    engine = LLMEngine(llama.path, num_blocks=8, dtype="float16")
    assert engine.dtype is torch.float16 and engine.kv_cache.data.dtype is torch.float16
    assert next(engine.model.parameters()).dtype is torch.float16
    assert engine.kv_cache.layout()["dtype"] == "float16"
    auto = LLMEngine(llama.path, num_blocks=8, dtype="auto")  # hidden 64: below the bf16 threshold
    assert auto.dtype is torch.float32
