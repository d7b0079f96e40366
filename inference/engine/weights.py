"""Loading HF safetensors checkpoints into `LlamaForCausalLM` (HF parameter names -> our fused modules)."""
from __future__ import annotations

import json
import logging
import os
import re

import torch
from safetensors import safe_open

from .config import ModelConfig
from .gemma import GemmaForCausalLM
from .model import LlamaForCausalLM

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Per-layer tensors whose names are the same in HF checkpoints and in our modules: Phi-3 stores q/k/v
# and gate/up fused in our own layout ([q; k; v] and [gate; up] rows), Qwen3 and Gemma 3 have per-head
# q/k norms, Gemma its extra feed-forward norms.
_DIRECT_PREFIXES = (
    "self_attn.o_proj.", "mlp.down_proj.", "input_layernorm.", "post_attention_layernorm.",
    "self_attn.qkv_proj.", "mlp.gate_up_proj.", "self_attn.q_norm.", "self_attn.k_norm.",
    "pre_feedforward_layernorm.", "post_feedforward_layernorm.",
)


def checkpoint_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint folder (sharded via `model.safetensors.index.json`, or all
    `*.safetensors` files)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    return [os.path.join(path, f) for f in files]


def map_hf_name(name: str, config: ModelConfig) -> tuple[str, tuple[int, int] | None] | None:
    """Map a HF tensor name to (our parameter name, optional row slice of it).

    q/k/v go into slices of `qkv_proj`, gate/up into slices of `gate_up_proj`. Returns None for tensors
    we do not use (rotary caches, a duplicated LM head of tied checkpoints).
    """
    if name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if name == "model.norm.weight":
        return "norm.weight", None
    if name == "lm_head.weight":
        return (None if config.tie_word_embeddings else ("lm_head.weight", None))
    m = _LAYER_RE.match(name)
    if m is None:
        return None
    layer, rest = m.group(1), m.group(2)
    prefix = f"layers.{layer}."
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    if "rotary_emb" in rest:
        return None
    for proj, (start, size) in (("q_proj", (0, q)), ("k_proj", (q, kv)), ("v_proj", (q + kv, kv))):
        if rest.startswith(f"self_attn.{proj}."):
            return prefix + "self_attn.qkv_proj." + rest.rsplit(".", 1)[1], (start, size)
    for proj, (start, size) in (("gate_proj", (0, inter)), ("up_proj", (inter, inter))):
        if rest.startswith(f"mlp.{proj}."):
            return prefix + "mlp.gate_up_proj." + rest.rsplit(".", 1)[1], (start, size)
    if rest.startswith(_DIRECT_PREFIXES):
        return prefix + rest, None
    return None


@torch.inference_mode()
def load_model(
    path: str,
    config: ModelConfig | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """Build the model for the checkpoint in `path` and load its weights (tensor by tensor, so peak
    memory stays near one copy of the model)."""
    config = config or ModelConfig.from_pretrained(path)
    # Build on the meta device: random initialisation of a real model would cost seconds for nothing.
    with torch.device("meta"):
        model = (GemmaForCausalLM if config.gemma is not None else LlamaForCausalLM)(config)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty re-creates parameters, which unties them
    model.to(dtype)
    model.init_buffers(device)

    params = dict(model.named_parameters())
    # Every row range of every parameter must be written exactly once; track what was loaded.
    expected = {name: p.shape[0] for name, p in params.items()}
    loaded: dict[str, int] = {}
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                target = map_hf_name(hf_name, config)
                if target is None:
                    logger.debug("skipping checkpoint tensor %s", hf_name)
                    continue
                name, rows = target
                if name not in params:
                    raise ValueError(
                        f"checkpoint tensor {hf_name!r} has no place in the model ({name!r}); "
                        "does config.json match the weights (bias flags)?"
                    )
                param = params[name]
                tensor = f.get_tensor(hf_name)
                if config.gemma is not None and name.endswith("norm.weight"):
                    # Gemma's norms multiply by (1 + w): fold the one in, in fp32, so the shared
                    # RMSNorm (and its fused kernel) computes exactly that.
                    tensor = tensor.float() + 1.0
                dst = param if rows is None else param.narrow(0, rows[0], rows[1])
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"shape mismatch for {hf_name}: checkpoint {tuple(tensor.shape)}, "
                        f"model {tuple(dst.shape)}"
                    )
                dst.copy_(tensor.to(dtype))
                loaded[name] = loaded.get(name, 0) + tensor.shape[0]
    missing = sorted(n for n, size in expected.items() if loaded.get(n, 0) != size)
    if config.tie_word_embeddings:
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise ValueError(f"checkpoint {path!r} is missing weights for: {', '.join(missing[:10])}")
    model.eval()
    return model
