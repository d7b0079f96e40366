"""What bench/kv_routing.py's chat workload allows, and where a run's turns went: the best hit ratio the
workload's shape permits (beside the measured one), and per turn which prefill worker served it, what it
found cached and where its TTFT went.

The ceiling, for conversations sent as token ids (each turn: the whole history, then a new user turn):
- a turn after the first can find cached at most what one worker computed of that history before: a
  prefill worker holds the previous turn's prompt (its full blocks), never the reply, which the decode
  worker generated; a decode worker prefilling locally holds the previous prompt and the reply's tokens
  but the last (its KV is computed only when fed back), in full blocks;
- a first turn shares only the system prompt with the others, and each worker that serves first turns
  computes it once (a burst of first turns finds nothing cached at receipt: none is computed yet).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.common import percentile


@dataclass(frozen=True)
class Shape:
    """The chat workload's sizes (tokens), as bench/kv_routing.py builds it."""

    conversations: int
    turns: int
    system: int
    user: int
    reply: int
    context: int = 0  # a conversation's own document in its first turn
    block: int = 16  # the workers' --block-size

    def prompt(self, turn: int) -> int:
        """The prompt length of turn `turn` (0-based): the history and the new user turn."""
        return self.system + self.context + self.user * (turn + 1) + self.reply * turn

    def full_blocks(self, tokens: int) -> int:
        """The tokens of `tokens` that lie in full blocks (only those are cached)."""
        return tokens // self.block * self.block


def hit_ratio_ceiling(shape: Shape, first_turn_workers: int) -> dict[str, float]:
    """The best hit ratio (cached prompt tokens / prompt tokens over every prefill) of `shape`:
    `remote`: every turn prefilled on a prefill worker that holds the conversation's previous prompt;
    `local`: later turns prefilled by the decode worker that generated the previous reply; each with the
    first turns computing the system prompt once per worker serving them (`first_turn_workers`), and the
    `_burst` figures with first turns finding nothing (all sent at once, counted at receipt)."""
    total = shape.conversations * sum(shape.prompt(k) for k in range(shape.turns))
    later_remote = later_local = 0
    for k in range(1, shape.turns):
        later_remote += shape.full_blocks(shape.prompt(k - 1))
        # The decode worker computed the previous prompt and the reply's tokens but its last.
        later_local += shape.full_blocks(shape.prompt(k - 1) + max(0, shape.reply - 1))
    later_remote *= shape.conversations
    later_local *= shape.conversations
    first = max(0, shape.conversations - first_turn_workers) * shape.full_blocks(shape.system)
    return {
        "prompt_tokens": float(total),
        "remote": (later_remote + first) / total,
        "local": (later_local + first) / total,
        "remote_burst": later_remote / total,
        "local_burst": later_local / total,
    }


def turn_report(turns: list[Any], shape: Shape) -> dict[int, dict[str, Any]]:
    """Per turn index: TTFT p50/p90 (all, and split by local / remote prefill), the share of turns whose
    prefill worker served the conversation's previous turn (the one holding its history), and the TTFT's
    parts (medians: prefill call, KV transfer, the rest: admission, decode reservation, first step);
    `turns` are bench/kv_routing.Turn records of one variant."""
    served = {(t.conversation, t.turn): t for t in turns if not t.error and t.ttft_s is not None}
    by_turn: dict[int, dict[str, Any]] = {}
    for k in range(shape.turns):
        rows = [t for t in served.values() if t.turn == k]
        if not rows:
            continue
        ttfts = [t.ttft_s for t in rows]
        entry: dict[str, Any] = {"n": len(rows), "ttft_p50_s": percentile(ttfts, 50),
                                 "ttft_p90_s": percentile(ttfts, 90)}
        for key in ("prefill_s", "kv_transfer_s"):
            values = [float(t.timings[key]) for t in rows if isinstance(t.timings.get(key), int | float)]
            entry[key + "_p50"] = percentile(values, 50)
        rest = [t.ttft_s - float(t.timings.get("prefill_s") or 0.0) for t in rows]
        entry["ttft_minus_prefill_p50_s"] = percentile(rest, 50)
        entry["local"] = sum(1 for t in rows if not t.prefill)
        # Where the turn's TTFT tail sits: the turns prefilled on their decode worker against the remote ones.
        for where, part in (("local", [t.ttft_s for t in rows if not t.prefill]),
                            ("remote", [t.ttft_s for t in rows if t.prefill])):
            entry[f"ttft_p50_{where}_s"] = percentile(part, 50)
            entry[f"ttft_p90_{where}_s"] = percentile(part, 90)
        if k > 0:
            remote = [t for t in rows if t.prefill]
            prev = [served.get((t.conversation, k - 1)) for t in remote]
            entry["same_prefill"] = (sum(1 for t, p in zip(remote, prev, strict=True) if p and p.prefill == t.prefill)
                                     / len(remote)) if remote else None
            entry["same_decode"] = sum(1 for t in rows if (p := served.get((t.conversation, k - 1)))
                                       and p.decode == t.decode) / len(rows)
        by_turn[k] = entry
    return by_turn


def step_summary(rows: list[tuple[float, float, int, int, int]], until: float | None = None) -> dict[str, Any]:
    """One worker's engine steps (`ENGINE_STEP_LOG` lines: start s, duration ms, prompt tokens, prompt
    sequences, decode rows), all of them or those that began before `until` (wall clock: the burst of
    first turns): how many steps took prompts, the prompt tokens they computed, and the busy seconds."""
    chosen = [r for r in rows if until is None or r[0] < until]
    prompt_steps = [r for r in chosen if r[2] > 0]
    return {"steps": len(chosen), "prompt_steps": len(prompt_steps),
            "prompt_tokens": sum(r[2] for r in chosen), "prompts": sum(r[3] for r in chosen),
            "busy_s": round(sum(r[1] for r in chosen) / 1000, 3),
            "prompt_busy_s": round(sum(r[1] for r in prompt_steps) / 1000, 3),
            "max_step_ms": max((r[1] for r in chosen), default=0.0)}


def read_steps(text: str) -> list[tuple[float, float, int, int, int]]:
    """The step log's lines (step_log.py) as (start s, duration ms, prompt tokens, prompts, decode rows)."""
    rows = []
    for line in text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 5:
            rows.append((float(parts[0]), float(parts[1]), int(parts[2]), int(parts[3]), int(parts[4])))
    return rows
