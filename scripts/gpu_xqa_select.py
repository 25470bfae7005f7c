"""The product's own validation on FlashInfer's XQA decode: select() with flashinfer_xqa named for decode, on a bf16
and an fp8 e4m3 cache (32/8 heads, d128, page 16). Prints each outcome: the selection, or the SelectionError's
reason (what a user sees).

Usage (device): python3 scripts/gpu_xqa_select.py
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnsel import select  # noqa: E402
from attnsel.selection import SelectionError  # noqa: E402
from attnsel.spec import AttentionSpec  # noqa: E402

for kv in (None, "fp8_e4m3"):
    spec = AttentionSpec(32, 8, 128, "bf16", 16, kv_dtype=kv)
    try:
        sel = select(spec, prefill="triton", decode="flashinfer_xqa", cache_dir=tempfile.mkdtemp())
        print(f"{spec.describe()}: decode {sel.decode} (selected)", flush=True)
    except SelectionError as exc:
        print(f"{spec.describe()}: refused: {exc}", flush=True)
