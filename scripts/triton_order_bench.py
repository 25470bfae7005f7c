"""Triton paged decode launched longest row first (ORDER_ROWS True) against the unordered launch (False) and FA3, on
ragged and uniform batches, CUDA graphs and eager. One GPU, about 2 minutes with Triton's compiles.

Usage: python scripts/triton_order_bench.py [--dry-run] [--only graph|eager]
32 query / 8 KV heads, head_dim 128, bf16, page 16; pages shuffled in the cache. Graph: planned outside capture on
one-token rows (validate/engine_capture.capture_args, as the timing plans a graph), captured, then the real lengths
written in place and the graph replayed (validate/timing.capture and bench). Eager: planned on the real lengths, the
run timed. One line per shape and backend: microseconds per call, the ratio to FA3, the max abs difference of the
output against FA3's (and ordered against unordered: 0 expected). JSON to $OUT/order.json when OUT is set.
"auto": whether decode_ordered's rule (ORDER_ROWS None) would order the batch.
--dry-run: the shapes, their lengths and the rule's choice at 132 SMs only (no GPU).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnsel.spec import AttentionSpec  # noqa: E402
from attnsel.validate.grid import ragged_decode_lens  # noqa: E402

SPEC = AttentionSpec(32, 8, 128, dtype="bf16", page_size=16)


def shapes() -> list[tuple[str, str, list[int]]]:
    """(mode, name, lengths) of every timed batch."""
    out = [("graph", f"ragged {b} x {2048}", ragged_decode_lens(b, 2048)) for b in (128, 256, 512)]
    out += [("graph", f"uniform {b} x {n}", [n] * b) for b, n in ((512, 256), (512, 1024), (64, 4096))]
    out += [("eager", "ragged 87 x 4300", ragged_decode_lens(87, 4300)),
            ("eager", "ragged 512 x 2048", ragged_decode_lens(512, 2048)),
            ("eager", "uniform 512 x 256", [256] * 512)]
    return out


def rule_ordered(rows: int, kv_heads: int, sms: int) -> bool:
    """What decode_ordered's rule (ORDER_ROWS None) chooses for a batch on a GPU of ``sms`` SMs: the module's
    ORDER_ROWS default (False until timed) would answer False for every shape."""
    import attnsel.backends.triton as tb

    saved, tb.ORDER_ROWS = tb.ORDER_ROWS, None
    try:
        return tb.decode_ordered(rows, kv_heads, sms)
    finally:
        tb.ORDER_ROWS = saved


def _inputs(lens: list[int], device, seed: int = 0):
    """q [B, H, D], k/v caches [pages, 16, KVH, D] (pages shuffled), page table, seq_lens int32."""
    gen = torch.Generator(device=device).manual_seed(seed)
    ps = SPEC.page_size
    pages = [-(-n // ps) for n in lens]
    total = sum(pages)
    perm = torch.randperm(total, device=device, generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=device)
    at = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[at:at + p]
        at += p
    shape = (total, ps, SPEC.num_kv_heads, SPEC.head_dim)
    k = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(len(lens), SPEC.num_q_heads, SPEC.head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32, device=device)


def _time(backend, mode: str, q, k, v, table, lens, device):
    """(seconds per call, output, the run) of one backend on one batch."""
    from attnsel.validate.engine_capture import capture_args
    from attnsel.validate.timing import bench, capture

    if mode == "eager":
        run = backend.plan_decode(SPEC, table, lens)
        run(q, k, v)  # compiles
        return bench(lambda: run(q, k, v), device), run(q, k, v), run
    (table_c, dummy), fill = capture_args("decode", (table, lens))
    run = backend.plan_decode(SPEC, table_c, dummy)
    graph, outs = capture(run, [(q, k, v)], device)
    fill()
    seconds = bench(graph.replay, device)
    outs[0].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize(device)
    out = outs[0].clone()
    del graph
    return seconds, out, run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--only", choices=("graph", "eager"))
    args = parser.parse_args()
    todo = [s for s in shapes() if args.only in (None, s[0])]
    if args.dry_run:
        for mode, name, lens in todo:
            auto = "on" if rule_ordered(len(lens), SPEC.num_kv_heads, 132) else "off"
            print(f"{mode:5} {name:20} rows {len(lens)} mean {sum(lens) / len(lens):.0f} longest {max(lens)} "
                  f"auto {auto} at 132 SMs")
        return 0
    import attnsel.backends.triton as tb
    from attnsel.backends import get

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    triton_backend = get("triton")
    fa3 = None
    try:
        candidate = get("fa3")
        why = candidate.unsupported(SPEC, "decode", device)
        fa3 = None if why else candidate
        if why:
            print("fa3 skipped:", why)
    except Exception as exc:  # noqa: BLE001 - a missing plugin is a skip, not a failure
        print("fa3 skipped:", type(exc).__name__, exc)
    print(f"device {torch.cuda.get_device_name(device)}, {sms} SMs; spec 32/8 d128 bf16 page 16")
    rows = []
    for mode, name, lens in todo:
        q, k, v, table, seq_lens = _inputs(lens, device)
        auto = rule_ordered(len(lens), SPEC.num_kv_heads, sms)  # the rule's choice, not the default (off)
        row = {"mode": mode, "shape": name, "rows": len(lens), "mean": sum(lens) / len(lens), "longest": max(lens),
               "auto_ordered": auto}
        outs = {}
        merge, order_rows = tb.MERGE_IN_DECODE_KERNEL, tb.ORDER_ROWS
        variants = [("ordered", True, 1), ("unordered", False, 1)]
        if mode == "graph" and name.startswith("ragged"):  # ORDER_ROOM_SPLITS 2: a long row's second split
            variants.append(("ordered_room2", True, 2))
        for label, ordered, room in variants:
            tb.ORDER_ROWS, tb.ORDER_ROOM_SPLITS = ordered, room
            # graph: a captured run merges in the reduce kernel; no in-kernel merge in the warm-up (one compile less)
            tb.MERGE_IN_DECODE_KERNEL = merge and mode == "eager"
            try:
                seconds, outs[label], run = _time(triton_backend, mode, q, k, v, table, seq_lens, device)
            finally:
                tb.ORDER_ROWS, tb.MERGE_IN_DECODE_KERNEL, tb.ORDER_ROOM_SPLITS = order_rows, merge, 1
            row[f"{label}_us"], row[f"{label}_splits"] = seconds * 1e6, run.splits
            assert run.ordered is ordered
        if fa3 is not None:
            seconds, outs["fa3"], _ = _time(fa3, mode, q, k, v, table, seq_lens, device)
            row["fa3_us"] = seconds * 1e6
            for label, _, _ in variants:
                row[f"{label}_vs_fa3"] = row[f"{label}_us"] / row["fa3_us"]
                row[f"{label}_diff_fa3"] = (outs[label].float() - outs["fa3"].float()).abs().max().item()
        row["ordered_diff_unordered"] = (outs["ordered"].float() - outs["unordered"].float()).abs().max().item()
        rows.append(row)
        fa3_part = (f" fa3 {row['fa3_us']:8.1f} us | ordered/fa3 {row['ordered_vs_fa3']:.3f} unordered/fa3 "
                    f"{row['unordered_vs_fa3']:.3f} | diff vs fa3 {row['ordered_diff_fa3']:.2e} "
                    f"{row['unordered_diff_fa3']:.2e}") if fa3 is not None else ""
        print(f"{mode:5} {name:20} longest {max(lens):6} | ordered {row['ordered_us']:8.1f} us "
              f"(splits {row['ordered_splits']}) unordered {row['unordered_us']:8.1f} us "
              f"(splits {row['unordered_splits']}) auto {'on' if auto else 'off'} |{fa3_part} | ordered vs "
              f"unordered diff {row['ordered_diff_unordered']:.2e}", flush=True)
        if "ordered_room2_us" in row:
            ratio = f" /fa3 {row['ordered_room2_vs_fa3']:.3f} diff vs fa3 {row['ordered_room2_diff_fa3']:.2e}" \
                if fa3 is not None else ""
            print(f"{'':26} ordered, ORDER_ROOM_SPLITS 2: {row['ordered_room2_us']:8.1f} us (splits "
                  f"{row['ordered_room2_splits']}){ratio}", flush=True)
        del q, k, v, table, seq_lens, outs
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "order.json"
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "sms": sms, "rows": rows},
                                   indent=1))
        print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
