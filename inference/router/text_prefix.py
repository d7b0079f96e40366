"""A text prompt's ids only as far as the KV index can match them: chunked encoding with an early stop.

A fresh 1,000-token text prompt cost the router's tokenizer 1-2 ms of a core (docs/benchmarks.md,
issue 19), nearly all of it in the Rust tokenizer's pre-tokenizer regex and BPE, linear in the text's
length. The router needs the ids only as far as some decode worker holds the prompt's blocks: block
hashes are chained, so once block i is held by no worker no later block can match. `TextPrefix`
encodes the text in chunks of a few hundred characters (the first shorter) and asks after each chunk
whether a worker still holds every block so far (`PrefixWatch`); a fresh prompt costs one small
chunk. When it stops early the decode worker tokenizes the whole text as before (the router sends
the text, not ids).

Exactness: a chunk's ids must equal the full encode's ids of the same span. The text is cut only just
before a space (U+0020) that follows a non-space character. The byte-level regexes (GPT-2's, which
SmolLM2 and Llama 2-style BPEs use, and Llama 3's / Qwen2's `Split` pattern) never put a non-space
character and a following space into one pre-token, and scan without looking behind, so the
pre-tokens on each side of such a cut are the same as in the whole text, and BPE merges never cross
pre-tokens. That holds only for tokenizers without a normalizer, with a BPE model, byte-level or
`Split` / `Digits` pre-tokenizers, a post-processor that adds only leading special tokens, and added
tokens without whitespace or stripping; anything else is encoded whole (`chunk_plan` returns None). The
plan is also checked at load against the full encode on `CHECK_TEXTS`, cut at every allowed place.

Chunks are cached by their text (a prefix shared by prompts is cut at the same places: a cut depends
only on the text before it and the character after), so a long cached prefix costs lookups.
"""
from __future__ import annotations

import json
from array import array
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

# A chunk: a few blocks of 16 tokens of English (4-5 characters a token). Chunks do not grow: a prefix
# held by a worker was mostly seen before (its chunks come from the cache), and the chunk where the new
# text starts is the one encoded in vain past the miss (doubling chunks made it as long as the prefix).
CHUNK_CHARS = 256
# The first chunk is shorter: it decides alone for a fresh prompt (about 25 tokens of English, a block and
# a half of 16), and its encode is most of a fresh prompt's cost (~0.3 us a character on SmolLM2's).
FIRST_CHUNK_CHARS = 128
# Chunks kept (text -> ids as an int64 array): about 1 KB each, 4 MB in all.
CHUNK_CACHE_ENTRIES = 4096

# Pre-tokenizers that split only where a byte-level regex or digits split (see the module docstring).
_SPLITTING = {"ByteLevel", "Split", "Digits"}

# Texts the plan is checked on at load (with PROBE_TEXT): every kind of character next to a space.
CHECK_TEXTS = (
    "Hello, world! It's 12345 naïve cafés — don't we'll they've  two  spaces\tand\ttabs\nnew line\r\n",
    "code: def f(x):  return x**2 + 3.14159  # comment\n    if a != b: print(\"x y\")  \n\n  end",
    "分布式 推理 架构的 优势 🙂 🚀 emoji  mixed 中文 words 123 456 7890 ,.;:!? ' \" ( ) [ ] { }",
    "   leading spaces, trailing spaces   ",
    "a" * 300 + " " + "b" * 300 + " 1 2 3 4 5 6 7 8 9 0 . . . ' s 's 't 're 've 'm 'll 'd",
)

# Given the ids so far, whether some worker still holds every full block of them (more are worth having).
Wanted = Callable[[list[int]], bool]


