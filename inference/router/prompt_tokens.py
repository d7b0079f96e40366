"""The router's own tokenization of text and chat prompts: the worker's ids, computed before the choice.

A `kv-aware` router needs a prompt's token ids to look its blocks up in the KV index before it picks
a decode worker; clients mostly send text (`/v1/completions`) or chat messages. `PromptTokenizer`
runs the worker's tokenizer (`inference/wire/tokenizer.py`: the Rust backend's JSON, the chat
template, the special tokens) as the engine does (`inference.engine.tokenizer.Tokenizer`): text
with the tokenizer's special tokens, chat rendered by transformers' own `apply_chat_template`
(tools the template does not render go into the Hermes tool prompt) and encoded without them. It is
used only if it reproduces the worker's ids for both probes; the router then sends the ids, so the
worker does not tokenize again.

Chat prompts are encoded piecewise: the Rust tokenizer splits text at its added tokens
(`<|im_start|>`, `<|im_end|>`, ...) before anything else, and encodes the pieces between them
independently, so a piece's ids never depend on its neighbours. A conversation resends its history
every turn: its pieces (system prompt, earlier turns) are kept in an LRU, and a turn encodes only its
new messages. That holds for tokenizers without a normalizer, whose added tokens strip nothing and
match anywhere, and whose pre-tokenizer treats every piece alike (not Metaspace's "first piece only"
prefix); others are encoded whole. The probes check the piecewise path too.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

from inference.router.events import GenerateRequest
from inference.router.kv_index import PrefixWatch, PromptBlocks
from inference.router.text_prefix import CHECK_TEXTS, text_prefix
from inference.wire.chat_tools import template_renders_tools, with_tool_prompt
from inference.wire.tokenizer import PROBE_MESSAGES, PROBE_TEXT, PROBE_TOOLS, TokenizerSpec

# Pieces and text prompts kept (a piece is a message's text between two added tokens).
PIECE_CACHE_ENTRIES = 16384
TEXT_CACHE_ENTRIES = 256


class TokenizerMismatch(ValueError):
    """The router's tokenization of a probe differs from the worker's: it must not be used."""


class _LRU:
    """A bounded map, least recently used out first."""

    __slots__ = ("_items", "_limit")

    def __init__(self, limit: int) -> None:
        self._items: OrderedDict[str, list[int]] = OrderedDict()
        self._limit = limit

    def get(self, key: str) -> list[int] | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: str, value: list[int]) -> None:
        self._items[key] = value
        if len(self._items) > self._limit:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def _piece_splitter(spec: dict[str, Any]) -> tuple[re.Pattern[str], dict[str, int]] | None:
    """A regex matching the added tokens leftmost-longest (as the Rust tokenizer's Aho-Corasick does),
    and their ids; None when pieces would not encode independently (see the module docstring)."""
    if spec.get("normalizer") is not None or "Metaspace" in json.dumps(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if not added or any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") for t in added):
        return None
    ids = {str(t["content"]): int(t["id"]) for t in added}
    pattern = "|".join(re.escape(content) for content in sorted(ids, key=len, reverse=True))
    return re.compile(pattern), ids


class PromptTokenizer:
    """The worker's tokenization, in the router. Construction checks both probes (TokenizerMismatch)."""

    def __init__(self, spec: TokenizerSpec) -> None:
        # Imported here: only a router that routes by KV pays for them (about 1 s and 40 MB, no torch).
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        self.model = spec.model
        self.digest = spec.digest
        self._backend = Tokenizer.from_str(spec.tokenizer_json)
        self._chat: Any = None
        self._renders_tools = False
        if spec.chat_template is not None:
            # transformers renders the template exactly as on the worker: same environment, filters,
            # special-token variables and message normalization.
            self._chat = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(spec.tokenizer_json),
                                                 **spec.special_tokens)
            self._chat.chat_template = spec.chat_template
            self._renders_tools = template_renders_tools(str(spec.chat_template))
        self._splitter = _piece_splitter(json.loads(spec.tokenizer_json))
        self._pieces = _LRU(PIECE_CACHE_ENTRIES)
        self._texts = _LRU(TEXT_CACHE_ENTRIES)
        # Text prompts in chunks, stopping where no worker holds the blocks (None: encoded whole).
        self._prefix = text_prefix(self._backend, spec.tokenizer_json, (PROBE_TEXT, *CHECK_TEXTS))
        self._check(spec)

    def _check(self, spec: TokenizerSpec) -> None:
        text = self.text_ids(PROBE_TEXT)
        if text != spec.probe_text_ids:
            raise TokenizerMismatch(f"the probe text encodes to {len(text)} ids here, "
                                    f"{len(spec.probe_text_ids)} on the worker (or different ones)")
        if spec.probe_chat_ids is None:
            self._chat = None  # the worker has no template: chat stays text and the worker says why
            return
        chat = self.chat_ids(PROBE_MESSAGES, PROBE_TOOLS)
        if chat != spec.probe_chat_ids:
            raise TokenizerMismatch(f"the probe chat renders to {0 if chat is None else len(chat)} ids here, "
                                    f"{len(spec.probe_chat_ids)} on the worker (or different ones)")

    @property
    def piecewise(self) -> bool:
        """Whether chat prompts are encoded piece by piece (with the piece cache)."""
        return self._splitter is not None

    def text_ids(self, text: str) -> list[int]:
        """A text prompt's ids, as the engine's `Tokenizer.encode(text)` (special tokens added)."""
        ids = self._texts.get(text)
        if ids is None:
            ids = self._backend.encode(text).ids
            self._texts.put(text, ids)
        return ids

    def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int] | None:
        """A chat prompt's ids, as the engine's `Tokenizer.apply_chat_template(messages, tools=tools)`;
        None when there is no chat template."""
        if self._chat is None:
            return None
        if tools and not self._renders_tools:
            messages, tools = with_tool_prompt(messages, tools), None
        text = str(self._chat.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                  tools=tools or None))
        return self._encode_pieces(text)

    def _encode_pieces(self, text: str) -> list[int]:
        """`text` encoded without added special tokens: piece by piece with the cache when that is exact."""
        if self._splitter is None:
            return self._backend.encode(text, add_special_tokens=False).ids
        pattern, added = self._splitter
        out: list[int] = []
        start = 0
        for match in pattern.finditer(text):
            if match.start() > start:
                out += self._piece(text[start:match.start()])
            out.append(added[match.group()])
            start = match.end()
        if start < len(text):
            out += self._piece(text[start:])
        return out

    def _piece(self, piece: str) -> list[int]:
        ids = self._pieces.get(piece)
        if ids is None:
            ids = self._backend.encode(piece, add_special_tokens=False).ids
            self._pieces.put(piece, ids)
        return ids

    def request_prompt(self, req: GenerateRequest, watch: PrefixWatch) -> PromptBlocks | None:
        """`req`'s prompt for the decode choice, as `request_ids` computes it, setting `req.token_ids`
        when the router has all of its ids (then the worker does not tokenize). A text prompt is
        tokenized only as far as some worker of `watch` holds its blocks: stopped early, the prompt is
        the ids so far (with an estimate of its length) and the worker tokenizes the text."""
        text = req.prompt
        if self._prefix is None or req.messages is not None or not isinstance(text, str) or not text:
            req.token_ids = self.request_ids(req)
            return PromptBlocks(req.token_ids) if req.token_ids else None
        ids = self._texts.get(text)
        if ids is None:
            try:
                ids, consumed = self._prefix.ids(text, watch)
            except Exception:  # noqa: BLE001  as request_ids: the worker reports what the encoder refused
                return None
            if consumed < len(text):
                if consumed == 0:
                    return None  # no worker holds anything: the decode choice goes by load
                prompt = PromptBlocks(ids, total_tokens=len(ids) * len(text) // consumed)
                prompt.reuse(watch.hashes)
                return prompt
            self._texts.put(text, ids)
        req.token_ids = ids or None
        return PromptBlocks(ids) if ids else None

    def request_ids(self, req: GenerateRequest) -> list[int] | None:
        """`req`'s prompt ids as its decode worker would compute them, or None where the worker must
        tokenize itself: ids sent already, a request the worker would refuse (it says why, the
        router does not guess), or anything this tokenizer cannot render."""
        try:
            if req.messages is not None:
                if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                           for m in req.messages):
                    return None
                return self.chat_ids(req.messages, req.tools) or None
            if isinstance(req.prompt, str) and req.prompt:
                return self.text_ids(req.prompt) or None
        except Exception:  # noqa: BLE001  templates and encoders raise many types; the worker reports them
            return None
        return None

    def status(self) -> dict[str, Any]:
        """For /router/status."""
        return {"model": self.model, "digest": self.digest, "piecewise": self.piecewise,
                "chat": self._chat is not None, "cached_pieces": len(self._pieces),
                "text_chunks": self._prefix is not None,
                "cached_chunks": len(self._prefix) if self._prefix is not None else 0}
