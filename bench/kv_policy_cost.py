"""Router CPU per request of the kv-aware choice against round-robin's, in process (thread CPU time).

Per request the kv-aware policy hashes the prompt's blocks (once per block size) and looks each
candidate's longest held prefix up in the index; round-robin only moves a cursor. Measured for a
1,000-token prompt (block size 16, the workers' default) over 2 and 4 candidates that hold half of
it, one choice for prefill and one for decode per request, alternating the variants in rounds.

With the workers' tokenizer (SmolLM2's when prepared, else the tiny model's) two more variants: the
router tokenizes the prompt before the choices (inference/router/prompt_tokens.py): a fresh 1,000-token
text prompt per request encoded whole (`kv-aware+text`, as before issue 19's third session: no cache
can help) and encoded in chunks only as far as a decode worker holds its blocks (`kv-aware+text-prefix`,
text_prefix.py: one chunk, then the prefill choice hashes the decode worker's ids), the same with the
first half of the text held by every worker (`kv-aware+text-half`: a shared document, a new question),
and a chat turn (`kv-aware+chat`: a conversation's history of about 1,000 tokens whose earlier
messages were seen before, plus a new user message). `worker text encode` is the engine's own
`Tokenizer.encode` of the same text prompts (what the worker spends when the router sends text).

    .venv/bin/python -m bench.kv_policy_cost

Without a prepared SmolLM2 (`make demo-model`) the tokenizer is the tiny model's (512 ids: about 2
characters a token against SmolLM2's 5, so its texts are shorter and cost less).
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

from bench.common import (
    base_parser,
    log,
    median,
    parse_args,
    print_header,
    smollm2_dir,
    tiny_model_dir,
    write_result,
)

MODULE = "bench.kv_policy_cost"
VARIANTS = ("round-robin", "kv-aware", "kv-aware+text", "kv-aware+text-prefix", "kv-aware+text-half", "kv-aware+chat")


WORDS = ("the of and to in is was for on that with as by at from his her an it which are be this or have had not "
         "but they were one their all has been more also who its after first new two would other when into time "
         "can only some may most over about up out so these could than then made used them world many such").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))



class Prompts:
    """The requests' prompts for the tokenizing variants: distinct text prompts of about `tokens` tokens,
    and chat turns of one conversation-shaped history with a new last user message each."""

    def __init__(self, model: Path, tokens: int, requests: int) -> None:
        from inference.engine.tokenizer import Tokenizer
        from inference.router.prompt_tokens import PromptTokenizer
        from inference.server.tokenizer_spec import tokenizer_spec

        self.worker = Tokenizer.from_pretrained(str(model))
        spec = tokenizer_spec(model.name, self.worker)
        assert spec is not None
        self.router = PromptTokenizer(spec)
        rng = random.Random(2)
        words = tokens
        while len(self.worker.encode(_text(random.Random(0), words))) > tokens:
            words -= tokens // 50
        self.texts = [f"{i} {_text(rng, words)}" for i in range(requests)]
        history: list[dict[str, str]] = [{"role": "system", "content": _text(rng, 250)}]
        while len(self.worker.apply_chat_template(history)) < tokens - 64:
            history += [{"role": "user", "content": _text(rng, 60)}, {"role": "assistant", "content": _text(rng, 40)}]
        self.chats = [[*history, {"role": "user", "content": f"{i} {_text(rng, 50)}"}] for i in range(requests)]
        self.text_tokens = len(self.worker.encode(self.texts[0]))
        self.calls = 0
        self.chat_tokens = len(self.worker.apply_chat_template(self.chats[0]))


def _worker_encode_us(prompts: Prompts, requests: int) -> float:
    started = time.thread_time()
    for text in prompts.texts[:requests]:
        prompts.worker.encode(text)
    return (time.thread_time() - started) / requests * 1e6


def _per_request_us(variant: str, candidates: int, prompt_tokens: int, requests: int,
                    prompts: Prompts | None = None, loaded: bool = False) -> float:
    """Thread CPU microseconds per request: one decode and one prefill choice, as the router makes them
    (after tokenizing the prompt, for the `+text` and `+chat` variants)."""
    from inference.router.endpoint import Endpoint
    from inference.router.events import GenerateRequest
    from inference.router.kv_index import CURRENT_PROMPT, KVIndex, PromptBlocks
    from inference.router.policies import KVAware, make_policy
    from inference.wire.kv_events import KVSnapshot, block_hashes
    from inference.wire.sampling import Sampling

    policy_name, _, tokenize = variant.partition("+")
    rng = random.Random(1)
    prompt = [rng.randrange(3, 49000) for _ in range(prompt_tokens)]
    requests_in: list[GenerateRequest] = []
    worker_ids: list[list[int]] = []
    if tokenize:
        assert prompts is not None
        sampling = Sampling.from_json({})
        prompts.calls += 1  # a text never seen before, in every call: the router's text cache never hits
        if tokenize == "chat":
            requests_in = [GenerateRequest(sampling=sampling, messages=chat) for chat in prompts.chats[:requests]]
            prompts.router.request_ids(GenerateRequest(sampling=sampling, messages=prompts.chats[-1]))  # history seen
        elif tokenize == "text-half":  # the first half of every text is the same, held by every worker
            half = prompts.texts[0][: prompts.texts[0].index(" ", len(prompts.texts[0]) // 2)]
            requests_in = [GenerateRequest(sampling=sampling, prompt=f"{half} {prompts.calls} {text[len(half):]}")
                           for text in prompts.texts[:requests]]
        else:
            requests_in = [GenerateRequest(sampling=sampling, prompt=f"{prompts.calls} {text}")
                           for text in prompts.texts[:requests]]
        # The decode worker's ids (its descriptor's), computed before the timed loop.
        worker_ids = [prompts.worker.encode(r.prompt) if r.prompt is not None
                      else prompts.worker.apply_chat_template(r.messages or []) for r in requests_in]
        prompt = worker_ids[0]
    index = KVIndex()
    endpoints = {role: [Endpoint(f"http://10.0.{i // 256}.{i % 256}:800{n}", role) for i in range(candidates)]
                 for n, role in enumerate(("prefill", "decode"))}
    held = block_hashes(prompt[: prompt_tokens // 2], 16)
    every = block_hashes(prompt, 16)
    for role_endpoints in endpoints.values():
        for e in role_endpoints:
            if loaded:  # a fleet in use: each worker holds some prefix of the prompt and has requests in flight
                e.inflight = rng.randrange(0, 41)
                held = every[: rng.randrange(0, len(every) + 1)]
            index.apply_snapshot(e.url, KVSnapshot(role=e.role, block_size=16, epoch="e", seq=0, hashes=held))
    policies = {role: make_policy(policy_name) for role in endpoints}
    for policy in policies.values():
        if isinstance(policy, KVAware):
            policy.configure(index, 1.0, 64.0)
    whole = tokenize in ("text", "chat")
    started = time.thread_time()
    for i in range(requests):
        if not tokenize:
            blocks: PromptBlocks | None = PromptBlocks(list(prompt))
        elif whole:
            # As the router did: every id of the text or chat (the chat's history from the piece cache).
            blocks = PromptBlocks(prompts.router.request_ids(requests_in[i]) or [])  # type: ignore[union-attr]
        else:
            # As pd_client does now: the text's ids only as far as a decode worker holds its blocks.
            watch = index.prefix_watch(endpoints["decode"])
            blocks = prompts.router.request_prompt(requests_in[i], watch)  # type: ignore[union-attr]
        token = CURRENT_PROMPT.set(blocks)
        policies["decode"].choose_where(endpoints["decode"], lambda e: True)
        # As prefill_call does: the descriptor's ids (the decode worker's), reusing the hashes when equal.
        descriptor_ids = list(worker_ids[i] if tokenize else prompt)
        current = CURRENT_PROMPT.get()
        if current is None or current.token_ids != descriptor_ids:
            CURRENT_PROMPT.set(PromptBlocks(descriptor_ids))
        policies["prefill"].choose_where(endpoints["prefill"], lambda e: True)
        CURRENT_PROMPT.reset(token)
    return (time.thread_time() - started) / requests * 1e6


def main(argv: list[str] | None = None) -> int:
    """Alternate the policies in rounds; print and write the medians."""
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--prompt-tokens", type=int, default=1000)
    p.add_argument("--loaded", action="store_true",
                   help="workers with 0-40 requests in flight and random prefixes of the prompt (default: idle, "
                        "each holding its first half: every candidate ties, the most lookups)")
    p.add_argument("--candidates", default="2,4",
                   help="candidates per role, comma separated (default 2,4; issue 25's fleet: 256)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    rounds, requests = (2, 200) if args.quick else (args.rounds, args.requests)
    model = args.model_dir or smollm2_dir() or tiny_model_dir()
    prompts = Prompts(Path(model), args.prompt_tokens, requests)
    log(f"tokenizer of {Path(model).name}: text prompts of {prompts.text_tokens} tokens, "
        f"chat turns of {prompts.chat_tokens} (piecewise: {prompts.router.piecewise})")
    rows: dict[int, dict[str, float | None]] = {}
    for candidates in [int(c) for c in args.candidates.split(",") if c.strip()]:
        samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
        samples["worker text encode"] = []
        for _ in range(rounds):
            for name in VARIANTS:
                samples[name].append(_per_request_us(name, candidates, args.prompt_tokens, requests, prompts,
                                                     args.loaded))
            samples["worker text encode"].append(_worker_encode_us(prompts, requests))
        rows[candidates] = {name: median(values) for name, values in samples.items()}
        log(f"{candidates} candidates per role: {rows[candidates]}")
    print_header(f"router CPU per request, {args.prompt_tokens}-token prompt (prefill + decode choice)")
    for candidates, row in rows.items():
        base = row["round-robin"] or 0.0
        print(f"{candidates} candidates: round-robin {base:.1f} us; "
              + "; ".join(f"{name} {row[name] or 0:.1f} us (+{(row[name] or 0) - base:.1f})" for name in VARIANTS[1:])
              + f"; the worker's own encode of the text {row['worker text encode'] or 0:.1f} us")
    name = "kv_policy_cost" + ("_loaded" if args.loaded else "") + ("_quick" if args.quick else "")
    write_result(args.out_dir, name, MODULE, argv,
                 {"prompt_tokens": args.prompt_tokens, "model": str(model), "text_tokens": prompts.text_tokens,
                  "chat_tokens": prompts.chat_tokens, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
