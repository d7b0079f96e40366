"""The router's view of its workers: prefill and decode endpoints, their health and their load.

Endpoints can be replaced at run time (`set_endpoints`) so that a control plane can feed the pool;
an endpoint kept across a replacement keeps its state (in-flight count, health). A background
asyncio task polls `GET /health` on every endpoint each interval.

The list of endpoints in rotation per role is kept, not rebuilt per request: it is rebuilt when an
endpoint's health flips (the process-wide `rotation_stamp` moved) or `set_endpoints` replaced the
role's endpoints.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import aiohttp

from inference.router.endpoint import ROLES, Endpoint, rotation_stamp
from inference.router.health import KEEPALIVE_S, HealthChecker, check_endpoint, new_session
from inference.router.kv_events import KVFeed
from inference.router.kv_index import KVIndex
from inference.router.policies import (
    DEFAULT_KV_LOAD_WEIGHT,
    DEFAULT_REMOTE_DECODE_SHARE,
    Accept,
    KVAware,
    Policy,
    canonical_policy_name,
    make_policy,
)
from inference.router.prompt_tokens import PromptTokenizer
from inference.router.tokenizer_source import TokenizerSource
from inference.router.upstream import UpstreamClient
from inference.wire.kv_events import WorkerLoad

logger = logging.getLogger(__name__)

DEFAULT_FAILURE_THRESHOLD = 3


class WorkerPool:
    """Prefill and decode endpoints, a policy per role, health checks and one HTTP client.

    The pool is used from one event loop at a time (a gunicorn/uvicorn worker has exactly one).
    Its HTTP session is bound to the loop it was created in; when the pool is used from a new loop
    (tests, `async_to_sync`) it is recreated there. Health checks run in their own thread.
    """

    def __init__(
        self,
        prefill_urls: Iterable[str] = (),
        decode_urls: Iterable[str] = (),
        policy: str = "round-robin",
        *,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 2.0,
        connect_timeout_s: float = 3.0,
        headers: Mapping[str, str] | None = None,
        kv_token_weight: float = 1.0,
        kv_load_weight: float = DEFAULT_KV_LOAD_WEIGHT,
        kv_remote_decode_share: float = DEFAULT_REMOTE_DECODE_SHARE,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        if kv_token_weight < 0 or kv_load_weight < 0:
            raise ValueError("kv-aware weights must be >= 0")
        self.kv_token_weight = kv_token_weight
        self.kv_load_weight = kv_load_weight
        # The local prefill threshold of the deployment a managed router follows (None: the client's own,
        # `default_local_prefill_tokens`, which the client sets).
        self.local_prefill_tokens: int | None = None
        # Set by a managed router from its deployment: True while the deployment has a prefill role, so an
        # empty prefill list (its workers not registered yet, or all gone) is a pool not ready, never one
        # whose decode workers start prefilling; None (static endpoints): the lists say it.
        self.prefill_expected: bool | None = None
        self.default_local_prefill_tokens = 0
        if not 0 <= kv_remote_decode_share <= 1:
            raise ValueError("kv_remote_decode_share must be within [0, 1]")
        self.kv_remote_decode_share = kv_remote_decode_share
        # Where the workers' prefix caches are (kv_index.py), fed by their KV event streams while a
        # `kv-aware` policy is in use (kv_events.py).
        self.kv_index = KVIndex()
        self._kv_feed: KVFeed | None = None
        # The workers' tokenizer (fetched from one of them), so that text and chat prompts are hashed too.
        self.tokenizers = TokenizerSource(headers)
        self._started = False  # start_health_checks ran: background work follows the policy
        self.policy_name = canonical_policy_name(policy)
        self.failure_threshold = failure_threshold
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.headers: dict[str, str] = dict(headers or {})
        self._policies: dict[str, Policy] = self._make_policies(self.policy_name)
        # The prompt tokens the chosen workers then reported they held (decode) or reused (prefill), per role,
        # from the requests that finished: beside the kv-aware prediction in /router/status and /metrics.
        self.reported_cached_tokens: dict[str, int] = {"prefill": 0, "decode": 0}
        self._endpoints: dict[str, list[Endpoint]] = {role: [] for role in ROLES}
        # Every endpoint by URL, for the KV feed's load reports (rebuilt by set_endpoints, one assignment).
        self._by_url: dict[str, Endpoint] = {}
        # Prompt tokens of requests whose decode worker is deciding now whether to prefill locally: they
        # may join the prefill pool's queue in a moment (`remote_prefill_queue` counts them).
        self.prefill_deciding_tokens = 0
        # Per role: (the rotation stamp it was built at, the endpoints in rotation); None: rebuild.
        self._rotation: dict[str, tuple[int, list[Endpoint]] | None] = {role: None for role in ROLES}
        self.endpoints_version = 0  # moves on every set_endpoints (the health checker follows it)
        self._http: aiohttp.ClientSession | None = None
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._upstream: UpstreamClient | None = None
        self._upstream_loop: asyncio.AbstractEventLoop | None = None
        self._checker: HealthChecker | None = None
        self._info_cache: tuple[float, list[dict[str, Any]]] | None = None
        self.started_at = time.time()
        self.set_endpoints("prefill", prefill_urls)
        self.set_endpoints("decode", decode_urls)

    # ----------------------------------------------------------------------------------------
    # Endpoints and choice
    # ----------------------------------------------------------------------------------------

    def set_endpoints(self, role: str, urls: Iterable[str]) -> None:
        """Replace the endpoints of `role` (`"prefill"` or `"decode"`).

        URLs are validated first (ValueError, nothing changed, on a bad one). Endpoints whose URL
        was already present keep their object, so their in-flight count and health survive; new
        ones start healthy so they take traffic before their first health check.
        """
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        existing = {endpoint.url: endpoint for endpoint in self._endpoints[role]}
        updated: list[Endpoint] = []
        seen: set[str] = set()
        for url in urls:
            endpoint = Endpoint(url=url, role=role)  # validates and normalizes the URL
            if endpoint.url in seen:
                continue
            seen.add(endpoint.url)
            updated.append(existing.get(endpoint.url, endpoint))
        # One assignment: a request choosing concurrently sees either the old or the new list.
        self._endpoints[role] = updated
        self._by_url = {endpoint.url: endpoint for r in ROLES for endpoint in self._endpoints[r]}
        self._rotation[role] = None
        self.endpoints_version += 1
        if self._checker is not None:
            self._checker.wake()  # new endpoints get their first check now, not at their phase
        self._info_cache = None

    def set_policy(self, policy: str) -> None:
        """Switch the load-balancing policy (ValueError on an unknown name; unchanged name: no-op)."""
        name = canonical_policy_name(policy)
        if name != self.policy_name:
            self._policies = self._make_policies(name)
            self.policy_name = name
            if self._started:
                self._follow_kv_events()

    def set_kv_weights(self, token_weight: float, load_weight: float) -> None:
        """The kv-aware cost's weights (both >= 0, ValueError otherwise), applied to the running policies."""
        if token_weight < 0 or load_weight < 0:
            raise ValueError("kv-aware weights must be >= 0")
        self.kv_token_weight, self.kv_load_weight = token_weight, load_weight
        for policy in self._policies.values():
            if isinstance(policy, KVAware):
                policy.configure(self.kv_index, token_weight, load_weight)

    def _make_policies(self, name: str) -> dict[str, Policy]:
        """A policy per role; a `kv-aware` one reads the pool's KV index with the pool's weights."""
        policies = {role: make_policy(name) for role in ROLES}
        for role, policy in policies.items():
            if isinstance(policy, KVAware):
                policy.configure(self.kv_index, self.kv_token_weight, self.kv_load_weight)
                if role == "decode":
                    policy.token_share = self.decode_token_share
        return policies

    def decode_prefills(self) -> bool:
        """Whether decode workers prefill prompts themselves (a colocated pool, or local prefill offered)."""
        limit = self.local_prefill_tokens
        return self.colocated or bool(self.default_local_prefill_tokens if limit is None else limit)

    def decode_token_share(self) -> float:
        """What a token cached on a decode worker saves, as a share of computing it: all of it when the
        decode worker may prefill the prompt itself, else only its KV transfer (`kv_remote_decode_share`):
        a decode choice that weighed a remote prompt's cached tokens fully kept conversations on the
        worker that held them and piled their streams up there, for a saving of a few ms of transfer."""
        return 1.0 if self.decode_prefills() else self.kv_remote_decode_share

    def _follow_kv_events(self) -> None:
        """Subscribe to the workers' KV event streams while the policy reads them (idempotent)."""
        if self.policy_name == KVAware.name and (self._kv_feed is None or not self._kv_feed.running):
            self._kv_feed = KVFeed(self, self.kv_index)
            self._kv_feed.start()

    def prompt_tokenizer(self) -> PromptTokenizer | None:
        """The decode workers' tokenizer while the policy routes by KV and there is a decode choice to
        make (None otherwise, or not fetched yet: the worker tokenizes, and the prefill choice reads
        the ids its descriptor sends back)."""
        if self.policy_name != KVAware.name:
            return None
        decode = self.in_rotation("decode")
        return self.tokenizers.for_endpoints(decode) if len(decode) > 1 else None

    def endpoints(self, role: str) -> list[Endpoint]:
        """The endpoints of `role` (a copy of the list)."""
        return list(self._endpoints[role])

    def all_endpoints(self) -> list[Endpoint]:
        """Every endpoint, prefill first."""
        return [endpoint for role in ROLES for endpoint in self._endpoints[role]]

    def candidates(self, role: str, exclude: Collection[Endpoint] = ()) -> list[Endpoint]:
        """Endpoints of `role` a request may try next: in rotation and not in `exclude`.

        When no endpoint of the role is in rotation at all, every endpoint not yet tried is a
        candidate ("panic mode", as in Envoy): a worker whose health check merely timed out under
        load still gets the request instead of every request failing until the next check.
        """
        rotation = self.in_rotation(role)
        if not exclude:
            return list(rotation)
        return [e for e in rotation if e not in exclude]

    def in_rotation(self, role: str) -> list[Endpoint]:
        """The endpoints of `role` in rotation (all of them in panic mode, see `candidates`).

        The pool's own list, kept until an endpoint's health flips or `set_endpoints` runs: read it,
        do not change it.
        """
        stamp = rotation_stamp()  # read before building: a flip during the build moves it again
        cached = self._rotation[role]
        if cached is None or cached[0] != stamp:
            endpoints = self._endpoints[role]
            healthy = [e for e in endpoints if e.healthy]
            cached = (stamp, healthy or list(endpoints))
            self._rotation[role] = cached
        return cached[1]

    def has_candidate(self, role: str, exclude: Collection[Endpoint] = ()) -> bool:
        """Whether `candidates(role, exclude)` is not empty, without building it."""
        rotation = self.in_rotation(role)
        if not exclude:
            return bool(rotation)
        return any(e not in exclude for e in rotation)

    def choose(self, role: str, exclude: Collection[Endpoint] = ()) -> Endpoint | None:
        """The endpoint the policy picks among `candidates(role, exclude)`, or None if there is none."""
        rotation = self.in_rotation(role)
        if not exclude:
            return self._policies[role].choose(rotation) if rotation else None
        return self._policies[role].choose_where(rotation, lambda e: e not in exclude)

    def choose_where(self, role: str, accept: Accept) -> Endpoint | None:
        """The endpoint the role's policy picks among those in rotation that `accept` takes, or None."""
        return self._policies[role].choose_where(self.in_rotation(role), accept)

    def apply_load(self, url: str, load: WorkerLoad | None) -> None:
        """The load report of the worker at `url` (None: its stream ended), from the KV feed's thread."""
        endpoint = self._by_url.get(url)
        if endpoint is not None:
            endpoint.apply_load(load)

    def remote_prefill_queue(self) -> dict[str, Any] | None:
        """What a decode worker offered local prefill weighs the remote path by (`remote_prefill` of its
        body): the prompt tokens ahead on the prefill worker that would start a prompt soonest (its
        reported queue plus this router's prefills since the report, `Endpoint.queued_tokens`; plus a
        share of the prompts whose decode workers are deciding now) and the tokens/s that worker reported
        (null until measured). None without prefill workers."""
        prefill = self.in_rotation("prefill")
        if not prefill:
            return None
        rates = [rate for e in prefill if (rate := e.prefill_rate())]
        typical = sum(rates) / len(rates) if rates else 1.0  # unmeasured workers: as fast as the others
        best, best_s = prefill[0], -1.0
        for endpoint in prefill:
            wait_s = endpoint.queued_tokens() / (endpoint.prefill_rate() or typical)
            if best_s < 0 or wait_s < best_s:
                best, best_s = endpoint, wait_s
        # The prompts being decided may go either way: their share of the queue is what spreading them over
        # every worker that may prefill them (prefill and decode) leaves to one.
        spread = len(prefill) + len(self.in_rotation("decode"))
        queue = max(0, best.queued_tokens()) + self.prefill_deciding_tokens // spread
        return {"queue_tokens": queue, "tokens_per_s": best.prefill_rate()}

    def record_failure(self, endpoint: Endpoint, error: str) -> None:
        """A request failed on `endpoint` (connect error, 5xx, timeout): count it toward removal."""
        was_healthy = endpoint.healthy
        endpoint.record_failure(error, self.failure_threshold)
        if was_healthy and not endpoint.healthy:
            logger.warning(
                "%s endpoint %s out of rotation after %d consecutive failures: %s",
                endpoint.role, endpoint.url, endpoint.consecutive_failures, error,
            )

    def record_success(self, endpoint: Endpoint) -> None:
        """A request went through on `endpoint`."""
        endpoint.record_success()

    @property
    def colocated(self) -> bool:
        """No prefill endpoints but decode ones: the decode workers prefill every prompt themselves
        (`--service-type both` workers, or decode workers offered every prompt). Never while prefill
        workers are expected (`prefill_expected`)."""
        if self.prefill_expected:
            return False
        return not self._endpoints["prefill"] and bool(self._endpoints["decode"])

    def _needed_roles(self) -> tuple[str, ...]:
        return ("decode",) if self.colocated else ROLES

    def ready(self) -> bool:
        """True when at least one prefill (unless colocated) and one decode endpoint are in rotation and
        answered a health check (a new endpoint is in rotation before its first answer, but not yet known)."""
        return all(any(e.healthy and e.last_health is not None for e in self._endpoints[role])
                   for role in self._needed_roles())

    def unknown_roles(self) -> list[str]:
        """The roles none of whose endpoints has answered a health check yet: before their first
        answers the router knows neither their models nor their slots (empty once it knows both)."""
        return [role for role in self._needed_roles()
                if not any(e.last_health is not None for e in self._endpoints[role])]

    # ----------------------------------------------------------------------------------------
    # HTTP session and health checks
    # ----------------------------------------------------------------------------------------

    def session(self) -> aiohttp.ClientSession:
        """The pool's HTTP session for the running event loop (created on first use in a loop).

        aiohttp, not httpx: measured by bench/http_clients.py, httpx spends about 10x the CPU per
        call and 5x per streamed line, and this client is the router's hot path.
        """
        loop = asyncio.get_running_loop()
        if self._http is None or self._http_loop is not loop or self._http.closed:
            # The old session (if any) belongs to another loop and cannot be closed from here;
            # its connections die with that loop.
            self._http = new_session(self.headers)
            self._http_loop = loop
        return self._http

    def upstream(self) -> UpstreamClient:
        """The pool's client for the two requests of every generation (decode stream, prefill), for
        the running event loop: leaner than the aiohttp session (inference/router/upstream.py)."""
        loop = asyncio.get_running_loop()
        if self._upstream is None or self._upstream_loop is not loop or self._upstream.closed:
            self._upstream = UpstreamClient(self.headers, keepalive_s=KEEPALIVE_S)
            self._upstream_loop = loop
        return self._upstream

    def start_health_checks(self) -> None:
        """Start the health-check thread (idempotent).

        The checks run in a thread with an event loop and HTTP session of their own: a router
        whose request loop is saturated must still see healthy workers answer in time, or it would
        take them out of rotation for its own lateness.
        """
        self._started = True
        self._follow_kv_events()
        if self.health_interval_s <= 0:
            return
        if self._checker is None or not self._checker.running:
            self._checker = HealthChecker(self)
            self._checker.start()

    @property
    def health_checks_running(self) -> bool:
        """Whether the background health-check thread is alive."""
        return self._checker is not None and self._checker.running

    async def check_all(self) -> None:
        """Check every endpoint once, concurrently, from the running loop."""
        endpoints = self.all_endpoints()
        if endpoints:
            session = self.session()
            await asyncio.gather(*(check_endpoint(self, session, endpoint) for endpoint in endpoints))

    async def check_health(self, endpoint: Endpoint) -> bool:
        """`GET /health` on `endpoint` from the running loop and apply the result; True when healthy."""
        return await check_endpoint(self, self.session(), endpoint)

    async def worker_info(self, max_age_s: float = 10.0) -> list[dict[str, Any]]:
        """`GET /info` of every endpoint in rotation (each dict gets its `url`), cached `max_age_s`."""
        now = time.monotonic()
        if self._info_cache is not None and now - self._info_cache[0] < max_age_s:
            return self._info_cache[1]
        session = self.session()
        timeout = aiohttp.ClientTimeout(total=self.health_timeout_s + self.connect_timeout_s,
                                        sock_connect=self.connect_timeout_s)

        async def fetch(endpoint: Endpoint) -> dict[str, Any] | None:
            try:
                async with session.get(f"{endpoint.url}/info", timeout=timeout) as response:
                    body = await response.json(content_type=None) if response.status == 200 else None
            except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
                return None
            return {**body, "url": endpoint.url} if isinstance(body, dict) else None

        endpoints = [e for e in self.all_endpoints() if e.healthy] or self.all_endpoints()
        results = await asyncio.gather(*(fetch(endpoint) for endpoint in endpoints))
        infos = [info for info in results if info is not None]
        if infos:  # never cache a total failure: the next call should ask again
            self._info_cache = (now, infos)
        return infos

    async def aclose(self) -> None:
        """Stop the health checks and close the HTTP session (call from the pool's loop)."""
        checker, self._checker = self._checker, None
        if checker is not None:
            await asyncio.to_thread(checker.stop)
        self._started = False
        feed, self._kv_feed = self._kv_feed, None
        if feed is not None:
            await asyncio.to_thread(feed.stop)
        session, self._http = self._http, None
        if session is not None and self._http_loop is asyncio.get_running_loop():
            await session.close()
        upstream, self._upstream = self._upstream, None
        if upstream is not None and self._upstream_loop is asyncio.get_running_loop():
            upstream.close()

    # ----------------------------------------------------------------------------------------
    # Reporting
    # ----------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """A JSON-safe snapshot of the pool for /health and /router/status."""
        return {
            "policy": self.policy_name,
            "ready": self.ready(),
            "failure_threshold": self.failure_threshold,
            "health_interval_s": self.health_interval_s,
            "health_checks_running": self.health_checks_running,
            "prefill": [endpoint.to_dict() for endpoint in self._endpoints["prefill"]],
            "decode": [endpoint.to_dict() for endpoint in self._endpoints["decode"]],
            **({"kv": self.kv_status()} if self.policy_name == KVAware.name else {}),
        }

    def kv_counts(self, role: str) -> tuple[int, int, int]:
        """`role`'s (prompt tokens the `kv-aware` policy routed, the cached tokens it predicted, the cached
        tokens the workers reported); the first two are zeros under another policy."""
        policy = self._policies[role]
        reported = self.reported_cached_tokens[role]
        if isinstance(policy, KVAware):
            return policy.prompt_tokens, policy.predicted_cached_tokens, reported
        return 0, 0, reported

    def report_cached_tokens(self, role: str, tokens: int) -> None:
        """A finished request's worker of `role` reported it held (or reused) `tokens` of the prompt."""
        self.reported_cached_tokens[role] += max(0, tokens)

    def kv_status(self) -> dict[str, Any]:
        """The KV index and what the `kv-aware` choices predicted, per role."""
        predicted: dict[str, Any] = {}
        for role, policy in self._policies.items():
            if isinstance(policy, KVAware):
                predicted[role] = {"prompt_tokens": policy.prompt_tokens,
                                   "predicted_cached_tokens": policy.predicted_cached_tokens,
                                   "reported_cached_tokens": self.reported_cached_tokens[role]}
        feed = self._kv_feed
        return {"index": self.kv_index.status(), "predicted": predicted,
                "weights": {"token": self.kv_token_weight, "load": self.kv_load_weight},
                "tokenizer": self.tokenizers.status(),
                "feed_running": feed is not None and feed.running,
                "stream_errors": dict(feed.errors) if feed is not None else {}}
