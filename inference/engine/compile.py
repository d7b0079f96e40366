"""`--compile`: torch.compile (inductor) of the model's dense per-token parts.

Compiled: every RMSNorm, the q/k/v projection with RoPE, and the gated MLP of each layer, with dynamic
shapes (one graph serves every batch size and prefill length; the layers share it, because torch
inlines module parameters as graph inputs instead of guarding on each module). The attention over
the paged cache stays eager: its structure (how many length buckets, their widths) changes from
step to step, and a compiled version would recompile for every new layout.

On a CPU inductor generates and builds C++, so a C++ compiler must be installed; without one the
engine refuses `--compile` at startup (instead of failing at the first request). CUDA graphs are not
captured: the bucketed attention's Python-level structure would need one graph per bucket layout.
"""
from __future__ import annotations

import logging
import os
import shutil

import torch

from .model import DecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

_CXX_CANDIDATES = ("g++", "c++", "clang++")


class CompileUnavailable(ValueError):
    """torch.compile cannot run on this host (a missing C++ compiler, an unsupported device)."""


def cpp_compiler() -> str | None:
    """The C++ compiler inductor would use here (`$CXX`, else the first of g++/c++/clang++ on PATH)."""
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    for name in _CXX_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def check_compile_available(device: torch.device) -> None:
    """Raise CompileUnavailable with what to do when torch.compile cannot work on `device`."""
    if device.type == "cpu" and cpp_compiler() is None:
        raise CompileUnavailable(
            "--compile on a CPU needs a C++ compiler for torch inductor (none of $CXX, "
            f"{', '.join(_CXX_CANDIDATES)} found on PATH): install one (e.g. apt-get install g++) or "
            "run without --compile"
        )
    if device.type not in ("cpu", "cuda"):
        raise CompileUnavailable(f"--compile supports cpu and cuda devices, not {device.type}")


def compile_model(model: LlamaForCausalLM) -> None:
    """Compile the dense parts of `model` in place (see the module docstring). Compilation itself
    happens lazily, at the first forward that reaches each part."""
    check_compile_available(next(model.parameters()).device)
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)  # ModuleList items are typed as Module
        layer.input_layernorm.compile(dynamic=True)
        layer.post_attention_layernorm.compile(dynamic=True)
        layer.mlp.compile(dynamic=True)
        layer.self_attn.compile_projection()
    model.norm.compile(dynamic=True)
    logger.info("torch.compile enabled for norms, q/k/v + RoPE and MLPs (compiles on first use)")
