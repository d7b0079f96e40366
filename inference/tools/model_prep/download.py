"""`download_model`: pick the source for a model name, prepare it once into the model cache and make
``--save-path`` point at it (a relative symlink, or a copy)."""
from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from inference.tools.model_prep.core import ModelPrepError, is_complete_model, remove_path
from inference.tools.model_prep.fixups import ensure_sampling_defaults
from inference.tools.model_prep.hub import prepare_from_hub
from inference.tools.model_prep.local import prepare_from_local
from inference.tools.model_prep.smollm2 import (
    SMOLLM2_ALIASES,
    SMOLLM2_DIRNAME,
    SMOLLM2_REPO_ID,
    SMOLLM2_SAMPLING_DEFAULTS,
    prepare_from_smollm2,
)
from inference.tools.model_prep.tiny import TINY_ALIASES, TINY_DIRNAME, create_tiny_llama

logger = logging.getLogger(__name__)

SERVICE_TYPES: tuple[str, ...] = ("prefill", "decode", "both")

SOURCES: tuple[str, ...] = ("auto", "smollm2", "tiny", "local", "hub")



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
    remove_path(tmp)
    if copy:
        shutil.copytree(entry_abs, tmp)
    else:
        # Relative, so the link survives moving or bind-mounting the folder holding both.
        tmp.symlink_to(os.path.relpath(entry_abs, save_abs.parent), target_is_directory=True)
    if save_abs.is_dir() and not save_abs.is_symlink():
        remove_path(save_abs)  # os.replace cannot replace a directory with a link or non-empty dir
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
