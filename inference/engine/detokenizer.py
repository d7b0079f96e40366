"""Incremental detokenization with stop-string handling."""
from __future__ import annotations

import codecs

from .tokenizer import Tokenizer

# Prompt tokens kept as decoding context: tokenizers that drop a word's leading space at the start of a
# string (SentencePiece) need a few preceding tokens to render the first output token correctly.
_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Re-decodes only a short window of tokens per step (prefix/read offsets, as in HF's TextStreamer
    and vLLM), holds back text that ends in an incomplete UTF-8 character ("\\ufffd"), finds stop
    strings (truncating the text before them) and holds back a suffix that might still grow into a
    stop string. Without a tokenizer it produces no text and stop strings never match.

    Byte-level BPE tokenizers (`Tokenizer.byte_table`) take a faster path: each token's bytes from a
    table into an incremental UTF-8 decoder, which holds back an incomplete character by itself. The
    text is the same as `tokenizer.decode` of all the ids (tests/inference/engine/test_text.py), at a
    fraction of the cost of two `decode` calls per token (a tenth of a tiny model's decode step).
    """

    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], stop: list[str]) -> None:
        """Start after the prompt; `stop` are the request's stop strings."""
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # Output text so far (cut before the stop string once one matched); on the `append_plain` path
        # only what was not handed out yet.
        self.text = ""
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False
        self._table = tokenizer.byte_table if tokenizer is not None else None
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._table is not None else None
        # Byte-level table and no stop string: every token's text can be handed out at once, nothing is
        # searched or held back, so `append_plain` may replace append + take_delta (engine fast path).
        self.plain = self._table is not None and not self.stop

    def append_plain(self, token_id: int) -> str:
        """Add one generated token and return the text it completes: `append(token_id)` followed by
        `take_delta()`, for a `plain` detokenizer only (byte table, no stop strings).

        Nothing is kept in `text`: without stop strings there is nothing to search, and `take_delta`
        hands out all of it at every step anyway, so `text` only ever holds what a later `append` /
        `flush` adds before its `take_delta` (the final token of a request goes that way). `ids` is
        not kept either: the byte-table path never reads it.
        """
        table = self._table
        assert table is not None and self._utf8 is not None
        return self._utf8.decode(table[token_id] if 0 <= token_id < len(table) else b"")

    def append(self, token_id: int) -> bool:
        """Add one generated token; return True when the text now contains a stop string."""
        table, utf8 = self._table, self._utf8
        if table is None or utf8 is None:
            self.ids.append(token_id)  # only the tokenizer `decode` path below reads the ids
        if self.stopped:
            return False
        if table is not None and utf8 is not None:
            # Ids outside the tokenizer's vocabulary decode to nothing, as in `decode`.
            delta = utf8.decode(table[token_id] if 0 <= token_id < len(table) else b"")
            if delta:
                self._add_text(delta)
            return self.stopped
        tok = self.tokenizer
        if tok is None:
            return False
        prefix_text = tok.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = tok.decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            # Nothing printable yet (special token, or a multi-byte character still incomplete).
            return False
        self._add_text(new_text[len(prefix_text) :])
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return self.stopped

    def _add_text(self, delta: str) -> None:
        """Append decoded text and look for a stop string in the part that could contain a new match."""
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        if not self.stop:
            return
        best = -1
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best == -1 or idx < best):
                best = idx
        if best != -1:
            self.text = self.text[:best]
            self.stopped = True

    def flush(self) -> None:
        """At the end of generation: decode any still-undecoded tail (even if it is an incomplete
        character, the stream ends here) unless a stop string already ended the text."""
        if self._utf8 is not None:
            if not self.stopped:
                tail = self._utf8.decode(b"", final=True)  # an incomplete character becomes U+FFFD
                if tail:
                    self._add_text(tail)
            return
        tok = self.tokenizer
        if tok is None or self.stopped or self.read_offset >= len(self.ids):
            return
        prefix_text = tok.decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = tok.decode(self.ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text):
            self._add_text(new_text[len(prefix_text) :])
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)

    def _holdback(self) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        if not self.stop or self.stopped:
            return 0
        text = self.text
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def take_delta(self, final: bool = False) -> str:
        """Text that is safe to emit now (everything, when `final`)."""
        end = len(self.text) if final else len(self.text) - self._holdback()
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
