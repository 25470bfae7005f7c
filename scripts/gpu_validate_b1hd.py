"""Selection's validation of the decode backends that take FlashAttention's q layout (FA3, fa3_packgqa, Triton):
each is now also run with q [B, 1, H, D] and must give the same out as with [B, H, D] (validate.cases._b1hd_error).
Priority policy (no timing), no result cache, eager and graph mode, over the plain spec and the feature specs.

Usage (device): python3 scripts/gpu_validate_b1hd.py OUT.json
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from attnsel import AttentionSpec, select  # noqa: E402

SPECS = {
    "plain": AttentionSpec(32, 8, 128, "bf16", 16),
    "window256": AttentionSpec(32, 8, 128, "bf16", 16, sliding_window=256),
    "sinks": AttentionSpec(32, 8, 128, "bf16", 16, sinks=True),
    "fp8kv": AttentionSpec(32, 8, 128, "bf16", 16, kv_dtype="fp8_e4m3"),
    "gptoss-like": AttentionSpec(64, 8, 64, "bf16", 16, sliding_window=128, sinks=True),
    "gemma3-like": AttentionSpec(4, 1, 256, "bf16", 16, sliding_window=512),
}
rows = []
for mode in ("eager", "graph"):
    for key, spec in SPECS.items():
        t0 = time.perf_counter()
        sel = select(spec, policy="priority", mode=mode, prefill_priority=["fa3", "torch"],
                     decode_priority=["fa3", "fa3_packgqa", "triton", "torch"], use_cache=False)
        cands = sel.to_json()["decode"]["candidates"]
        row = {"mode": mode, "spec": key, "decode": sel.decode, "wall_s": round(time.perf_counter() - t0, 1),
               "candidates": [{k: c.get(k) for k in ("name", "status", "reason", "max_abs_err")} for c in cands]}
        print(json.dumps(row), flush=True)
        rows.append(row)
bad = [(r["mode"], r["spec"], c["name"], c["reason"]) for r in rows for c in r["candidates"]
       if c["name"] != "torch" and c["status"] not in ("valid", "selected", "unavailable")]
Path(sys.argv[1]).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                         "command": " ".join(sys.argv), "rows": rows, "rejected": bad}, indent=2))
print(f"rejected FA3/Triton decode candidates: {bad or 'none'}")
sys.exit(1 if bad else 0)
