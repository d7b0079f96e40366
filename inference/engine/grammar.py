"""Structured output: the grammar a request's tokens must follow, and its matcher state per sequence.

A request's `SamplingParams.grammar` (the wire's form: `{"type": "json_schema", "schema": {...}}`,
`{"type": "json_object"}`, `{"type": "regex", "pattern": "..."}` or `{"type": "choice", "choices":
[...]}`; its grammar text: inference/wire/grammar.py) is compiled by llguidance (the grammar library
chosen by `bench/structured_cost.py`: no per-schema compile step, the smallest install, full JSON
Schema) into a matcher per sequence. Each
sampling step the matcher takes the sequence's generated tokens it has not seen yet, then writes the
bitmask of the tokens allowed next; the sampler sets the others to -inf. Only constrained rows pay,
and the masks of all of them are computed in one call that releases the GIL (llguidance's executor).

The matcher follows the tokens, never the other way round: a decode worker's fresh matcher takes the
first token the prefill worker sampled on its first step, and a migrated stream (whose new prompt ends
with the `seed_offset` tokens already generated) replays those into a fresh matcher, so grammar state
is never sent across the hop. Once the grammar is complete only EOS is allowed; a matcher in error
(a token the grammar refuses, which cannot happen under its own mask) also allows only EOS.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from inference.wire.grammar import GrammarError, check_grammar

from .token_history import TokenHistory, generated_ids

if TYPE_CHECKING:
    import llguidance

    from .sampling_params import SamplingParams
    from .tokenizer import Tokenizer

# The thread that computes a step's masks while the forward pass runs (`prefetch_masks`).
_MASKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")


class GrammarState:
    """One sequence's matcher, how many of its generated tokens it has taken, and the mask being
    computed for its next token (`prefetch_masks`: the future, this state's row in it, and `consumed`
    when it was started)."""

    __slots__ = ("compiler", "consumed", "matcher", "pending")

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler) -> None:
        self.matcher = matcher
        self.compiler = compiler
        self.consumed = 0
        self.pending: tuple[Future[torch.Tensor], int, int] | None = None

    def settle(self) -> None:
        """Wait for a mask computation still using the matcher (it is not thread-safe)."""
        if self.pending is not None:
            self.pending[0].exception()  # waits; an error is the synchronous path's to raise again

    def catch_up(self, generated: Sequence[int]) -> None:
        """Feed the matcher the tokens of `generated` it has not taken (one per step; the whole list
        for a fresh matcher on a decode worker or after a migration)."""
        if len(generated) > self.consumed:
            # A refused token puts the matcher in its error state, which `fill` treats as "EOS only".
            self.matcher.consume_tokens(list(generated[self.consumed:]))
            self.consumed = len(generated)


class GrammarCompiler:
    """Grammars for one engine's tokenizer: its llguidance tokenizer (built on first use, about a second
    for a 49k vocabulary), compiled grammar texts by spec, and a mask executor."""

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = [int(t) for t in eos_token_ids]
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._sources: dict[str, str] = {}
        self._lock = threading.Lock()
        if tokenizer is not None:
            # Built in the background at start (1.4 s of CPU for SmolLM2's 49k tokens): the first
            # constrained request would otherwise build it while holding the engine's lock (a decode
            # worker's reservation), stalling every running sequence that long.
            threading.Thread(target=self._warm, name="grammar-tokenizer", daemon=True).start()

    def _warm(self) -> None:
        try:
            self._ll()
        except Exception:  # noqa: BLE001  a tokenizer llguidance cannot read fails the first request instead
            pass

    def _ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                import llguidance.hf

                if self._tokenizer is None:
                    raise GrammarError("structured output needs the model's tokenizer")
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer.hf, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
                # One thread: the engine already uses the cores; the call still releases the GIL.
                self._executor = llguidance.LLExecutor(num_threads=1)
            return self._ll_tokenizer

    def compile(self, spec: Mapping[str, Any]) -> str:
        """The checked grammar text of `spec` (cached by spec); GrammarError when invalid. Builds the
        tokenizer too, so the first constrained request pays that in the caller's thread, before it
        joins a batch."""
        key = json.dumps(spec, sort_keys=True)
        source = self._sources.get(key)
        if source is None:
            source = check_grammar(spec)
            if len(self._sources) > 256:  # bounded: many distinct schemas must not grow memory forever
                self._sources.clear()
            self._sources[key] = source
        self._ll()
        return source

    def new_state(self, spec: Mapping[str, Any]) -> GrammarState:
        """A fresh matcher for `spec`; GrammarError when it cannot be built for this tokenizer."""
        import llguidance

        matcher = llguidance.LLMatcher(self._ll(), self.compile(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarState(matcher, self)

    def fill_masks(self, states: Sequence[GrammarState]) -> torch.Tensor:
        """`[len(states), vocab]` bool: the tokens each matcher allows next (EOS only for a matcher
        that is complete or in error)."""
        self._ll()
        assert self._executor is not None
        words = (self.vocab_size + 31) // 32
        bits = np.zeros((len(states), words), dtype=np.int32)
        live = [(s.matcher, i) for i, s in enumerate(states) if not s.matcher.is_error()]
        if live:
            self._executor.unsafe_compute_mask_ptr(live, bits.ctypes.data, words * 4, len(states))
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        mask = torch.from_numpy(allowed.astype(np.bool_, copy=False))
        for i, s in enumerate(states):
            if s.matcher.is_error() or not mask[i].any():
                mask[i].zero_()
                mask[i, self._eos] = True
        return mask


def apply_grammars(
    x: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[TokenHistory]
) -> None:
    """Set to -inf, in place, the logits of `x` `[rows, vocab]` that a constrained row's grammar forbids
    now (rows without a grammar are left alone). The histories of constrained rows carry their
    `grammar_state` (set by the engine at admission)."""

    rows = [i for i, p in enumerate(params) if p.grammar is not None]
    if not rows:
        return
    states: list[GrammarState] = []
    for i in rows:
        state = getattr(histories[i], "grammar_state", None)
        if state is None:
            raise RuntimeError("a constrained request reached the sampler without its grammar state")
        state.settle()
        state.catch_up(generated_ids(histories[i], params[i]))
        states.append(state)
    mask = _prefetched(states)
    if mask is None:
        mask = states[0].compiler.fill_masks(states)
    mask = mask.to(x.device)
    width = min(mask.shape[1], x.shape[1])
    index = torch.tensor(rows, device=x.device)
    sub = x.index_select(0, index)
    sub[:, :width].masked_fill_(~mask[:, :width], float("-inf"))
    if x.shape[1] > width:
        sub[:, width:] = float("-inf")
    x.index_copy_(0, index, sub)


def _prefetched(states: list[GrammarState]) -> torch.Tensor | None:
    """The masks `prefetch_masks` computed for exactly these states at their current tokens, else None
    (then they are computed now). Clears the states' pending masks either way."""
    pending = [s.pending for s in states]
    for s in states:
        s.pending = None
    first = pending[0]
    if first is None or any(p is None or p[0] is not first[0] or p[2] != s.consumed
                            for p, s in zip(pending, states, strict=True)):
        return None
    try:
        masks = first[0].result()
    except Exception:  # noqa: BLE001  computed again synchronously, which raises it where it belongs
        return None
    return masks[torch.tensor([p[1] for p in pending if p is not None])]


def prefetch_masks(histories: Sequence[TokenHistory]) -> None:
    """Start computing the next-token masks of the constrained sequences among `histories` in the mask
    thread, to overlap the forward pass (call it just before the forward; the sampler picks them up).
    The matchers first take the tokens generated so far here, so the thread reads settled state."""

    states: list[GrammarState] = []
    for history in histories:
        state = getattr(history, "grammar_state", None)
        params = getattr(history, "params", None)
        if state is None or params is None:
            continue
        state.settle()
        state.catch_up(generated_ids(history, params))
        states.append(state)
    if not states:
        return
    future = _MASKS.submit(states[0].compiler.fill_masks, states)
    for row, state in enumerate(states):
        state.pending = (future, row, state.consumed)
