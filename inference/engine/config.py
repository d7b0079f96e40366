"""Model configuration read from a Hugging Face checkpoint folder (`config.json`)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

# Architectures we implement. SmolLM checkpoints declare LlamaForCausalLM, but some tools write their own
# model_type, so the model_type is accepted as a fallback.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "smollm": "llama",
    "smollm2": "llama",
}


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

    `family` is "llama" or "qwen2"; it decides which projections carry a bias.
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

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from the parsed `config.json` (and optional `generation_config.json`) dictionaries."""
        archs = cfg.get("architectures") or []
        model_type = str(cfg.get("model_type", ""))
        family = None
        arch_name = archs[0] if archs else model_type
        for arch in archs:
            if arch in SUPPORTED_ARCHITECTURES:
                family = SUPPORTED_ARCHITECTURES[arch]
                arch_name = arch
                break
        if family is None:
            family = SUPPORTED_MODEL_TYPES.get(model_type)
        if family is None:
            raise ValueError(
                f"unsupported architecture {arch_name!r} (model_type {model_type!r}); "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)} / model_type {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        hidden_act = str(cfg.get("hidden_act", "silu"))
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (only silu)")

        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)

        # transformers 5 writes `rope_parameters` ({rope_type, rope_theta, ...}); older checkpoints write
        # `rope_theta` plus `rope_scaling` ({type|rope_type, factor, ...}). Accept both.
        rope_params = cfg.get("rope_parameters")
        rope_theta = float(cfg.get("rope_theta") or 10000.0)
        rope_scaling: dict[str, Any] | None = cfg.get("rope_scaling")
        if isinstance(rope_params, dict):
            rope_theta = float(rope_params.get("rope_theta", rope_theta))
            rope_scaling = dict(rope_params)
        rope_scaling = _normalise_rope_scaling(rope_scaling)

        if family == "qwen2":
            # Qwen2 always has q/k/v biases and never an o_proj bias.
            qkv_bias, o_bias = True, False
            if cfg.get("use_sliding_window"):
                raise ValueError("Qwen2 sliding-window attention is not supported")
        else:
            qkv_bias = o_bias = bool(cfg.get("attention_bias", False))

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
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=hidden_act,
            bos_token_id=int(bos) if isinstance(bos, int) else None,
            eos_token_ids=eos,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
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


def _normalise_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Return None for plain RoPE, the dict (with `rope_type`) for llama3; raise for anything else."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: none, 'llama3')")
    for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if key not in scaling:
            raise ValueError(f"llama3 rope scaling is missing {key!r}")
    out = dict(scaling)
    out["rope_type"] = "llama3"
    return out
