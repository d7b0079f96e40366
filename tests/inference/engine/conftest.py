"""Fixtures for the engine tests: tiny random HF checkpoints and transformers' greedy references.

Weights use initializer_range 0.3 so logits are well separated: greedy argmax then does not depend on
float rounding differences between our batched paged attention and transformers' batch-1 run.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One intra-op thread: the matrices are tiny, and on a shared, busy CPU OpenMP barriers between two
# threads cost far more than they save.
torch.set_num_threads(1)

PROMPT_LENGTHS = (3, 17, 40, 70)
NEW_TOKENS = 24
VOCAB = 512


@dataclass
class TinyModel:
    """A saved checkpoint plus what the tests compare against."""

    path: str
    hf_model: Any
    prompts: list[list[int]]
    greedy: list[list[int]]  # transformers generate(do_sample=False), one prompt at a time


def _common_config() -> dict[str, Any]:
    """Shape shared by the tiny models (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 512)."""
    return {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "initializer_range": 0.3,
        "max_position_embeddings": 512,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }


def _make_prompts(seed: int, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[int]]:
    """Random prompts of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy continuation of one prompt (batch 1)."""
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
    )
    return list(out[0, len(prompt) :].tolist())


def _build(
    root: Path, name: str, model_cls: Any, config: Any, seed: int, lengths: tuple[int, ...], **save: Any
) -> TinyModel:
    """Create, save and reference-run one random model."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    path = root / name
    model.save_pretrained(path, safe_serialization=True, **save)
    prompts = _make_prompts(seed + 1, lengths)
    return TinyModel(str(path), model, prompts, [hf_greedy(model, p) for p in prompts])


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Folder holding the tiny checkpoints."""
    return tmp_path_factory.mktemp("engine-models")


@pytest.fixture(scope="session")
def llama(models_root: Path) -> TinyModel:
    """Tiny LlamaForCausalLM."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(models_root, "llama", LlamaForCausalLM, LlamaConfig(**_common_config()), 0, PROMPT_LENGTHS)


@pytest.fixture(scope="session")
def qwen2(models_root: Path) -> TinyModel:
    """Tiny Qwen2ForCausalLM (q/k/v biases)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _build(models_root, "qwen2", Qwen2ForCausalLM, Qwen2Config(**_common_config()), 10, PROMPT_LENGTHS)


@pytest.fixture(scope="session")
def llama_variant(models_root: Path) -> TinyModel:
    """Llama with every optional feature: attention + MLP biases, tied embeddings, llama3 RoPE scaling,
    and a checkpoint sharded into several safetensors files with an index."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = _common_config()
    cfg.update(
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    return _build(
        models_root, "llama-variant", LlamaForCausalLM, LlamaConfig(**cfg), 20, (5, 90), max_shard_size="100KB"
    )


@pytest.fixture(scope="session")
def tok_model(models_root: Path) -> TinyModel:
    """Tiny Llama with a byte-level BPE tokenizer trained offline (vocab = the tokenizer's size, so every
    sampled id decodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rnd = random.Random(0)
    words = (
        "the quick brown fox jumps over lazy dog hello world token stream engine cache block batch "
        "prefill decode sample river mountain café naïve über 日本 語 ✓"
    ).split()
    corpus = [" ".join(rnd.choice(words) for _ in range(12)) for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    cfg = _common_config()
    cfg["vocab_size"] = len(fast)
    torch.manual_seed(30)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).eval()
    path = models_root / "llama-tok"
    model.save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    prompt = fast.encode("hello world the quick brown fox")
    return TinyModel(str(path), model, [prompt], [hf_greedy(model, prompt)])
