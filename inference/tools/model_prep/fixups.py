"""File fix-ups shared by the sources: generation_config.json (stop tokens, sampling defaults),
a portable tokenizer_config.json and the legacy keys of config.json."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from inference.tools.model_prep.core import ModelPrepError, dest_lock, read_json, remove_path, write_json

logger = logging.getLogger(__name__)

def write_generation_config(out: Path, *, bos_id: int | None, eos_id: int | list[int] | None,
                             pad_id: int | None) -> None:
    """Write a minimal generation_config.json: the engine reads its eos_token_id as a stop token."""
    data: dict[str, Any] = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": pad_id}
    write_json(out / "generation_config.json", {k: v for k, v in data.items() if v is not None})



def ensure_sampling_defaults(folder: Path, defaults: dict[str, float]) -> list[str]:
    """Add the `defaults` that the folder's generation_config.json does not set; returns the fields added.

    Idempotent, and a value the file already holds is kept (it is the model's own choice). The file is
    rewritten atomically under the folder's lock, so a worker starting meanwhile reads old or new.
    """
    folder = Path(folder)
    path = folder / "generation_config.json"
    with dest_lock(folder):
        data = read_json(path) if path.is_file() else {}
        missing = [k for k in defaults if data.get(k) is None]
        if not missing:
            return []
        data.update({k: defaults[k] for k in missing})
        tmp = path.with_name(path.name + ".tmp")
        try:
            write_json(tmp, data)
            os.replace(tmp, path)
        except OSError as exc:
            remove_path(tmp)
            raise ModelPrepError(f"cannot write {path}: {exc}") from None
    logger.info("%s: added the recommended sampling defaults %s", path, {k: defaults[k] for k in missing})
    return missing



def normalise_tokenizer_config(out: Path, *, model_max_length: int | None = None) -> None:
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
    cfg = read_json(path)
    if cfg.get("tokenizer_class") in (None, "TokenizersBackend"):
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    jinja = out / "chat_template.jinja"
    if not cfg.get("chat_template") and jinja.is_file():
        cfg["chat_template"] = jinja.read_text(encoding="utf-8")
    for key in ("is_local", "local_files_only", "_commit_hash", "name_or_path"):
        cfg.pop(key, None)
    if model_max_length:
        cfg["model_max_length"] = model_max_length
    write_json(path, cfg)



def add_legacy_config_keys(out: Path) -> None:
    """Add top-level `rope_theta` to a transformers-5 config.json that only has `rope_parameters`, so
    readers written for older checkpoints find it too (transformers 5 itself accepts both)."""
    path = out / "config.json"
    cfg = read_json(path)
    params = cfg.get("rope_parameters")
    if "rope_theta" not in cfg and isinstance(params, dict) and "rope_theta" in params:
        cfg["rope_theta"] = params["rope_theta"]
        write_json(path, cfg)
