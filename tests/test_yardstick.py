"""The validation yardstick (attnsel/validate/yardstick.py): each row of an output is judged against a careful
low-precision computation of that row. A backend wrong by less than a plain bf16 computation errs under a softcap,
or wrong on one long row among short ones, is rejected; right backends pass on every case the features create.

Real backends in-process (the torch backend; Triton interpreted on a small spec) and fault backends that wrap torch
(tests/fixtures/fault_numerics.py, YARDSTICK_FAULTS), on cases built by the real case builders
(attnsel.validate.cases)."""
import pytest
import torch

from attnsel import select
from attnsel.backends import BUILTINS, get
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.selection import SelectionError
from attnsel.spec import AttentionSpec
from attnsel.validate import cases, spot
from tests.fixtures import fault_numerics as faults

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # only to ask the builders for the GPU case's lengths: every case is built on the CPU
PHASES = ["prefill", "decode"]
IGNORE_SCALE, DROP_LAST_KEYS = faults.YARDSTICK_FAULTS
# Gemma 2 27B: query_pre_attn_scalar 144 (softmax scale 1/12, not 1/sqrt(head_dim 128)), logit softcap 50
GEMMA2_27B = dict(num_q_heads=32, num_kv_heads=16, head_dim=128, softmax_scale=144 ** -0.5, softcap=50.0)
LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
LONG = 1531  # the GPU decode case's long row


def judge(backend, spec: AttentionSpec, case) -> dict:
    """What the worker does with one candidate on one case: run it, reject what raises, check the output."""
    try:
        out = cases.run_case(backend, spec, case)
    except Exception as exc:
        return {"status": "rejected", "reason": f"raised {type(exc).__name__}: {exc}"}
    return cases.check_output(spec, out, case)


def _long_row_case(spec: AttentionSpec, phase: str):
    """A LONG-key row among short ones: decode, the GPU case's lengths; prefill, the CPU case's lengths and a chunk
    of 64 queries at the end of LONG keys (chunked prefill)."""
    if phase == "decode":
        lens, _ = cases.decode_lengths(spec, CUDA)
        assert max(lens) == LONG and min(lens) == 0
        return cases.decode_case(spec, CPU, lengths=lens)
    q_lens, k_lens, _ = cases.prefill_lengths(spec, CPU)
    return cases.prefill_case(spec, CPU, lengths=([*q_lens, 64], [*k_lens, LONG]))


# --- the two faults the case-wide tolerance let through ----------------------------------------------------------

@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_backend_that_ignores_softmax_scale_under_softcap_is_rejected(dtype, phase):
    """Gemma 2 27B's numbers: the case's scores reach the softcap, where a plain bf16 computation rounds ~50-sized
    scores and its error made the tolerance larger than the outputs. The careful yardstick keeps scores in float32."""
    spec = AttentionSpec(**GEMMA2_27B, dtype=dtype, page_size=16)
    case = cases.make_case(spec, phase, CPU)
    good = judge(TORCH, spec, case)
    assert good["status"] == "valid", good["reason"]
    bad = judge(IGNORE_SCALE, spec, case)
    assert bad["status"] == "rejected" and "exceeds tolerance" in bad["reason"], bad
    assert "at position" in bad["reason"]  # names the worst row: sequence, position, error, tolerance
    assert bad["tolerance"] < 0.1 < bad["max_abs_err"]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_backend_that_drops_the_last_keys_of_a_long_row_is_rejected(dtype, phase):
    """No softcap: the short rows' outputs (values of V, rounded at their magnitude) set one tolerance per case
    above the error of dropping the last 64 of 1531 keys. Each row's own tolerance catches it, on the long row."""
    spec = AttentionSpec(**LLAMA3_8B, dtype=dtype, page_size=16)
    case = _long_row_case(spec, phase)
    good = judge(TORCH, spec, case)
    assert good["status"] == "valid", good["reason"]
    bad = judge(DROP_LAST_KEYS, spec, case)
    assert bad["status"] == "rejected" and "exceeds tolerance" in bad["reason"], bad
    assert (f"seq_len {LONG}" if phase == "decode" else f"k_len {LONG}") in bad["reason"], bad["reason"]


