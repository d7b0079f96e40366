"""n > 1 on a deployment of two prefill and two decode workers (real processes, round-robin router): the
choices after the first go to choice 0's decode and prefill workers (inference/router/pin.py), so their
prompt is a prefix-cache hit there: one decode worker reserves every choice, one prefill worker computes,
and the KV moved for three choices is about one prompt's plus two partial blocks (round-robin alone sends
choice 1 to the other pair, which prefills and moves the whole prompt again). Greedy choices are equal."""
from __future__ import annotations

import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.processes import Proc, start_parallel, start_router, start_worker

pytestmark = pytest.mark.django_db(transaction=False, databases=[])
MODEL = "tiny-llama"
PROMPT_LEN = 45  # five full 8-token blocks and a partial one


@pytest.fixture(scope="module")
def deployment(tiny_model_dir: Path, log_dir: Path) -> Iterator[dict[str, list[str]]]:
    """Two prefill workers, two decode workers (fp32, 8-token blocks) and a round-robin router."""
    procs: list[Proc] = []
    try:
        common = ["--context-length", "256", "--block-size", "8", "--dtype", "float32"]
        decode_extra = [*common, "--max-sequence-length", "256"]
        started = start_parallel({
            "p0": partial(start_worker, "prefill", tiny_model_dir, log_dir, extra=common),
            "p1": partial(start_worker, "prefill", tiny_model_dir, log_dir, extra=common),
            "d0": partial(start_worker, "decode", tiny_model_dir, log_dir, extra=decode_extra),
            "d1": partial(start_worker, "decode", tiny_model_dir, log_dir, extra=decode_extra),
        })
        procs += [started[name][0] for name in ("p0", "p1", "d0", "d1")]
        urls: dict[str, list[str]] = {"prefill": [started["p0"][1], started["p1"][1]],
                                      "decode": [started["d0"][1], started["d1"][1]]}
        router, router_url = start_router(urls["prefill"], urls["decode"], log_dir)
        procs.append(router)
        urls["router"] = [router_url]
        yield urls
    finally:
        for proc in reversed(procs):
            proc.stop()


def counter(url: str, name: str) -> float:
    """A worker's counter `name` (its `_total` sample) from /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(rf"^{name}_total(?:\{{[^}}]*\}})? ([0-9.e+-]+)$", text, re.M)
    assert found, f"no {name}_total on {url}/metrics"
    return float(found.group(1))


def snapshot(urls: dict[str, list[str]]) -> dict[str, list[float]]:
    """Each worker's prompt tokens and KV bytes, by role."""
    return {
        "decode_prompt": [counter(u, "worker_prompt_tokens") for u in urls["decode"]],
        "prefill_prompt": [counter(u, "worker_prompt_tokens") for u in urls["prefill"]],
        "kv_bytes": [counter(u, "worker_kv_transfer_bytes") for u in urls["decode"]],
    }


def delta(after: dict[str, list[float]], before: dict[str, list[float]]) -> dict[str, list[float]]:
    return {k: [a - b for a, b in zip(after[k], before[k], strict=True)] for k in after}


def test_later_choices_reuse_the_first_choices_workers_and_kv(deployment: dict[str, list[str]]) -> None:
    client = openai.OpenAI(base_url=deployment["router"][0] + "/v1", api_key="unused", max_retries=0, timeout=120)
    # One prompt alone first (prompt of ids: both prompts have exactly PROMPT_LEN tokens): the KV of
    # a whole prompt.
    before = snapshot(deployment)
    single = client.completions.create(model=MODEL, prompt=list(range(10, 10 + PROMPT_LEN)), max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    one = delta(snapshot(deployment), before)
    whole_prompt_bytes = sum(one["kv_bytes"])
    assert single.choices[0].text and whole_prompt_bytes > 0
    # Three choices of a fresh prompt, twice over so that round-robin's cursor starts on each pair.
    for start in (100, 200):
        prompt = list(range(start, start + PROMPT_LEN))
        before = snapshot(deployment)
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=3,
                                           extra_body={"ignore_eos": True})
        moved = delta(snapshot(deployment), before)
        texts = [c.text for c in answer.choices]
        assert [c.index for c in answer.choices] == [0, 1, 2]
        assert texts[0] and texts == [texts[0]] * 3, texts  # greedy: equal choices
        assert answer.usage is not None and answer.usage.completion_tokens == 18
        # Every choice was reserved on one decode worker, and prefilled on one prefill worker.
        assert sorted(moved["decode_prompt"]) == [0, 3 * PROMPT_LEN], moved
        assert sorted(moved["prefill_prompt"])[0] == 0, moved
        # Choice 0 moved the whole prompt's KV; choices 1 and 2 only the blocks after the cached ones
        # (unpinned, choice 1 would move a whole prompt again on the other pair: 2x and more).
        print(f"KV bytes for n=3: {sum(moved['kv_bytes']):.0f}, one prompt {whole_prompt_bytes:.0f}")
        assert sum(moved["kv_bytes"]) < 1.5 * whole_prompt_bytes, (moved, whole_prompt_bytes)
    # Choice 0 is the request itself: a single run of the same prompt gives its text.
    again = client.completions.create(model=MODEL, prompt=list(range(200, 200 + PROMPT_LEN)), max_tokens=6,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == texts[0]
