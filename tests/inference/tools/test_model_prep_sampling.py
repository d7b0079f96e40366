"""The demo model's recommended sampling defaults in generation_config.json: written when missing,
also into a folder prepared earlier (`make demo-model` / `make up` rerun the preparation), never over
a value the file already holds, and read by the workers as their defaults."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inference.engine.sampling_params import load_sampling_defaults
from inference.tools.model_prep import (
    SMOLLM2_DIRNAME,
    SMOLLM2_SAMPLING_DEFAULTS,
    ModelPrepError,
    download_model,
    ensure_sampling_defaults,
    prepare_from_smollm2,
)


def gen_config(folder: Path) -> dict[str, object]:
    return json.loads((folder / "generation_config.json").read_text())


@pytest.fixture
def old_demo_cache(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A model cache whose demo folder was prepared before the defaults existed (no sampling fields)."""
    entry = tmp_path / "model_cache" / SMOLLM2_DIRNAME
    shutil.copytree(tiny_model_dir, entry)
    assert "temperature" not in gen_config(entry)
    return entry


def test_demo_preparation_adds_the_defaults_to_an_existing_folder(old_demo_cache: Path) -> None:
    before = gen_config(old_demo_cache)
    weights = (old_demo_cache / "model.safetensors").stat().st_mtime_ns
    path = download_model("smollm2", cache_dir=old_demo_cache.parent)
    assert path == old_demo_cache.absolute()
    assert gen_config(old_demo_cache) == {**before, "temperature": 0.2, "top_p": 0.9}
    assert (old_demo_cache / "model.safetensors").stat().st_mtime_ns == weights  # not rebuilt
    assert load_sampling_defaults(old_demo_cache) == SMOLLM2_SAMPLING_DEFAULTS
    # Idempotent: a second run changes nothing.
    text = (old_demo_cache / "generation_config.json").read_bytes()
    prepare_from_smollm2(old_demo_cache)
    assert (old_demo_cache / "generation_config.json").read_bytes() == text


def test_values_already_set_are_kept(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.7}))
    assert ensure_sampling_defaults(tmp_path, SMOLLM2_SAMPLING_DEFAULTS) == ["top_p"]
    assert gen_config(tmp_path) == {"eos_token_id": 2, "temperature": 0.7, "top_p": 0.9}
    assert ensure_sampling_defaults(tmp_path, SMOLLM2_SAMPLING_DEFAULTS) == []


def test_missing_file_is_created_and_a_broken_one_is_named(tmp_path: Path) -> None:
    assert ensure_sampling_defaults(tmp_path, {"temperature": 0.2}) == ["temperature"]
    assert gen_config(tmp_path) == {"temperature": 0.2}
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ModelPrepError, match="generation_config.json"):
        ensure_sampling_defaults(tmp_path, {"temperature": 0.2})


def test_other_models_get_no_defaults(tiny_model_dir: Path, tmp_path: Path) -> None:
    entry = download_model("tiny", cache_dir=tmp_path / "cache")
    assert load_sampling_defaults(entry) == {}
