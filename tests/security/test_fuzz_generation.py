"""Hypothesis-generated request bodies against the real router and workers (the secure cluster).

Router: /generate, /api/generate, /v1/completions and /v1/chat/completions get JSON bodies where
every field takes any type (prompt, max_tokens, temperature, top_p, top_k, seed, stop, stream,
messages, ...), plus unknown fields, deep nesting, huge numbers, NaN/Infinity literals and strings,
lone surrogates and other unicode, and raw bytes that are not JSON at all. Every answer must be
200 (a complete JSON body or SSE stream ending in [DONE]) or a 4xx with a JSON error; never a 5xx,
never a hang (each request has a timeout).

Workers: /internal/decode and /internal/prefill get bodies of the same kind (with the shared
secret, and sometimes a random one instead) and must answer 2xx or a 4xx JSON error. The one 5xx
allowed is prefill's 502 `kv_transfer_error` for a descriptor that passes validation but whose
decode side is not there or refuses it (an upstream failure the router retries elsewhere).

Examples are derandomized (the same on every run); counts are printed with -s and recorded in
docs/security.md. SECURITY_FUZZ_EXAMPLES scales them (default 150 per test).
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.security.conftest import API_KEY, SECRET, SecureCluster
from tests.support.processes import free_port

pytestmark = pytest.mark.django_db(transaction=False, databases=[])
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request drowns a failure

EXAMPLES = int(os.environ.get("SECURITY_FUZZ_EXAMPLES", "150"))
TIMEOUT = httpx.Timeout(60.0, connect=10.0)
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,  # the same examples on every run
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking against live servers: report as found
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
# endpoint -> Counter of status codes; printed by the last test.
OUTCOMES: dict[str, Counter[int]] = {}

# --------------------------------------------------------------------------- strategies

HUGE = 10**400  # beyond a float: float(HUGE) raises OverflowError
WEIRD_STRINGS = ["NaN", "Infinity", "-Infinity", "1e999", "-0", "\ud800", "\udfff", "\x00", "\u202e",
                 "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "🦙" * 20, "<|endoftext|>", "</s>", "{{ raise_exception('x') }}", " ", ""]
leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([HUGE, -HUGE, 2**63, -(2**63) - 1, 0, -1, 1]),
    st.floats(allow_nan=True, allow_infinity=True),  # serialized as NaN/Infinity literals
    st.text(max_size=40),
    st.sampled_from(WEIRD_STRINGS),
)
any_json = st.recursive(
    leaf,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
small_ints = st.integers(min_value=-3, max_value=40)
prompt_text = st.text(min_size=0, max_size=120) | st.sampled_from(WEIRD_STRINGS) | st.just("word " * 400)
message = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["system", "user", "assistant", "tool", ""]) | any_json,
        "content": prompt_text | any_json | st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]) | any_json,
                                   "text": prompt_text | any_json}), max_size=3),
        "name": any_json,
    },
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "prompt": prompt_text | st.lists(st.integers(min_value=-2, max_value=600), max_size=20) | any_json,
    "input_ids": st.lists(st.integers(min_value=-2, max_value=600), max_size=20) | any_json,
    "messages": st.lists(message, max_size=4) | any_json,
    "max_tokens": small_ints | any_json,
    "max_completion_tokens": small_ints | any_json,
    "temperature": st.floats(min_value=-1, max_value=3) | any_json,
    "top_p": st.floats(min_value=-0.5, max_value=1.5) | any_json,
    "top_k": small_ints | any_json,
    "seed": st.integers() | any_json,
    "stop": st.lists(st.text(max_size=5), max_size=20) | prompt_text | any_json,
    "stop_token_ids": st.lists(st.integers(min_value=-2, max_value=600), max_size=5) | any_json,
    "ignore_eos": st.booleans() | any_json,
    "stream": st.booleans() | any_json,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | any_json}) | any_json,
    "model": st.text(max_size=20) | any_json,
    "n": st.sampled_from([1, 2]) | any_json,
    "logprobs": any_json,
    "echo": any_json,
    "response_format": any_json,
}
unknown_fields = st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda k: k not in FIELDS), any_json,
                                 max_size=3)


@st.composite
def object_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A JSON object with a random subset of the API's fields (each of any type) and maybe unknown ones."""
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=8, unique=True))
    body = {name: draw(FIELDS[name]) for name in names}
    if draw(st.booleans()):
        body.update(draw(unknown_fields))
    return body


