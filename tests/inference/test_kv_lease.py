"""KV leases that follow progress, with real worker processes (docs/internals.md "KV leases").

A decode worker with a 2 s lease serves a prompt of context length - 16 tokens whose prefill worker
holds the KV for 6 s before sending it (PLATFORM_FAULT_PREFILL_DELAY_S): the prefill worker renews
the lease while it works, so the request completes with the tokens of an undelayed run. A prefill
worker that falls silent (SIGSTOP) lets the lease expire within one lease period; the error line
says who went silent and what it last reported, and the blocks are free again.

Processes (tiny model, context length 2048, block size 16):
    D  decode, --kv-lease-timeout 2
    F  prefill
    S  prefill, KV send delayed 6 s (3 leases)
"""
from __future__ import annotations

import contextlib
import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.server.worker import FAULT_PREFILL_DELAY_ENV
from tests.support.processes import Proc, start_router, start_worker

pytestmark = pytest.mark.django_db(transaction=False, databases=[])

CONTEXT = 2048
LEASE_S = 2.0
DELAY_S = 6.0
COMMON = ["--block-size", "16", "--context-length", str(CONTEXT), "--batch-size", "4"]
DELAY_LOG = "fault injection: delaying the KV send"
RENEWED_LOG = "lease renewal(s)"
# Greedy, exactly 8 tokens: the longest prompt leaves 16 positions.
SAMPLING = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
PROMPT_IDS = [3 + (i * 7919) % 509 for i in range(CONTEXT - 16)]  # tiny vocabulary: 512 ids
TIMEOUT = httpx.Timeout(60.0, connect=10.0)


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, log_dir: Path) -> Iterator[dict[str, tuple[Proc, str]]]:
    """D, F and S from the module docstring, started in parallel, stopped at the end."""
    specs: dict[str, tuple[str, list[str], dict[str, str] | None]] = {
        "D": ("decode", ["--kv-lease-timeout", str(LEASE_S)], None),
        "F": ("prefill", [], None),
        "S": ("prefill", [], {FAULT_PREFILL_DELAY_ENV: str(DELAY_S)}),
    }
    started: dict[str, tuple[Proc, str]] = {}
    try:
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                name: pool.submit(
                    start_worker, role, tiny_model_dir, log_dir, extra=[*COMMON, *extra], env=env,
                    name=f"lease-{name}",
                )
                for name, (role, extra, env) in specs.items()
            }
            for name, future in futures.items():
                started[name] = future.result()
        yield started
    finally:
        for proc, _url in started.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill(signal.SIGCONT)  # a stopped worker would ignore SIGTERM
            proc.stop()


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")


def kv_usage(url: str) -> float:
    """A decode worker's share of KV blocks in use."""
    return float(httpx.get(url + "/health", timeout=10).json()["kv_usage"])


class Disaggregated:
    """One request driven through the worker API as the router drives it: reserve, prefill, stream."""

    def __init__(self, decode: str, prefill: str, request_id: str) -> None:
        self.decode, self.prefill, self.request_id = decode, prefill, request_id
        self._stack = contextlib.ExitStack()
        self._pool = self._stack.enter_context(ThreadPoolExecutor(1))
        body = {"request_id": request_id, "input_ids": PROMPT_IDS, "sampling": SAMPLING}
        response = self._stack.enter_context(
            httpx.stream("POST", decode + "/internal/decode", json=body, timeout=TIMEOUT)
        )
        assert response.status_code == 200, response.read()
        self.lines = (json.loads(line) for line in response.iter_lines() if line)
        self.descriptor_line = next(self.lines)
        assert self.descriptor_line["type"] == "descriptor", self.descriptor_line

    def start_prefill(self) -> Future[httpx.Response]:
        """POST /internal/prefill with the descriptor, in the background."""
        body = {
            "request_id": self.request_id,
            "prompt_token_ids": self.descriptor_line["prompt_token_ids"],
            "sampling": SAMPLING,
            "descriptor": self.descriptor_line["descriptor"],
        }
        return self._pool.submit(httpx.post, self.prefill + "/internal/prefill", json=body, timeout=TIMEOUT)

    def close(self) -> None:
        """Close the decode stream (aborting the request if it is still running)."""
        self._stack.close()


def run(decode: str, prefill: str, request_id: str) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """A whole request: the prefill answer and the decode lines after the descriptor."""
    request = Disaggregated(decode, prefill, request_id)
    try:
        answer = request.start_prefill()
        lines = list(request.lines)
        return answer.result(timeout=60), lines
    finally:
        request.close()


