"""logprobs, echo and n > 1 end to end with the official `openai` client: router + prefill + decode
worker, real processes, on the disaggregated path (the first token and the prompt's log-probabilities
come from the prefill worker, the rest from the decode worker). Streamed and not; the numbers equal
the colocated fp32 engine's."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from inference.engine import LLMEngine, SamplingParams
from inference.engine.logprobs import TokenLogprobs
from tests.inference.conftest import OpenAIDeployment

pytestmark = pytest.mark.django_db(transaction=False, databases=[])
CONTEXT = 256
PROMPT = "Disaggregated inference separates prefill from decode so that"
TOL = 1e-4
MODEL = "tiny-llama"  # the checkpoint folder's name, as the workers report it
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say something about prefill and decode."}]


@pytest.fixture(scope="module")
def cluster(openai_deployment: OpenAIDeployment) -> tuple[str, str, str]:
    """The shared fp32 deployment's router, decode and prefill URLs."""
    return openai_deployment.router, openai_deployment.decode, openai_deployment.prefill


@pytest.fixture(scope="module")
def client(cluster: tuple[str, str, str]) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    """The same checkpoint colocated in this process, fp32."""
    return LLMEngine(str(tiny_model_dir), block_size=8, max_model_len=CONTEXT)


def reference(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], list[TokenLogprobs],
                                                                                       list[TokenLogprobs | None]]:
    """The colocated engine's tokens, their log-probabilities and the prompt's."""
    engine.add_request("ref", prompt, params)
    tokens: list[int] = []
    entries: list[TokenLogprobs] = []
    prompt_lps: list[TokenLogprobs | None] = []
    for _ in range(1000):
        for out in engine.step():
            tokens += out.new_token_ids
            entries += out.logprobs or []
            prompt_lps += out.prompt_logprobs or []
        if not engine.has_work():
            return tokens, entries, prompt_lps
    raise AssertionError("the reference run did not finish")


def test_completion_logprobs_and_echo_equal_the_engine_streamed_and_not(client: openai.OpenAI,
                                                                        engine: LLMEngine) -> None:
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode(PROMPT)
    tokens, entries, prompt_lps = reference(engine, prompt, SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, logprobs=3, prompt_logprobs=3))
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                      echo=True, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.text.startswith(PROMPT) and choice.logprobs is not None
    lp = choice.logprobs
    assert lp.token_logprobs is not None and lp.top_logprobs is not None and lp.tokens is not None
    assert len(lp.tokens) == len(prompt) + 8
    assert lp.token_logprobs[0] is None  # nothing predicts the first prompt token
    expected = [e.logprob for e in prompt_lps if e is not None] + [e.logprob for e in entries]
    got = lp.token_logprobs[1:]
    assert all(abs(g - x) < TOL for g, x in zip(got, expected, strict=True)), (got, expected)
    # The first generated token's (sampled by the prefill worker) is there, with its top 3.
    first = lp.top_logprobs[len(prompt)]
    assert len(first) == 3 and abs(max(first.values()) - entries[0].top[0][1]) < TOL
    assert "".join(lp.tokens[len(prompt):]) == choice.text[len(PROMPT):]
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    assert lp.text_offset is not None and lp.text_offset[len(prompt)] == len(PROMPT)
    # Streamed: the same tokens and numbers, chunk by chunk, text offsets running on.
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                       stream=True, extra_body={"ignore_eos": True})
    streamed: list[float] = []
    offsets: list[int] = []
    text = ""
    for chunk in stream:
        part = chunk.choices[0]
        text += part.text
        if part.logprobs is not None:
            streamed += part.logprobs.token_logprobs or []
            offsets += part.logprobs.text_offset or []
    assert text == choice.text[len(PROMPT):]
    assert all(abs(g - e.logprob) < TOL for g, e in zip(streamed, entries, strict=True))
    assert offsets == [o - len(PROMPT) for o in lp.text_offset[len(prompt):]]


