"""`--compile`: greedy tokens with the compiled model equal the eager engine's, and a host without a
C++ compiler is refused with a message naming the flag."""
from __future__ import annotations

import pytest
import torch

from inference.engine import LLMEngine, SamplingParams
from inference.engine.compile import CompileUnavailable, check_compile_available, cpp_compiler

from .conftest import TinyModel

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.skipif(cpp_compiler() is None, reason="no C++ compiler here: torch inductor cannot build CPU kernels")
def test_compiled_greedy_tokens_equal_eager(llama: TinyModel) -> None:
    """Prefill of mixed lengths and decode steps through the compiled parts give the same tokens (and
    the same as transformers) as the eager engine."""
    eager = LLMEngine(llama.path, num_blocks=64, max_num_seqs=8, load_tokenizer=False)
    compiled = LLMEngine(llama.path, num_blocks=64, max_num_seqs=8, load_tokenizer=False, use_compile=True)
    assert compiled.runner.compiled
    want = [r.token_ids for r in eager.generate(llama.prompts, GREEDY)]
    got = [r.token_ids for r in compiled.generate(llama.prompts, GREEDY)]
    assert got == want
    assert got == [g[:12] for g in llama.greedy]


def test_compile_without_a_cpp_compiler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no compiler on PATH (an empty PATH and no $CXX) the check names --compile and what to do."""
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", "")
    assert cpp_compiler() is None
    with pytest.raises(CompileUnavailable, match=r"--compile on a CPU needs a C\+\+ compiler.*without --compile"):
        check_compile_available(torch.device("cpu"))
