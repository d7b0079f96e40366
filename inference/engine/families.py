"""What each supported model family adds to the Llama decoder, read once from `config.json`.

Every family is a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, gated MLP); this
module turns a checkpoint's family-specific fields into the feature flags `ModelConfig` carries, and
refuses, naming the feature, what the engine does not implement:

- llama / smollm: the base (optional attention/MLP biases, tied head, llama3 or linear RoPE scaling).
- qwen2: q/k/v biases; sliding windows on the layers past `max_window_layers` when `use_sliding_window`.
- mistral: Llama plus an optional `sliding_window` on every layer.
- qwen3: per-head RMSNorm of q and k before RoPE (`head_dim` need not be hidden / heads), no biases.
- phi3: fused `qkv_proj` / `gate_up_proj` checkpoint tensors (our own layout, loaded as they are),
  an optional `sliding_window`; partial rotary and longrope scaling are refused.
- gemma2 / gemma3: see `GemmaFeatures` below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Architecture names (config.json `architectures`) and the family each one is.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
}
# SmolLM checkpoints declare LlamaForCausalLM, but some tools write their own model_type, so the
# model_type is accepted as a fallback.
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "smollm": "llama",
    "smollm2": "llama",
    "qwen2": "qwen2",
    "mistral": "mistral",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class GemmaFeatures:
    """Gemma 2/3's differences from Llama: the embedding is scaled by sqrt(hidden), every RMSNorm
    multiplies by (1 + w) (folded into the weight at load: `weights.py`), the MLP is GeGLU with
    gelu_tanh, each sublayer output is normalised again before the residual add (post-attention and
    pre/post feed-forward norms), queries are scaled by `query_pre_attn_scalar ** -0.5`, and attention
    and final logits may be soft-capped (`cap * tanh(x / cap)`). Gemma 3 adds q/k norms and a separate
    RoPE base for its sliding layers."""

    query_pre_attn_scalar: float
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    rope_local_theta: float | None  # Gemma 3: RoPE base of the sliding-window layers


def family_of(cfg: dict[str, Any]) -> tuple[str, str]:
    """(architecture name, family) of a parsed config.json; ValueError naming it when unsupported."""
    archs = cfg.get("architectures") or []
    model_type = str(cfg.get("model_type", ""))
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch, SUPPORTED_ARCHITECTURES[arch]
    arch_name = archs[0] if archs else model_type
    family = SUPPORTED_MODEL_TYPES.get(model_type)
    if family is None:
        raise ValueError(
            f"unsupported architecture {arch_name!r} (model_type {model_type!r}); "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)} / model_type {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    return arch_name, family


def hidden_act_of(family: str, cfg: dict[str, Any]) -> str:
    """The MLP gate's activation: "silu" (every family but Gemma) or "gelu_tanh" (Gemma)."""
    if family in ("gemma2", "gemma3"):
        act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {act!r} for {family} (only gelu_pytorch_tanh)")
        return "gelu_tanh"
    act = str(cfg.get("hidden_act", "silu"))
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
    return "silu"


def biases_of(family: str, cfg: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, MLP bias) of the family."""
    if family == "qwen2":
        return True, False, False  # Qwen2 always has q/k/v biases and never an o_proj bias
    if family == "phi3":
        return False, False, False
    attn = bool(cfg.get("attention_bias", False))
    return attn, attn, bool(cfg.get("mlp_bias", False))


def layer_types_of(family: str, cfg: dict[str, Any], num_layers: int, max_positions: int) -> tuple[
    int | None, list[str]
]:
    """(sliding window, each layer's attention type). The window is None when no layer slides, or when
    it is at least `max_positions` (a window that never drops a key is full attention); the types stay
    as declared (Gemma 3's sliding layers keep their own RoPE base either way)."""
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None
    if family == "llama" or (window is None and family not in ("gemma2", "gemma3")):
        return None, [FULL] * num_layers
    given = cfg.get("layer_types")
    if given is not None:
        types = [str(t) for t in given]
        if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
            raise ValueError(f"unsupported layer_types {given!r} (one of {SLIDING!r}, {FULL!r} per layer)")
    elif family in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", num_layers))
        types = [SLIDING if i >= first else FULL for i in range(num_layers)]
    elif family == "gemma2":
        types = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    elif family == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    else:  # mistral, phi3: every layer
        types = [SLIDING] * num_layers
    if window is None or int(window) >= max_positions or SLIDING not in types:
        return None, types
    if int(window) < 1:
        raise ValueError(f"sliding_window must be positive, got {window}")
    return int(window), types


def check_rotary(family: str, cfg: dict[str, Any], rope_params: dict[str, Any] | None) -> None:
    """Refuse partial rotary embeddings (Phi-4-mini's 0.75, some Phi-3 variants): the engine rotates
    whole heads."""
    factor = cfg.get("partial_rotary_factor")
    if isinstance(rope_params, dict) and "partial_rotary_factor" in rope_params:
        factor = rope_params["partial_rotary_factor"]
    if factor is not None and float(factor) != 1.0:
        raise ValueError(f"partial_rotary_factor {factor} is not supported ({family}: only whole-head RoPE)")


def gemma_features(family: str, cfg: dict[str, Any], head_dim: int) -> GemmaFeatures | None:
    """The Gemma-specific fields (None for the other families)."""
    if family not in ("gemma2", "gemma3"):
        return None
    local_theta = None
    if family == "gemma3":
        local_theta = float(cfg.get("rope_local_base_freq") or 10000.0)
        rope_params = cfg.get("rope_parameters")
        if isinstance(rope_params, dict) and isinstance(rope_params.get(SLIDING), dict):
            local_theta = float(rope_params[SLIDING].get("rope_theta", local_theta))
    attn_cap = cfg.get("attn_logit_softcapping")
    final_cap = cfg.get("final_logit_softcapping")
    return GemmaFeatures(
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim),
        attn_logit_softcapping=float(attn_cap) if attn_cap else None,
        final_logit_softcapping=float(final_cap) if final_cap else None,
        rope_local_theta=local_theta,
    )