def nested(depth: int) -> bytes:
    """`{"prompt": [[[...]]]}` nested `depth` levels (past Python's recursion limit when large)."""
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.integers(min_value=1, max_value=200_000).map(nested),
    st.sampled_from([b"", b"null", b"[]", b'"x"', b"NaN", b"Infinity", b"1e999", b"1" + b"0" * 5000,
                     b'{"prompt": "\\ud800"}', b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
                     b"\xff\xfe{", b'{"prompt": "a"', b'{"prompt": "a"}{"prompt": "b"}']),
)


def encode(body: Any) -> bytes:
    """JSON as a lenient client would send it: NaN/Infinity literals, lone surrogates escaped."""
    return json.dumps(body, allow_nan=True).encode()


# Well-formed values of each field: most fuzzed bodies start from these so that the requests get
# past validation into the prefill → KV → decode path, then a few fields are corrupted.
VOCAB_IDS = st.integers(min_value=0, max_value=511)  # the tiny model's vocabulary
VALID: dict[str, st.SearchStrategy[Any]] = {
    "prompt": st.text(min_size=1, max_size=60),
    "input_ids": st.lists(VOCAB_IDS, min_size=1, max_size=30),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": st.text(max_size=40)}), min_size=1, max_size=3),
    "max_tokens": st.integers(min_value=1, max_value=40),  # the workers' limit is 32: some are 400s
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.01, max_value=1.0),
    "top_k": st.integers(min_value=-1, max_value=60),
    "seed": st.none() | st.integers(min_value=-(2**70), max_value=2**70),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3) | st.text(min_size=1, max_size=4),
    "stop_token_ids": st.lists(VOCAB_IDS, max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "model": st.text(max_size=10),
}
PROMPT_FIELD = {"/generate": "prompt", "/api/generate": "prompt", "/v1/completions": "prompt",
                "/v1/chat/completions": "messages"}


@st.composite
def mutated(draw: st.DrawFn, fields: dict[str, st.SearchStrategy[Any]], required: list[str]) -> dict[str, Any]:
    """A valid body (required fields plus a random subset of the optional ones) with 0-2 fields
    corrupted (any JSON value, or dropped) and sometimes unknown fields added."""
    optional = [name for name in fields if name not in required]
    chosen = list(required)
    if optional:
        chosen += draw(st.lists(st.sampled_from(optional), max_size=len(optional), unique=True))
    body = {name: draw(fields[name]) for name in chosen}
    corrupt = draw(st.sampled_from([0, 0, 0, 1, 1, 2]))
    for name in draw(st.lists(st.sampled_from(sorted(fields)), min_size=corrupt, max_size=corrupt, unique=True)):
        if draw(st.booleans()):
            body[name] = draw(FIELDS.get(name, any_json))
        else:
            body.pop(name, None)
    if draw(st.integers(0, 4)) == 0:
        body.update(draw(unknown_fields))
    return body


@st.composite
def router_requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """(endpoint, body): mostly mutated valid bodies, else any fields of any type, any JSON, raw bytes."""
    path = draw(st.sampled_from(sorted(PROMPT_FIELD)))
    prompt_field = PROMPT_FIELD[path]
    fields = {k: v for k, v in VALID.items() if k not in ("prompt", "input_ids", "messages") or k == prompt_field}
    body = draw(st.one_of(
        mutated(fields, [prompt_field]).map(encode),
        mutated(fields, [prompt_field]).map(encode),
        mutated(fields, [prompt_field]).map(encode),
        object_bodies().map(encode),
        raw_bodies,
        any_json.map(encode),
    ))
    return path, body

# --------------------------------------------------------------------------- checks


def record(endpoint: str, status: int) -> None:
    OUTCOMES.setdefault(endpoint, Counter())[status] += 1


def assert_json_error(response: httpx.Response, body: bytes) -> None:
    """A 4xx whose body is `{"error": {"message": ...}}`."""
    response.read()
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500], body[:300])
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], error


