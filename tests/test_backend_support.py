"""What each built-in backend declares it cannot serve, checked on the CPU with the libraries faked as installed.

A backend must name every spec feature it does not implement (never ignore one), and check the compute capability
of the device it is asked about, not of the current device.
"""
import importlib.util
import itertools
import sys
import types

import pytest

import torch

import attnsel.backends.support as support
import attnsel.device
from attnsel.backends import BUILTINS, get
from attnsel.spec import AttentionSpec

# tokenspeed-fa3 3.0.0.post20260810's flash_attn_config.CONFIG["build_flags"] (read from the staged wheel)
FA3_FLAGS = {"FLASHATTENTION_DISABLE_LOCAL": False, "FLASHATTENTION_DISABLE_SOFTCAP": True,
             "FLASHATTENTION_DISABLE_FP8": False, "FLASHATTENTION_DISABLE_PACKGQA": False,
             "FLASHATTENTION_DISABLE_HDIM64": False, "FLASHATTENTION_DISABLE_HDIM96": True,
             "FLASHATTENTION_DISABLE_HDIM128": False, "FLASHATTENTION_DISABLE_HDIM192": False,
             "FLASHATTENTION_DISABLE_HDIM256": False}
CAPS = {"cuda:0": (9, 0), "cuda:1": (8, 0)}
FEATURES = {  # spec field values -> the words a reason must contain
    "sliding_window": ({"sliding_window": 64}, "sliding window"),
    "softcap": ({"softcap": 30.0}, "softcap"),
    "sinks": ({"sinks": True}, "sinks"),
    "kv_dtype": ({"kv_dtype": "fp8_e4m3"}, "fp8_e4m3"),
}


