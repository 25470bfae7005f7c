"""Which garbage breaks FlashInfer's XQA decode on an fp8 cache (issue 11: the GPU feature test got inf)?

Usage (device): python3 scripts/gpu_xqa_garbage.py OUT.json
Variants of tests/feature_cases.decode_case on 32/8 heads, d128, page 16, fp8 e4m3 (and bf16 for comparison): NaN
in unused slots and pages or zeros there, -1 / valid-NaN-page sentinels in unused page-table columns, zero-length
rows or none. Per variant: which rows are not finite, the largest error of the finite rows against the reference.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from attnsel.backends import get  # noqa: E402
from attnsel.spec import AttentionSpec  # noqa: E402
from tests.feature_cases import decode_case  # noqa: E402

WITH_ZEROS = [0, 1, 17, 1531, 45, 300, 0]
NO_ZEROS = [5, 1, 17, 1531, 45, 300, 9]
FULL_PAGES = [16, 32, 1536, 48, 304, 16, 160]


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for kv in ("fp8_e4m3", None):
        spec = AttentionSpec(32, 8, 128, "bf16", 16, kv_dtype=kv)
        for lens_name, lens in (("zeros", WITH_ZEROS), ("no_zeros", NO_ZEROS), ("full_pages", FULL_PAGES)):
            for sentinel in (-1, "nan_page"):
                for garbage in ("nan", "zero"):
                    case = decode_case(spec, dev, lens, sentinel)
                    q, k_cache, v_cache = case.inputs
                    if garbage == "zero":  # every slot that is not a token of some row: 0 instead of NaN
                        for c in (k_cache, v_cache):
                            c.view(torch.uint8 if c.element_size() == 1 else torch.int16)[torch.isnan(c.float())] = 0
                    run = get("flashinfer_xqa").plan_decode(spec, *case.plan_args)
                    out = run(*case.inputs, **case.kwargs).float()
                    torch.cuda.synchronize()
                    bad = [i for i in range(out.shape[0]) if not torch.isfinite(out[i]).all()]
                    good = [i for i in range(out.shape[0]) if i not in bad]
                    err = (out[good] - case.ref[good]).abs().max().item() if good else None
                    row = {"kv": kv or "bf16", "lens": lens_name, "sentinel": str(sentinel), "garbage": garbage,
                           "nonfinite_rows": bad, "lens_of_bad": [lens[i] for i in bad], "finite_err": err,
                           "tolerance": case.tolerance(spec)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
