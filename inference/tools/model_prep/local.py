"""Source ``local``: an existing Hugging Face checkpoint folder, validated and copied (PyTorch ``.bin``
weights are converted to safetensors, loaded with ``weights_only=True`` so nothing untrusted is unpickled)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from inference.engine.families import SUPPORTED_ARCHITECTURES, SUPPORTED_MODEL_TYPES
from inference.tools.model_prep.core import (
    TOKENIZER_FILES,
    ModelPrepError,
    atomic_build,
    is_complete_model,
    read_json,
    safetensors_files,
    write_json,
)
from inference.tools.model_prep.fixups import (
    add_legacy_config_keys,
    normalise_tokenizer_config,
    write_generation_config,
)

# The architectures the engine implements are the engine's own list (inference/engine/families.py), so a
# family added there is accepted here; model_type is the fallback when a config.json lacks "architectures".
_FAMILY_TO_ARCH: dict[str, str] = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}
_MODEL_TYPE_TO_ARCH: dict[str, str] = {
    model_type: _FAMILY_TO_ARCH[family] for model_type, family in SUPPORTED_MODEL_TYPES.items()
}



def _check_config(src: Path) -> dict[str, Any]:
    """Load and validate src/config.json; returns it with `architectures` filled in when inferable."""
    config_path = src / "config.json"
    if not config_path.is_file():
        raise ModelPrepError(f"{src} has no config.json: not a Hugging Face checkpoint folder")
    cfg = read_json(config_path)
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
        weight_map = read_json(index).get("weight_map")
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
        write_json(out / "model.safetensors.index.json",
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
    st_files = safetensors_files(src)
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
        write_json(out / "config.json", cfg)
        add_legacy_config_keys(out)
        if st_files:
            for file in st_files:
                shutil.copyfile(file, out / file.name)  # follows symlinks (hub cache snapshots)
            index = src / "model.safetensors.index.json"
            if index.is_file():
                shutil.copyfile(index, out / index.name)
        else:
            assert bin_files is not None
            _convert_bin_to_safetensors(bin_files, out, tied=bool(cfg.get("tie_word_embeddings", False)))
        for name in ("generation_config.json", *TOKENIZER_FILES):
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
        if not (out / "tokenizer.json").is_file():
            _build_tokenizer_json(src, out)
        if not (out / "generation_config.json").is_file():
            write_generation_config(out, bos_id=cfg.get("bos_token_id"), eos_id=cfg.get("eos_token_id"),
                                     pad_id=cfg.get("pad_token_id"))
        normalise_tokenizer_config(out)

    return atomic_build(dest, build, force=force, what=f"the model from {src}")
