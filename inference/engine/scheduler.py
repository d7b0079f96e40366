"""Continuous-batching scheduler: which sequences run in the next forward pass."""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Set
from dataclasses import dataclass, field

from .block_manager import BlockManager, block_hashes
from .sequence import Sequence, SequenceStatus
from .step_cost import MixedStepBudget

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    """One step's plan: a prefill batch, a decode batch, or both in one forward (mixed prefill), plus
    sequences that were preempted or had to be finished because they can never fit."""

    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    too_long: list[Sequence] = field(default_factory=list)


class StepPlan(tuple[int, int, int]):
    """A step's plan in numbers: (prompt tokens, prefill sequences, decode sequences), a plain 3-tuple
    to compare, plus what the step log needs to say where a tail came from: `rule`, the rule that set a
    mixed step's prompt budget ("fixed", "queue", "burst", "cost", "cost-fallback", "cost-wait"; ""
    outside mixed steps), and `waiting`, the prompts waiting when the step was planned."""

    rule: str
    waiting: int

    def __new__(cls, tokens: int, seqs: int, decode: int, rule: str = "", waiting: int = 0) -> StepPlan:
        plan = super().__new__(cls, (tokens, seqs, decode))
        plan.rule, plan.waiting = rule, waiting
        return plan


# A prompt whose next uncached blocks another prompt of the same step computes waits one step when they
# are at least this many tokens, then finds them cached (SGLang's in-batch prefix caching check, to the
# same end): a burst of conversations sharing a system prompt computes it once, not once each. Below it
# (a chat template's common first block) waiting a step would cost more than computing the blocks.
SHARED_PREFIX_WAIT_TOKENS = 64

# Mixed prefill: a step's prompt tokens grow past the budget when the queue is deep, to the waiting
# prompt tokens per running stream (the tokens each stream's next step is delayed for, spread evenly),
# at most this many budgets. A burst arriving at an idle or lightly loaded worker (a closed loop's
# start: 32 prompts per worker at 64 in flight) then takes a few large steps instead of one budget a
# step (TTFT p99 5.1 s against 3.8 s with alternating 256-token prefill steps, Xeon, 64/64); in steady
# state the streams outnumber the queued tokens' budgets and the step keeps the budget.
MIXED_QUEUE_SCALE = 8

# Mixed prefill: while more prompts wait than streams run (a burst: a closed loop's start, or a group
# of streams that started together finishing together), a step takes the waiting prompts' uncached
# tokens up to this many instead of the queue-scaled budget. The fewer running streams lose one step's
# gap, but protecting them would delay more first tokens than it saves: the burst drained at
# `MIXED_QUEUE_SCALE` budgets a step, each step also paying every running row, put the last first token
# of a 32-prompt burst seconds behind vllm serve's, which takes up to 2,048 tokens a step on a CPU (its
# `max_num_batched_tokens` there, decode rows included). On Zen 4 (64/64 at 32 / 64 in flight, two runs)
# TTFT p99 0.72x / 0.95x vllm serve's became 0.50x / 0.49x, ITL p99 stayed under vLLM's as far
# (docs/benchmarks.md, "Tails against vllm serve, thirteenth session"). 0: off (the env switch below
# overrides it, for A/B runs).
MIXED_BURST_TOKENS = 2048
MIXED_BURST_ENV = "ENGINE_MIXED_BURST_TOKENS"


# A prefill step (without mixed prefill) takes a wave of waiting prompts in about this many steps, of at
# least `PREFILL_WAVE_MIN_TOKENS` prompt tokens each (never more than `max_num_batched_tokens`), instead of
# all of it in one step: their first tokens then come in turn, with decode steps between (chunked
# prefill). A decode worker whose conversations finished together (a wave of next turns, 14-16 prompts of
# ~80 new tokens) otherwise gave every one of them the whole wave's step as its TTFT, and the next wave
# arrived as one again (multi-turn on the AMX Xeon: TTFT p50 / p90 2.61-4.63x / 1.94-2.28x round-robin's
# with 256-token steps against 1.63-2.27x / 1.20-1.90x in one step; docs/benchmarks.md, "Seventeenth
# session: multi-turn"). A lone prompt keeps the whole budget. 1: off (the env switch below overrides it).
PREFILL_WAVE_STEPS = 4
PREFILL_WAVE_MIN_TOKENS = 256
PREFILL_WAVE_ENV = "ENGINE_PREFILL_WAVE_STEPS"


