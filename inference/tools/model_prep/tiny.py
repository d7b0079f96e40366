"""Source ``tiny``: a tiny random Llama with a real byte-level BPE tokenizer trained offline on a
built-in corpus (tests and smoke runs: it builds in about a second, byte-identical for equal arguments)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from inference.tools.model_prep.core import ModelPrepError, atomic_build, write_json
from inference.tools.model_prep.fixups import normalise_tokenizer_config, write_generation_config

TINY_ALIASES: frozenset[str] = frozenset({"tiny", "tiny-llama"})

TINY_DIRNAME = "tiny-llama"

# Special tokens of the tiny tokenizer, in id order. They get ids 0, 1, 2 exactly like SmolLM2
# (<|endoftext|>=0, <|im_start|>=1, <|im_end|>=2), so code paths tested on the tiny model see the same
# special ids as the real demo model.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_BYTE_ALPHABET_SIZE = 256
# Large enough that greedy decoding produces varied tokens instead of repeating one.
_TINY_INIT_RANGE = 0.3
_TINY_BOS_ID = SPECIAL_TOKENS.index("<|im_start|>")
_TINY_EOS_ID = SPECIAL_TOKENS.index("<|im_end|>")

MIN_TINY_VOCAB = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)

# Plain ChatML (no default system prompt): what SmolLM2 and Qwen2 chat models use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A few paragraphs of plain English to train the tiny tokenizer on. Varied vocabulary so that ~900
# merges exist; the default 512-entry vocabulary needs 253.
TINY_CORPUS = """\
The capital of France is Paris. Paris sits on the river Seine and is known for its museums, its cafes
and the tall iron tower built for the world fair of 1889. Many travellers arrive by train, walk along
the river in the evening and visit the old cathedral on the island in the middle of the city.

A language model reads text as a sequence of tokens and predicts the next token, one step at a time.
During prefill the model processes the whole prompt in parallel and stores the keys and values of
every layer in a cache. During decode it generates new tokens one by one, reading that cache instead
of recomputing the prompt. Splitting the two phases across machines lets each one be scaled on its own.

To bake bread, mix four cups of flour with water, salt and a little yeast. Knead the dough for ten
minutes until it is smooth, cover the bowl and let it rise for two hours in a warm place. Shape the
loaf, let it rest again, and bake it in a hot oven until the crust is golden brown and sounds hollow.

The weather today is cold and windy, with rain expected in the afternoon. Tomorrow will be sunny and
warmer, although clouds may return over the weekend. Farmers hope for a dry week so they can bring in
the harvest of wheat, apples and grapes before the first frost of the year.

Hello! How are you? I am fine, thank you. What is your name? My name is Sam, and I like reading books,
playing music and learning about science. Can you help me with a question about numbers? Of course:
two plus two is four, ten times ten is one hundred, and half of 64 is 32.
"""



def _train_tiny_tokenizer(vocab_size: int) -> Any:
    """Train a byte-level BPE on TINY_CORPUS to exactly `vocab_size` entries (special tokens included).

    When the corpus has fewer merges than needed, the remaining ids become reserved special tokens
    (`<|reserved_N|>`, as Llama 3 does), so any vocab_size >= MIN_TINY_VOCAB works.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False: decode(encode(text)) == text exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes in the base vocabulary: any text (accents, CJK, emoji) stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=0,
        show_progress=False,
    )
    tokenizer.train_from_iterator([TINY_CORPUS], trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True) for i in range(missing)])
    if tokenizer.get_vocab_size() != vocab_size:  # pragma: no cover - guards a tokenizers behaviour change
        raise ModelPrepError(f"tokenizer training produced {tokenizer.get_vocab_size()} ids, not {vocab_size}")
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != expected_id:  # pragma: no cover - same
            raise ModelPrepError(f"special token {token} did not get id {expected_id}")
    return tokenizer



