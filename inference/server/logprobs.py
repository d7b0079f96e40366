"""A worker's log-probabilities as the wire carries them: the engine's token ids rendered as text.

The router has no tokenizer, so the worker that computed them names each token: the tokenizer's
decoding of that token alone (special tokens kept), as vLLM reports them; without a tokenizer the
token is written `token_id:<id>` (vLLM's form for token ids). Texts are cached per token id: a
stream asks for the same few thousand tokens over and over.
"""
from __future__ import annotations

from inference.engine import Tokenizer
from inference.engine.logprobs import TokenLogprobs
from inference.wire.logprobs import Logprob

# Bounds the cache (a vocabulary of 150k tokens renders at most that many strings anyway).
_CACHE_LIMIT = 200_000


class LogprobRenderer:
    """Renders `TokenLogprobs` into the wire's `Logprob` positions."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        """The text of one token alone."""
        cached = self._texts.get(token_id)
        if cached is not None:
            return cached
        if self.tokenizer is None:
            text = f"token_id:{token_id}"
        else:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        if len(self._texts) < _CACHE_LIMIT:
            self._texts[token_id] = text
        return text

    def position(self, entry: TokenLogprobs) -> Logprob:
        """One position."""
        text = self.text
        return Logprob(text(entry.token_id), entry.logprob, [(text(t), lp) for t, lp in entry.top])

    def positions(self, entries: list[TokenLogprobs]) -> list[Logprob]:
        """Sampled tokens' positions."""
        return [self.position(e) for e in entries]

    def prompt(self, entries: list[TokenLogprobs | None], prompt_token_ids: list[int]) -> list[Logprob | None]:
        """A prompt's positions; the first (None from the engine: nothing predicts it) carries its token's
        text and no log-probability."""
        return [Logprob(self.text(prompt_token_ids[i]), None, []) if e is None else self.position(e)
                for i, e in enumerate(entries)]