class SchedulerSettingError(ValueError):
    """An environment switch of the scheduler (`ENGINE_...`) holds no valid value; the message names it."""


def _env_count(name: str, default: int, minimum: int, unit: str) -> int:
    """Whole number `name` from the environment (at least `minimum`), `default` when unset;
    SchedulerSettingError naming the variable otherwise."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return max(minimum, int(value))
    except ValueError:
        raise SchedulerSettingError(f"{name} must be a whole number of {unit}, got {value!r}") from None


def prefill_wave_steps() -> int:
    """The steps a wave of waiting prompts is spread over: `ENGINE_PREFILL_WAVE_STEPS` when set (1: one
    step, as before, for A/B runs), else `PREFILL_WAVE_STEPS`."""
    return _env_count(PREFILL_WAVE_ENV, PREFILL_WAVE_STEPS, 1, "steps (1: off)")


def mixed_burst_tokens() -> int:
    """The burst cap of mixed steps: `ENGINE_MIXED_BURST_TOKENS` when set (0 turns bursts off, for A/B
    runs of the serving benchmark), else `MIXED_BURST_TOKENS`."""
    return _env_count(MIXED_BURST_ENV, MIXED_BURST_TOKENS, 0, "prompt tokens (0: off)")


class Scheduler:
    """Waiting queue + ready queue + running list over a `BlockManager`.

    `waiting` holds sequences that need a prefill (new prompts, or preempted sequences to recompute);
    `ready` holds decode-side sequences whose prompt KV arrived from a prefill worker (their blocks are
    already filled). At most `max_num_seqs` sequences run at once, whichever queue they came from.
    Each step first fills free slots in arrival order (a ready sequence joins the batch directly, a
    waiting one whose blocks fit goes into this step's prefill batch); when no prefill was admitted it
    decodes every running sequence. A decode that needs a new block while none is free preempts the
    newest running sequence (its blocks are freed and it is recomputed later).

    `paused` names running sequences to leave out of decode steps (flow control: their consumer is
    behind). A paused sequence keeps its blocks and its batch slot and is never preempted; the owner
    of the set (AsyncEngine) may change it from another thread, so it is only read here, per step.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool = False,
        enable_chunked_prefill: bool = False,
        enable_mixed_prefill: bool = False,
    ) -> None:
        """Limits: `max_num_seqs` sequences in flight, `max_num_batched_tokens` prompt tokens per prefill.
        With `enable_prefix_caching`, an admitted sequence reuses the cached blocks of its longest
        cached prefix and computes only the rest. With `enable_chunked_prefill`, a prompt over the token
        budget is computed `max_num_batched_tokens` at a time, and every prefill step (a chunk, or whole
        prompts that fit the budget) is followed by a decode step of the running batch: a long prompt,
        or a wave of new prompts, never stalls the running streams for more than one budget's worth of
        prefill at a time (vLLM's chunked prefill mixes the two in one step to the same end).
        With `enable_mixed_prefill` (and chunked prefill) every step is one forward carrying the running
        batch's decode rows plus up to `max_num_batched_tokens` prompt tokens (the rows do not count
        against it: vLLM counts both in a budget far larger than its batch), more while the waiting
        prompts' tokens per running stream exceed it (up to `mixed_queue_scale` budgets), and the whole
        queue (up to `mixed_burst_tokens`) while more prompts wait than streams run."""
        self.block_manager = block_manager
        self.enable_chunked_prefill = enable_chunked_prefill
        # Mixing needs chunks: a whole prompt over what the decode rows leave of the budget would wait.
        self.enable_mixed_prefill = enable_mixed_prefill and enable_chunked_prefill
        self._decode_next = False  # a prefill ran last step: give the running batch a step first
        # The last step's plan (prefill tokens, prefill sequences, decode sequences), for step timings.
        self.last_plan: StepPlan = StepPlan(0, 0, 0)
        self._rule = ""  # the rule that set this step's prompt budget (StepPlan.rule)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_query_tokens = 0  # prompt tokens admitted for prefill (prefix caching on)
        self.prefix_hit_tokens = 0  # of which served from cached blocks
        self.shared_prefix_waits = 0  # admissions put off a step for blocks a prompt ahead computes
        # None: never wait (every prompt of a burst computes a shared prefix itself; benchmarks compare).
        self.shared_prefix_wait_tokens: int | None = SHARED_PREFIX_WAIT_TOKENS
        self.mixed_queue_scale = MIXED_QUEUE_SCALE  # 1: a mixed step's prompt tokens never pass the budget
        self.mixed_burst_tokens = mixed_burst_tokens()  # 0: a burst takes the queue-scaled budget too
        self.prefill_wave_steps = prefill_wave_steps()  # 1: a prefill step takes the whole budget
        # A budget from the measured step cost (step_cost.py) instead of the fixed / queue-scaled one
        # once it has samples; None: off. The engine sets it and feeds it every step's time.
        self.step_budget: MixedStepBudget | None = None
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.ready: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused: Set[str] = frozenset()

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens of KV."""
        return -(-num_tokens // self.block_size)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence for prefill."""
        seq.status = SequenceStatus.WAITING
        seq.queued_at = time.monotonic()
        self.waiting.append(seq)

    def add_ready(self, seq: Sequence) -> None:
        """Queue a sequence whose prompt KV is cached (decode side, after the transfer) for a batch slot."""
        seq.status = SequenceStatus.READY
        self.ready.append(seq)

    @property
    def num_queued(self) -> int:
        """Sequences waiting for a batch slot (ready, or waiting for a prefill)."""
        return len(self.ready) + len(self.waiting)

    def add_running(self, seq: Sequence) -> None:
        """Put a sequence whose KV is cached into the running batch (no slot check: callers check)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        # Keep arrival order so that "the newest" (the preemption victim) is always the last element.
        self.running.sort(key=lambda s: s.arrival)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it."""
        if seq.status == SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        elif seq.status == SequenceStatus.READY:
            try:
                self.ready.remove(seq)
            except ValueError:
                pass
        elif seq.status == SequenceStatus.RUNNING:
            try:
                self.running.remove(seq)
            except ValueError:
                pass

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (allocating the blocks it needs)."""
        waiting = len(self.waiting)
        self._rule = ""
        out = self._plan()
        self.last_plan = StepPlan(sum(s.num_new_tokens for s in out.prefill), len(out.prefill), len(out.decode),
                                  self._rule, waiting)
        return out

    def _plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.enable_mixed_prefill:
            # Decode rows first (they may preempt), then up to the budget of prompt tokens on top of them:
            # counting the rows against it starved prompts once a worker ran 16-32 streams (64 in
            # flight: TTFT p99 1.2-1.9x vllm serve's, a 64-token prompt spread over 2+ steps).
            self._plan_decode(out)
            self._admit(out, self._mixed_prompt_budget(len(out.decode)))
            return out
        if self._decode_next and self.running:
            self._decode_next = False
            self._plan_decode(out)
            if out.decode:
                return out
            # Every running sequence is paused: the next prefill may run right away.
        self._admit(out, self._wave_budget())
        if out.prefill:
            # Chunked prefill bounds a prefill step by the token budget; a decode step follows each one
            # (also after whole prompts: a wave of admissions would otherwise run budget after budget).
            self._decode_next = self.enable_chunked_prefill
            return out
        self._plan_decode(out)
        return out

    def _mixed_prompt_budget(self, rows: int) -> int:
        """Prompt tokens a mixed step with `rows` decode rows may take: the budget, or the waiting
        prompt tokens per row when that is more (up to `mixed_queue_scale` budgets), or all of them (up
        to `mixed_burst_tokens`) when more prompts wait than rows run; the waiting tokens counted
        after their cached prefixes. With `step_budget`, once it knows the step cost, what keeps a
        step beside `rows` rows within its time target replaces the first two (a burst still goes
        whole, and so do the waiting prompts once the oldest is overdue: step_cost.py)."""
        budget = self.max_num_batched_tokens
        if not self.waiting:
            return budget  # no prompt to take: a decode-only step (no rule in the step log)
        burst = self.mixed_burst_tokens > 0 and len(self.waiting) > rows
        if self.step_budget is not None and rows and not burst:
            # The measured cost decides (no queue scaling: a deep queue's larger steps were the tails).
            measured = self.step_budget.tokens(rows)
            if measured is not None:
                waited = time.monotonic() - min(seq.queued_at for seq in self.waiting)
                if self.step_budget.overdue(rows, waited):
                    # The waiting prompts whole, in one step beside the rows (step_cost.py, "A prompt's wait").
                    self._rule = "cost-wait"
                    queued = sum(self._uncached_tokens(seq) for seq in self.waiting)
                    return max(measured, min(queued, max(self.mixed_burst_tokens, self.step_budget.cap)))
                self._rule = "cost-fallback" if self.step_budget.fell_back else "cost"
                return measured
        self._rule = "fixed"
        if not burst and self.mixed_queue_scale <= 1:
            return budget
        queued = sum(self._uncached_tokens(seq) for seq in self.waiting)
        if burst:  # MIXED_BURST_TOKENS: the waiting prompts outnumber the streams; take them whole
            self._rule = "burst"
            return max(budget, min(queued, self.mixed_burst_tokens))
        scaled = min(self.mixed_queue_scale * budget, max(budget, queued // max(rows, 1)))
        self._rule = "queue" if scaled > budget else "fixed"
        return scaled

    def _wave_budget(self) -> int:
        """Prompt tokens a prefill step may take: the budget, or while several prompts wait, their uncached
        tokens (those that could join the batch) spread over `prefill_wave_steps` steps, at least
        `PREFILL_WAVE_MIN_TOKENS` a step."""
        budget = self.max_num_batched_tokens
        slots = self.max_num_seqs - len(self.running)
        if self.prefill_wave_steps <= 1 or len(self.waiting) < 2 or slots < 2:
            return budget
        queued = sum(self._uncached_tokens(seq) for seq in itertools.islice(self.waiting, slots))
        return min(budget, max(PREFILL_WAVE_MIN_TOKENS, -(-queued // self.prefill_wave_steps)))

    def _uncached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens `seq` still has to compute: after its chunks so far, or after its cached prefix
        (counted whole, a burst sharing a 384-token prefix read as 4x its work and took 512-token steps
        beside running streams: ITL gaps of 0.4-1.2 s against 0.1 s decode steps)."""
        if seq.block_ids:
            return seq.num_tokens - seq.num_cached
        return seq.num_tokens - len(self.cached_prefix(seq)) * self.block_size

    def requeue_partial(self, seq: Sequence) -> None:
        """A chunk of `seq`'s prefill ran: it continues first at the next prefill step (keeping its blocks)."""
        seq.status = SequenceStatus.WAITING
        seq.queued_at = time.monotonic()  # it progressed: its wait (for the overdue rule) starts again
        self.waiting.appendleft(seq)

    def _admit(self, out: SchedulerOutput, limit: int | None = None) -> None:
        """Fill free batch slots in arrival order: ready sequences join the running batch, waiting ones
        go into a prefill batch while blocks and the prompt-token budget (`limit`, default
        `max_num_batched_tokens`) allow."""
        bm = self.block_manager
        limit = self.max_num_batched_tokens if limit is None else limit
        tokens = 0  # prompt tokens this step computes
        computing: set[bytes] = set()  # hashes of the prompt blocks this step's prefills complete
        while (self.waiting or self.ready) and len(self.running) + len(out.prefill) < self.max_num_seqs:
            if self.ready and (not self.waiting or self.ready[0].arrival < self.waiting[0].arrival):
                self.add_running(self.ready.popleft())
                continue
            if not self.waiting:
                break
            seq = self.waiting[0]
            budget = limit - tokens
            if seq.block_ids:
                # A chunked prefill in progress: its blocks are held, the next chunk follows.
                remaining = seq.num_tokens - seq.num_cached
                if (out.prefill or out.decode) and budget < min(remaining, self.block_size):
                    break
                self.waiting.popleft()
                seq.chunk = budget if remaining > budget else 0
                out.prefill.append(seq)
                tokens += min(remaining, budget)
                self._note_computing(seq, min(remaining, budget), computing)
                continue
            n = seq.num_tokens  # a preempted sequence recomputes its generated tokens too
            need = self.blocks_for(n)
            if need > bm.num_blocks:
                # Can only happen to a preempted sequence that grew past the whole pool.
                self.waiting.popleft()
                out.too_long.append(seq)
                continue
            hits = self.cached_prefix(seq)
            if computing and self._shares_computing(seq, len(hits), computing):
                # Its next blocks are being computed by a prompt ahead of it: cached after this step.
                self.shared_prefix_waits += 1
                if self.ready:
                    self.add_running(self.ready.popleft())
                    continue
                break
            take = bm.blocks_to_take(hits, need - len(hits))
            new_tokens = n - len(hits) * self.block_size
            chunked = self.enable_chunked_prefill and new_tokens > budget
            # Without chunking, always admit one, even over the token budget, or a long prompt would
            # never run; with it, a chunk fills the budget (not a sliver of it).
            over = bool(out.prefill or out.decode) and (budget < self.block_size if chunked else new_tokens > budget)
            if over or not bm.can_allocate(take):
                # FCFS among prompts: later (smaller) ones must not overtake the head of the queue. A
                # ready sequence already holds its blocks, so it may take the slot instead: this is
                # also what prevents a deadlock when ready sequences hold the blocks the head needs.
                if self.ready:
                    self.add_running(self.ready.popleft())
                    continue
                break
            self.waiting.popleft()
            self.take_prefix(seq, hits, need)
            seq.num_cached = len(hits) * self.block_size
            seq.chunk = budget if chunked else 0
            out.prefill.append(seq)
            tokens += min(new_tokens, budget) if chunked else new_tokens
            self._note_computing(seq, min(new_tokens, budget) if chunked else new_tokens, computing)

    def _note_computing(self, seq: Sequence, step_tokens: int, computing: set[bytes]) -> None:
        """Add the hashes of `seq`'s prompt blocks that this step's `step_tokens` complete."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return
        first = seq.num_cached // self.block_size
        last = min(seq.num_cached + step_tokens, seq.num_tokens) // self.block_size
        if last <= first:
            return
        if len(seq.block_hashes) < last:  # a chunk's registration keeps only the hashes of computed blocks
            seq.block_hashes = block_hashes(seq.all_token_ids()[: last * self.block_size], self.block_size,
                                            seq.block_hashes)
        computing.update(seq.block_hashes[first:last])

    def _shares_computing(self, seq: Sequence, cached_blocks: int, computing: set[bytes]) -> bool:
        """Whether `seq`'s blocks after its cached ones start with `shared_prefix_wait_tokens` or more that
        a prefill of this step completes."""
        if self.shared_prefix_wait_tokens is None:
            return False
        usable = (seq.num_tokens - 1) // self.block_size
        shared = 0
        for h in seq.block_hashes[cached_blocks:usable]:
            if h not in computing:
                break
            shared += 1
        return shared * self.block_size >= self.shared_prefix_wait_tokens

    def take_prefix(self, seq: Sequence, hits: list[int], need: int) -> None:
        """Give `seq` its cached prefix blocks `hits` plus fresh ones up to `need` blocks, and count the
        prefix cache's use (the one place that counts it: prefill admission and decode reservations)."""
        seq.block_ids = self.block_manager.extend_prefix(hits, need - len(hits))
        if seq.admitted_cached_tokens is None:  # the prompt's first admission: what it did not compute
            seq.admitted_cached_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.prefix_query_tokens += seq.num_tokens
            self.prefix_hit_tokens += len(hits) * self.block_size

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from cached blocks (0.0 before any admission)."""
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    def register_blocks(self, seq: Sequence, before: int) -> None:
        """Register the blocks of `seq` that became full since `before` cached tokens under their content
        hashes, so that later prefills can reuse them (prefix caching)."""
        if not self.enable_prefix_caching:
            return
        first, full = before // self.block_size, seq.num_cached // self.block_size
        if full <= first:
            return
        seq.block_hashes = block_hashes(seq.all_token_ids()[: full * self.block_size], self.block_size,
                                        seq.block_hashes[:full])
        for i in range(first, full):
            self.block_manager.register(seq.block_ids[i], seq.block_hashes[i])

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks of `seq`'s longest cached prefix; at least its last token is left to compute
        (its logits give the next token); none for a sequence that asks for its prompt's
        log-probabilities (every prompt token's logits must be computed)."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []
        tokens = seq.all_token_ids()
        seq.block_hashes = block_hashes(tokens, self.block_size, seq.block_hashes)
        usable = (len(tokens) - 1) // self.block_size
        return self.block_manager.lookup(seq.block_hashes[:usable])

    def _plan_decode(self, out: SchedulerOutput) -> None:
        """Make sure every running sequence that is not paused has a slot for its next token, preempting
        (never a paused sequence) when the pool is dry."""
        bm = self.block_manager
        bs = self.block_size
        running = self.running
        held: list[Sequence] = []
        if self.paused:
            # One pass: the set may change on another thread while this step is planned.
            running = []
            for seq in self.running:
                (held if seq.request_id in self.paused else running).append(seq)
        # Fast path, most steps: every sequence has a slot for its next token already (a new block is
        # needed once every `block_size` tokens), so nothing is allocated or preempted.
        if all(len(s.prompt_token_ids) + len(s.output_token_ids) <= len(s.block_ids) * bs for s in running):
            out.decode = list(running)
            return
        queue = deque(running)  # sorted by arrival: oldest first
        scheduled: list[Sequence] = []
        while queue:
            seq = queue.popleft()
            need = self.blocks_for(seq.num_tokens) - len(seq.block_ids)
            if need <= 0:
                scheduled.append(seq)
                continue
            if self.blocks_for(seq.num_tokens) > bm.num_blocks:
                out.too_long.append(seq)
                continue
            while not bm.can_allocate(need) and queue:
                self._preempt(queue.pop(), out)  # the newest running sequence
            if bm.can_allocate(need):
                seq.block_ids.extend(bm.allocate(need))
                scheduled.append(seq)
            else:
                # Nothing left to preempt but itself (the rest of the pool is held by transfers).
                self._preempt(seq, out)
        # Paused sequences stay in the batch (blocks and slot kept), in arrival order.
        self.running = sorted(scheduled + held, key=lambda s: s.arrival) if held else scheduled
        out.decode = list(scheduled)  # a copy: the engine removes finished sequences from running

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free a running sequence's blocks and queue it (first) for recomputation."""
        logger.debug("preempting %s (%d tokens)", seq.request_id, seq.num_tokens)
        self.block_manager.free(seq.block_ids)
        seq.block_ids = []
        seq.num_cached = 0
        seq.status = SequenceStatus.WAITING
        seq.queued_at = time.monotonic()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
