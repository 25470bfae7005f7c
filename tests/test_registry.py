"""Registry: built-ins, plugins from the environment, broken plugins, unknown names."""
import os

import pytest
import torch

from attnsel import backends, select
from attnsel.backends import UnknownBackendError
from attnsel.spec import AttentionSpec


def test_builtins_registered():
    assert {"torch", "triton", "fa3", "flashinfer", "flashinfer_cuda_cores"} <= set(backends.names())


def test_unknown_name_lists_valid_ones():
    with pytest.raises(UnknownBackendError, match="unknown backend 'nope'; valid names: fa3, flashinfer"):
        backends.get("nope")


@pytest.mark.usefixtures("thread_or_process_worker")
def test_env_plugin_is_validated_like_a_builtin(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:WRONG_PREFILL")
    assert "wrong_prefill" in backends.names()
    sel = select(AttentionSpec(4, 2, 64, "fp16"), policy="priority")
    cand = {c.name: c for c in sel.candidates["prefill"]}["wrong_prefill"]
    assert cand.status == "rejected" and "exceeds tolerance" in cand.reason
    # plugins join the default priority list before torch
    assert [c.name for c in sel.candidates["prefill"]][-2:] == ["wrong_prefill", "torch"]


def test_broken_plugin_is_reported_not_hidden(monkeypatch, caplog):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.broken_plugin:BACKEND,tests.fixtures.fault_backends:PREFILL")
    names = backends.names()
    assert "tests.fixtures.broken_plugin:BACKEND" in names
    reason = backends.get("tests.fixtures.broken_plugin:BACKEND").unsupported(AttentionSpec(4, 2, 64), "prefill")
    assert reason.startswith("plugin tests.fixtures.broken_plugin:BACKEND failed to load: ModuleNotFoundError")
    # an object that is not a backend (a dict) is refused with the missing methods named
    not_a_backend = backends.get("tests.fixtures.fault_backends:PREFILL")
    assert "backend protocol" in not_a_backend.unsupported(AttentionSpec(4, 2, 64), "prefill")


@pytest.mark.usefixtures("thread_or_process_worker")
def test_entry_point_plugin(tmp_path, monkeypatch):
    """A plugin installed as a distribution with an `attnsel.backends` entry point is found and validated."""
    dist = tmp_path / "attnsel_test_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: attnsel-test-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[attnsel.backends]\nwrong = tests.fixtures.fault_backends:WRONG_PREFILL\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ['PYTHONPATH']}")
    backends._registry.cache_clear()
    try:
        assert "wrong_prefill" in backends.names()
        sel = select(AttentionSpec(4, 2, 64, "fp16"), policy="priority")
        cand = {c.name: c for c in sel.candidates["prefill"]}["wrong_prefill"]
        assert cand.status == "rejected" and "exceeds tolerance" in cand.reason
    finally:
        backends._registry.cache_clear()


def test_flashinfer_stale_run_function_raises():
    """FlashInfer keeps one plan per wrapper. attnsel never re-plans a wrapper a live run function owns
    (tests/test_flashinfer_plans.py); should a wrapper be planned again anyway, its earlier run function must fail
    loudly and say so through current(), not run another batch's plan (plain Python: a stand-in wrapper)."""
    import types

    from attnsel.backends.flashinfer import BACKEND

    wrapper = types.SimpleNamespace()
    first = BACKEND._checked(wrapper, None, lambda x: x + 1)
    assert first(1) == 2 and first.current()
    second = BACKEND._checked(wrapper, None, lambda x: x + 2)
    assert second(1) == 3 and second.current() and not first.current()
    with pytest.raises(RuntimeError, match="plan was replaced"):
        first(1)


# ---- plugin code called in the parent never aborts a selection ----------------------------------------------------

def test_availability_turns_plugin_errors_into_reasons():
    from tests.fixtures.fault_backends import BAD_NOTE, BAD_VERSION

    spec = AttentionSpec(4, 2, 64, "fp16")
    reason, identity = backends.availability(BAD_VERSION, spec, "prefill", torch.device("cpu"))
    assert reason == "version raised RuntimeError: cannot read the kernel library's version" and identity is None

    class Raises(BAD_NOTE.__class__):
        def unsupported(self, spec, phase):
            raise KeyError("boom")

    reason, _ = backends.availability(Raises("raises"), spec, "prefill", torch.device("cpu"))
    assert reason == "availability check raised KeyError: 'boom'"

    class Lists(BAD_NOTE.__class__):
        def unsupported(self, spec, phase):
            return ["no sinks", None, "no softcap"]

    assert backends.availability(Lists("lists"), spec, "prefill")[0] == "no sinks; no softcap"
    assert backends.first_use_note(BAD_NOTE) == "first_use_note raised RuntimeError: note unavailable"
    assert backends.report_extras(BAD_NOTE) == {"error": "report_extras raised RuntimeError: extras unavailable"}
    assert backends.first_use_note(backends.get("torch")) == "" and backends.report_extras(backends.get("torch")) == {}


