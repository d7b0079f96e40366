"""Sampling defaults read from a checkpoint's generation_config.json, and their precedence."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from inference.engine.sampling_params import SamplingParams, load_sampling_defaults


def write_config(folder: Path, data: object) -> Path:
    (folder / "generation_config.json").write_text(json.dumps(data))
    return folder


def test_reads_only_the_sampling_fields_the_file_sets(tmp_path: Path) -> None:
    write_config(tmp_path, {"eos_token_id": 2, "temperature": 0.2, "top_p": 0.9, "do_sample": True,
                            "repetition_penalty": 1.1})
    assert load_sampling_defaults(tmp_path) == {"temperature": 0.2, "top_p": 0.9}


def test_no_file_means_no_defaults(tmp_path: Path) -> None:
    assert load_sampling_defaults(tmp_path) == {}


def test_integers_become_floats_and_top_k_stays_an_integer(tmp_path: Path) -> None:
    write_config(tmp_path, {"temperature": 1, "top_k": 20, "min_p": 0})
    defaults = load_sampling_defaults(tmp_path)
    assert defaults == {"temperature": 1.0, "top_k": 20, "min_p": 0.0}
    assert isinstance(defaults["temperature"], float) and isinstance(defaults["top_k"], int)


@pytest.mark.parametrize(("data", "field"), [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": 3}, "min_p"),
])
def test_invalid_values_name_the_file_and_field(tmp_path: Path, data: dict[str, object], field: str) -> None:
    write_config(tmp_path, data)
    with pytest.raises(ValueError, match=field) as info:
        load_sampling_defaults(tmp_path)
    assert "generation_config.json" in str(info.value)


def test_not_json_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{temperature: 0")
    with pytest.raises(ValueError, match="generation_config.json"):
        load_sampling_defaults(tmp_path)


def test_request_values_win_over_defaults_and_null_means_unset() -> None:
    defaults = {"temperature": 0.2, "top_p": 0.9}
    params = SamplingParams.from_dict({"temperature": 0, "top_p": None, "max_tokens": 5}, defaults)
    assert (params.temperature, params.top_p, params.max_tokens) == (0, 0.9, 5)
    assert SamplingParams.from_dict({}, defaults).temperature == 0.2
    assert SamplingParams.from_dict({}).temperature == 1.0  # no model defaults: the dataclass's own
