"""The decode step's fast path (`OutputProcessor.apply_decode`) against the general one (`apply`): the
same outputs, step by step, for stop tokens, EOS with and without `ignore_eos`, `max_tokens`, the
context length, stop strings and seeded sampling, with and without a tokenizer; and the
detokenizer's `append_plain` against `append` + `take_delta`."""
from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from inference.engine import LLMEngine, SamplingParams
from inference.engine.detokenizer import IncrementalDetokenizer
from inference.engine.tokenizer import Tokenizer

from .conftest import TinyModel


def _general(engine: LLMEngine) -> LLMEngine:
    """Make `engine` apply decode steps through the general path (the reference)."""
    outputs = engine.outputs
    setattr(outputs, "apply_decode", lambda batch, tokens: outputs.apply(batch, tokens, False))  # noqa: B010
    return engine


def _run(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> list[list[tuple[Any, ...]]]:
    """Every step's outputs (as tuples, in order) until the engine is idle."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    steps: list[list[tuple[Any, ...]]] = []
    for _ in range(500):
        if not engine.has_work():
            return steps
        steps.append([dataclasses.astuple(o) for o in engine.step()])
    raise AssertionError("engine did not finish")


def _stream(path: str, prompt: list[int], n: int, **kw: Any) -> list[int]:
    """The greedy continuation of `prompt` (n tokens, EOS ignored)."""
    engine = LLMEngine(path, block_size=4, num_blocks=64, **kw)
    res = engine.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return res[0].token_ids


def _requests(prompts: list[list[int]], stream: list[int], eos: int, stop_text: str | None
              ) -> list[tuple[str, list[int], SamplingParams]]:
    """A mixed batch: each request ends (or not) for a different reason, on the same greedy stream."""
    p = prompts[0]
    reqs = [
        ("length", p, SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0)),
        ("ignore-eos", p, SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.0)),
        ("eos", p, SamplingParams(max_tokens=20, temperature=0.0)),
        ("stop-id", p, SamplingParams(max_tokens=20, stop_token_ids=[stream[7]], ignore_eos=True, temperature=0.0)),
        ("first-token", p, SamplingParams(max_tokens=1, temperature=0.0)),
        ("context", _long_prompt(prompts), SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)),
        ("seeded", p, SamplingParams(max_tokens=15, temperature=0.9, seed=3, ignore_eos=True)),
    ]
    reqs += [(f"other-{i}", q, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0))
             for i, q in enumerate(prompts[1:])]
    if stop_text is not None:
        reqs.append(("stop-str", p, SamplingParams(max_tokens=20, stop=[stop_text], ignore_eos=True, temperature=0.0)))
    assert eos in stream[:20]
    return reqs


def _long_prompt(prompts: list[list[int]]) -> list[int]:
    """The longest prompt of the test, 10 tokens longer: it reaches the context length first."""
    longest = max(prompts, key=len)
    return (longest * 11)[: len(longest) + 10]


def _compare(path: str, prompts: list[list[int]], stop_text_of: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = _stream(path, prompts[0], 24)
    eos = stream[5]  # a token the greedy stream produces: as EOS, "eos" stops there and "ignore-eos" not
    # "context" ends at the context length, 5 tokens into its output; the others may reach it too.
    limit = len(_long_prompt(prompts)) + 5
    fast = LLMEngine(path, block_size=4, num_blocks=128, max_model_len=limit)
    ref = _general(LLMEngine(path, block_size=4, num_blocks=128, max_model_len=limit))
    stop_text = stop_text_of(fast, stream)
    for engine in (fast, ref):
        engine.outputs.eos_token_ids = frozenset({eos})
    plain_calls = 0
    original = IncrementalDetokenizer.append_plain

    def counting(self: IncrementalDetokenizer, token_id: int) -> str:
        nonlocal plain_calls
        plain_calls += 1
        return original(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "append_plain", counting)
    got = _run(fast, _requests(prompts, stream, eos, stop_text))
    want = _run(ref, _requests(prompts, stream, eos, stop_text))
    assert got == want
    finished = {o[0]: o[4] for step in got for o in step if o[3]}
    assert finished["length"] == "length" and finished["ignore-eos"] == "length"
    assert finished["eos"] == "stop" and finished["stop-id"] == "stop" and finished["context"] == "length"
    if stop_text is not None:
        assert finished["stop-str"] == "stop"
        assert plain_calls > 0  # the fast path ran (and its text matched the general path's)
    assert fast.num_running == 0 and fast.num_free_blocks == ref.num_free_blocks


def test_fast_path_equals_general_path_with_a_tokenizer(tok_model: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Byte-level tokenizer: text deltas, stop strings and every finish reason agree."""
    tok = Tokenizer.maybe_from_pretrained(tok_model.path)
    assert tok is not None
    prompts = [tok_model.prompts[0], tok.encode("the lazy dog"), tok.encode("river café 日本")]

    def stop_text(engine: LLMEngine, stream: list[int]) -> str:
        assert engine.tokenizer is not None
        text = engine.tokenizer.decode(stream[:16])
        assert len(text) >= 6
        return text[len(text) // 2 : len(text) // 2 + 3]

    _compare(tok_model.path, prompts, stop_text, monkeypatch)


def test_fast_path_equals_general_path_without_a_tokenizer(llama: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """No tokenizer (no text): stop ids, EOS, max_tokens and the context length agree."""
    _compare(llama.path, llama.prompts[:3], lambda engine, stream: None, monkeypatch)


@pytest.mark.parametrize("stop", [[], ["zz"]])
def test_append_plain_equals_append_and_take_delta(tok_model: TinyModel, stop: list[str]) -> None:
    """`append_plain` hands out what `append` + `take_delta` do, and a request that ends through the
    general path after plain steps (flush, final delta) renders the same text, incomplete UTF-8 included."""
    tok = Tokenizer.maybe_from_pretrained(tok_model.path)
    assert tok is not None and tok.byte_table is not None
    rnd = random.Random(5)
    vocab = len(tok.byte_table)
    for _ in range(30):
        ids = [rnd.randrange(-2, vocab + 2) for _ in range(rnd.randrange(1, 12))]  # out-of-vocab ids too
        ref = IncrementalDetokenizer(tok, [5, 6], [])
        want = []
        for t in ids[:-1]:
            ref.append(t)
            want.append(ref.take_delta())
        ref.append(ids[-1])
        ref.flush()
        want.append(ref.take_delta(final=True))
        detok = IncrementalDetokenizer(tok, [5, 6], stop)
        if stop:
            assert not detok.plain  # stop strings always go through `append`
            continue
        assert detok.plain
        got = [detok.append_plain(t) for t in ids[:-1]]
        detok.append(ids[-1])
        detok.flush()
        got.append(detok.take_delta(final=True))
        assert got == want
        assert "".join(got) == tok.decode([t for t in ids if 0 <= t < vocab])