def test_an_availability_check_that_never_returns_costs_the_backend_not_the_selection(tmp_path):
    """A real process: a plugin whose unsupported() sleeps for an hour. The selection goes on after
    ATTNSEL_CHECK_TIMEOUT_S with the reason, selects torch and exits (the stuck thread is a daemon)."""
    import subprocess
    import sys
    import time

    code = ("from attnsel import AttentionSpec, select\n"
            "sel = select(AttentionSpec(4, 2, 64, 'fp16'), policy='priority', "
            "prefill_priority=['hanging_check', 'torch'], decode_priority=['torch'])\n"
            "c = {c.name: c for c in sel.candidates['prefill']}['hanging_check']\n"
            "print(sel.prefill, c.status, c.reason)\n")
    env = {**os.environ, "ATTNSEL_BACKENDS": "tests.fixtures.fault_backends:HANGING_CHECK",
           "ATTNSEL_CHECK_TIMEOUT_S": "1", "ATTNSEL_CACHE_DIR": str(tmp_path)}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == (
        "torch unavailable availability check did not return: hanging_check's unsupported() did not return within "
        "1 s (ATTNSEL_CHECK_TIMEOUT_S); it is left running in a background thread and the backend is treated as "
        "unavailable")
    assert time.monotonic() - t0 < 60


def test_raising_version_and_note_do_not_abort_the_selection(monkeypatch, caplog):
    import logging

    monkeypatch.setenv("ATTNSEL_BACKENDS",
                       "tests.fixtures.fault_backends:BAD_VERSION,tests.fixtures.fault_backends:BAD_NOTE")
    spec = AttentionSpec(4, 2, 64, "fp16")
    with caplog.at_level(logging.INFO, logger="attnsel"):
        sel = select(spec, policy="priority", prefill_priority=["bad_version", "bad_note", "torch"],
                     decode_priority=["torch"])
    cand = {c.name: c for c in sel.candidates["prefill"]}
    assert cand["bad_version"].status == "unavailable"
    assert cand["bad_version"].reason == "version raised RuntimeError: cannot read the kernel library's version"
    assert sel.prefill == "bad_note"  # its failing note is shown, not fatal
    assert "validating bad_note prefill (first_use_note raised RuntimeError: note unavailable)" in caplog.text


def test_first_use_note_comes_from_the_backend(monkeypatch):
    """The progress line's note is the backend's own first_use_note (no backend knowledge in the runner)."""
    from attnsel.validate import runner
    from tests.fixtures.fault_backends import Wrapped

    noted = Wrapped("noted", first_use_note="first use JIT-compiles kernels (test)")
    monkeypatch.setattr(backends, "get", lambda name: noted)
    assert runner._note("noted") == "first use JIT-compiles kernels (test)"
    assert not hasattr(runner, "SLOW_FIRST_USE")


# ---- the device a selection is for reaches the availability check -------------------------------------------------

def test_unsupported_gets_the_device_keyword_when_it_takes_it():
    from tests.fixtures.fault_backends import DEVICE_AWARE, OOM

    spec = AttentionSpec(4, 2, 64, "fp16")
    DEVICE_AWARE.seen.clear()
    assert backends.availability(DEVICE_AWARE, spec, "decode", torch.device("cpu"))[0] is None
    assert DEVICE_AWARE.seen == [torch.device("cpu")]
    assert backends.availability(OOM, spec, "decode", torch.device("cpu"))[0] is None  # (spec, phase) plugins


def test_selection_checks_the_device_it_selects_for(monkeypatch):
    from tests.fixtures.fault_backends import DEVICE_AWARE

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:DEVICE_AWARE")
    DEVICE_AWARE.seen.clear()
    backends._registry.cache_clear()
    sel = select(AttentionSpec(4, 2, 64, "fp16"), policy="priority", prefill_priority=["device_aware"],
                 decode_priority=["torch"], device="cpu")
    assert sel.prefill == "device_aware"
    assert backends.get("device_aware").seen == [torch.device("cpu")]


def test_capability_reason_checks_the_given_device():
    from attnsel.device import capability_reason

    reason = capability_reason(">= 8.0", lambda cap: cap >= (8, 0), torch.device("cpu"))
    assert reason == "needs a CUDA device with compute capability >= 8.0, got device cpu"
