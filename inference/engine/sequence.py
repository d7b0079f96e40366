"""A request's state inside the engine."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from .detokenizer import IncrementalDetokenizer
from .logprobs import TokenLogprobs
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Lifecycle of a sequence."""

    WAITING = "waiting"  # queued for prefill (new, or preempted and to be recomputed)
    RUNNING = "running"  # in the decode batch
    WAITING_FOR_KV = "waiting_for_kv"  # decode side: blocks reserved, prompt KV not yet received
    READY = "ready"  # decode side: prompt KV received, queued for a slot in the running batch
    PREFILLED = "prefilled"  # prefill side: done, blocks kept until release()
    FINISHED = "finished"  # done, blocks freed


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request.

    `new_token_ids` / `new_text` are deltas since the previous output. `block_ids` is set on the
    output of a prefill-only request (the blocks holding its prompt KV). `error` carries the message
    when `finish_reason == "error"`. `logprobs` (one per new token) when the request asked for them;
    `prompt_logprobs` once, on the first output of a request that asked (None for the first prompt
    token, which nothing predicts). `num_cached_tokens`: the prompt tokens the engine did not compute
    because their KV was cached when it first scheduled the prompt (`Sequence.admitted_cached_tokens`).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    block_ids: list[int] | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, blocks, stopping state and detokenizer.

    `num_cached` counts tokens whose KV is in `block_ids`. A preempted sequence drops its blocks and
    is recomputed from `prompt_token_ids + output_token_ids` as one prefill.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    prefill_only: bool = False
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_cached: int = 0
    # Decode side of a disaggregated request: how many of its first blocks were already cached here
    # when it was reserved (prefix caching), so the prefill worker sends only the blocks after them.
    reserved_hits: int = 0
    # Prompt tokens whose KV the prefix cache supplied when the prompt was first given blocks (its prefill
    # admitted, or its decode reservation), so never computed here: cached by an earlier request, or by a
    # prompt of the same burst that computed a shared prefix a step before (scheduler._shares_computing).
    # Counted at that moment, not at receipt; None until then; a preempted sequence's recompute keeps it.
    admitted_cached_tokens: int | None = None
    finish_reason: str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    # Chained content hashes of the full blocks computed so far (prefix caching; see block_manager).
    block_hashes: list[bytes] = field(default_factory=list)
    # Chunked prefill: tokens to compute in this step when fewer than all the uncached ones (0: all).
    chunk: int = 0
    # `time.monotonic()` when it last joined the waiting queue (added, preempted, or after a chunk of its
    # prompt ran): how long it has waited without progress (the mixed step budget's overdue rule).
    queued_at: float = 0.0
    # Outputs not yet reported (tokens and text since the last RequestOutput).
    pending_token_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    # Stopping, precomputed by the engine when it admits the request (`LLMEngine._new_sequence`) so
    # that a decode step decides "not finished" with one set lookup and one comparison per sequence:
    # the token ids that end it (EOS unless `ignore_eos`, plus `stop_token_ids`), and the total token
    # count (prompt + output) at which it ends with "length" (`max_tokens` or the context length,
    # whichever comes first). `stop_ids` None: not set up, the engine takes its general path.
    stop_ids: frozenset[int] | None = None
    token_limit: int = 0
    # Structured output: the matcher of the request's grammar (grammar.GrammarState; None without one).
    grammar_state: Any = None
    # Log-probabilities of the pending tokens (one each, when the request asks) and of the prompt
    # (gathered over the chunks of its first prefill, reported with the first output).
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    # Speculative decoding: the sequence's n-gram lookup state (speculative.NgramState; None until it
    # first may propose, and always without speculation).
    spec_state: Any = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_new_tokens(self) -> int:
        """Tokens this step computes: the chunk, or every token not cached yet (1 in a decode step)."""
        return self.chunk or self.num_tokens - self.num_cached

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length."""
        return len(self.prompt_token_ids)

    @property
    def last_token_id(self) -> int:
        """The newest token (the input of the next decode step)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether this step's prefill must compute the prompt's log-probabilities (asked for, and
        not computed yet: a preempted sequence recomputing does not report them again)."""
        return self.params.prompt_logprobs is not None and not self.prompt_logprobs_sent and not self.output_token_ids

    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        """Whether the request reached a final state (PREFILLED counts: it will not produce more)."""
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.PREFILLED)

    def take_output(self) -> RequestOutput:
        """Build the RequestOutput for what is pending and reset the pending deltas."""
        status = self.status
        # Positional: this runs once per sequence per step, and keyword calls cost more.
        out = RequestOutput(
            self.request_id,
            self.pending_token_ids,
            self.pending_text,
            status is SequenceStatus.FINISHED or status is SequenceStatus.PREFILLED,  # is_finished
            self.finish_reason,
            len(self.prompt_token_ids),
            len(self.output_token_ids),
            list(self.block_ids) if status is SequenceStatus.PREFILLED else None,
        )
        self.pending_token_ids = []
        self.pending_text = ""
        out.num_cached_tokens = self.admitted_cached_tokens or 0
        if self.pending_logprobs:
            out.logprobs, self.pending_logprobs = self.pending_logprobs, []
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            out.prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return out