@pytest.mark.parametrize("phase", PHASES)
def test_the_timing_spot_check_judges_each_sampled_row(phase):
    """The check of sampled rows after the timing (cases.spot_check) takes each row's tolerance too: the sampled
    short rows no longer cover a long row's dropped keys."""
    spec = AttentionSpec(**LLAMA3_8B, dtype="bf16", page_size=16)
    case = _long_row_case(spec, phase)
    if phase == "prefill":
        plan_args, inputs = (case.cu_q, case.cu_k, case.max_q, case.max_k), (case.q, case.k, case.v)
    else:
        plan_args, inputs = (case.page_table, case.seq_lens), (case.q, case.k_cache, case.v_cache)
    for backend in (TORCH, DROP_LAST_KEYS):
        plan = backend.plan_prefill if phase == "prefill" else backend.plan_decode
        out = plan(spec, *plan_args)(*inputs)
        reason = spot.spot_check(spec, phase, plan_args, inputs, out, {})
        if backend is TORCH:
            assert reason is None
        else:
            assert reason and "exceeds tolerance" in reason, reason


def test_an_explicitly_named_backend_goes_through_the_same_check(monkeypatch):
    """A backend named explicitly is validated by the worker like any candidate: the selection refuses it."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:YARDSTICK_FAULTS")
    spec = AttentionSpec(**GEMMA2_27B, dtype="bf16", page_size=16)
    with pytest.raises(SelectionError, match="'ignore_scale' was requested explicitly but is rejected: "
                                             "max abs error .* exceeds tolerance"):
        select(spec, prefill="ignore_scale", decode="torch", extend="torch")


# --- right backends pass on every case the features create --------------------------------------------------------

# what the case builders plant traps for, alone and as models combine them (tests/fixtures/feature_cases.py)
FEATURES = {
    "plain": {},
    "window1": {"sliding_window": 1},
    "window5": {"sliding_window": 5},
    "window40": {"sliding_window": 40},
    "softcap": {"softcap": 30.0},
    "sinks": {"sinks": True},
    "fp8": {"kv_dtype": "fp8_e4m3"},
    "gpt-oss": {"sliding_window": 7, "sinks": True},
    "gemma2": {"sliding_window": 9, "softcap": 50.0},
    "all": {"sliding_window": 5, "softcap": 20.0, "sinks": True, "kv_dtype": "fp8_e4m3"},
    "non-causal": {"causal": False},
}


def _all_cases(spec: AttentionSpec, phase: str):
    """The validation's cases of a phase: the ragged case, then a batch of one sequence."""
    return [cases.make_case(spec, phase, CPU), cases.single_case(spec, phase, CPU)]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_torch_passes_every_feature_case(feature, dtype, phase):
    spec = AttentionSpec(4, 2, 64, dtype, page_size=4, **FEATURES[feature])
    for case in _all_cases(spec, phase):
        result = judge(TORCH, spec, case)
        assert result["status"] == "valid", result["reason"]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("model", ["gemma2-27b", "gpt-oss-20b"])
def test_torch_passes_real_model_specs(model, phase):
    """Real models' numbers: Gemma 2 27B's sliding layers (window 4096, softcap 50, scale 1/12), gpt-oss-20b's
    (64 query heads, 8 KV heads, head_dim 64, window 128, sinks)."""
    spec = (AttentionSpec(**GEMMA2_27B, dtype="bf16", page_size=16, sliding_window=4096) if model == "gemma2-27b"
            else AttentionSpec(64, 8, 64, "bf16", page_size=16, sliding_window=128, sinks=True))
    for case in _all_cases(spec, phase):
        result = judge(TORCH, spec, case)
        assert result["status"] == "valid", result["reason"]


# Triton's interpreter casts float32 to bf16 by truncation (compiled kernels round to nearest): up to one ulp, 0.031
# on the window cases' boundary outputs (|out| 4 to 8), twice what rounding errs. bf16 runs here without a window;
# test_features_on_the_gpu checks compiled Triton with windows.
TRITON_CASES = [(f, "fp16") for f in ("plain", "window5", "gemma2", "all")] + [(f, "bf16") for f in
                                                                                ("plain", "softcap", "sinks", "fp8")]


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("feature,dtype", TRITON_CASES, ids=[f"{f}-{d}" for f, d in TRITON_CASES])
def test_triton_interpreted_passes_every_feature_case(feature, dtype, phase):
    spec = AttentionSpec(2, 1, 32, dtype, page_size=4, **FEATURES[feature])
    triton = get("triton")
    assert triton.unsupported(spec, phase) is None
    result = judge(triton, spec, cases.make_case(spec, phase, CPU))
    assert result["status"] == "valid", result["reason"]


# --- on the GPU: the real backends, compiled, and the faults on the GPU cases -------------------------------------

