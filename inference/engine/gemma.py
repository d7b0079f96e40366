"""Gemma 2 and Gemma 3 (text) on the Llama decoder's modules (families.GemmaFeatures lists what differs).

The (1 + w) norms are ordinary RMSNorms whose weights had the one added at load (weights.py). Gemma
runs on torch ops only, also where the CPU kernels are loaded: its layers normalise each sublayer's
output before the residual add, which the fused residual/norm kernels do not do, and soft-capped
attention scores do not fit the paged decode kernel. A CPU-kernel decode step's metadata is turned into
a decode bucket (attention_window.bucketed).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention_window import bucketed
from .batch import BatchMetadata, DecodeBucket
from .config import ModelConfig
from .families import SLIDING, GemmaFeatures
from .kv_cache import KVCache
from .model import MLP, Attention, DecoderLayer, LlamaForCausalLM, RMSNorm
from .rope import RotaryEmbedding, rope_inv_freq


def _gemma(config: ModelConfig) -> GemmaFeatures:
    """The config's Gemma features (a Gemma module built for another family is a programming error)."""
    if config.gemma is None:
        raise ValueError(f"{config.architecture} is not a Gemma model")
    return config.gemma


class GemmaAttention(Attention):
    """Attention scaled by `query_pre_attn_scalar ** -0.5`, its scores soft-capped when configured."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        """Projections as in Llama (q/k norms for Gemma 3), Gemma's scale and cap."""
        super().__init__(config, layer_idx)
        features = _gemma(config)
        self.scale = features.query_pre_attn_scalar**-0.5
        self.softcap = features.attn_logit_softcapping

    def _sdpa(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """SDPA, or with a soft cap the same maths written out: the cap sits between the scores and
        the mask, where SDPA has no hook. Softmax in fp32, as transformers' eager attention."""
        if self.softcap is None:
            return super()._sdpa(q, k, v, attn_mask, is_causal)
        group = self.num_heads // self.num_kv_heads
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [batch, heads, len, hd]
        if group > 1:
            kh, vh = kh.repeat_interleave(group, dim=1), vh.repeat_interleave(group, dim=1)
        scores = torch.matmul(qh, kh.transpose(2, 3)).float() * self.scale
        scores = torch.tanh(scores / self.softcap) * self.softcap
        if is_causal:
            q_len, k_len = scores.shape[-2], scores.shape[-1]
            future = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).triu(k_len - q_len + 1)
            scores = scores.masked_fill(future, float("-inf"))
        if attn_mask is not None:
            scores = scores + attn_mask
        out = torch.matmul(torch.softmax(scores, dim=-1).to(vh.dtype), vh)
        return out.transpose(1, 2).reshape(-1, self.q_size)

    def _decode_cpu(self, q: torch.Tensor, bk: DecodeBucket, kv_cache: KVCache, layer_offset: int) -> torch.Tensor:
        """One query per sequence through `_sdpa` (so the cap applies), keys gathered token-major."""
        n = bk.end - bk.start
        rows = bk.gather_rows + layer_offset
        shape = (n, bk.max_k, self.num_kv_heads, self.head_dim)
        keys = kv_cache.rows.index_select(0, rows).view(shape).to(q.dtype)
        values = kv_cache.rows.index_select(0, rows + kv_cache.block_size).view(shape).to(q.dtype)
        return self._sdpa(q.reshape(n, 1, self.num_heads, self.head_dim), keys, values, attn_mask=bk.mask)


class GemmaMLP(MLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The gated MLP with the tanh-approximated GELU."""
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(DecoderLayer):
    """x + post_attn_norm(attn(in_norm(x))), then + post_ff_norm(mlp(pre_ff_norm(.)))."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        """Gemma's attention and MLP, and its four norms (`post_attention_layernorm` normalises the
        attention output here, not the MLP input as in Llama)."""
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = GemmaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GemmaMLP(config)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: BatchMetadata, kv_cache: KVCache | None
    ) -> torch.Tensor:
        """Both sublayers, each normalised before and after."""
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2/3: embeddings scaled by sqrt(hidden), Gemma layers, final logits soft-capped when
    configured; Gemma 3's sliding layers rotate with their own RoPE base."""

    def __init__(self, config: ModelConfig) -> None:
        """The Llama stack with Gemma layers, plus the local RoPE of Gemma 3."""
        super().__init__(config)
        self.features = _gemma(config)
        self.local_rotary: RotaryEmbedding | None = None
        if self.features.rope_local_theta is not None:
            self.local_rotary = RotaryEmbedding(config)
            self.local_rotary.inv_freq = rope_inv_freq(config, self.features.rope_local_theta, scaled=False)

    def make_layer(self, config: ModelConfig, layer_idx: int) -> DecoderLayer:
        """A Gemma layer."""
        return GemmaDecoderLayer(config, layer_idx)

    def init_buffers(self, device: str | torch.device) -> None:
        """Both RoPE tables' frequencies."""
        super().init_buffers(device)
        if self.local_rotary is not None:
            theta = self.features.rope_local_theta
            self.local_rotary.inv_freq = rope_inv_freq(self.config, theta, scaled=False).to(device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata, kv_cache: KVCache | None) -> torch.Tensor:
        """Logits `[batch, vocab]` for the last token of each sequence (torch ops only: see the module
        docstring)."""
        x = self.embed_tokens(input_ids)
        # transformers rounds the scale to the activations' dtype first (sqrt(hidden) is not exact in bf16).
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        meta = bucketed(meta, x.dtype)
        rope = self.rotary.cos_sin(meta.positions, x.dtype)
        local = rope if self.local_rotary is None else self.local_rotary.cos_sin(meta.positions, x.dtype)
        for i, (layer, layer_meta) in enumerate(zip(self.layers, self.layer_metas(meta, x.dtype), strict=True)):
            cos, sin = local if self.config.layer_types[i] == SLIDING else rope
            x = layer(x, cos, sin, layer_meta, kv_cache)
        logits = self.lm_head(self.norm(x[meta.last_index]))
        cap = self.features.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
