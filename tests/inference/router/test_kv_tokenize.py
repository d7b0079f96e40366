"""A `kv-aware` router tokenizes text and chat prompts itself, with the tokenizer it fetched from a worker
(real processes: a prefill and two decode workers of the tiny model, a kv-aware and a round-robin router).

Its ids are the worker's: the same greedy tokens and prompt token counts as through a router that leaves
tokenization to the worker, for text completions and for chat with a system prompt and tools. And the
decode choice now sees text prompts: a conversation's next turn, sent as text, goes to the decode worker
that holds its prefix.
"""
from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import Proc, post_json, start_parallel, start_router, start_workers, wait_until

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

COMMON = ["--block-size", "8", "--context-length", "1024"]
HTTP_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
ROUTER_ENV = {"ROUTER_REQUEST_TIMEOUT_S": "60", "ROUTER_HEALTH_INTERVAL_S": "0.5"}
WORDS = "hello how are you I am fine thank what is your name my Sam and like reading books music".split()
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, log_dir: Path) -> Iterator[dict[str, Any]]:
    """One prefill and two decode workers; a kv-aware router (tokenizes) and a round-robin one (does not)."""
    started = start_workers({"p0": "prefill", "d0": "decode", "d1": "decode"}, tiny_model_dir, log_dir,
                            extra=COMMON, prefix="kvt")
    procs: list[Proc] = [proc for proc, _url in started.values()]
    try:
        urls = {name: url for name, (_proc, url) in started.items()}
        routers = start_parallel({
            "kv": functools.partial(start_router, [urls["p0"]], [urls["d0"], urls["d1"]], log_dir,
                                    policy="kv-aware", env=ROUTER_ENV),
            "plain": functools.partial(start_router, [urls["p0"]], [urls["d0"], urls["d1"]], log_dir, env=ROUTER_ENV),
        })
        (kv, kv_url), (plain, plain_url) = routers["kv"], routers["plain"]
        procs += [kv, plain]
        yield {"urls": urls, "kv": kv_url, "plain": plain_url, "procs": procs}
    finally:
        for proc in reversed(procs):
            proc.stop()


def _post(router: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    return post_json(router + path, body, HTTP_TIMEOUT)


def _kv(router: str) -> dict[str, Any]:
    kv = httpx.get(router + "/router/status", timeout=HTTP_TIMEOUT).json().get("kv")
    assert kv is not None
    return kv


def _tokenizer_loaded(cluster: dict[str, Any]) -> None:
    """The first request starts the fetch; wait until the tokenizer is in."""
    _post(cluster["kv"], "/generate", {"prompt": "warm up", "max_tokens": 1})
    wait_until("the router's tokenizer", lambda: _kv(cluster["kv"])["tokenizer"]["models"], 60, cluster["procs"])


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _counts(usage: dict[str, Any]) -> dict[str, Any]:
    # The token counts; how many of the prompt's tokens were cached depends on which request came first.
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


def test_router_ids_give_the_workers_tokens(cluster: dict[str, Any]) -> None:
    _tokenizer_loaded(cluster)
    status = _kv(cluster["kv"])["tokenizer"]
    assert not status["errors"], status
    rng = random.Random(3)
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    for prompt in [_text(rng, 40), "naïve café 分布式 🙂 <|im_end|> literal", _text(rng, 300)]:
        body = {"prompt": prompt, **greedy}
        kv, plain = _post(cluster["kv"], "/v1/completions", body), _post(cluster["plain"], "/v1/completions", body)
        assert kv["choices"][0]["text"] == plain["choices"][0]["text"]
        assert _counts(kv["usage"]) == _counts(plain["usage"])
    chats = [
        [{"role": "system", "content": "You are brief. " * 10}, {"role": "user", "content": _text(rng, 30)}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
         {"role": "user", "content": "how are you"}],
    ]
    for messages in chats:
        for tools in (None, TOOLS):
            body = {"messages": messages, **greedy, **({"tools": tools} if tools else {})}
            kv = _post(cluster["kv"], "/v1/chat/completions", body)
            plain = _post(cluster["plain"], "/v1/chat/completions", body)
            assert kv["choices"][0]["message"] == plain["choices"][0]["message"]
            assert _counts(kv["usage"]) == _counts(plain["usage"])
    # Every one of those prompts was hashed for the decode choice (its prompt tokens counted there).
    assert _kv(cluster["kv"])["predicted"]["decode"]["prompt_tokens"] > 300


def _holds(router: str, url: str, blocks: int) -> bool:
    return _kv(router)["index"]["workers"].get(url, {}).get("blocks", 0) >= blocks


def test_next_text_turn_goes_to_the_decode_worker_holding_it(cluster: dict[str, Any]) -> None:
    _tokenizer_loaded(cluster)
    router = cluster["kv"]
    rng = random.Random(11)
    for _ in range(4):
        history = _text(rng, 150)  # a conversation of its own: no other worker holds any of it
        first = _post(router, "/generate", {"prompt": history, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        holder = first["decode"]
        wait_until("the first turn's blocks", functools.partial(_holds, router, holder, 8), 30, cluster["procs"])
        second = _post(router, "/generate", {"prompt": history + first["text"] + " " + _text(rng, 5),
                                             "max_tokens": 4, "temperature": 0})
        assert second["decode"] == holder, (first, second, _kv(router)["predicted"])
    predicted = _kv(router)["predicted"]["decode"]
    assert predicted["predicted_cached_tokens"] >= 4 * 100, predicted
