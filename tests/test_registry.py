"""Registry: built-ins, plugins from the environment, broken plugins, unknown names."""
import pytest

from attnsel import backends, select
from attnsel.backends import UnknownBackendError
from attnsel.spec import AttentionSpec


def test_builtins_registered():
    assert {"torch", "triton", "fa3", "flashinfer", "flashinfer_cuda_cores"} <= set(backends.names())


def test_unknown_name_lists_valid_ones():
    with pytest.raises(UnknownBackendError, match="unknown backend 'nope'; valid names: fa3, flashinfer"):
        backends.get("nope")


def test_env_plugin_is_validated_like_a_builtin(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fault_backends:WRONG_PREFILL")
    assert "wrong_prefill" in backends.names()
    sel = select(AttentionSpec(4, 2, 64, "fp16"), policy="priority")
    cand = {c.name: c for c in sel.candidates["prefill"]}["wrong_prefill"]
    assert cand.status == "rejected" and "exceeds tolerance" in cand.reason
    # plugins join the default priority list before torch
    assert [c.name for c in sel.candidates["prefill"]][-2:] == ["wrong_prefill", "torch"]


def test_broken_plugin_is_reported_not_hidden(monkeypatch, caplog):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.broken_plugin:BACKEND,tests.fault_backends:PREFILL")
    names = backends.names()
    assert "tests.broken_plugin:BACKEND" in names
    reason = backends.get("tests.broken_plugin:BACKEND").unsupported(AttentionSpec(4, 2, 64), "prefill")
    assert reason.startswith("plugin tests.broken_plugin:BACKEND failed to load: ModuleNotFoundError")
    # an object that is not a backend (a dict) is refused with the missing methods named
    assert "backend protocol" in backends.get("tests.fault_backends:PREFILL").unsupported(AttentionSpec(4, 2, 64),
                                                                                        "prefill")


def test_entry_point_plugin(tmp_path, monkeypatch):
    """A plugin installed as a distribution with an `attnsel.backends` entry point is found and validated."""
    dist = tmp_path / "attnsel_test_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: attnsel-test-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[attnsel.backends]\nwrong = tests.fault_backends:WRONG_PREFILL\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ['PYTHONPATH']}")
    backends._cache.clear()
    try:
        assert "wrong_prefill" in backends.names()
        sel = select(AttentionSpec(4, 2, 64, "fp16"), policy="priority")
        cand = {c.name: c for c in sel.candidates["prefill"]}["wrong_prefill"]
        assert cand.status == "rejected" and "exceeds tolerance" in cand.reason
    finally:
        backends._cache.clear()


def test_flashinfer_stale_run_function_raises():
    """FlashInfer keeps one plan per wrapper: a run function of a replaced plan must fail loudly, not run another
    batch's plan (the check is plain Python, so it is tested here with a stand-in wrapper)."""
    import types

    from attnsel.backends.flashinfer import BACKEND

    wrapper = types.SimpleNamespace()
    first = BACKEND._checked(wrapper, lambda x: x + 1)
    assert first(1) == 2
    second = BACKEND._checked(wrapper, lambda x: x + 2)
    assert second(1) == 3
    with pytest.raises(RuntimeError, match="belongs to an earlier plan"):
        first(1)
