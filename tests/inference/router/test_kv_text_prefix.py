"""A text prompt tokenized in chunks with an early stop (text_prefix.py) gives exactly the full encode's
ids: property tests on varied texts (unicode, long words, digits, code, runs of spaces, no spaces, added
tokens' text) with the test model's tokenizer and with trained tokenizers shaped like SmolLM2's (digits
split, byte-level regex) and Llama 3's (a `Split` regex, byte-level without its own); tokenizers it
cannot cut exactly are encoded whole; the router stops tokenizing where no decode worker holds a block."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inference.engine.tokenizer import Tokenizer
from inference.router.endpoint import Endpoint
from inference.router.events import GenerateRequest
from inference.router.kv_index import KVIndex
from inference.router.prompt_tokens import PromptTokenizer
from inference.router.text_prefix import CHECK_TEXTS, TextPrefix, chunk_plan, next_cut, text_prefix
from inference.server.tokenizer_spec import tokenizer_spec
from inference.wire.kv_events import KVSnapshot, block_hashes
from inference.wire.sampling import Sampling
from inference.wire.tokenizer import PROBE_TEXT

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [*CHECK_TEXTS, PROBE_TEXT, "the quick brown fox jumps over the lazy dog 0123456789 " * 20,
          "def main(argv):\n    return {'a': [1, 2, 3]}  # done\n" * 10, "分布式推理架构的优势 naïve café 🙂 " * 10]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Characters that split differently: letters, digits, every kind of space, punctuation, apostrophes, accents,
# CJK, emoji; and the added tokens' text.
ALPHABET = st.sampled_from(list("aAzZ é中🙂 0 7  \t\n\r.,'\"!?-_(){}#") + ["'s", "'ll", " the", "  ", "\n\n", *SPECIAL])
TEXTS = st.lists(ALPHABET, max_size=120).map("".join)


def _trained(pre_tokenizer: Any, byte_level_regex: bool, bos: bool = False) -> Any:
    """A byte-level BPE trained on CORPUS with the given pre-tokenizer (optionally a BOS post-processor)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, processors, trainers
    from tokenizers import pre_tokenizers as pre

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIAL, initial_alphabet=pre.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(CORPUS, trainer=trainer)
    if bos:
        backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[
            ("<|im_start|>", backend.token_to_id("<|im_start|>"))])
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    assert byte_level_regex == ("Split" not in backend.to_str())
    return backend


def _backends(tiny_model_dir: Path) -> dict[str, Any]:
    from tokenizers import Regex
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers as pre

    return {
        "tiny": Backend.from_file(str(tiny_model_dir / "tokenizer.json")),
        "smollm2-shaped": _trained(pre.Sequence([pre.Digits(individual_digits=True),
                                                 pre.ByteLevel(add_prefix_space=False)]), True),
        "llama3-shaped": _trained(pre.Sequence([pre.Split(Regex(LLAMA3_PATTERN), "isolated"),
                                                pre.ByteLevel(add_prefix_space=False, use_regex=False)]), False,
                                  bos=True),
    }


@pytest.fixture(scope="module")
def prefixes(tiny_model_dir: Path) -> dict[str, tuple[Any, TextPrefix]]:
    out = {}
    for name, backend in _backends(tiny_model_dir).items():
        prefix = text_prefix(backend, backend.to_str(), (PROBE_TEXT, *CHECK_TEXTS))
        assert prefix is not None, name
        out[name] = (backend, prefix)
    return out


