"""KV transfer: TCP loopback bandwidth against memcpy, and the transfer's share of TTFT.

1. Bandwidth: a `TcpKVSender` in a child process (as a prefill worker would be) writes 1 MiB ..
   256 MiB of KV blocks into a `TcpKVReceiver`'s tensor in this process; the baseline is
   `torch.Tensor.copy_` of the same bytes between two tensors of this process (the best any
   transport on one host could do).
2. Share of TTFT: real prefill and decode workers (pinned to CPU 0 and CPU 1, one thread each)
   behind the real router; prompts of 128/512/1k/2k tokens with ``max_tokens=1``; the router's
   ``timings`` give TTFT, prefill time and KV transfer time of every request.

    .venv/bin/python -m bench.kv_transfer            # SmolLM2 for the TTFT part, about 2 minutes
    .venv/bin/python -m bench.kv_transfer --quick    # tiny sizes and the tiny model, seconds
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from bench.common import (
    LOOPBACK,
    Deadline,
    add_attach_args,
    base_parser,
    fmt,
    log,
    markdown_table,
    median,
    new_figure,
    note_shared_machine,
    parse_args,
    platform_processes,
    print_header,
    ratio,
    save_figure,
    smollm2_dir,
    synthetic_prompts,
    tiny_model_dir,
    write_result,
)

MODULE = "bench.kv_transfer"
MIB = 2**20
# 128 KiB blocks: 1 layer x K/V x 16 tokens x 8 heads x 128 dims x fp32 (any size divides MiB sizes).
BENCH_LAYOUT = {"num_layers": 1, "block_size": 16, "num_kv_heads": 8, "head_dim": 128, "dtype": "float32"}
FILL_VALUE = 1.5


def _kv_tensor(layout: Any, num_blocks: int, fill: float) -> Any:
    import torch

    shape = (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return torch.full(shape, fill, dtype=torch.float32)


def _sender_main(conn: Connection, layout_dict: dict[str, Any], num_blocks: int) -> None:
    """Child process: hold a KV tensor and send blocks for each descriptor received on `conn`."""
    from inference.kv_transfer.base import KVLayout, TransferDescriptor
    from inference.kv_transfer.tcp import TcpKVSender

    layout = KVLayout.from_dict(layout_dict)
    sender = TcpKVSender(_kv_tensor(layout, num_blocks, FILL_VALUE), layout)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        descriptor = TransferDescriptor.from_dict(msg)
        stats = sender.send(descriptor, descriptor.block_ids, first_token=0, timeout=60.0)
        conn.send((stats.nbytes, stats.seconds))


def bandwidth(sizes_mib: list[int], reps: int, deadline: Deadline) -> list[dict[str, Any]]:
    """Median TCP-loopback and memcpy times for each size (MiB); GiB/s and their ratio."""
    import torch

    from inference.kv_transfer.base import KVLayout
    from inference.kv_transfer.tcp import TcpKVReceiver

    layout = KVLayout.from_dict(BENCH_LAYOUT)
    max_blocks = max(sizes_mib) * MIB // layout.block_nbytes
    dst = _kv_tensor(layout, max_blocks, 0.0)
    src = _kv_tensor(layout, max_blocks, FILL_VALUE)
    receiver = TcpKVReceiver(dst, layout, lambda rid, tok, stats: None, bind_host=LOOPBACK, port=0)
    receiver.start()
    ctx = mp.get_context("spawn")  # no fork of a process that already runs torch's thread pool
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender_main, args=(child, BENCH_LAYOUT, max_blocks), daemon=True)
    proc.start()
    rows: list[dict[str, Any]] = []
    try:
        for size in sizes_mib:
            if deadline.expired():
                log(f"time budget spent, skipping {size} MiB and larger")
                break
            n = size * MIB // layout.block_nbytes
            tcp_s: list[float] = []
            for rep in range(reps + 1):  # the first one warms up the connection path
                dst[:n].zero_()
                descriptor = receiver.expect(f"bw-{size}-{rep}", list(range(n)), n * layout.block_size, 60.0,
                                             LOOPBACK)
                parent.send(descriptor.to_dict())
                if not parent.poll(120):
                    raise RuntimeError("sender child did not answer within 120 s")
                nbytes, _sender_s = parent.recv()
                # The sender's clock covers connect, header, bytes and the receiver's ack.
                if rep:
                    tcp_s.append(_sender_s)
                if nbytes != n * layout.block_nbytes or not bool(dst[n - 1].eq(FILL_VALUE).all()):
                    raise RuntimeError(f"transfer of {size} MiB arrived incomplete")
            copy_s: list[float] = []
            for _ in range(reps + 1):
                t = time.perf_counter()
                dst[:n].copy_(src[:n])
                copy_s.append(time.perf_counter() - t)
            copy_s = copy_s[1:]
            t_tcp, t_copy = median(tcp_s), median(copy_s)
            assert t_tcp is not None and t_copy is not None
            row = {
                "size_mib": size, "reps": reps, "tcp_s": t_tcp, "memcpy_s": t_copy,
                "tcp_gib_s": size / 1024 / t_tcp, "memcpy_gib_s": size / 1024 / t_copy,
                "memcpy_over_tcp": ratio(t_tcp, t_copy), "torch_threads": torch.get_num_threads(),
            }
            rows.append(row)
            log(f"{size} MiB: tcp {row['tcp_gib_s']:.2f} GiB/s, memcpy {row['memcpy_gib_s']:.2f} GiB/s")
    finally:
        parent.send(None)
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        receiver.stop()
    return rows


def ttft_share(
    model_dir: Path, lengths: list[int], reps: int, log_dir: Path, deadline: Deadline, attach: Any = None
) -> dict[str, Any]:
    """TTFT, prefill and KV transfer time (router timings) per prompt length on real processes."""
    import httpx

    from inference.engine.config import ModelConfig

    cfg = ModelConfig.from_pretrained(str(model_dir))
    common = ["--context-length", str(max(4096, max(lengths) + 64)), "--num-threads", "1", "--kv-lease-timeout", "180"]
    rows: list[dict[str, Any]] = []
    with platform_processes(model_dir, log_dir, prefill_extra=[*common, "--base-cpu-id", "0"],
                            decode_extra=[*common, "--base-cpu-id", "1"], attach=attach) as plat, \
            httpx.Client(timeout=300, trust_env=False) as client:
        for length in lengths:
            if deadline.expired():
                log(f"time budget spent, skipping prompts of {length} tokens")
                break
            samples = []
            for rep in range(reps + 1):  # first: warm-up at this length
                ids = synthetic_prompts(1, length, cfg.vocab_size, seed=length * 100 + rep)[0]
                r = client.post(plat.router_url + "/generate",
                                json={"input_ids": ids, "max_tokens": 1, "temperature": 0})
                r.raise_for_status()
                body = r.json()
                if rep:
                    samples.append(body["timings"] | {"kv_bytes": body.get("kv_bytes")})
            ttft = median([s["ttft_s"] for s in samples])
            pre = median([s["prefill_s"] for s in samples])
            kv = median([s["kv_transfer_s"] for s in samples])
            kv_bytes = samples[0]["kv_bytes"]
            rows.append({
                "prompt_tokens": length, "reps": reps, "ttft_ms": _ms(ttft), "prefill_ms": _ms(pre),
                "kv_transfer_ms": _ms(kv), "kv_bytes": kv_bytes, "transfer_share_of_ttft": ratio(kv, ttft),
                "transfer_over_prefill": ratio(kv, pre),
                "in_situ_gib_s": (kv_bytes / 2**30 / kv) if kv_bytes and kv else None,
            })
            log(f"{length} tokens: TTFT {rows[-1]['ttft_ms']:.1f} ms, transfer {rows[-1]['kv_transfer_ms']:.2f} ms")
    return {"model": model_dir.name, "rows": rows}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _tables(result: dict[str, Any]) -> str:
    bw = markdown_table(
        ["size MiB", "TCP loopback GiB/s", "memcpy GiB/s", "memcpy / TCP (× faster)", "TCP ms", "memcpy ms"],
        [[r["size_mib"], fmt(r["tcp_gib_s"]), fmt(r["memcpy_gib_s"]), fmt(r["memcpy_over_tcp"], 1),
          fmt(r["tcp_s"] * 1000, 1), fmt(r["memcpy_s"] * 1000, 2)] for r in result["bandwidth"]],
    )
    share = result["ttft"]
    tt = markdown_table(
        ["prompt tokens", "KV MiB", "TTFT ms", "prefill ms", "KV transfer ms", "transfer / TTFT", "in-situ GiB/s"],
        [[r["prompt_tokens"], fmt((r["kv_bytes"] or 0) / MIB, 1), fmt(r["ttft_ms"], 1), fmt(r["prefill_ms"], 1),
          fmt(r["kv_transfer_ms"], 2), f"{100 * r['transfer_share_of_ttft']:.1f} %"
          if r["transfer_share_of_ttft"] is not None else "-", fmt(r["in_situ_gib_s"])] for r in share["rows"]],
    )
    return f"{bw}\n\nTTFT share ({share['model']}):\n\n{tt}"


def _plot(result: dict[str, Any], img_dir: Path, name: str) -> Path:
    fig, (ax_bw, ax_share) = new_figure(12, 4.5, ncols=2)
    bw = result["bandwidth"]
    sizes = [r["size_mib"] for r in bw]
    ax_bw.plot(sizes, [r["tcp_gib_s"] for r in bw], marker="o", label="TCP loopback (TcpKVSender→Receiver)")
    ax_bw.plot(sizes, [r["memcpy_gib_s"] for r in bw], marker="s", label="memcpy (torch copy_)")
    ax_bw.set(xscale="log", yscale="log", xlabel="transfer size (MiB)", ylabel="GiB/s", title="KV bandwidth")
    rows = result["ttft"]["rows"]
    xs = list(range(len(rows)))
    # Side by side on a log scale: the transfer is two orders of magnitude below the prefill.
    ax_share.bar([x - 0.2 for x in xs], [r["prefill_ms"] or 0 for r in rows], width=0.4, label="prefill")
    ax_share.bar([x + 0.2 for x in xs], [r["kv_transfer_ms"] or 0 for r in rows], width=0.4, label="KV transfer")
    for x, r in zip(xs, rows, strict=True):
        if r["transfer_share_of_ttft"] is not None:
            ax_share.annotate(f"{100 * r['transfer_share_of_ttft']:.1f}% of TTFT", (x + 0.2, r["kv_transfer_ms"] or 1),
                              textcoords="offset points", xytext=(0, 4), ha="center", fontsize=7)
    ax_share.set_xticks(xs, [str(r["prompt_tokens"]) for r in rows])
    ax_share.set(yscale="log", xlabel="prompt tokens", ylabel="ms (median)",
                 title=f"prefill vs KV transfer ({result['ttft']['model']})")
    for ax in (ax_bw, ax_share):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, img_dir, name)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the tables, write JSON and the plot."""
    p = base_parser(__doc__.splitlines()[0])
    add_attach_args(p)
    p.add_argument("--budget-s", type=float, default=600.0, help="total time budget (later steps are skipped)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(p, argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    deadline = Deadline(args.budget_s)
    import torch

    torch.set_num_threads(args.threads)  # memcpy baseline: copy_ of large tensors is multi-threaded
    if args.quick:
        sizes, reps, lengths, share_reps = [1, 4], 2, [32, 64], 1
        model = args.model_dir or tiny_model_dir()
    else:
        sizes, reps, lengths, share_reps = [1, 4, 16, 64, 256], 5, [128, 512, 1024, 2048], 3
        model = args.model_dir or smollm2_dir() or tiny_model_dir()
    result: dict[str, Any] = {"note": note_shared_machine(), "layout": BENCH_LAYOUT}
    result["bandwidth"] = bandwidth(sizes, reps, deadline)
    result["ttft"] = ttft_share(model, lengths, share_reps, args.log_dir, deadline, attach=args)
    name = "kv_transfer_quick" if args.quick else "kv_transfer"
    print_header("KV transfer")
    print(_tables(result))
    plot = _plot(result, args.img_dir, name)
    path = write_result(args.out_dir, name, MODULE, argv, result | {"plot": str(plot)})
    print(f"\nresult: {path}\nplot: {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