def _pre_tokenizers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    pre = spec.get("pre_tokenizer")
    if pre is None:
        return []
    return list(pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else [pre]


def chunk_plan(spec: dict[str, Any]) -> bool:
    """Whether a tokenizer (its JSON, parsed) may be encoded in chunks cut before spaces (the module
    docstring's conditions; the probes still check it)."""
    if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
        return False
    pres = _pre_tokenizers(spec)
    if not pres or any(p.get("type") not in _SPLITTING for p in pres):
        return False
    # A Split as Llama 3's and Qwen2's: its regex's matches are pre-tokens of their own (a space merged
    # with the piece before it, or an inverted pattern, would move the boundaries).
    if any(p.get("type") == "Split" and (str(p.get("behavior")).lower() != "isolated" or p.get("invert"))
           for p in pres):
        return False
    # Something must split at spaces: a regex (ByteLevel's own or a Split pattern); ByteLevel alone
    # without its regex would make the whole text one pre-token.
    if not any(p.get("type") == "Split" or (p.get("type") == "ByteLevel" and p.get("use_regex", True)) for p in pres):
        return False
    for token in spec.get("added_tokens") or []:
        content = str(token.get("content", ""))
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word") or any(c.isspace() for c in content):
            return False
    return True


def next_cut(text: str, at: int) -> int:
    """The first place >= `at` just before a space that follows a non-space character; len(text) if none."""
    n = len(text)
    i = max(at, 1)
    while i < n:
        i = text.find(" ", i)
        if i < 0:
            return n
        if not text[i - 1].isspace():
            return i
        i += 1
    return n


class TextPrefix:
    """Encodes text prompts chunk by chunk with an early stop; `encode` is the tokenizer's own encode of
    a piece without special tokens, `leading` the special ids its post-processor puts first."""

    def __init__(self, encode: Callable[[str], list[int]], leading: list[int],
                 chunk_chars: int = CHUNK_CHARS, first_chunk_chars: int = FIRST_CHUNK_CHARS) -> None:
        self._encode = encode
        self.leading = leading
        self.chunk_chars = chunk_chars  # tests cut small texts too
        self.first_chunk_chars = first_chunk_chars
        self._chunks: OrderedDict[str, array[int]] = OrderedDict()

    def ids(self, text: str, wanted: Wanted | None = None) -> tuple[list[int], int]:
        """`text`'s ids (special tokens added) as far as `wanted` asks for them (all of them when None):
        the ids and how many of the text's characters they cover (all of them: every id of the text)."""
        ids = list(self.leading)
        if wanted is not None and not wanted(ids):
            return ids, 0
        start, n = 0, len(text)
        while start < n:  # at most one pass over the text
            cut = next_cut(text, start + (self.chunk_chars if start else self.first_chunk_chars))
            ids += self._chunk(text[start:cut])
            start = cut
            if start < n and wanted is not None and not wanted(ids):
                return ids, start
        return ids, n

    def _chunk(self, piece: str) -> list[int]:
        cached = self._chunks.get(piece)
        if cached is not None:
            self._chunks.move_to_end(piece)
            return cached.tolist()
        ids = self._encode(piece)
        self._chunks[piece] = array("q", ids)
        if len(self._chunks) > CHUNK_CACHE_ENTRIES:
            self._chunks.popitem(last=False)
        return ids

    def __len__(self) -> int:
        return len(self._chunks)


def text_prefix(backend: Any, tokenizer_json: str, probes: tuple[str, ...]) -> TextPrefix | None:
    """A `TextPrefix` over a `tokenizers.Tokenizer` when chunks are exact for it (the plan's conditions,
    and every probe cut at every allowed place encodes to the full encode's ids), else None."""
    if not chunk_plan(json.loads(tokenizer_json)):
        return None

    def encode(piece: str) -> list[int]:
        return list(backend.encode(piece, add_special_tokens=False).ids)

    # The post-processor's special tokens: only leading ones are supported (BOS; an appended EOS is not).
    sample = "probe text"
    full, bare = backend.encode(sample).ids, encode(sample)
    if full[len(full) - len(bare):] != bare:
        return None
    leading = list(full[: len(full) - len(bare)])
    for text in probes:
        expected = list(backend.encode(text).ids)
        ids, start = list(leading), 0
        while start < len(text):  # a cut at every allowed place
            cut = next_cut(text, start + 1)
            ids += encode(text[start:cut])
            start = cut
        if ids != expected:
            return None
    return TextPrefix(encode, leading)
