"""A thin wrapper over a Hugging Face tokenizer (optional: the engine also works on token ids only)."""
from __future__ import annotations

import functools
import json
import os
from typing import Any

from inference.wire.chat_tools import template_renders_tools, with_tool_prompt

# Any of these files means the checkpoint folder ships a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    """encode / decode / chat template over `transformers.AutoTokenizer`."""

    def __init__(self, hf_tokenizer: Any) -> None:
        """Wrap an already loaded HF tokenizer."""
        self.hf = hf_tokenizer
        # The detokenizer decodes twice per generated token; transformers' `decode` wrapper costs
        # about 5x the Rust tokenizer's own (a third of a tiny model's decode step was spent there).
        # Its only extra work is the optional clean-up of spaces, so use the backend when that is off.
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        cleanup = getattr(hf_tokenizer, "clean_up_tokenization_spaces", True)
        self._fast_decode = backend.decode if backend is not None and not cleanup else None

    @functools.cached_property
    def byte_table(self) -> list[bytes] | None:
        """For a byte-level BPE tokenizer (GPT-2 style: Llama 3, SmolLM, Qwen2), the bytes each id decodes
        to (b"" for special tokens, which `decode` skips), so that detokenization can be a table lookup
        plus an incremental UTF-8 decoder; None for other tokenizers. Built as the `tokenizers` ByteLevel
        decoder does: every character maps back to its byte, and a token with a character outside that
        map (an added token's literal text) is its own UTF-8 bytes."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None or self._fast_decode is None:
            return None
        spec = json.loads(backend.to_str())
        if (spec.get("decoder") or {}).get("type") != "ByteLevel" or spec.get("normalizer") is not None:
            return None
        char_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
        special = {int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
        table = [b""] * (max(vocab.values(), default=-1) + 1)
        for token, idx in vocab.items():
            if idx in special:
                continue
            if all(c in char_to_byte for c in token):
                table[idx] = bytes(char_to_byte[c] for c in token)
            else:
                table[idx] = token.encode("utf-8")
        return table

    @staticmethod
    def available(path: str) -> bool:
        """Whether `path` contains tokenizer files."""
        return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)

    @classmethod
    def from_pretrained(cls, path: str) -> Tokenizer:
        """Load the tokenizer in `path` (local files only: workers never reach the network)."""
        # Imported here so that token-id-only engines never pay for importing transformers.
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path, local_files_only=True))

    @classmethod
    def maybe_from_pretrained(cls, path: str) -> Tokenizer | None:
        """Load the tokenizer if `path` has one, else None."""
        return cls.from_pretrained(path) if cls.available(path) else None

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS id, if it has one."""
        tok = self.hf.eos_token_id
        return int(tok) if tok is not None else None

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows (added tokens included)."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text to token ids."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids to text."""
        if self._fast_decode is not None:
            return str(self._fast_decode(token_ids, skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    @property
    def has_chat_template(self) -> bool:
        """Whether the tokenizer defines a chat template."""
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Render chat messages (and `tools`, OpenAI function tools) with the model's template and
        tokenize them. A template that does not render tools gets them in the Hermes/Qwen tool prompt
        (`chat_tools.with_tool_prompt`).

        Rendered to text first, then encoded without extra special tokens: the template already holds
        them, and transformers versions differ in what `tokenize=True` returns.
        """
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        if tools and not template_renders_tools(str(self.hf.chat_template)):
            messages, tools = with_tool_prompt(messages, tools), None
        text = self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
        )
        return self.encode(str(text), add_special_tokens=False)


@functools.lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map used by byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}
