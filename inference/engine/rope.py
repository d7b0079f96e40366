"""Rotary position embeddings in transformers' "rotate half" convention, with the RoPE scalings the
engine implements (llama3, linear; config.py refuses the others)."""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import ModelConfig


def rope_inv_freq(config: ModelConfig, theta: float | None = None, scaled: bool = True) -> torch.Tensor:
    """RoPE inverse frequencies (base `theta`, default the config's), with the config's llama3 or linear
    scaling when configured and `scaled` (Gemma 3's sliding layers use a plain local base)."""
    dim = config.head_dim
    base = config.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling if scaled else None
    if scaling is None:
        return inv_freq
    if scaling.get("rope_type") == "linear":
        return inv_freq / float(scaling["factor"])
    if scaling.get("rope_type") != "llama3":
        raise ValueError(f"unsupported rope scaling {scaling!r}")
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, and the band between interpolated.
    long_scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * long_scaled / factor + smooth * long_scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, long_scaled)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the HF "rotate half" convention."""

    def __init__(self, config: ModelConfig) -> None:
        """Precompute inverse frequencies (cos/sin are computed per step for the step's positions only:
        a table for 128k positions would cost more memory than it saves)."""
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.inv_freq: torch.Tensor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin `[num_tokens, 1, head_dim]` for the given positions, as `apply_rope` takes
        them: the sin's first half is negated, so that rotating half the vector is a plain roll."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, : freqs.shape[1]].neg_()
        return emb.cos().to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `[num_tokens, heads, head_dim]` by the per-token angles (HF's "rotate half" convention:
    x * cos + (-x2, x1) * sin, here with (x2, x1) = roll(x) and the sign folded into `signed_sin`,
    which gives the same bits with two kernels fewer)."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin
