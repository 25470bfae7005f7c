"""torch and triton (interpreted on CPU) against the float32 reference, prefill and paged decode, several specs."""
import pytest
import torch

from attnsel.backends import get
from attnsel.spec import AttentionSpec
from attnsel.validate import cases
from attnsel.validate.cases import check_output

CPU = torch.device("cpu")
# (q heads, kv heads, head_dim): MHA, GQA 4:1, GQA 7:1, MQA, head_dim 64 and 128 (and 96: padded tiles)
SHAPES = [(4, 4, 64), (8, 2, 128), (7, 1, 64), (14, 2, 128), (4, 1, 64), (4, 2, 96)]


def _check(name: str, spec: AttentionSpec, phase: str):
    backend = get(name)
    assert backend.unsupported(spec, phase) is None
    case = cases.make_case(spec, phase, CPU)
    out = cases.run_case(backend, spec, case)
    result = check_output(spec, out, case)
    assert result["status"] == "valid", result["reason"]
    assert out.dtype == spec.torch_dtype and out.shape == case.ref.shape
    return result


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv_d{s[2]}")
def test_torch_backend(shape, dtype, phase):
    _check("torch", AttentionSpec(*shape, dtype=dtype, page_size=16), phase)


# bf16 runs in the interpreter with the dot operands up-cast to float32 (Triton's interpreter computes bf16 dots
# wrongly, docs/ARCHITECTURE.md and the project notes); compiled bf16 dots are covered by tests/test_gpu.py on the device.
# By default the smallest specs that still reach each path: one query head per KV head (4q4kv, fp16), an odd GQA
# group (7q1kv, bf16) and a padded head_dim (4q2kv_d96, bf16), each in both phases; the slow stage runs the grid.
TRITON_FAST = {((4, 4, 64), "fp16"), ((7, 1, 64), "bf16"), ((4, 2, 96), "bf16")}


def _triton_grid():
    for phase in ("prefill", "decode"):
        for dtype in ("fp16", "bf16"):
            for shape in SHAPES:
                marks = () if (shape, dtype) in TRITON_FAST else pytest.mark.slow
                name = f"{shape[0]}q{shape[1]}kv_d{shape[2]}-{dtype}-{phase}"
                yield pytest.param(shape, dtype, phase, marks=marks, id=name)


@pytest.mark.parametrize("shape,dtype,phase", list(_triton_grid()))
def test_triton_backend_interpreted(shape, dtype, phase):
    result = _check("triton", AttentionSpec(*shape, dtype=dtype, page_size=16), phase)
    assert result["max_abs_err"] <= result["tolerance"]


@pytest.mark.parametrize("page_size", [1, 5, pytest.param(16, marks=pytest.mark.slow)])  # 16: every other test's
def test_triton_decode_page_sizes(page_size):
    _check("triton", AttentionSpec(8, 2, 64, dtype="fp16", page_size=page_size), "decode")


def test_triton_non_causal_prefill():
    spec = AttentionSpec(4, 2, 64, dtype="fp16", causal=False)
    _check("triton", spec, "prefill")
    _check("torch", spec, "prefill")


def test_triton_decode_split_path_matches_single_split(monkeypatch):
    """Long contexts take the split-KV path (partial outputs merged by log-sum-exp): same numbers as one split."""
    import attnsel.backends.triton as tb

    spec = AttentionSpec(8, 2, 64, dtype="fp16", page_size=16)
    case = cases.decode_case(spec, CPU)
    backend = get("triton")
    outs = {}
    for splits in (1, 3):
        monkeypatch.setattr(tb, "decode_splits", lambda *a, s=splits, **k: (s, 2**30, 1))  # every row uses s splits
        outs[splits] = backend.plan_decode(spec, case.page_table, case.seq_lens)(case.q, case.k_cache, case.v_cache)
        assert check_output(spec, outs[splits], case)["status"] == "valid"
    assert (outs[1].float() - outs[3].float()).abs().max().item() < 2e-3


def test_reference_rejects_a_wrong_result():
    spec = AttentionSpec(4, 2, 64, dtype="fp16")
    case = cases.prefill_case(spec, CPU)
    wrong = case.ref.to(spec.torch_dtype) * 1.05
    result = check_output(spec, wrong, case)
    assert result["status"] == "rejected" and "exceeds tolerance" in result["reason"]


def test_triton_unavailable_without_cuda_or_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = get("triton").unsupported(AttentionSpec(4, 2, 64, dtype="bf16"), "prefill")
    assert reason == ("no CUDA device (TRITON_INTERPRET=1 runs the kernels in Triton's interpreter: for tests, far "
                      "slower than torch)")


def test_unavailable_reasons_collect_every_failure(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = get("triton").unsupported(AttentionSpec(4, 2, 512, dtype="fp32"), "decode")
    assert "dtype fp32 is not supported (fp16, bf16)" in reason
    assert "head_dim 512 is not supported" in reason
