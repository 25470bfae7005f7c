"""Compile the Triton kernels for sm_90 without a GPU (Triton's bundled ptxas only): catches what the interpreter
lets through (type changes across branches, unsupported ops, fp8 conversions). Run in a process without
TRITON_INTERPRET (tests/test_triton_features.py does); prints one line per kernel variant, exits 1 on a failure."""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from attnsel.backends.triton import kernels as K
from attnsel.backends.triton import tile_d

T = GPUTarget("cuda", 90, 32)

def compile_(fn, sig, consts, aligned=False, num_warps=8, num_stages=3):
    """aligned: pointers and strides divisible by 16, as Triton specialises a real launch on a cache whose strides
    are multiples of 16 (without it the loads are not vectorised at all)."""
    params = fn.arg_names
    signature = {}
    for p in params:
        signature[p] = "constexpr" if p in consts else sig.get(p, "i32")
    attrs = None
    if aligned:
        attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params
                 if p not in consts and (sig.get(p, "i32").startswith("*") or p.startswith("stride"))}
    src = ASTSource(fn=fn, signature=signature, constexprs={(params.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=T, options={"num_warps": num_warps, "num_stages": num_stages})

def prefill(dtype, **flags):
    sig = {"Q": f"*{dtype}", "K": f"*{dtype}", "V": f"*{dtype}", "O": f"*{dtype}", "cu_q": "*i32", "cu_k": "*i32",
           "SINKS": "*fp32", "scale_in": "fp32"}
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=128, CAUSAL=True, WINDOW=0,
                  SOFTCAP=0.0, HAS_SINKS=False, LONG=False, UPCAST=False)
    consts.update(flags)
    return compile_(K.prefill_kernel, sig, consts)

def decode(dtype, kvdtype, aligned=False, num_warps=8, num_stages=3, **flags):
    sig = {"Q": f"*{dtype}", "K": f"*{kvdtype}", "V": f"*{kvdtype}", "PT": "*i32", "LENS": "*i32", "O": f"*{dtype}",
           "O_part": "*fp32", "LSE_part": "*fp32", "ARRIVED": "*i32", "SINKS": "*fp32", "K_SCALE": "*fp32",
           "V_SCALE": "*fp32", "scale_in": "fp32"}
    consts = dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, PAGE_SIZE=16, BLOCK_N=64, SPLIT=True, BLOCK_B=64,
                  BLOCK_S=64, MERGE=True, WINDOW=0, SOFTCAP=0.0, HAS_SINKS=False, FP8=False, UPCAST=False)
    consts.update(flags)
    return compile_(K.decode_kernel, sig, consts, aligned, num_warps, num_stages)


def fp8_operands_in_words():
    """The fp8 decode with the plan's tiles moves its K/V operands in wide words: H200 2026-12-04 (round 9), V's
    fp8 bytes read one at a time from shared memory (128 ld.shared.b8 per thread and tile, Triton's layout change
    of an 8-bit operand) held Triton's fp8 decode 6% below FA3's."""
    from attnsel.backends.triton import decode_config
    cfg = decode_config(128)
    ptx = decode("bf16", "fp8e4nv", aligned=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                 BLOCK_N=cfg.block_n, FP8=True).asm["ptx"]
    for op in ("ld.shared.b8", "st.shared.b8", "ld.global.b8"):
        if op in ptx:
            raise AssertionError(f"{ptx.count(op)} {op} in the fp8 decode kernel: bytes moved one at a time")

