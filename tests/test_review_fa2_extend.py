"""flashinfer_fa2 as a default extend candidate: with an fp8 KV cache FlashInfer's own template choice (the
flashinfer candidate) is its FA2 template already, so the variant would time the same kernel twice."""
from attnsel.backends import get
from attnsel.selection import DEFAULT_PRIORITY
from attnsel.spec import AttentionSpec
from tests.test_backend_support import hopper_with_libraries  # noqa: F401  (a fixture)


def test_fa2_extend_with_an_fp8_cache_says_it_is_what_flashinfer_runs(hopper_with_libraries):
    assert "flashinfer_fa2" in DEFAULT_PRIORITY["extend"]
    fp8 = AttentionSpec(32, 8, 128, kv_dtype="fp8_e4m3")
    assert get("flashinfer").unsupported(fp8, "extend") is None
    why = get("flashinfer_fa2").unsupported(fp8, "extend")
    assert why is not None and "is the kernel flashinfer runs" in why
    # without fp8, and in prefill (which takes k/v in spec.dtype), the variant is a candidate of its own
    assert get("flashinfer_fa2").unsupported(AttentionSpec(32, 8, 128), "extend") is None
    assert get("flashinfer_fa2").unsupported(fp8, "prefill") is None