def check_router_answer(response: httpx.Response, body: bytes) -> None:
    """200 with a whole JSON body or a complete SSE stream, or a 4xx JSON error."""
    if response.status_code != 200:
        assert_json_error(response, body)
        return
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        text = response.read().decode()
        events = [block.removeprefix("data: ") for block in text.split("\n\n") if block]
        assert events and events[-1] == "[DONE]", text[-500:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event  # an error after the first token
    else:
        assert content_type.startswith("application/json"), content_type
        assert "error" not in json.loads(response.read())


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    """One connection pool for the whole module."""
    with httpx.Client(timeout=TIMEOUT) as c:
        yield c


# --------------------------------------------------------------------------- router


@FUZZ_SETTINGS
@given(request=router_requests())
@example(request=("/generate", encode({"prompt": "hi", "temperature": HUGE})))
@example(request=("/v1/completions", encode({"prompt": "hi", "top_p": -HUGE})))
@example(request=("/generate", nested(100_000)))
@example(request=("/v1/chat/completions", nested(5_000)))
@example(request=("/generate", encode({"prompt": "\ud800\udfff\ud800", "max_tokens": 2})))
@example(request=("/v1/chat/completions", encode({"messages": [{"role": "user", "content": "\ud800"}]})))
@example(request=("/v1/completions", encode({"prompt": "x", "max_tokens": 2, "stream": True, "stop": "\udfff"})))
@example(request=("/generate", encode({"prompt": "hi", "temperature": float("nan"), "top_p": float("inf")})))
@example(request=("/v1/chat/completions", encode({"messages": [{"role": "\ud800", "content": "hi"}], "max_tokens": 2})))
def test_router_answers_any_body_with_200_or_a_4xx_json_error(
    secure_cluster: SecureCluster, client: httpx.Client, request: tuple[str, bytes]
) -> None:
    path, body = request
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with client.stream("POST", secure_cluster.router + path, content=body, headers=headers) as response:
        record(f"router {path}", response.status_code)
        check_router_answer(response, body)


# Header values an HTTP client can send: visible latin-1 bytes (no CR/LF/NUL, no edge whitespace).
header_values = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=60
).map(lambda s: s.encode("latin-1"))
nonempty_header_values = header_values.filter(bool)


@FUZZ_SETTINGS
@given(authorization=header_values | st.sampled_from([b"Bearer", b"Bearer " + API_KEY.encode() + b"\xff"])
       | nonempty_header_values.map(lambda v: b"Bearer " + v))
def test_router_refuses_any_other_authorization(
    secure_cluster: SecureCluster, client: httpx.Client, authorization: bytes
) -> None:
    response = client.post(secure_cluster.router + "/generate", content=b'{"prompt": "hi", "max_tokens": 1}',
                           headers=[(b"authorization", authorization)])
    record("router auth", response.status_code)
    assert response.status_code == 401, (authorization, response.text)
    assert response.json()["error"]["type"] == "authentication_error"


# --------------------------------------------------------------------------- workers


def sampling() -> st.SearchStrategy[Any]:
    names = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos"]
    return st.one_of(
        st.fixed_dictionaries({}, optional={name: FIELDS[name] for name in names}),
        st.dictionaries(st.text(max_size=10), any_json, max_size=3),
        any_json,
    )


SAMPLING_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos"]
valid_sampling = mutated({name: VALID[name] for name in SAMPLING_FIELDS}, [])


@st.composite
def decode_bodies(draw: st.DrawFn) -> dict[str, Any]:
    """A decode request: one prompt form (text, chat or token ids) and sampling, either of them maybe corrupt."""
    prompt_field = draw(st.sampled_from(["prompt", "messages", "input_ids"]))
    fields = {
        "request_id": st.text(min_size=1, max_size=20),
        prompt_field: VALID[prompt_field],
        "sampling": valid_sampling | sampling(),
    }
    return draw(mutated(fields, ["request_id", prompt_field]))


WITH_SECRET = [(b"x-platform-secret", SECRET.encode())]
internal_headers: st.SearchStrategy[list[tuple[bytes, bytes]]] = st.one_of(
    st.just(WITH_SECRET),
    st.just(WITH_SECRET),
    st.just(WITH_SECRET),
    header_values.map(lambda v: [(b"x-platform-secret", v)]),
    st.just([]),
)


