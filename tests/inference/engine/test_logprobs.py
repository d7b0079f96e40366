"""Log-probabilities of sampled and prompt tokens against transformers' log-softmax (fp32, 1e-4):
in a batch with rows that ask nothing, sampled (not only greedy), over chunked and prefix-cached
prefills, and on the disaggregated path (the first token's from the prefill engine)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from inference.engine import LLMEngine, SamplingParams
from inference.engine.logprobs import TokenLogprobs, prefill_rows, row_topk, token_logprobs

from .conftest import TinyModel
from .helpers import drain, prefill_into

TOL = 1e-4
TOP = 5


@torch.inference_mode()
def reference(hf: Any, tokens: list[int]) -> torch.Tensor:
    """transformers' fp32 log-softmax at every position of `tokens` (row t predicts token t + 1)."""
    return torch.log_softmax(hf(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)


def check_entry(entry: TokenLogprobs, ref_row: torch.Tensor, token: int, top: int) -> None:
    """One position: the token's log-probability and the top list equal transformers' within TOL."""
    assert entry.token_id == token
    assert abs(entry.logprob - float(ref_row[token])) < TOL
    assert len(entry.top) == top
    ref_top = torch.topk(ref_row, top)
    for (tid, lp), ref_lp in zip(entry.top, ref_top.values.tolist(), strict=True):
        assert abs(lp - ref_lp) < TOL
        assert abs(float(ref_row[tid]) - lp) < TOL  # the id is the one holding that value
    lps = [lp for _, lp in entry.top]
    assert lps == sorted(lps, reverse=True)


def test_token_logprobs_rows_ask_different_widths() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1)) * 4
    found = token_logprobs(logits, [3, 7, 9], [0, 2, 5])
    ref = torch.log_softmax(logits, -1)
    assert [len(e.top) for e in found] == [0, 2, 5]
    for i, (entry, tok) in enumerate(zip(found, [3, 7, 9], strict=True)):
        assert abs(entry.logprob - float(ref[i, tok])) < 1e-6
        assert entry.top == [(int(t), pytest.approx(float(v), abs=1e-6))
                             for v, t in zip(*torch.topk(ref[i], len(entry.top)), strict=True)]


@pytest.mark.parametrize(("vocab", "k"), [(49152, 5), (512, 20), (500, 3), (128, 2)])
def test_row_topk_equals_torch_topk(vocab: int, k: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(7, vocab, generator=g)
    x[0, :] = 0.0  # all tied: any k of them, values equal
    x[1, 64:70] = 50.0  # the top values crowded into one chunk
    values, indices = row_topk(x, k)
    ref = torch.topk(x, k, dim=-1)
    assert torch.equal(values, ref.values)
    assert torch.equal(x.gather(1, indices), ref.values)  # each index holds its value


def test_prefill_rows_only_when_asked() -> None:
    assert prefill_rows([3, 4], [False, False]) is None
    rows = prefill_rows([3, 4, 2], [False, True, False])
    assert rows is not None
    assert rows[0].tolist() == [2, 3, 4, 5, 6, 8]
    assert rows[1] == [0, 4, 5]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_sampled_and_prompt_logprobs_match_transformers(llama: TinyModel, temperature: float) -> None:
    hf = llama.hf_model.float()
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64)
    asking = SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True,
                            logprobs=TOP, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=6, temperature=temperature, seed=4, ignore_eos=True)
    for i, prompt in enumerate(llama.prompts):
        engine.add_request(f"r{i}", prompt, asking if i % 2 == 0 else plain)
    results = drain(engine)
    for i, prompt in enumerate(llama.prompts):
        res = results[f"r{i}"]
        entries = [e for out in res.outputs for e in (out.logprobs or [])]
        prompt_lps = [out.prompt_logprobs for out in res.outputs if out.prompt_logprobs is not None]
        if i % 2:
            assert entries == [] and prompt_lps == []
            continue
        ref = reference(hf, prompt + res.token_ids)
        assert len(entries) == len(res.token_ids) == 6
        for t, (entry, tok) in enumerate(zip(entries, res.token_ids, strict=True)):
            check_entry(entry, ref[len(prompt) - 1 + t], tok, TOP)
        assert len(prompt_lps) == 1 and len(prompt_lps[0]) == len(prompt)
        assert prompt_lps[0][0] is None
        for pos in range(1, len(prompt)):
            at = prompt_lps[0][pos]
            assert at is not None
            check_entry(at, ref[pos - 1], prompt[pos], 2)


def test_prompt_logprobs_over_chunks_and_a_cached_prefix(llama: TinyModel) -> None:
    """A prompt computed in chunks, whose prefix is already cached, still reports every position."""
    hf = llama.hf_model.float()
    engine = LLMEngine(llama.path, block_size=16, num_blocks=64, max_num_batched_tokens=32)
    prompt = llama.prompts[-1]  # 70 tokens: three chunks of at most 32
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))
    drain(engine)
    engine.add_request("echo", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))
    res = drain(engine)["echo"]
    ref = reference(hf, prompt)
    got = [out.prompt_logprobs for out in res.outputs if out.prompt_logprobs is not None]
    assert len(got) == 1 and len(got[0]) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = got[0][pos]
        assert entry is not None
        check_entry(entry, ref[pos - 1], prompt[pos], 0)


def test_disaggregated_first_token_logprobs_from_the_prefill_engine(llama: TinyModel) -> None:
    """The prefill engine reports the first token's log-probabilities with its output; the decode
    engine the ones it samples; together they equal an unbroken run's."""
    hf = llama.hf_model.float()
    prefill = LLMEngine(llama.path, block_size=16, num_blocks=64)
    decode = LLMEngine(llama.path, block_size=16, num_blocks=64)
    prompt = llama.prompts[1]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    first: list[TokenLogprobs] = []
    hook = _capture_prefill_logprobs(prefill, first)
    try:
        prefill_into(prefill, decode, "d", prompt, params)
    finally:
        hook()
    res = drain(decode)["d"]
    ref = reference(hf, prompt + res.token_ids)
    assert len(first) == 1
    check_entry(first[0], ref[len(prompt) - 1], res.token_ids[0], 3)
    rest = [e for out in res.outputs for e in (out.logprobs or [])]
    assert len(rest) == len(res.token_ids) - 1  # the decode engine never saw the first token's logits
    for t, entry in enumerate(rest, start=1):
        check_entry(entry, ref[len(prompt) - 1 + t], res.token_ids[t], 3)


def _capture_prefill_logprobs(engine: LLMEngine, into: list[TokenLogprobs]) -> Any:
    """Wrap `engine.step` so that the logprobs of its outputs land in `into`; returns the undo."""
    step = engine.step

    def wrapped() -> Any:
        outs = step()
        for out in outs:
            into.extend(out.logprobs or [])
        return outs

    engine.step = wrapped  # type: ignore[method-assign]

    def undo() -> None:
        engine.step = step  # type: ignore[method-assign]

    return undo