def _stopping_after(calls: int) -> Callable[[list[int]], bool]:
    """A `wanted` that asks for more `calls` times, then stops."""
    asked: list[int] = []

    def wanted(ids: list[int]) -> bool:
        asked.append(len(ids))
        return len(asked) <= calls

    return wanted


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, first=st.integers(1, 40), stop_after=st.integers(0, 8))
def test_chunks_equal_the_full_encode(prefixes: dict[str, tuple[Any, TextPrefix]], text: str, first: int,
                                      stop_after: int) -> None:
    for name, (backend, prefix) in prefixes.items():
        expected = list(backend.encode(text).ids)
        prefix.chunk_chars, prefix.first_chunk_chars = first, max(1, first // 2)
        ids, consumed = prefix.ids(text)
        assert (ids, consumed) == (expected, len(text)), name
        assert prefix.ids(text)[0] == expected, name  # from the chunk cache
        # Stopped early: the ids so far are exactly the full encode's first ids, and of the text before the cut.
        ids, consumed = prefix.ids(text, _stopping_after(stop_after))
        assert ids == expected[: len(ids)], name
        assert ids == list(backend.encode(text[:consumed]).ids), name


def test_cuts_fall_only_before_a_space_after_a_non_space() -> None:
    assert next_cut("ab cd", 0) == 2
    assert next_cut("ab  cd", 3) == 6  # the second space follows a space: no cut there
    assert next_cut("a\n b", 0) == 4
    assert next_cut("分布式推理", 0) == 5


def test_tokenizers_it_cannot_cut_are_encoded_whole(tiny_model_dir: Path) -> None:
    spec = json.loads((tiny_model_dir / "tokenizer.json").read_text())
    assert chunk_plan(spec)
    for change in ({"normalizer": {"type": "NFC"}},
                   {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}},
                   {"pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}},
                   {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                       {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False},
                       {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}},
                   {"added_tokens": [*spec["added_tokens"], {"id": 600, "content": "a b", "lstrip": False,
                                                              "rstrip": False, "single_word": False}]}):
        assert not chunk_plan({**spec, **change}), change
    # A post-processor that appends a token (EOS after the text) is not supported either.
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    backend = Backend.from_file(str(tiny_model_dir / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="$A <|im_end|>", special_tokens=[("<|im_end|>", 2)])
    assert text_prefix(backend, backend.to_str(), (PROBE_TEXT,)) is None


def _router(tiny_model_dir: Path) -> tuple[Tokenizer, PromptTokenizer]:
    worker = Tokenizer.from_pretrained(str(tiny_model_dir))
    spec = tokenizer_spec(tiny_model_dir.name, worker)
    assert spec is not None
    return worker, PromptTokenizer(spec)


def test_the_router_stops_where_no_decode_worker_holds_a_block(tiny_model_dir: Path) -> None:
    worker, router = _router(tiny_model_dir)
    assert router.status()["text_chunks"]
    shared = "a long shared document about distributed inference, " * 60
    held_ids = worker.encode(shared)
    index = KVIndex()
    decode = [Endpoint("http://127.0.0.1:9001", "decode"), Endpoint("http://127.0.0.1:9002", "decode")]
    index.apply_snapshot(decode[0].url, KVSnapshot(role="decode", block_size=16, epoch="e", seq=0,
                                                   hashes=block_hashes(held_ids, 16)))
    sampling = Sampling.from_json({})

    # Nothing known of either worker: no tokenization at all, the decode choice goes by load.
    req = GenerateRequest(sampling=sampling, prompt="fresh " + shared)
    assert router.request_prompt(req, KVIndex().prefix_watch(decode)) is None and req.token_ids is None

    # A fresh prompt: one chunk, the text goes on to the worker; the estimate is about its length.
    req = GenerateRequest(sampling=sampling, prompt="fresh " + shared)
    prompt = router.request_prompt(req, index.prefix_watch(decode))
    full = worker.encode(req.prompt or "")
    assert prompt is not None and not prompt.complete and req.token_ids is None
    assert prompt.token_ids == full[: len(prompt.token_ids)] and len(prompt.token_ids) < len(full) // 4
    assert abs(prompt.total_tokens - len(full)) < len(full) // 4
    assert index.cached_tokens(decode[0].url, prompt) == 0

    # The shared document and a new question: tokenized past the held blocks only, credited as the worker holds.
    req = GenerateRequest(sampling=sampling, prompt=shared + "and now a question of my own " * 40)
    prompt = router.request_prompt(req, index.prefix_watch(decode))
    full = worker.encode(req.prompt or "")
    assert prompt is not None and not prompt.complete and req.token_ids is None
    assert prompt.token_ids == full[: len(prompt.token_ids)] and len(prompt.token_ids) < len(full)
    held = set(block_hashes(held_ids, 16))
    matched = next(i for i, h in enumerate(block_hashes(full, 16)) if h not in held)
    assert matched > 10 and index.cached_tokens(decode[0].url, prompt) == matched * 16
    assert index.cached_tokens(decode[1].url, prompt) == 0

    # Held to its end: every id, sent to the worker (it does not tokenize), as the worker's own.
    req = GenerateRequest(sampling=sampling, prompt=shared)
    prompt = router.request_prompt(req, index.prefix_watch(decode))
    assert prompt is not None and prompt.complete and req.token_ids == held_ids == prompt.token_ids