def test_chat_logprobs_streamed_and_not(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert whole.usage is not None and len(content) == whole.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert "".join(c.token for c in content) == choice.message.content
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [c for chunk in stream for part in chunk.choices if part.logprobs and part.logprobs.content
                for c in part.logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]


def _hit_ratio(worker_url: str) -> float:
    text = httpx.get(worker_url + "/metrics", timeout=30).text
    found = re.search(r"^worker_prefix_cache_hit_ratio(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M)
    assert found, "no worker_prefix_cache_hit_ratio on /metrics"
    return float(found.group(1))


def test_n_choices_share_one_prompt_streamed_and_not(client: openai.OpenAI, cluster: tuple[str, str, str]) -> None:
    # A prompt of its own (about 40 tokens: five full blocks of 8), so the prefix cache's figure moves.
    prompt = "n choices: " + " ".join(f"w{i}" for i in range(20))
    before = _hit_ratio(cluster[1]), _hit_ratio(cluster[2])
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=5, n=3,
                                      logprobs=1, extra_body={"ignore_eos": True})
    after = _hit_ratio(cluster[1]), _hit_ratio(cluster[2])
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(c.logprobs is not None and len(c.logprobs.tokens or []) == 6 for c in whole.choices)
    single = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.0, seed=5,
                                       extra_body={"ignore_eos": True})
    assert whole.usage is not None and single.usage is not None
    # The prompt counts once; the completions of all choices add up.
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens
    assert whole.usage.completion_tokens == 18
    # Choice 0 is the request itself (seed 5), as a single run of it; the others are seeded 6 and 7.
    assert whole.choices[0].text == single.choices[0].text
    # Choices 1 and 2 found the prompt's full blocks in both workers' prefix caches.
    print(f"prefix cache hit ratio: decode {before[0]:.3f} -> {after[0]:.3f}, "
          f"prefill {before[1]:.3f} -> {after[1]:.3f}")
    assert after[0] > before[0] and after[1] > before[1]
    # Streamed chat: each choice's chunks carry its index, and each one finishes.
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=1.0,
                                            n=2, stream=True, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finished: dict[int, str] = {}
    usage: Any = None
    for chunk in stream:
        usage = chunk.usage or usage
        for part in chunk.choices:
            texts[part.index] = texts.get(part.index, "") + (part.delta.content or "")
            if part.finish_reason:
                finished[part.index] = part.finish_reason
    assert set(texts) == {0, 1} and set(finished) == {0, 1}
    assert usage is not None and usage.completion_tokens <= 10


def test_best_of_returns_the_most_likely_choices(client: openai.OpenAI) -> None:
    prompt = "best of: " + " ".join(f"b{i}" for i in range(12))
    common: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 1.5, "seed": 5,
                              "extra_body": {"ignore_eos": True}}
    # All four choices (choice i is seeded 5 + i, so best_of=4 generates these same four).
    every = client.completions.create(n=4, logprobs=0, **common)
    totals = []
    for c in every.choices:
        assert c.logprobs is not None and c.logprobs.token_logprobs is not None
        totals.append(sum(c.logprobs.token_logprobs))
    ranked = sorted(range(4), key=lambda i: -totals[i])
    print(f"best_of: cumulative log-probabilities {totals}")
    # With this seed the most likely two are not choices 0 and 1: returning the first n would fail below.
    assert ranked[:2] != [0, 1], totals
    best = client.completions.create(n=2, best_of=4, logprobs=0, **common)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [every.choices[i].text for i in ranked[:2]]
    assert best.choices[0].logprobs is not None and best.choices[0].logprobs.token_logprobs is not None
    assert abs(sum(best.choices[0].logprobs.token_logprobs) - totals[ranked[0]]) < TOL
    assert best.usage is not None and best.usage.completion_tokens == 24  # every generated token counts
    # Without logprobs asked: the ranking still uses them, the answer shows none.
    one = client.completions.create(best_of=4, **common)
    assert len(one.choices) == 1 and one.choices[0].text == every.choices[ranked[0]].text
    assert one.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=1, best_of=2, stream=True, **common)