def merge_is_ordered():
    """The in-kernel merge of a split decode, in the sm_90 PTX: the arrival count is an acquire-release atomic at GPU
    scope; between the program's last store (its partial) and that atomic a barrier (every thread's stores come
    first; Triton places one before a scalar atomic itself, the kernel's tl.debug_barrier() does not rely on it);
    every global load between it and the count's reset reads past L1 (.cg: L1 is not coherent across SMs,
    a line cached earlier in the launch would be stale)."""
    lines = [line.strip() for line in decode("bf16", "bf16", aligned=True, num_warps=4, num_stages=4).asm["ptx"]
             .splitlines()]
    arrive = [i for i, line in enumerate(lines) if "atom.global.gpu.acq_rel.add" in line]
    reset = [i for i, line in enumerate(lines) if ".global.gpu.relaxed.add" in line]  # atom. or red.
    if len(arrive) != 1 or len(reset) != 1 or reset[0] < arrive[0]:
        raise AssertionError(f"expected one acq_rel arrival and one relaxed reset after it, got lines {arrive} "
                             f"and {reset}")
    last_store = max(i for i in range(arrive[0]) if "st.global" in lines[i])
    if not any("bar.sync" in line for line in lines[last_store:arrive[0]]):
        raise AssertionError("no barrier between the partial's last store and the arrival count")
    loads = [line for line in lines[arrive[0]:reset[0]] if "ld.global" in line]
    cached = [line for line in loads if ".cg" not in line]
    if not loads or cached:
        raise AssertionError(f"the merge's loads must bypass L1 (.cg); {len(cached)} of {len(loads)} do not: "
                             f"{cached[:3]}")


def merge_does_not_spill():
    """The largest merge tiles a plan makes (MERGE_TILE_MAX: head_dim 128 with 64 splits, 256 with 32) compile
    without a stack (head_dim 256 with 64 splits spilled: 255 registers and 112-152 bytes of stack). Needs the
    cuobjdump that Triton bundles; skipped (OK) without it."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from attnsel.backends.triton import MERGE_TILE_MAX, decode_config
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return
    for d in (128, 256):
        cfg, splits = decode_config(d), MERGE_TILE_MAX // d
        for group in (4, 8, 16):
            kernel = decode("bf16", "bf16", aligned=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            HEAD_DIM=d, BLOCK_D=d, BLOCK_N=cfg.block_n, GROUP=group, BLOCK_S=splits)
            with tempfile.TemporaryDirectory() as tmp:
                cubin = Path(tmp) / "k.cubin"
                cubin.write_bytes(kernel.asm["cubin"])
                usage = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True,
                                       text=True, check=True).stdout
            found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
            if found is None or found.group(2) != "0":
                raise AssertionError(f"head_dim {d}, group {group}, {splits} splits: {usage.strip()[-200:]}")


def reduce_(**flags):
    sig = {"O": "*bf16", "O_part": "*fp32", "LSE_part": "*fp32", "SINKS": "*fp32"}
    consts = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=8, HAS_SINKS=False)
    consts.update(flags)
    return compile_(K.decode_reduce_kernel, sig, consts)

failed = 0
for name, thunk in [
    ("prefill plain", lambda: prefill("bf16")),
    ("prefill all", lambda: prefill("bf16", WINDOW=4096, SOFTCAP=30.0 * 1.4426950408889634, HAS_SINKS=True)),
    ("prefill noncausal long", lambda: prefill("fp16", CAUSAL=False, LONG=True)),
    ("decode split", lambda: decode("bf16", "bf16")),
    ("decode split reduce kernel", lambda: decode("bf16", "bf16", MERGE=False)),
    ("decode merge ordered", merge_is_ordered),
    ("decode merge does not spill", merge_does_not_spill),
    ("decode split merge sinks group 8", lambda: decode("bf16", "bf16", GROUP=8, HAS_SINKS=True, BLOCK_S=2)),
    ("decode nosplit all fp8", lambda: decode("bf16", "fp8e4nv", SPLIT=False, WINDOW=4096, SOFTCAP=43.3,
                                              HAS_SINKS=True, FP8=True)),
    ("decode split all fp8", lambda: decode("fp16", "fp8e4nv", WINDOW=128, SOFTCAP=43.3, HAS_SINKS=True, FP8=True)),
    ("decode fp8 operands in words", fp8_operands_in_words),
    ("prefill head_dim 8", lambda: prefill("bf16", HEAD_DIM=8, BLOCK_D=tile_d(8))),
    ("decode head_dim 8", lambda: decode("bf16", "bf16", HEAD_DIM=8, BLOCK_D=tile_d(8))),
    ("reduce sinks", lambda: reduce_(HAS_SINKS=True)),
    ("reduce", lambda: reduce_()),
]:
    try:
        thunk()
        print("OK  ", name)
    except Exception as exc:
        failed += 1
        print("FAIL", name, type(exc).__name__, str(exc)[:1500])
sys.exit(1 if failed else 0)
