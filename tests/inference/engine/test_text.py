"""Tokenizer wrapper, incremental detokenization and stop strings."""
from __future__ import annotations

import pytest

from inference.engine import LLMEngine, SamplingParams, Tokenizer
from inference.engine.detokenizer import IncrementalDetokenizer

from .conftest import NEW_TOKENS, TinyModel


@pytest.fixture(scope="module")
def tokenizer(tok_model: TinyModel) -> Tokenizer:
    """The trained byte-level BPE tokenizer."""
    tok = Tokenizer.maybe_from_pretrained(tok_model.path)
    assert tok is not None
    return tok


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    """Push ids one by one as the engine does; return the emitted deltas and whether a stop matched."""
    deltas = []
    stopped = False
    for i, tok in enumerate(ids):
        stopped = detok.append(tok)
        final = stopped or i == len(ids) - 1
        if final:
            detok.flush()
        d = detok.take_delta(final=final)
        if d:
            deltas.append(d)
        if stopped:
            break
    return deltas, stopped


def test_tokenizer_wrapper(tokenizer: Tokenizer, llama: TinyModel) -> None:
    """encode/decode round trip, chat template to ids, and no tokenizer for a bare checkpoint."""
    text = "hello world über"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids) == "<user>hi\n<assistant>"
    assert tokenizer.eos_token_id is not None
    assert Tokenizer.maybe_from_pretrained(llama.path) is None
    assert LLMEngine(llama.path, num_blocks=4).tokenizer is None


def test_multibyte_characters_are_never_split(tokenizer: Tokenizer) -> None:
    """Deltas never end in a partial UTF-8 character and add up to the text."""
    text = "café € 中文 Ж 𝄞 über ✓"  # mostly characters the BPE never merged: split into bytes
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # some tokens are partial characters
    deltas, stopped = feed(IncrementalDetokenizer(tokenizer, tokenizer.encode("hello"), []), ids)
    assert not stopped
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_truncates_and_holds_back(tokenizer: Tokenizer) -> None:
    """Text is cut before the stop string, and a possible stop prefix is never emitted early."""
    ids = tokenizer.encode(" say hello world now")
    detok = IncrementalDetokenizer(tokenizer, [5], ["world", "zzz"])
    deltas, stopped = feed(detok, ids)
    assert stopped and "".join(deltas) == " say hello "
    assert not any("w" in d for d in deltas)

    # "x" might start "xyz": held back until it is clear it does not, then released.
    detok = IncrementalDetokenizer(tokenizer, [5], ["xyz"])
    emitted = []
    for i, tok in enumerate(tokenizer.encode("ax ab")):
        detok.append(tok)
        emitted.append(detok.take_delta(final=i == 4))
    assert "".join(emitted) == "ax ab"
    assert not any(d.endswith("x") for d in emitted)


def test_engine_text_and_stop_strings(tok_model: TinyModel) -> None:
    """Greedy text from the engine; rerun with a stop string taken from the middle of that text."""
    engine = LLMEngine(tok_model.path, block_size=16, num_blocks=32)
    base = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    full = engine.generate(tok_model.prompts, base)[0]
    assert full.token_ids == tok_model.greedy[0]
    assert engine.tokenizer is not None
    assert full.text and full.text == engine.tokenizer.decode(full.token_ids)

    clean = [i for i in range(len(full.text) // 3, len(full.text) - 2) if "\ufffd" not in full.text[i : i + 2]]
    assert clean, full.text
    stop = full.text[clean[0] : clean[0] + 2]
    res = engine.generate(tok_model.prompts, SamplingParams(**{**base.to_dict(), "stop": [stop]}))[0]
    assert res.finish_reason == "stop"
    assert res.text == full.text[: full.text.index(stop)]
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    assert engine.block_manager.num_free == 32


def test_fast_decode_equals_transformers_decode(tok_model: TinyModel) -> None:
    """Tokenizer.decode skips transformers' wrapper but must give exactly its text."""
    import random

    tok = Tokenizer.from_pretrained(tok_model.path)
    assert tok._fast_decode is not None
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tok.hf)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert tok.decode(ids, skip) == tok.hf.decode(ids, skip_special_tokens=skip)


def _windowed(tok_model: TinyModel) -> Tokenizer:
    """The same tokenizer with transformers' space clean-up on: no backend fast path, so no byte table,
    and the detokenizer takes its general (windowed re-decode) path."""
    from transformers import AutoTokenizer

    tok = Tokenizer(AutoTokenizer.from_pretrained(tok_model.path, clean_up_tokenization_spaces=True))
    assert tok.byte_table is None
    return tok


@pytest.mark.parametrize("path", ["byte_table", "windowed"])
def test_incremental_text_equals_decode_of_all_ids(tok_model: TinyModel, path: str) -> None:
    """Random ids (invalid UTF-8, partial characters, special and out-of-vocabulary ids included): the
    deltas add up to `decode` of all the ids on both detokenizer paths."""
    import random

    tok = Tokenizer.from_pretrained(tok_model.path) if path == "byte_table" else _windowed(tok_model)
    assert (tok.byte_table is not None) == (path == "byte_table")
    reference = Tokenizer.from_pretrained(tok_model.path)
    rng = random.Random(3)
    for _ in range(150):
        ids = [rng.randrange(len(tok.hf) + 3) for _ in range(rng.randrange(1, 30))]
        deltas, stopped = feed(IncrementalDetokenizer(tok, [5, 6], []), ids)
        assert not stopped
        known = [i for i in ids if i < len(tok.hf)]
        assert "".join(deltas) == reference.decode(known)


def test_byte_table_matches_decode_token_by_token(tok_model: TinyModel) -> None:
    """Every id's table entry is what decode makes of it (special tokens: nothing)."""
    tok = Tokenizer.from_pretrained(tok_model.path)
    table = tok.byte_table
    assert table is not None and len(table) == len(tok.hf)
    for i, raw in enumerate(table):
        assert raw.decode("utf-8", errors="replace") == tok.decode([i])
