"""Structured output's cost: decode tokens/s at batch 32 with `response_format` json_schema against
unconstrained sampling, side by side in one process (issue 23's target: at least 0.8x), and the
per-token mask cost of the grammar libraries that are installed (llguidance, the one the engine uses;
xgrammar and outlines-core when present) on the tiny model's and SmolLM2's vocabularies.

Decode: 32 requests are prefilled, then engine steps are timed while all 32 rows run; rounds alternate
the configurations (every row constrained, no row constrained; both sampled at temperature 0.7, so the
grammar is the only difference) so that load from other jobs hits them alike. Times are the process's
CPU time (`time.process_time`: the engine thread and llguidance's mask thread; one torch thread), since
on a shared machine wall time mostly measures the other jobs; wall time is recorded too.

    .venv/bin/python -m bench.structured_cost             # SmolLM2 (make demo-model), else the tiny model
    .venv/bin/python -m bench.structured_cost --quick
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import base_parser, log, parse_args, smollm2_dir, tiny_model_dir, write_result

MODULE = "bench.structured_cost"
# A schema that keeps every row generating for the whole measurement (an open list of records).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"people": {"type": "array", "minItems": 1, "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]}, "active": {"type": "boolean"}},
        "required": ["name", "age", "city", "active"], "additionalProperties": False}}},
    "required": ["people"],
    "additionalProperties": False,
}
# A JSON document of the schema, for the library comparison (tokens fed one by one).
DOCUMENT = {"people": [{"name": "Ada Lovelace", "age": 36, "city": "Paris", "active": True},
                       {"name": "Alan Turing", "age": 41, "city": "Oslo", "active": False}]}


def library_costs(model_dir: Path) -> dict[str, Any]:
    """Per-token mask time (microseconds) and one-off costs of each installed library on `model_dir`'s
    vocabulary: the mask before each token of DOCUMENT, then the token consumed."""
    import numpy as np
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    vocab = len(tok)
    ids = tok.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False)
    out: dict[str, Any] = {"vocab": vocab, "tokens": len(ids)}
    words = (vocab + 31) // 32
    try:
        import llguidance
        import llguidance.hf

        started = time.perf_counter()
        fast: Any = tok  # a fast (Rust) tokenizer, which llguidance reads
        lltok = llguidance.hf.from_tokenizer(fast, n_vocab=vocab)
        tokenizer_s = time.perf_counter() - started
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - started
        bits = np.zeros(words, dtype=np.int32)
        mask_s = 0.0
        for t in ids:
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(bits.ctypes.data, words * 4)
            mask_s += time.perf_counter() - started
            assert matcher.consume_token(t), matcher.get_error()
        out["llguidance"] = {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_us": 1e6 * mask_s / len(ids)}
    except ImportError:
        pass
    try:
        import torch
        import xgrammar

        started = time.perf_counter()
        info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        tokenizer_s = time.perf_counter() - started
        started = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
        compile_s = time.perf_counter() - started
        xmatcher = xgrammar.GrammarMatcher(compiled)
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        mask_s = 0.0
        for t in ids:
            started = time.perf_counter()
            xmatcher.fill_next_token_bitmask(bitmask, 0)
            mask_s += time.perf_counter() - started
            assert xmatcher.accept_token(t)
        out["xgrammar"] = {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_us": 1e6 * mask_s / len(ids)}
        del torch
    except ImportError:
        pass
    try:
        import outlines_core
        import torch
        from outlines_core.json_schema import build_regex_from_schema

        started = time.perf_counter()
        # outlines-core reads a hub model's vocabulary itself; offline it is given the token strings.
        mapping: dict[str, list[int]] = {}
        for i in range(vocab):
            if i != tok.eos_token_id:
                text = tok.convert_tokens_to_string([str(tok.convert_ids_to_tokens(i))])
                if text:
                    mapping.setdefault(text, []).append(i)
        ovocab = outlines_core.Vocabulary(tok.eos_token_id, mapping)
        tokenizer_s = time.perf_counter() - started
        started = time.perf_counter()
        index = outlines_core.Index(build_regex_from_schema(json.dumps(SCHEMA)), ovocab)
        compile_s = time.perf_counter() - started
        guide = outlines_core.Guide(index)
        mask = torch.zeros(words, dtype=torch.int32)
        mask_s = 0.0
        for t in ids:
            started = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            mask_s += time.perf_counter() - started
            guide.advance(t, return_tokens=False)
        out["outlines-core"] = {"tokenizer_s": tokenizer_s, "compile_s": compile_s, "mask_us": 1e6 * mask_s / len(ids)}
    except ImportError:
        pass
    return out


def decode_rates(model_dir: Path, batch: int, steps: int, rounds: int) -> dict[str, Any]:
    """Per decode step CPU and wall milliseconds at `batch` rows, constrained against not."""
    from inference.engine import LLMEngine, SamplingParams

    engine = LLMEngine(str(model_dir), block_size=16, max_model_len=1024, max_num_seqs=batch)
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "List people as JSON."}])
    configs = {
        "unconstrained": SamplingParams(max_tokens=steps + 8, temperature=0.7, ignore_eos=True),
        "json_schema": SamplingParams(max_tokens=steps + 8, temperature=0.7,
                                      grammar={"type": "json_schema", "schema": SCHEMA}),
    }
    cpu: dict[str, list[float]] = {k: [] for k in configs}
    wall: dict[str, list[float]] = {k: [] for k in configs}
    for r in range(rounds):
        for name, params in configs.items():
            for i in range(batch):
                engine.add_request(f"{name}-{r}-{i}", prompt, params)
            for _ in range(batch + 8):  # the prefill (in chunks): bounded; a row may finish meanwhile
                if engine.num_running >= batch:
                    break
                engine.step()
            for _ in range(steps):
                started_cpu, started = time.process_time(), time.perf_counter()
                engine.step()
                if engine.num_running < batch:  # a row finished: the step is not at full batch
                    break
                cpu[name].append((time.process_time() - started_cpu) * 1000)
                wall[name].append((time.perf_counter() - started) * 1000)
            for i in range(batch):
                engine.abort(f"{name}-{r}-{i}")
            for _ in range(4):  # deliver the aborts
                if not engine.has_work():
                    break
                engine.step()
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    med_wall = {k: statistics.median(v) for k, v in wall.items()}
    tok_s = {k: batch * 1000 / v for k, v in med_cpu.items()}
    return {"batch": batch, "step_cpu_ms": med_cpu, "step_wall_ms": med_wall, "tokens_per_cpu_s": tok_s,
            "ratio": tok_s["json_schema"] / tok_s["unconstrained"],
            "steps_measured": {k: len(v) for k, v in cpu.items()}}


def main(argv: list[str] | None = None) -> int:
    """Measure; print and write the figures."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=24, help="timed decode steps per configuration per round")
    p.add_argument("--rounds", type=int, default=4)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    import torch

    torch.set_num_threads(args.threads)
    tiny = tiny_model_dir()
    big = None if args.quick else smollm2_dir()
    model = big or tiny
    libraries = {"tiny": library_costs(tiny)}
    if big is not None:
        libraries["smollm2"] = library_costs(big)
    for name, costs in libraries.items():
        for lib, c in costs.items():
            if isinstance(c, dict):
                log(f"{name} (vocab {costs['vocab']}): {lib} mask {c['mask_us']:.1f} us/token, "
                    f"compile {c['compile_s'] * 1000:.1f} ms, tokenizer {c['tokenizer_s'] * 1000:.0f} ms")
    batch, steps, rounds = (4, 3, 1) if args.quick else (args.batch, args.steps, args.rounds)
    decode = decode_rates(model, batch, steps, rounds)
    log(f"decode at batch {batch} ({model.name}): unconstrained {decode['tokens_per_cpu_s']['unconstrained']:.0f} "
        f"tok/CPU-s, json_schema {decode['tokens_per_cpu_s']['json_schema']:.0f}: ratio {decode['ratio']:.3f}")
    result = {"clock": "process CPU time", "model": model.name, "threads": args.threads, "decode": decode,
              "libraries": libraries}
    name = "structured_cost" + ("_quick" if args.quick else "")
    print(f"result: {write_result(args.out_dir, name, MODULE, argv, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
