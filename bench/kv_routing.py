"""KV-aware routing against round-robin: a multi-turn chat on 2 prefill + 2 decode workers, in one run.

Each conversation sends the whole history every turn (a shared system prompt, then user turns and the
replies it got, as token ids), its turns one after another, all conversations at once. Each policy
gets a fresh deployment (workers and router started for it, so the caches start cold alike) and the
same conversations. Reported per policy: the prefill workers' own prefix-cache hit ratio (their
/metrics), the hit ratio of every prefill wherever it ran (per worker, and for the deployment: cached
prompt tokens over prompt tokens of the prompts prefill workers and, locally, decode workers computed)
counted two ways: at receipt (`worker_prefilled_cached_tokens_total`, what the cache held when the
request came) and by the engine (`worker_prefilled_reused_tokens_total`, what it did not compute when it
scheduled the prefill: a burst's shared system prompt computed once counts as reused by the others),
what the router predicted (kv-aware), TTFT p50/p90 as the client sees it (and per turn, local / remote),
output tok/s. `--step-log DIR` keeps every worker's engine steps (ENGINE_STEP_LOG) and sums them over the
burst of first turns and the whole run.

`--prompts chat` sends the same shape as OpenAI chat instead (`/v1/chat/completions`, streamed: a
system message, user messages of random words, the replies' text as assistant messages), which the
router must tokenize itself to route by KV (inference/router/prompt_tokens.py); "same prefill" is then
not known (the chat stream does not name the workers).

    .venv/bin/python -m bench.kv_routing            # SmolLM2 if prepared, else the tiny model
    .venv/bin/python -m bench.kv_routing --quick    # tiny model, a few short conversations
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import (
    base_parser,
    fmt,
    log,
    machine_info,
    markdown_table,
    parse_args,
    percentile,
    print_header,
    ratio,
    smollm2_dir,
    tiny_model_dir,
    write_result,
)
from bench.kv_routing_analysis import Shape, hit_ratio_ceiling, read_steps, step_summary, turn_report

MODULE = "bench.kv_routing"
CHAT_MODE = False  # --prompts chat
# (name, router policy, router environment, workers' environment, workers' extra flags): "+local" offers
# local prefill to the decode workers.
Variant = tuple[str, str, dict[str, str], dict[str, str], list[str]]
# A prefill step budget of 256 prompt tokens (`-b256`): a burst of prompts is admitted a few at a time,
# decode steps between, so their first tokens come in turn instead of all after one long step.
B256 = ["--max-num-batched-tokens", "256"]
# Mixed prefill with the learned step-cost budget (`-mixed`: the README's flags for workers that prefill and
# decode, tuned on the serving tails): prompt tokens run inside decode steps, as many as keep a step within
# 2x a decode step, so a burst's first tokens come in turn and streams keep their pace. Only a decode worker
# that prefills locally has both; on prefill workers and decode-only workers it changes nothing.
MIXED = ["--mixed-prefill", "--mixed-step-target", "auto"]
VARIANTS: tuple[Variant, ...] = (
    ("round-robin", "round-robin", {}, {}, []),
    ("round-robin-b256", "round-robin", {}, {}, B256),
    ("kv-aware", "kv-aware", {}, {}, []),
    # The decode choice weighing a remotely prefilled prompt's cached tokens fully (as before
    # ROUTER_KV_REMOTE_DECODE_SHARE).
    ("kv-aware-sticky", "kv-aware", {"ROUTER_KV_REMOTE_DECODE_SHARE": "1"}, {}, []),
    ("kv-aware+local", "kv-aware", {"ROUTER_LOCAL_PREFILL_TOKENS": "128"}, {}, []),
    ("kv-aware+local-b256", "kv-aware", {"ROUTER_LOCAL_PREFILL_TOKENS": "128"}, {}, B256),
    ("kv-aware+local-mixed", "kv-aware", {"ROUTER_LOCAL_PREFILL_TOKENS": "128"}, {}, MIXED),
    # Every worker prefilling a wave of prompts in one step, as before scheduler.PREFILL_WAVE_STEPS (A/B).
    ("round-robin-wave1", "round-robin", {}, {"ENGINE_PREFILL_WAVE_STEPS": "1"}, []),
    ("kv-aware+local-wave1", "kv-aware", {"ROUTER_LOCAL_PREFILL_TOKENS": "128"}, {"ENGINE_PREFILL_WAVE_STEPS": "1"},
     []),
    # The decode workers counting a prompt's tokens to compute at receipt only (before pending_prefix.py):
    # a burst's cold first turns all look whole.
    ("kv-aware+local-receipt", "kv-aware", {"ROUTER_LOCAL_PREFILL_TOKENS": "128"},
     {"WORKER_PENDING_PREFIX_CREDIT": "0"}, []),
)


@dataclass
class Turn:
    """One request of a conversation as the client saw it."""

    conversation: int
    turn: int
    prompt_tokens: int
    ttft_s: float | None = None
    output: list[int] = field(default_factory=list)
    prefill: str = ""
    decode: str = ""
    error: str = ""
    timings: dict[str, Any] = field(default_factory=dict)  # the done event's (ids mode)
    sent_at: float = 0.0  # wall clock (time.time()) when the request was sent, to line up with step logs


async def _turn(client: Any, router: str, ids: list[int], max_tokens: int, rec: Turn) -> None:
    """One streamed /generate with the prompt as token ids; fills `rec`."""
    body = {"input_ids": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    async with client.stream("POST", router + "/generate", json=body) as response:
        if response.status_code != 200:
            rec.error = f"http {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            obj = json.loads(data)
            if obj.get("error"):
                rec.error = str(obj["error"])
                return
            ids_out = obj.get("token_ids")
            if isinstance(ids_out, list) and ids_out:
                if rec.ttft_s is None:
                    rec.ttft_s = time.perf_counter() - start
                rec.output.extend(ids_out)
            if obj.get("prefill") or obj.get("decode"):
                rec.prefill, rec.decode = str(obj.get("prefill") or ""), str(obj.get("decode", ""))
            if isinstance(obj.get("timings"), dict):
                rec.timings = obj["timings"]


async def _chat_turn(client: Any, router: str, messages: list[dict[str, str]], max_tokens: int,
                     rec: Turn) -> str:
    """One streamed /v1/chat/completions; fills `rec` (output: one entry per content delta); the reply text."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    text = []
    async with client.stream("POST", router + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            rec.error = f"http {response.status_code}: {(await response.aread())[:200]!r}"
            return ""
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            obj = json.loads(line[5:].strip())
            if obj.get("error"):
                rec.error = str(obj["error"])
                return ""
            for choice in obj.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    if rec.ttft_s is None:
                        rec.ttft_s = time.perf_counter() - start
                    text.append(delta)
            usage = obj.get("usage")
            if usage:
                rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                rec.output = [0] * int(usage.get("completion_tokens") or 0)
    return "".join(text)


def _words(ids: list[int]) -> str:
    """A token-id list as text of as many words (the chat mode's stand-in for the same prompt)."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


WORDS = ("the of and to in is was for on that with as by at from his her an it which are be this or have had "
         "not but they were one their all has been more also who its after first new two would other when into "
         "time can only some may most over about up out so these could than then made used them world many").split()


async def _chat_conversation(client: Any, router: str, index: int, system: list[int], users: list[list[int]],
                             max_tokens: int) -> list[Turn]:
    import httpx

    messages = [{"role": "system", "content": _words(system)}]
    turns: list[Turn] = []
    for k, user in enumerate(users):
        messages.append({"role": "user", "content": _words(user)})
        rec = Turn(conversation=index, turn=k, prompt_tokens=0, sent_at=time.time())
        try:
            reply = await _chat_turn(client, router, list(messages), max_tokens, rec)
        except (httpx.HTTPError, ValueError) as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            reply = ""
        turns.append(rec)
        if rec.error:
            break
        messages.append({"role": "assistant", "content": reply})
    return turns


async def _conversation(client: Any, router: str, index: int, system: list[int], users: list[list[int]],
                        max_tokens: int) -> list[Turn]:
    import httpx

    if CHAT_MODE:
        return await _chat_conversation(client, router, index, system, users, max_tokens)
    history = list(system)
    turns: list[Turn] = []
    for k, user in enumerate(users):
        history += user
        rec = Turn(conversation=index, turn=k, prompt_tokens=len(history), sent_at=time.time())
        try:
            await _turn(client, router, list(history), max_tokens, rec)
        except (httpx.HTTPError, ValueError) as exc:  # counted as an error of the run, not its end
            rec.error = f"{type(exc).__name__}: {exc}"
        turns.append(rec)
        if rec.error:
            break
        history += rec.output
    return turns


async def _chat(router: str, system: list[int], users: list[list[list[int]]],
                max_tokens: int) -> tuple[list[Turn], float]:
    import httpx

    limits = httpx.Limits(max_connections=len(users) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(_conversation(client, router, i, system, conv, max_tokens)
                                         for i, conv in enumerate(users)))
        return [t for turns in results for t in turns], time.perf_counter() - started


def _metric(url: str, name: str) -> float | None:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    return None


def _run_policy(variant: Variant, model: Path, log_dir: Path, system: list[int],
                users: list[list[list[int]]], max_tokens: int, worker_extra: list[str], shape: Shape,
                step_dir: Path | None = None) -> dict[str, Any]:
    """A fresh 2 + 2 deployment with the variant's policy and settings; the chat through it; its figures."""
    name, policy, router_env, worker_env, flags = variant
    worker_extra = [*worker_extra, *flags]  # the variant's after the run's: argparse keeps the last
    import httpx

    from tests.support.processes import Proc, start_router, start_worker

    roles = ["prefill", "prefill", "decode", "decode"]
    # One step-log folder per worker (its file is named by pid), so each file names its worker.
    step_dirs = [step_dir / name / f"{i}-{role}" for i, role in enumerate(roles)] if step_dir else []
    procs: list[Proc] = []
    try:
        with ThreadPoolExecutor(len(roles)) as pool:
            futures = [pool.submit(start_worker, role, model, log_dir, extra=worker_extra, name=f"kvb-{name}-{i}",
                                   env={**worker_env, **({"ENGINE_STEP_LOG": str(step_dirs[i])} if step_dirs else {})})
                       for i, role in enumerate(roles)]
        started = [f.result() for f in futures if f.exception() is None]
        procs += [p for p, _ in started]
        for f in futures:
            f.result()
        urls = [u for _, u in started]
        router, router_url = start_router(urls[:2], urls[2:], log_dir, policy=policy,
                                          env={"ROUTER_REQUEST_TIMEOUT_S": "600", "ROUTER_QUEUE_TIMEOUT_S": "600",
                                               "ROUTER_WORKER_TIMEOUT_S": "600",  # a starved router must not be killed
                                               **router_env})
        procs.append(router)
        if policy == "kv-aware":  # every worker's snapshot in before the first request
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # bounded
                kv = httpx.get(router_url + "/router/status", timeout=30).json().get("kv", {})
                if len(kv.get("index", {}).get("workers", {})) == 4:
                    break
                time.sleep(0.5)
            if CHAT_MODE:  # the router fetches the workers' tokenizer on its first text request
                httpx.post(router_url + "/v1/chat/completions", timeout=60,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                while time.monotonic() < deadline + 60:  # bounded
                    kv = httpx.get(router_url + "/router/status", timeout=30).json().get("kv", {})
                    if kv.get("tokenizer", {}).get("models"):
                        break
                    time.sleep(0.5)
        turns, wall = asyncio.run(_chat(router_url, system, users, max_tokens))
        status = httpx.get(router_url + "/router/status", timeout=30).json()
        hit = [_metric(u, "worker_prefix_cache_hit_ratio") for u in urls[:2]]
        decode_hit = [_metric(u, "worker_prefix_cache_hit_ratio") for u in urls[2:]]
        # Every prefill wherever it ran (prefill workers, and decode workers' local prefills): the prompt
        # tokens and those the worker's prefix cache held at receipt, per worker and summed; and those its
        # engine reused when it scheduled the prefill (a burst's shared prefix computed once counts here).
        prefilled = [(_metric(u, "worker_prefilled_cached_tokens_total") or 0.0,
                      _metric(u, "worker_prefilled_prompt_tokens_total") or 0.0) for u in urls]
        reused = [_metric(u, "worker_prefilled_reused_tokens_total") or 0.0 for u in urls]
        # How evenly the decode workers shared the streams: the tokens each generated.
        decode_tokens = [_metric(u, "worker_generation_tokens_total") for u in urls[2:]]
        where = {w: _metric(router_url, f'router_prefill_where_total{{where="{w}"}}') for w in ("local", "remote")}
        # Each worker's KV pool (blocks) and its use at the end: a pool the run filled evicted prefixes.
        kv_blocks = [_kv_blocks(p.log()) for p in procs[:4]]
        kv_usage = [_metric(u, "worker_kv_cache_usage_ratio") for u in urls]
    finally:
        for proc in reversed(procs):
            proc.stop()
    ok = [t for t in turns if not t.error and t.ttft_s is not None]
    later = [t for t in ok if t.turn > 0]
    ttfts = [t.ttft_s for t in ok if t.ttft_s is not None]
    later_ttfts = [t.ttft_s for t in later if t.ttft_s is not None]
    # Turns after the first that the same prefill worker served as the conversation's previous turn.
    served: dict[tuple[int, int], Turn] = {(t.conversation, t.turn): t for t in ok}
    # Of those prefilled remotely (a local prefill has no prefill worker, and two local turns are no "same").
    later_remote = [t for t in later if t.prefill]
    same = [t for t in later_remote
            if (prev := served.get((t.conversation, t.turn - 1))) and prev.prefill == t.prefill]
    predicted = (status.get("kv") or {}).get("predicted", {})
    first_workers = {t.prefill or "local " + t.decode for t in ok if t.turn == 0}
    total_prompt = sum(t for _, t in prefilled)
    # The burst of first turns ends when the last of them got its first token (wall clock).
    burst_end = max((t.sent_at + t.ttft_s for t in ok if t.turn == 0 and t.ttft_s is not None), default=None)
    return {
        "policy": policy,
        "router_env": router_env,
        "worker_env": worker_env,
        "variant_worker_flags": flags,
        "prefill_where": where,
        "requests": len(turns),
        "errors": [t.error for t in turns if t.error][:5],
        "prefill_hit_ratio": [h for h in hit if h is not None],
        "decode_hit_ratio": [h for h in decode_hit if h is not None],
        # Per worker (prefill, prefill, decode, decode): cached / prompt tokens of the prompts it prefilled.
        "prefilled_hit_ratio": [cached / total if total else None for cached, total in prefilled],
        "prefilled_prompt_tokens": [total for _, total in prefilled],
        "deployment_hit_ratio": sum(c for c, _ in prefilled) / total_prompt if total_prompt else None,
        # The same counted by the engines, when each prefill was scheduled (what they did not compute).
        "prefilled_engine_hit_ratio": [r / total if total else None for r, (_, total) in zip(reused, prefilled,
                                                                                              strict=True)],
        "deployment_engine_hit_ratio": sum(reused) / total_prompt if total_prompt else None,
        "steps": _steps(step_dirs, burst_end),
        "decode_generated_tokens": decode_tokens,
        "predicted": predicted,
        "same_prefill_as_previous_turn": len(same) / len(later_remote) if later_remote and not CHAT_MODE else None,
        "per_turn": turn_report(ok, shape) if not CHAT_MODE else None,
        # The best hit ratio this workload allows (ids only: chat adds the template's tokens), with the
        # first turns spread over as many workers as this run spread them.
        "hit_ratio_ceiling": hit_ratio_ceiling(shape, len(first_workers)) if not CHAT_MODE else None,
        "first_turn_workers": len(first_workers),
        "kv_blocks": kv_blocks,
        "kv_usage_at_end": kv_usage,
        "router_tokenizer": ((status.get("kv") or {}).get("tokenizer") or {}).get("models"),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "later_turns_ttft_p50_s": percentile(later_ttfts, 50),
        "later_turns_ttft_p90_s": percentile(later_ttfts, 90),
        "output_tokens": sum(len(t.output) for t in ok),
        "wall_s": wall,
        "output_tok_s": sum(len(t.output) for t in ok) / wall if wall else None,
    }


def _print_turns(rows: dict[str, dict[str, Any]]) -> None:
    """Per variant and turn: TTFT, where it went, the same workers as the previous turn; the ceiling."""
    table = []
    for name, r in rows.items():
        for k, t in (r.get("per_turn") or {}).items():
            ms = {key: fmt(t[key] * 1000, 0) if t.get(key) is not None else "-" for key in (
                "ttft_p50_s", "ttft_p90_s", "ttft_p50_local_s", "ttft_p90_local_s", "ttft_p50_remote_s",
                "ttft_p90_remote_s", "prefill_s_p50", "ttft_minus_prefill_p50_s")}
            table.append([name, k, t["n"], t["local"], fmt(t.get("same_prefill"), 2), fmt(t.get("same_decode"), 2),
                          f"{ms['ttft_p50_s']} / {ms['ttft_p90_s']}",
                          f"{ms['ttft_p50_local_s']} / {ms['ttft_p90_local_s']}",
                          f"{ms['ttft_p50_remote_s']} / {ms['ttft_p90_remote_s']}", ms["prefill_s_p50"],
                          fmt((t["kv_transfer_s_p50"] or 0) * 1000, 1), ms["ttft_minus_prefill_p50_s"]])
    if table:
        print(markdown_table(["variant", "turn", "n", "local", "same prefill", "same decode", "TTFT p50 / p90 ms",
                              "local p50 / p90 ms", "remote p50 / p90 ms", "prefill call p50 ms",
                              "KV transfer p50 ms", "TTFT - prefill p50 ms"], table))
    for name, r in rows.items():
        if r.get("hit_ratio_ceiling"):
            ceiling = {k: round(v, 3) for k, v in r["hit_ratio_ceiling"].items()}
            print(f"{name}: deployment hit ratio {fmt(r['deployment_hit_ratio'], 3)} at receipt, "
                  f"{fmt(r['deployment_engine_hit_ratio'], 3)} by the engines; ceiling {ceiling} "
                  f"(first turns on {r['first_turn_workers']} workers), KV blocks {r['kv_blocks']}, "
                  f"KV use at the end {r['kv_usage_at_end']}")
        for i, steps in enumerate(r.get("steps") or []):
            print(f"{name} worker {i}: steps during the first turns' burst {steps['burst']}; whole run {steps['run']}")


def _steps(step_dirs: list[Path], burst_end: float | None) -> list[dict[str, Any]] | None:
    """Per worker (p, p, d, d): its engine steps during the burst of first turns and over the whole run."""
    if not step_dirs:
        return None
    out = []
    for folder in step_dirs:
        rows = [r for f in sorted(folder.glob("steps-*.tsv")) for r in read_steps(f.read_text())]
        out.append({"burst": step_summary(rows, burst_end), "run": step_summary(rows)})
    return out


def _kv_blocks(log_text: str) -> int | None:
    """A worker's KV pool size, from its start line (`..., N KV blocks)`)."""
    match = re.search(r"(\d+) KV blocks\)", log_text)
    return int(match.group(1)) if match else None


def main(argv: list[str] | None = None) -> int:
    """Run the chat under each policy on fresh deployments; print and write the comparison."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=256)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--reply-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--context-tokens", type=int, default=0,
                   help="a conversation's own context (a document) after the system prompt, in its first turn")
    p.add_argument("--variants", default=",".join(v[0] for v in VARIANTS), help="which variants to run")
    p.add_argument("--worker-flags", default="",
                   help="more flags for every worker, e.g. '--no-chunked-prefill --max-num-batched-tokens 512'")
    p.add_argument("--step-log", type=Path, default=None,
                   help="a folder for every worker's engine step log (ENGINE_STEP_LOG), summed in the result")
    p.add_argument("--prompts", choices=["ids", "chat"], default="ids",
                   help="ids: /generate with input_ids; chat: /v1/chat/completions messages (the router tokenizes)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    global CHAT_MODE
    CHAT_MODE = args.prompts == "chat"
    if args.quick:
        args.conversations, args.turns, args.system_tokens, args.user_tokens, args.reply_tokens = 4, 3, 64, 16, 8
    model = args.model_dir or (None if args.quick else smollm2_dir()) or tiny_model_dir()
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    system = [rng.randrange(3, vocab) for _ in range(args.system_tokens)]
    users = [[[rng.randrange(3, vocab) for _ in range(args.user_tokens + (args.context_tokens if k == 0 else 0))]
              for k in range(args.turns)] for _ in range(args.conversations)]
    worker_extra = ["--batch-size", str(max(8, args.conversations)), *args.worker_flags.split()]
    args.log_dir.mkdir(parents=True, exist_ok=True)  # a fresh clone has no var/bench/logs yet
    shape = Shape(args.conversations, args.turns, args.system_tokens, args.user_tokens, args.reply_tokens,
                  args.context_tokens)
    load_before = os.getloadavg()
    rows: dict[str, dict[str, Any]] = {}
    chosen = args.variants.split(",")
    for variant in [v for v in VARIANTS if v[0] in chosen]:
        name = variant[0]
        log(f"{name}: {args.conversations} conversations x {args.turns} turns on 2 prefill + 2 decode ({model.name})")
        rows[name] = _run_policy(variant, Path(model), args.log_dir, system, users, args.reply_tokens, worker_extra,
                                 shape, args.step_log)
        log(f"{name}: {rows[name]}")
    load_after = os.getloadavg()
    empty: dict[str, Any] = {}
    rr, kv, local = (rows.get(name, empty) for name in ("round-robin", "kv-aware", "kv-aware+local"))
    comparison = {
        "ttft_p50_rr_over_local": ratio(rr.get("ttft_p50_s"), local.get("ttft_p50_s")),
        "ttft_p90_rr_over_local": ratio(rr.get("ttft_p90_s"), local.get("ttft_p90_s")),
        "tok_s_local_over_rr": ratio(local.get("output_tok_s"), rr.get("output_tok_s")),
        "later_ttft_p50_kv_over_local": ratio(kv.get("later_turns_ttft_p50_s"), local.get("later_turns_ttft_p50_s")),
        "later_ttft_p90_kv_over_local": ratio(kv.get("later_turns_ttft_p90_s"), local.get("later_turns_ttft_p90_s")),
        "tok_s_local_over_kv": ratio(local.get("output_tok_s"), kv.get("output_tok_s")),
        "ttft_p50_rr_over_kv": ratio(rr.get("ttft_p50_s"), kv.get("ttft_p50_s")),
        "ttft_p90_rr_over_kv": ratio(rr.get("ttft_p90_s"), kv.get("ttft_p90_s")),
        "later_ttft_p50_rr_over_kv": ratio(rr.get("later_turns_ttft_p50_s"), kv.get("later_turns_ttft_p50_s")),
        "later_ttft_p90_rr_over_kv": ratio(rr.get("later_turns_ttft_p90_s"), kv.get("later_turns_ttft_p90_s")),
        "tok_s_kv_over_rr": ratio(kv.get("output_tok_s"), rr.get("output_tok_s")),
    }
    receipt = rows.get("kv-aware+local-receipt", empty)
    rr_b, local_b = rows.get("round-robin-b256", empty), rows.get("kv-aware+local-b256", empty)
    comparison.update({  # local prefill deciding at receipt only (the A/B of pending_prefix.py)
        "ttft_p50_rr_over_local_receipt": ratio(rr.get("ttft_p50_s"), receipt.get("ttft_p50_s")),
        "ttft_p90_rr_over_local_receipt": ratio(rr.get("ttft_p90_s"), receipt.get("ttft_p90_s")),
        "tok_s_local_receipt_over_rr": ratio(receipt.get("output_tok_s"), rr.get("output_tok_s")),
        # A 256-token prefill step budget on every worker, against round-robin as it is and with the same budget.
        "ttft_p50_rr_over_local_b256": ratio(rr.get("ttft_p50_s"), local_b.get("ttft_p50_s")),
        "ttft_p90_rr_over_local_b256": ratio(rr.get("ttft_p90_s"), local_b.get("ttft_p90_s")),
        "tok_s_local_b256_over_rr": ratio(local_b.get("output_tok_s"), rr.get("output_tok_s")),
        "ttft_p50_rr_b256_over_local_b256": ratio(rr_b.get("ttft_p50_s"), local_b.get("ttft_p50_s")),
        "ttft_p90_rr_b256_over_local_b256": ratio(rr_b.get("ttft_p90_s"), local_b.get("ttft_p90_s")),
        "tok_s_local_b256_over_rr_b256": ratio(local_b.get("output_tok_s"), rr_b.get("output_tok_s")),
    })
    rr_1, local_1 = rows.get("round-robin-wave1", empty), rows.get("kv-aware+local-wave1", empty)
    comparison.update({  # a wave of prompts in one prefill step on every worker (before the wave rule)
        "ttft_p50_rr_wave1_over_local_wave1": ratio(rr_1.get("ttft_p50_s"), local_1.get("ttft_p50_s")),
        "ttft_p90_rr_wave1_over_local_wave1": ratio(rr_1.get("ttft_p90_s"), local_1.get("ttft_p90_s")),
        "tok_s_local_wave1_over_rr_wave1": ratio(local_1.get("output_tok_s"), rr_1.get("output_tok_s")),
    })
    mixed = rows.get("kv-aware+local-mixed", empty)
    comparison.update({  # mixed prefill with the step-cost budget on every worker, against round-robin as it is
        "ttft_p50_rr_over_local_mixed": ratio(rr.get("ttft_p50_s"), mixed.get("ttft_p50_s")),
        "ttft_p90_rr_over_local_mixed": ratio(rr.get("ttft_p90_s"), mixed.get("ttft_p90_s")),
        "tok_s_local_mixed_over_rr": ratio(mixed.get("output_tok_s"), rr.get("output_tok_s")),
    })
    print_header("KV-aware routing vs round-robin: multi-turn chat, 2 prefill + 2 decode")
    headers = ["variant", "prefill hit ratio", "decode hit ratio",
               "hit ratio of prefills per worker (p/p/d/d), at receipt / engine",
               "deployment hit ratio, at receipt / engine", "decode tokens per worker", "local/remote prefills",
               "same prefill as prev. turn", "TTFT p50 ms", "TTFT p90 ms",
               "later turns p50/p90 ms", "output tok/s", "errors"]
    table = []
    for name, r in rows.items():
        hits = "/".join(fmt(h, 2) for h in r["prefill_hit_ratio"])
        decode_hits = "/".join(fmt(h, 2) for h in r["decode_hit_ratio"])
        where = r["prefill_where"]
        spread = "/".join(fmt(t, 0) for t in r.get("decode_generated_tokens", []))
        per_worker = " ".join(f"{fmt(h, 2) if h is not None else '-'}/{fmt(e, 2) if e is not None else '-'}"
                              for h, e in zip(r["prefilled_hit_ratio"], r["prefilled_engine_hit_ratio"], strict=True))
        table.append([name, hits, decode_hits, per_worker,
                      f"{fmt(r['deployment_hit_ratio'], 3)} / {fmt(r['deployment_engine_hit_ratio'], 3)}", spread,
                      f"{fmt(where['local'], 0)}/{fmt(where['remote'], 0)}",
                      fmt(r["same_prefill_as_previous_turn"], 2),
                      fmt((r["ttft_p50_s"] or 0) * 1000, 0), fmt((r["ttft_p90_s"] or 0) * 1000, 0),
                      f"{fmt((r['later_turns_ttft_p50_s'] or 0) * 1000, 0)}/"
                      f"{fmt((r['later_turns_ttft_p90_s'] or 0) * 1000, 0)}",
                      fmt(r["output_tok_s"], 1), len(r["errors"])])
    print(markdown_table(headers, table))
    _print_turns(rows)
    print(json.dumps(comparison))
    print(f"load average before {load_before}, after {load_after}")
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "")
    name = ("kv_routing" + ("_chat" if CHAT_MODE else "") + ("_context" if args.context_tokens else "")
            + ("_quick" if args.quick else ""))
    write_result(args.out_dir, name, MODULE, argv, {
        "model_dir": str(model), "conversations": args.conversations, "turns": args.turns,
        "system_tokens": args.system_tokens, "user_tokens": args.user_tokens, "context_tokens": args.context_tokens,
        "reply_tokens": args.reply_tokens, "prompts": args.prompts, "worker_flags": worker_extra,
        "rows": rows, "comparison": comparison, "load_before": load_before, "load_after": load_after,
        "cpu": model_name, "machine": machine_info(),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