def _tiny_weights(
    *, seed: int, vocab_size: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
    init_range: float,
) -> dict[str, Any]:
    """Random Llama weights (HF parameter names), drawn with numpy from one seeded generator.

    Drawn in a fixed order with numpy rather than by instantiating transformers' LlamaForCausalLM: the
    bytes then depend only on the seed (not on transformers' init order, which changes between
    versions) and no torch/transformers import is needed, which keeps creation well under a second.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    head_dim = hidden // heads

    def normal(*shape: int) -> Any:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(init_range)).astype(np.float32)

    tensors: dict[str, Any] = {"model.embed_tokens.weight": normal(vocab_size, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        tensors[p + "mlp.gate_proj.weight"] = normal(intermediate, hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(intermediate, hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(hidden, intermediate)
        # RMSNorm weights start at one, as in transformers' own init.
        tensors[p + "input_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
    tensors["model.norm.weight"] = np.ones(hidden, dtype=np.float32)
    tensors["lm_head.weight"] = normal(vocab_size, hidden)
    return tensors



def _tiny_config(
    *, vocab_size: int, hidden_size: int, intermediate: int, layers: int, heads: int, kv_heads: int,
    max_position_embeddings: int,
) -> dict[str, Any]:
    """The tiny model's config.json: a plain LlamaForCausalLM with the tiny tokenizer's special ids."""
    rope_theta = 10000.0
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden_size // heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": _TINY_INIT_RANGE,
        "rms_norm_eps": 1e-5,
        # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": _TINY_BOS_ID,
        "eos_token_id": _TINY_EOS_ID,
        "pad_token_id": _TINY_EOS_ID,
        "dtype": "float32",
    }


def _save_tiny_tokenizer(out: Path, *, vocab_size: int, model_max_length: int) -> None:
    """Train the tiny tokenizer and save it as a PreTrainedTokenizerFast with the ChatML template."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_tiny_tokenizer(vocab_size),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=model_max_length,
    )
    tokenizer.save_pretrained(out, save_jinja_files=False)
    normalise_tokenizer_config(out, model_max_length=model_max_length)


def create_tiny_llama(
    dest: Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a tiny random LlamaForCausalLM checkpoint with a real trained tokenizer into `dest`.

    Weights are fp32 safetensors drawn with initializer_range 0.3 (large enough that greedy decoding
    produces varied tokens instead of repeating one). The tokenizer is a byte-level BPE trained on a
    built-in English corpus to exactly `vocab_size` ids, with <|endoftext|>=0, <|im_start|>=1,
    <|im_end|>=2, saved as a PreTrainedTokenizerFast with a ChatML chat template and EOS <|im_end|>.
    The same arguments always give byte-identical files. An existing `dest` is replaced (atomically).
    """
    if vocab_size < MIN_TINY_VOCAB:
        raise ModelPrepError(f"vocab_size must be at least {MIN_TINY_VOCAB} (256 bytes + 3 special tokens)")
    for name, value in (("hidden_size", hidden_size), ("layers", layers), ("heads", heads),
                        ("kv_heads", kv_heads), ("max_position_embeddings", max_position_embeddings)):
        if value < 1:
            raise ModelPrepError(f"{name} must be positive, got {value}")
    if hidden_size % heads:
        raise ModelPrepError(f"hidden_size ({hidden_size}) must be divisible by heads ({heads})")
    if heads % kv_heads:
        raise ModelPrepError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")

    intermediate = 4 * hidden_size

    def build(out: Path) -> None:
        from safetensors.numpy import save_file

        tensors = _tiny_weights(
            seed=seed, vocab_size=vocab_size, hidden=hidden_size, intermediate=intermediate, layers=layers,
            heads=heads, kv_heads=kv_heads, init_range=_TINY_INIT_RANGE,
        )
        # "format": "pt" is what transformers checks before loading a safetensors file as PyTorch.
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        write_json(out / "config.json", _tiny_config(
            vocab_size=vocab_size, hidden_size=hidden_size, intermediate=intermediate, layers=layers,
            heads=heads, kv_heads=kv_heads, max_position_embeddings=max_position_embeddings,
        ))
        write_generation_config(out, bos_id=_TINY_BOS_ID, eos_id=_TINY_EOS_ID, pad_id=_TINY_EOS_ID)
        _save_tiny_tokenizer(out, vocab_size=vocab_size, model_max_length=max_position_embeddings)

    return atomic_build(Path(dest), build, force=True, what="tiny Llama")
