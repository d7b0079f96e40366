"""Flags of `python -m inference.launch_router` (the process runs in tests/inference/gateway/test_consumers.py)."""
from __future__ import annotations

import pytest

from inference.launch_router import parse_args, router_environment

BASE = ["--prefill-endpoint", "http://p1:30000", "--decode-endpoint", "http://d1:30001/"]


def test_flags_become_the_router_environment() -> None:
    args = parse_args(
        [*BASE, "--prefill-endpoint", "http://p2:30000", "--listen-port", "8100",
         "--load-balance-strategy", "least-connections", "--workers", "2", "--log-level", "debug"]
    )
    env = router_environment(args)
    assert env["ROUTER_PREFILL_ENDPOINTS"] == "http://p1:30000,http://p2:30000"
    assert env["ROUTER_DECODE_ENDPOINTS"] == "http://d1:30001"
    assert env["ROUTER_POLICY"] == "least-connections"
    assert env["ROUTER_PORT"] == "8100" and env["ROUTER_WORKERS"] == "2"
    assert env["ROUTER_HOST"] == "0.0.0.0" and env["PLATFORM_LOG_LEVEL"] == "DEBUG"
    assert "ROUTER_MAX_INFLIGHT" not in env  # unset flag: the environment (or no cap) decides
    assert router_environment(parse_args([*BASE, "--max-inflight", "8"]))["ROUTER_MAX_INFLIGHT"] == "8"


@pytest.mark.parametrize(
    ("argv", "flag", "words"),
    [
        (["--prefill-endpoint", "http://p:1", "--decode-endpoint", "decode-node:30001"], "--decode-endpoint",
         "http(s)"),
        (["--prefill-endpoint", "ftp://p:1", "--decode-endpoint", "http://d:1"], "--prefill-endpoint", "http(s)"),
        ([*BASE, "--load-balance-strategy", "random"], "--load-balance-strategy", "power-of-two"),
        ([*BASE, "--listen-port", "70000"], "--listen-port", "65535"),
        ([*BASE, "--workers", "0"], "--workers", "[1, 256]"),
        (["--prefill-endpoint", "http://p:1"], "--decode-endpoint", "required"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(
    argv: list[str], flag: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and words in err


def test_decode_endpoints_alone_are_a_colocated_pool() -> None:
    env = router_environment(parse_args(["--decode-endpoint", "http://both:30001"]))
    assert env["ROUTER_PREFILL_ENDPOINTS"] == "" and env["ROUTER_DECODE_ENDPOINTS"] == "http://both:30001"


def test_queue_flags_reach_the_environment() -> None:
    env = router_environment(parse_args([*BASE, "--queue-timeout", "2.5", "--max-queue", "7"]))
    assert env["ROUTER_QUEUE_TIMEOUT_S"] == "2.5" and env["ROUTER_MAX_QUEUE"] == "7"
    assert "ROUTER_QUEUE_TIMEOUT_S" not in router_environment(parse_args(BASE))


@pytest.mark.parametrize("value", ["0", "-1", "nan", "5000"])
def test_bad_queue_timeout_names_the_flag(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--queue-timeout", value])
    assert "--queue-timeout" in capsys.readouterr().err


def test_kv_flags_reach_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    env = router_environment(parse_args([*BASE, "--load-balance-strategy", "KV_aware", "--kv-token-weight", "0.5",
                                         "--kv-load-weight", "128"]))
    assert env["ROUTER_POLICY"] == "kv-aware"
    assert (env["ROUTER_KV_TOKEN_WEIGHT"], env["ROUTER_KV_LOAD_WEIGHT"]) == ("0.5", "128.0")
    assert "ROUTER_KV_TOKEN_WEIGHT" not in router_environment(parse_args(BASE))
    local = router_environment(parse_args([*BASE, "--local-prefill-tokens", "32"]))
    assert local["ROUTER_LOCAL_PREFILL_TOKENS"] == "32"
    assert "ROUTER_LOCAL_PREFILL_TOKENS" not in router_environment(parse_args(BASE))
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--kv-load-weight", "-1"])
    assert "--kv-load-weight" in capsys.readouterr().err