def check_worker_answer(response: httpx.Response, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    if headers != WITH_SECRET:
        assert response.status_code == 401, (headers, response.status_code, response.text[:300])
        return
    if response.status_code < 300:
        return
    assert_json_error(response, body)


@FUZZ_SETTINGS
@given(body=st.one_of(decode_bodies().map(encode), decode_bodies().map(encode), raw_bodies),
       headers=internal_headers)
@example(body=encode({"prompt": "hi", "sampling": {"temperature": HUGE}}), headers=WITH_SECRET)
@example(body=encode({"prompt": "\ud800", "sampling": {"max_tokens": 2}}), headers=WITH_SECRET)
@example(body=encode({"messages": [{"role": "user", "content": "\udfff"}]}), headers=WITH_SECRET)
@example(body=nested(100_000), headers=WITH_SECRET)
@example(body=b"{}", headers=[(b"x-platform-secret", "s\u00e9cret".encode("latin-1"))])
def test_decode_worker_answers_any_body_with_2xx_or_4xx_json(
    secure_cluster: SecureCluster, client: httpx.Client, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    with client.stream("POST", secure_cluster.decode + "/internal/decode", content=body, headers=headers) as response:
        record("worker /internal/decode", response.status_code)
        check_worker_answer(response, body, headers)
        if response.status_code == 200:
            # A valid request: its descriptor comes first; leaving now aborts it and frees its blocks.
            first = json.loads(next(response.iter_lines()))
            assert first["type"] == "descriptor", first


DESCRIPTOR_MUTATIONS: dict[str, st.SearchStrategy[Any]] = {
    "port": st.sampled_from([0, -1, 65536, 2**70]),
    "num_tokens": st.sampled_from([0, -1, 10**6, HUGE]),
    "block_ids": st.lists(st.integers(-2, 10**6), max_size=6),
    "layout": st.fixed_dictionaries({"num_layers": st.integers(-1, 3), "block_size": st.integers(-1, 9),
                                     "num_kv_heads": st.integers(-1, 3), "head_dim": st.integers(-1, 9),
                                     "dtype": st.sampled_from(["float32", "float16", "int8", ""])}),
    "lease_expires_at": st.sampled_from([1e300, HUGE, 0, -1e300]),
    "transport": st.sampled_from(["rdma", "", "udp"]),
    "token": st.text(max_size=40),
}


@st.composite
def prefill_bodies(draw: st.DrawFn, kv_port: int, closed_port: int, layout: dict[str, Any]) -> dict[str, Any]:
    """A consistent prefill request (prompt ids, sampling, a descriptor for them pointing at the real
    KV port or a closed one, loopback only), then maybe corrupted at the top level or inside the
    descriptor."""
    ids = draw(st.lists(VOCAB_IDS, min_size=1, max_size=40))
    blocks = -(-len(ids) // int(layout["block_size"]))
    descriptor: dict[str, Any] = {
        "request_id": draw(st.text(min_size=1, max_size=12)),
        "transport": "tcp",
        "host": draw(st.sampled_from(["127.0.0.1", "localhost"])),
        "port": draw(st.sampled_from([kv_port, closed_port])),
        "block_ids": list(range(blocks)),
        "num_tokens": len(ids),
        "layout": dict(layout),
        "lease_expires_at": time.time() + draw(st.sampled_from([5.0, -5.0])),
        "token": draw(st.text(max_size=32)),
    }
    for name in draw(st.lists(st.sampled_from(sorted(descriptor)), max_size=2, unique=True)):
        choice = draw(st.integers(0, 2))
        if choice == 0:
            descriptor.pop(name)
        else:
            descriptor[name] = draw(DESCRIPTOR_MUTATIONS.get(name, any_json) if choice == 1 else any_json)
    fields = {
        "request_id": st.text(min_size=1, max_size=12),
        "prompt_token_ids": st.just(ids),
        "sampling": valid_sampling | sampling(),
        "descriptor": st.just(descriptor) | any_json,
    }
    return draw(mutated(fields, sorted(fields)))


def test_prefill_worker_answers_any_body_with_2xx_or_4xx_json(
    secure_cluster: SecureCluster, client: httpx.Client
) -> None:
    kv_port = int(httpx.get(secure_cluster.decode + "/info", timeout=10).json()["kv_port"])
    # The real layout, as a legitimate decode worker describes it (closing the stream aborts the probe).
    with client.stream("POST", secure_cluster.decode + "/internal/decode", headers={"X-Platform-Secret": SECRET},
                       json={"prompt": "layout probe", "sampling": {"max_tokens": 1}}) as opened:
        layout = json.loads(next(opened.iter_lines()))["descriptor"]["layout"]
    bodies = prefill_bodies(kv_port, free_port(), layout).map(encode)

    @FUZZ_SETTINGS
    @given(body=st.one_of(bodies, bodies, bodies, raw_bodies), headers=internal_headers)
    def run(body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        response = client.post(secure_cluster.prefill + "/internal/prefill", content=body, headers=headers)
        record("worker /internal/prefill", response.status_code)
        if response.status_code == 502 and headers == WITH_SECRET:
            # Passed validation, then the decode side was absent or refused: an upstream failure.
            assert response.json()["error"]["type"] == "kv_transfer_error", response.text
            return
        check_worker_answer(response, body, headers)

    run()


def test_fuzz_counts() -> None:
    """Print what the fuzzers sent and got (after the tests above, in file order)."""
    if not OUTCOMES:
        pytest.skip("run together with the fuzz tests")
    total = sum(sum(c.values()) for c in OUTCOMES.values())
    print(f"\nhypothesis fuzz: {total} requests")
    for endpoint, statuses in sorted(OUTCOMES.items()):
        print(f"  {sum(statuses.values()):5d}  {endpoint}: {dict(sorted(statuses.items()))}")
    assert all(status < 500 or status == 502 for c in OUTCOMES.values() for status in c)