@pytest.fixture
def hopper_with_libraries(monkeypatch):
    """flash_attn_interface and flashinfer 'installed'; cuda:0 is an H200 (9.0), cuda:1 an A100 (8.0)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("flash_attn_interface", "flashinfer", "flashinfer.xqa")
                        else real(name, *a))
    config = types.ModuleType("flash_attn_config")
    config.CONFIG = {"build_flags": FA3_FLAGS}
    monkeypatch.setitem(sys.modules, "flash_attn_config", config)
    monkeypatch.setattr(attnsel.device, "cuda_capability",
                        lambda device=None: CAPS["cuda:0" if device is None else str(device)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _reason(name, phase, **fields):
    return get(name).unsupported(AttentionSpec(32, 8, 128, **fields), phase)


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", [n for n in BUILTINS if n != "torch"])
def test_every_feature_is_served_or_named(name, feature, hopper_with_libraries):
    """With the base spec servable, adding one feature either leaves it servable (the backend implements it) or
    adds a reason naming that feature."""
    fields, words = FEATURES[feature]
    for phase in ("prefill", "decode"):
        base = _reason(name, phase)
        with_feature = _reason(name, phase, **fields)
        if base is not None:
            assert base.startswith("this variant differs")
            continue
        if with_feature is not None:
            assert words in with_feature, with_feature


@pytest.mark.parametrize("name, phase, feature, why", [
    ("fa3", "prefill", "softcap", "FLASHATTENTION_DISABLE_SOFTCAP"),
    ("fa3", "decode", "softcap", "FLASHATTENTION_DISABLE_SOFTCAP"),
    ("flashinfer_fa2", "prefill", "sinks", "trtllm-gen"),
    ("flashinfer_fa3", "decode", "sinks", "trtllm-gen"),
    ("flashinfer_cuda_cores", "decode", "sinks", "trtllm-gen"),
    ("flashinfer_fa3", "decode", "kv_dtype", "needs fp8 queries"),
    ("flashinfer_xqa", "decode", "softcap", "XQA has no logit softcap"),
])
def test_library_limits_are_named_with_their_cause(name, phase, feature, why, hopper_with_libraries):
    fields, words = FEATURES[feature]
    reason = _reason(name, phase, **fields)
    assert reason is not None and words in reason and why in reason


@pytest.mark.parametrize("name, phase", [("fa3", "prefill"), ("fa3", "decode"), ("triton", "decode"),
                                         ("flashinfer", "decode"), ("flashinfer", "prefill"),
                                         ("flashinfer_xqa", "decode")])
def test_implemented_features_are_not_declined(name, phase, hopper_with_libraries):
    fields = {"sliding_window": 64, "kv_dtype": "fp8_e4m3"}
    if name == "flashinfer_xqa":  # its fp8 path is declined on Hopper (test_xqa_limits)
        fields = {"sliding_window": 64, "sinks": True}
    if name == "triton":
        fields.update(softcap=30.0, sinks=True)
    assert _reason(name, phase, **fields) is None


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_flashinfer_sinks_and_their_limits(phase, hopper_with_libraries):
    assert _reason("flashinfer", phase, sinks=True, sliding_window=128) is None
    assert "no softcap" in _reason("flashinfer", phase, sinks=True, softcap=30.0)
    fp8 = _reason("flashinfer", phase, sinks=True, kv_dtype="fp8_e4m3")
    assert (fp8 is None) if phase == "prefill" else ("does not dequantise" in fp8)


def test_prefill_ignores_kv_dtype(hopper_with_libraries):
    """The fp8 cache is a decode matter: prefill takes k/v in spec.dtype."""
    assert _reason("flashinfer_fa2", "prefill", kv_dtype="fp8_e4m3") is None


@pytest.mark.parametrize("name", ["fa3", "flashinfer_fa2", "flashinfer_fa3", "flashinfer_xqa"])
def test_capability_is_that_of_the_device_asked_about(name, hopper_with_libraries):
    spec = AttentionSpec(32, 8, 128)
    phase = "decode" if name in ("flashinfer_fa3", "flashinfer_xqa") else "prefill"
    assert get(name).unsupported(spec, phase, device=torch.device("cuda:0")) is None
    reason = get(name).unsupported(spec, phase, device=torch.device("cuda:1"))
    assert reason is not None and "found 8.0" in reason


def test_triton_capability_is_that_of_the_device_asked_about(hopper_with_libraries):
    CAPS["cuda:2"] = (7, 5)
    try:
        reason = get("triton").unsupported(AttentionSpec(32, 8, 128), "decode", device=torch.device("cuda:2"))
    finally:
        del CAPS["cuda:2"]
    assert reason == "needs CUDA compute capability >= 8.0, found 7.5"


def test_xqa_limits(hopper_with_libraries, monkeypatch, tmp_path):
    """FlashInfer 0.6.4's XQA JIT accepts pages of 16-128 tokens and head_dim multiples of 16 up to 256; a
    flashinfer without the module is named."""
    assert _reason("flashinfer_xqa", "decode") is None
    assert "page_size 8 is not supported" in get("flashinfer_xqa").unsupported(AttentionSpec(32, 8, 128, page_size=8),
                                                                               "decode")
    assert "head_dim 72 is not supported" in get("flashinfer_xqa").unsupported(AttentionSpec(32, 8, 72), "decode")
    assert _reason("flashinfer_xqa", "prefill").startswith("this variant differs from flashinfer only in decode")
    fp8 = get("flashinfer_xqa").unsupported(AttentionSpec(32, 8, 128, kv_dtype="fp8_e4m3"), "decode",
                                            device=torch.device("cuda:0"))
    assert "fp8_e4m3 KV cache: not supported in decode" in fp8 and "unused slots" in fp8
    CAPS["cuda:3"] = (10, 0)  # Blackwell: another fp8 kernel, left to the validation
    try:
        assert get("flashinfer_xqa").unsupported(AttentionSpec(32, 8, 128, kv_dtype="fp8_e4m3"), "decode",
                                                 device=torch.device("cuda:3")) is None
    finally:
        del CAPS["cuda:3"]
    real = importlib.util.find_spec
    package = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])  # a flashinfer without xqa.py
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: package if name == "flashinfer"
                        else real(name, *a))
    assert "has no XQA module" in _reason("flashinfer_xqa", "decode")
    (tmp_path / "xqa.py").write_text("")
    assert _reason("flashinfer_xqa", "decode") is None


def test_flashinfer_facts_for_the_generic_layers():
    for name in ("flashinfer", "flashinfer_cuda_cores", "flashinfer_fa2", "flashinfer_fa3", "flashinfer_xqa"):
        backend = get(name)
        assert "JIT-compiles" in backend.first_use_note
        assert backend.report_extras()["flashinfer_jit_dir"].endswith("flashinfer")


def test_shared_reasons():
    assert support.dtype_reason(AttentionSpec(4, 2, 64, dtype="fp32")) == "dtype fp32 is not supported (fp16, bf16)"
    assert support.joined([None, "a", "", "b"]) == "a; b" and support.joined([None]) is None
    assert support.capability_reason("9.x", lambda c: True, torch.device("cpu")).startswith("needs a CUDA device")


def test_rows_without_keys_are_the_first_queries_of_sequences_with_more_queries_than_keys():
    """Bottom-right causal alignment: a sequence of lq queries and lk keys leaves its first max(lq - lk, 0) queries
    before every key (FlashInfer's prefill, which returned something else there, zeroes them as FlashAttention)."""
    from attnsel.backends.support import rows_without_keys

    lens_q, lens_k = [5, 2, 3, 4, 150], [3, 2, 0, 40, 6]
    cu = lambda lens: torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)  # noqa: E731
    rows = rows_without_keys(cu(lens_q), cu(lens_k))
    expected = [0, 1] + [7, 8, 9] + list(range(14, 14 + 144))
    assert rows.dtype == torch.int64 and rows.tolist() == expected
    assert rows_without_keys(cu([3, 1, 4]), cu([3, 5, 4])) is None
    assert rows_without_keys(cu([]), cu([])) is None


def test_the_flashinfer_template_variants_say_why_they_need_hopper():
    """Below Hopper FlashInfer's auto backend runs the FA2 template (flashinfer_fa2 adds nothing there), while its
    FA3 template cannot run at all: each variant's reason says its own case."""
    from attnsel.backends import get

    spec = AttentionSpec(32, 8, 128, "bf16", 16)
    fa2 = get("flashinfer_fa2").unsupported(spec, "prefill", device=torch.device("cpu"))
    fa3 = get("flashinfer_fa3").unsupported(spec, "decode", device=torch.device("cpu"))
    assert "below Hopper flashinfer runs this same FA2 kernel" in fa2
    assert "FlashInfer's FA3 template runs on Hopper only" in fa3 and "same FA2 kernel" not in fa3
