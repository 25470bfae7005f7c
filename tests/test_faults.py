"""Fault matrix: real faults in plugin backends, each in prefill and in decode, all in one auto selection."""
import logging
import time

import pytest

from attnsel import select
from attnsel.spec import AttentionSpec
from attnsel.validate import runner
from tests.fault_backends import FAULTS

TIMEOUT = 8.0
SPEC = AttentionSpec(4, 2, 64, "fp32", page_size=4)
EXPECTED = {
    "import_error": "raised ModuleNotFoundError: No module named 'attnsel_missing_kernel_lib'",
    "raise": "raised RuntimeError: injected failure",
    "segfault": "worker died with SIGSEGV while running segfault_{phase} {phase}",
    "abort": "worker died with SIGABRT while running abort_{phase} {phase}",
    "hang": f"timed out after {TIMEOUT:.0f} s (worker killed) while running hang_{{phase}} {{phase}}",
    "nan": "output values are NaN or inf",
    "wrong": "exceeds tolerance",
}
DEATHS = ("segfault", "abort", "hang")


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNSEL_BACKENDS", "tests.fault_backends:ALL")
    mp.setenv("ATTNSEL_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    order = {p: [f"{f}_{p}" for f in FAULTS] + ["torch"] for p in ("prefill", "decode")}
    spawns_before = runner.spawn_count
    t0 = time.monotonic()
    sel = select(SPEC, policy="priority", prefill_priority=order["prefill"], decode_priority=order["decode"],
                 timeout=TIMEOUT)
    elapsed = time.monotonic() - t0
    mp.undo()
    return sel, elapsed, runner.spawn_count - spawns_before


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("fault", FAULTS)
def test_fault_is_rejected_with_its_reason(faulty, fault, phase):
    sel, _, _ = faulty
    cand = {c.name: c for c in sel.candidates[phase]}[f"{fault}_{phase}"]
    assert cand.status == "rejected"
    assert EXPECTED[fault].format(phase=phase) in cand.reason


def test_death_reasons_carry_the_stderr_tail(faulty):
    sel, _, _ = faulty
    cands = {c.name: c for c in sel.candidates["prefill"]}
    # faulthandler in the worker prints the Python stack of the crash to stderr
    assert "stderr tail:" in cands["segfault_prefill"].reason
    assert "Segmentation fault" in cands["segfault_prefill"].reason
    assert "Aborted" in cands["abort_prefill"].reason
    # a hung worker is asked for its stack before it is killed: the reason shows where it hung
    assert "fault_backends.py" in cands["hang_prefill"].reason


def test_auto_falls_back_and_parent_is_unharmed(faulty):
    sel, _, _ = faulty
    assert (sel.prefill, sel.decode) == ("torch", "torch")
    assert sel.prefill_source == sel.decode_source == "auto"


def test_worker_respawned_only_after_deaths(faulty):
    sel, _, spawns = faulty
    deaths = 2 * len(DEATHS)
    assert sel.stats["deaths"] == deaths
    assert spawns == sel.stats["spawns"] == deaths + 1


def test_total_time_bounded_by_timeouts(faulty):
    _, elapsed, spawns = faulty
    # two hangs cost a timeout each; every other spawn costs a torch import (a few seconds on CPU)
    assert elapsed < 2 * TIMEOUT + spawns * 15


def test_timeouts_are_not_cached_but_crashes_are(monkeypatch):
    from attnsel.cache import ResultCache

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fault_backends:ALL")
    kw = dict(policy="priority", prefill_priority=["segfault_prefill", "hang_prefill", "torch"],
              decode_priority=["torch"], timeout=3.0)
    first = select(SPEC, **kw)
    assert first.stats["deaths"] == 2
    cached = {(e["backend"], e["phase"]) for e in ResultCache().entries().values()}
    assert ("segfault_prefill", "prefill") in cached
    assert ("hang_prefill", "prefill") not in cached  # a timeout may be a slow first JIT build
    second = select(SPEC, **kw)
    assert second.stats["spawns"] == 1 and second.stats["deaths"] == 1  # only the hang is tried again
    assert second.prefill == "torch"


def test_rejections_are_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fault_backends:ALL")
    with caplog.at_level(logging.WARNING):
        sel = select(SPEC, policy="priority", prefill_priority=["raise_prefill", "torch"],
                     decode_priority=["nan_decode", "torch"])
    assert sel.prefill == "torch"
    text = caplog.text
    assert "raise_prefill prefill: rejected: raised RuntimeError: injected failure" in text
    assert "nan_decode decode: rejected" in text
