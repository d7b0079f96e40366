"""Where a text prompt's encode goes: thread CPU per call of each layer of the tokenizer, in process.

The router's kv-aware choice tokenizes text prompts (inference/router/prompt_tokens.py); a fresh
1,000-token prompt cost it ~2 ms (issue 19). This splits that cost on the worker's tokenizer (SmolLM2's
when prepared, else the tiny model's), for the same texts as bench/kv_policy_cost.py, in alternating rounds:
transformers' `encode` (what the engine calls), the Rust `Tokenizer.encode` and its `.ids` list,
`encode_batch_fast` (no offsets), the pre-tokenizer alone (`pre_tokenize_str`: the regex and the
byte-level mapping, plus a Python list of pieces; the BPE model alone cannot be timed from Python without a
call per pre-token, which costs more than the model), and the router's first chunk: an encode of the
first 128 characters (text_prefix.py).

    .venv/bin/python -m bench.tokenizer_cost
"""
from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import base_parser, log, median, parse_args, print_header, smollm2_dir, tiny_model_dir, write_result
from bench.kv_policy_cost import _text

MODULE = "bench.tokenizer_cost"


def main(argv: list[str] | None = None) -> int:
    """Time each layer in alternating rounds; print and write the medians (µs per text)."""
    from tokenizers import Tokenizer as Backend

    from inference.engine.tokenizer import Tokenizer

    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--texts", type=int, default=500)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    rounds, count = (2, 50) if args.quick else (args.rounds, args.texts)
    model = Path(args.model_dir or smollm2_dir() or tiny_model_dir())
    worker = Tokenizer.from_pretrained(str(model))
    backend = Backend.from_str(worker.hf.backend_tokenizer.to_str())
    rng = random.Random(2)
    words = 1000
    while len(worker.encode(_text(random.Random(0), words))) > 1000:
        words -= 20
    texts = [f"{i} {_text(rng, words)}" for i in range(count)]
    pieces = [[piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)] for text in texts]
    log(f"{model.name}: {len(worker.encode(texts[0]))} tokens, {len(texts[0])} characters, {len(pieces[0])} pre-tokens")
    layers: dict[str, Callable[[int], object]] = {
        "transformers encode (the worker's)": lambda i: worker.encode(texts[i]),
        "Rust encode().ids": lambda i: backend.encode(texts[i]).ids,
        "Rust encode() without .ids": lambda i: backend.encode(texts[i]),
        "Rust encode_batch_fast([text])[0].ids": lambda i: backend.encode_batch_fast([texts[i]])[0].ids,
        "pre-tokenizer alone (pre_tokenize_str)": lambda i: backend.pre_tokenizer.pre_tokenize_str(texts[i]),
        "first 128 characters, encode().ids": lambda i: backend.encode(texts[i][:128], add_special_tokens=False).ids,
    }
    samples: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(rounds):
        for name, layer in layers.items():
            started = time.thread_time()
            for i in range(count):
                layer(i)
            samples[name].append((time.thread_time() - started) / count * 1e6)
    rows = {name: median(values) for name, values in samples.items()}
    print_header(f"tokenizer layers, {model.name}, a 1,000-token text (µs per text, median of {rounds} rounds)")
    for name, value in rows.items():
        print(f"{name:45s} {value or 0:8.1f}")
    write_result(args.out_dir, "tokenizer_cost_quick" if args.quick else "tokenizer_cost", MODULE, argv,
                 {"model": str(model), "characters": len(texts[0]), "pre_tokens": len(pieces[0]), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
