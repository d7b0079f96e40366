"""A tiny checkpoint whose greedy output repeats itself, for speculative decoding tests."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def make_copying_model(source: Path, dest: Path) -> Path:
    """Copy the tiny Llama at `source` (with its tokenizer) to `dest` with every attention output
    projection zeroed and the final norm scaled up 4x.

    With no attention output the next token depends on the last token only, so greedy output falls
    into a cycle within a few dozen tokens that n-gram lookup predicts (most proposals are accepted);
    the scaled norm makes the distributions peaked (the top token's probability is ~0.8 at
    temperature 1, as a trained model's often is), so sampled proposals are often accepted too."""
    shutil.copytree(source, dest)
    weights = load_file(str(dest / "model.safetensors"))
    for name in weights:
        if "o_proj" in name:
            weights[name] = torch.zeros_like(weights[name])
        elif name == "model.norm.weight":
            weights[name] = weights[name] * 4
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