GPU_SPECS = {
    "gemma2-27b-sliding": AttentionSpec(**GEMMA2_27B, dtype="bf16", page_size=16, sliding_window=4096),
    "gemma2-27b-global": AttentionSpec(**GEMMA2_27B, dtype="bf16", page_size=16),
    "gpt-oss-20b-sliding": AttentionSpec(64, 8, 64, "bf16", page_size=16, sliding_window=128, sinks=True),
    "llama3-8b-fp8-kv": AttentionSpec(**LLAMA3_8B, dtype="bf16", page_size=16, kv_dtype="fp8_e4m3"),
    "llama3-8b-fp16-window": AttentionSpec(**LLAMA3_8B, dtype="fp16", page_size=16, sliding_window=5),
}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("key", list(GPU_SPECS))
@pytest.mark.parametrize("name", list(BUILTINS))
def test_features_on_the_gpu(name, key, phase):
    """Every built-in backend that serves the spec passes the per-row check on the GPU cases, both of them."""
    spec, backend = GPU_SPECS[key], get(name)
    reason = backend.unsupported(spec, phase)
    if reason:
        pytest.skip(reason)
    for case in (cases.make_case(spec, phase, CUDA), cases.single_case(spec, phase, CUDA)):
        result = judge(backend, spec, case)
        assert result["status"] == "valid", f"{name} {key} {phase}: {result['reason']}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("phase", PHASES)
def test_the_faults_are_rejected_on_the_gpu_cases(phase):
    """The GPU cases (a 1531-token decode row, a 1031-token prefill) reject both faults."""
    for spec, fault in ((AttentionSpec(**GEMMA2_27B, dtype="bf16", page_size=16), IGNORE_SCALE),
                        (AttentionSpec(**LLAMA3_8B, dtype="bf16", page_size=16), DROP_LAST_KEYS)):
        case = cases.make_case(spec, phase, CUDA)
        assert judge(TORCH, spec, case)["status"] == "valid"
        result = judge(fault, spec, case)
        assert result["status"] == "rejected" and "exceeds tolerance" in result["reason"], result


# --- an fp8 KV cache: a kernel that runs both products in fp8 (FA3) is right; one that drops the scale is not ------

class Fp8Products:
    """FA3's fp8-cache decode emulated on the CPU: q quantised to e4m3 per sequence and KV-head group (fa3.quantize_q),
    P rounded to e4m3 before P @ V, everything else in float32. ``k_scale_ignored``: a fault that reads the stored
    keys as real values."""
    name = "fp8_products"

    def __init__(self, k_scale_ignored=False):
        self.k_scale_ignored = k_scale_ignored

    def plan_decode(self, spec, page_table, seq_lens):
        from attnsel.backends.fa3 import quantize_q

        lens, ps = seq_lens.tolist(), spec.page_size

        def run(q, k_cache, v_cache, *, k_scale=None, v_scale=None, sinks=None):
            q8, q_scale = quantize_q(q, spec.num_kv_heads)
            group = spec.num_q_heads // spec.num_kv_heads
            qd = (q8.float().view(q.shape[0], spec.num_kv_heads, group, -1) * q_scale[:, :, None, None])
            qd = qd.view(q.shape)
            out = torch.zeros(q.shape, dtype=torch.float32)
            for b, n in enumerate(lens):
                if n == 0:
                    continue
                pages = page_table[b, :-(-n // ps)].long()
                k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:n].float()
                v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:n].float() * v_scale.float()
                k = k if self.k_scale_ignored else k * k_scale.float()
                scores = torch.einsum("hd,khd->hk", qd[b], k.repeat_interleave(group, 1)) * spec.scale
                if spec.sliding_window is not None:
                    scores[:, :max(0, n - spec.sliding_window)] = float("-inf")
                top = scores.amax(-1, keepdim=True)
                w = torch.exp(scores - top)
                p = w.to(torch.float8_e4m3fn).float() / w.sum(-1, keepdim=True)
                out[b] = torch.einsum("hk,khd->hd", p, v.repeat_interleave(group, 1))
            return out.to(q.dtype)

        return run


@pytest.mark.parametrize("window", [None, 24])
def test_an_fp8_cache_kernel_with_fp8_products_passes_and_a_dropped_scale_is_rejected(window):
    spec = AttentionSpec(**LLAMA3_8B, dtype="bf16", page_size=16, kv_dtype="fp8_e4m3", sliding_window=window)
    case = cases.decode_case(spec, CPU, lengths=cases.decode_lengths(spec, CUDA)[0])
    assert judge(Fp8Products(), spec, case)["status"] == "valid"
    assert judge(TORCH, spec, case)["status"] == "valid"
    wrong = judge(Fp8Products(k_scale_ignored=True), spec, case)
    assert wrong["status"] == "rejected" and "exceeds tolerance" in wrong["reason"]
