"""Model configuration read from a Hugging Face checkpoint folder (`config.json`)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from .families import (
    FULL,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_MODEL_TYPES,
    GemmaFeatures,
    biases_of,
    check_rotary,
    family_of,
    gemma_features,
    hidden_act_of,
    layer_types_of,
)

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_MODEL_TYPES", "ModelConfig"]

def _as_id_list(value: Any) -> list[int]:
    """Normalise an `eos_token_id` field (None, int or list of ints) to a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass
class ModelConfig:
    """The subset of a HF decoder config the engine needs.

    `family` is one of `families.SUPPORTED_ARCHITECTURES`' values; the flags below are what the families
    change in the Llama decoder (see families.py), read once here so the model never looks at the
    family name.
    """

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    # Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Keys a sliding-window layer attends to: its own position and the `sliding_window - 1` before it.
    sliding_window: int | None = None
    # Each layer's attention, `families.FULL` or `families.SLIDING` (all FULL without a window).
    layer_types: list[str] = field(default_factory=list)
    gemma: GemmaFeatures | None = None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, None for full attention."""
        if self.sliding_window is None or not self.layer_types or self.layer_types[layer] == FULL:
            return None
        return self.sliding_window

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from the parsed `config.json` (and optional `generation_config.json`) dictionaries.
        Raises ValueError naming the architecture or feature the engine does not implement."""
        arch_name, family = family_of(cfg)
        hidden_act = hidden_act_of(family, cfg)
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(cfg["num_hidden_layers"])
        max_positions = int(cfg.get("max_position_embeddings", 2048))

        # transformers 5 writes `rope_parameters` ({rope_type, rope_theta, ...}; Gemma 3 one dict per
        # attention type); older checkpoints write `rope_theta` plus `rope_scaling` ({type|rope_type,
        # factor, ...}). Accept both.
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict) and isinstance(rope_params.get(FULL), dict):
            rope_params = rope_params[FULL]
        rope_theta = float(cfg.get("rope_theta") or 10000.0)
        rope_scaling: dict[str, Any] | None = cfg.get("rope_scaling")
        if isinstance(rope_params, dict):
            rope_theta = float(rope_params.get("rope_theta", rope_theta))
            rope_scaling = dict(rope_params)
        rope_scaling = _normalise_rope_scaling(rope_scaling)
        check_rotary(family, cfg, rope_params if isinstance(rope_params, dict) else None)
        sliding_window, layer_types = layer_types_of(family, cfg, layers, max_positions)
        qkv_bias, o_bias, mlp_bias = biases_of(family, cfg)

        eos = _as_id_list(cfg.get("eos_token_id"))
        if generation_config:
            for tok in _as_id_list(generation_config.get("eos_token_id")):
                if tok not in eos:
                    eos.append(tok)
        bos = cfg.get("bos_token_id")
        return cls(
            architecture=arch_name,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family in ("gemma2", "gemma3"))),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            hidden_act=hidden_act,
            bos_token_id=int(bos) if isinstance(bos, int) else None,
            eos_token_ids=eos,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            qk_norm=family in ("qwen3", "gemma3"),
            sliding_window=sliding_window,
            layer_types=layer_types,
            gemma=gemma_features(family, cfg, head_dim),
        )

    @classmethod
    def from_pretrained(cls, path: str) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` when present) from a checkpoint folder."""
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no config.json in {path!r}")
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
        gen: dict[str, Any] | None = None
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path, encoding="utf-8") as f:
                gen = json.load(f)
        return cls.from_dict(cfg, gen)


# What each RoPE scaling type needs besides `factor`.
_ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}


def _normalise_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return None for plain RoPE, the dict (with `rope_type`) for llama3 and linear scaling; raise,
    naming the type, for anything else (dynamic NTK depends on the longest sequence of a batch, yarn
    and longrope change attention's scale: not implemented)."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_SCALING_KEYS:
        raise ValueError(
            f"unsupported rope scaling type {rope_type!r} (supported: none, {', '.join(map(repr, _ROPE_SCALING_KEYS))})"
        )
    for key in _ROPE_SCALING_KEYS[rope_type]:
        if key not in scaling:
            raise ValueError(f"{rope_type} rope scaling is missing {key!r}")
    out = dict(scaling)
    out["rope_type"] = rope_type
    return out
