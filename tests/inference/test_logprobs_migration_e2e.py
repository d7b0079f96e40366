"""A stream with log-probabilities whose decode worker is SIGKILLed mid-stream moves to the other decode
worker and keeps one log-probability per token, equal to an unbroken run's (issue 23 item 7): the
token it resumes with is sampled by a prefill worker, whose answer carries that token's entry. The
same drill under a JSON schema and penalties keeps the grammar and the penalties' counts."""
from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.support.processes import start_parallel, start_router, start_worker, wait_until

pytestmark = pytest.mark.django_db(transaction=False, databases=[])
CONTEXT = 256
PROMPT = "Disaggregated inference separates prefill from decode so that"
MAX_TOKENS = 120
TOL = 1e-4


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, log_dir: Path):
    """One prefill, two decode workers (a victim and a survivor) and a router, real processes, fp32."""
    procs: dict[str, Any] = {}
    try:
        common = ["--context-length", str(CONTEXT), "--block-size", "8", "--dtype", "float32"]
        decode = ["--max-sequence-length", str(CONTEXT)]
        started = start_parallel({
            "P": partial(start_worker, "prefill", tiny_model_dir, log_dir, extra=common),
            "V": partial(start_worker, "decode", tiny_model_dir, log_dir, extra=[*common, *decode], name="victim"),
            "X": partial(start_worker, "decode", tiny_model_dir, log_dir, extra=[*common, *decode], name="survivor"),
        })
        (procs["P"], prefill), (procs["V"], victim), (procs["X"], survivor) = (started[n] for n in "PVX")
        procs["R"], router = start_router([prefill], [victim, survivor], log_dir)
        yield procs, router, victim
    finally:
        for p in reversed(list(procs.values())):
            p.stop()


def _events(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            yield data if data == "[DONE]" else json.loads(data)


def _inflight(router: str, url: str) -> int:
    status = httpx.get(router + "/router/status", timeout=30).json()
    return int(next(e for e in status["decode"] if e["url"] == url)["inflight"])


def _moved_stream(procs: dict[str, Any], router: str, victim: str, body: dict[str, Any]) -> list[Any]:
    """The chunks of `body` streamed until its first chunk, then its decode worker (the victim) killed:
    round robin puts every other stream on the victim; the rest comes from the other one. A try whose
    stream the victim finished before it was frozen (a quiet machine) is tried again."""
    for _ in range(8):
        with httpx.stream("POST", router + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            assert r.status_code == 200
            events = _events(r.iter_lines())
            first = next(events)
            procs["V"].kill(signal.SIGSTOP)  # frozen first: it cannot finish while we look where it runs
            if _inflight(router, victim) != 1:
                procs["V"].kill(signal.SIGCONT)
                list(events)
                continue
            procs["V"].kill()
            rest = list(events)
            break
    else:
        pytest.fail("no stream landed on the victim decode worker")
    assert rest[-1] == "[DONE]", rest[-3:]
    chunks = [first, *[e for e in rest[:-1] if e.get("choices")]]
    assert all("error" not in c for c in chunks), chunks[-1]
    return chunks


def test_a_moved_stream_keeps_its_logprobs(cluster: tuple[dict[str, Any], str, str]) -> None:
    procs, router, victim = cluster
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 2}
    reference = httpx.post(router + "/v1/completions", json=body, timeout=120).json()["choices"][0]["logprobs"]
    assert len(reference["tokens"]) == MAX_TOKENS
    chunks = _moved_stream(procs, router, victim, body)
    tokens: list[str] = []
    values: list[float] = []
    for chunk in chunks:
        logprobs = chunk["choices"][0]["logprobs"]
        if logprobs:
            tokens += logprobs["tokens"]
            values += logprobs["token_logprobs"]
    # Every token has its number (none null), and they are the unbroken run's.
    assert tokens == reference["tokens"]
    assert all(v is not None for v in values)
    assert all(abs(v - ref) < TOL for v, ref in zip(values, reference["token_logprobs"], strict=True))


LIST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 6},
                             "minItems": 16, "maxItems": 16}},
    "required": ["items"],
    "additionalProperties": False,
}


def _healthy(router: str, url: str) -> bool:
    status = httpx.get(router + "/router/status", timeout=30).json()
    return bool(next(e for e in status["decode"] if e["url"] == url)["healthy"])


def test_a_moved_stream_keeps_its_grammar_and_penalties(cluster: tuple[dict[str, Any], str, str],
                                                        tiny_model_dir: Path, log_dir: Path) -> None:
    """The same drill under a JSON schema and the three penalties (issue 23 item 7): the surviving decode
    worker's matcher replays the streamed tokens and its penalties count them, so the answer still
    validates and equals the unbroken run's."""
    procs, router, victim = cluster
    if not procs["V"].alive():  # the drill above killed it: a fresh victim at the same URL
        procs["V"].stop()
        common = ["--context-length", str(CONTEXT), "--block-size", "8", "--dtype", "float32"]
        procs["V"], _ = start_worker("decode", tiny_model_dir, log_dir, port=int(victim.rsplit(":", 1)[1]),
                                     extra=[*common, "--max-sequence-length", str(CONTEXT)], name="victim2")
        wait_until("the router takes the restarted victim back", lambda: _healthy(router, victim), 60,
                   [procs["R"], procs["V"]])
    body = {"model": "tiny-llama", "prompt": "A list:", "max_tokens": 200, "temperature": 0,
            "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "list", "schema": LIST_SCHEMA}}}
    reference = httpx.post(router + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    jsonschema.validate(json.loads(reference), LIST_SCHEMA)
    chunks = _moved_stream(procs, router, victim, body)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(chunks[0]["choices"][0]["text"]) < len(text) // 4  # the kill came early in the answer
    assert text == reference
    jsonschema.validate(json.loads(text), LIST_SCHEMA)