def tokens(lines: list[dict[str, Any]]) -> list[int]:
    """The generated token ids of a decode stream that ended with done."""
    assert lines and lines[-1]["type"] == "done", lines[-3:]
    return [t for line in lines if line["type"] == "token" for t in line["token_ids"]]


def test_longest_prompt_completes_with_the_prefill_held_past_three_leases(
    workers: dict[str, tuple[Proc, str]],
) -> None:
    """Context length - 16 tokens, KV held 6 s by the prefill worker, 2 s lease: the same tokens
    as an undelayed run; the fast run sent no renewal, the slow one kept the lease alive."""
    (decode_proc, decode), (_, fast), (slow_proc, slow) = workers["D"], workers["F"], workers["S"]
    answer, lines = run(decode, fast, "lease-fast")
    assert answer.status_code == 200, answer.text
    reference = tokens(lines)
    assert len(reference) == 8
    assert lines[-1]["usage"]["prompt_tokens"] == CONTEXT - 16
    assert RENEWED_LOG not in decode_proc.log(), "a fast prefill renews nothing"

    started = time.monotonic()
    answer, lines = run(decode, slow, "lease-slow")
    elapsed = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    assert tokens(lines) == reference
    assert elapsed > DELAY_S > 3 * LEASE_S - 0.1, "the prefill really outlived the base lease"
    assert slow_proc.log().count(DELAY_LOG) == 1
    renewed = [line for line in decode_proc.log().splitlines() if "lease-slow" in line and RENEWED_LOG in line]
    assert renewed and "last progress: prefilled" in renewed[0], decode_proc.log()[-2000:]
    wait_until(lambda: kv_usage(decode) == 0, 10, "decode blocks freed after the request")


def test_silent_prefill_lets_the_lease_expire_within_one_period(workers: dict[str, tuple[Proc, str]]) -> None:
    """SIGSTOP of the prefill worker while it holds the KV: its renewals stop, the lease expires
    within one lease (2 s), the error line names it and its last progress, the blocks are freed;
    once resumed, the prefill worker learns its lease is gone and answers 409 lease_expired."""
    (_, decode), (slow_proc, slow) = workers["D"], workers["S"]
    request = Disaggregated(decode, slow, "lease-silent")
    try:
        seen = slow_proc.log().count(DELAY_LOG)
        answer = request.start_prefill()
        wait_until(lambda: slow_proc.log().count(DELAY_LOG) > seen, 30, "the prefill holds the KV")
        time.sleep(1.0)  # a renewal or two (one every 2/3 s) went out: progress was reported
        slow_proc.kill(signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            line = next(request.lines)
            silent_for = time.monotonic() - stopped_at
            assert line["type"] == "error" and line["reason"] == "kv_timeout", line
            assert 1.0 < silent_for < LEASE_S + 1.5, f"the lease expired {silent_for:.1f}s after SIGSTOP"
            assert line["lease_s"] == LEASE_S and line["silent_s"] >= LEASE_S - 0.05, line
            assert line["renewals"] >= 1, line
            assert line["last_progress"]["stage"] == "prefilled", line
            assert line["last_progress"]["prefill"] == slow, line
            assert re.match(rf"prefill worker {re.escape(slow)} made no progress for \d+\.\ds", line["message"]), line
            assert "last progress: prefilled" in line["message"], line
            wait_until(lambda: kv_usage(decode) == 0, 5, "the expired lease freed the blocks")
        finally:
            slow_proc.kill(signal.SIGCONT)
        response = answer.result(timeout=30)
        assert response.status_code == 409, response.text
        assert response.json()["error"]["type"] == "lease_expired", response.text
    finally:
        request.close()


def test_slow_prefill_through_the_router(workers: dict[str, tuple[Proc, str]], log_dir: Path) -> None:
    """The issue's target end to end: /generate with a prompt of context length - 16 tokens and a
    prefill slowed past the lease completes, with the tokens of the undelayed run."""
    (_, decode), (_, fast), (_, slow) = workers["D"], workers["F"], workers["S"]
    _answer, lines = run(decode, fast, "lease-router-reference")
    reference = tokens(lines)
    router, url = start_router([slow], [decode], log_dir, env={"ROUTER_REQUEST_TIMEOUT_S": "60"})
    try:
        payload = {"input_ids": PROMPT_IDS, **SAMPLING}
        response = httpx.post(url + "/generate", json=payload, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["tokens"] == reference and body["prefill"] == slow, body
        assert body["retries"] == 0, "no reservation was lost"
    finally:
        router.stop()
