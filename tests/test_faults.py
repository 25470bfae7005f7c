"""Fault matrix: real faults in plugin backends, all in one auto selection (by default one fault of each kind the
runner tells apart, in prefill; the slow stage: every fault, each in prefill and in decode); then the faults about
the machine (failed start, out of memory, a case that cannot be built), a worker that will not exit, and a parent
interrupted mid-selection."""
import types
import logging
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from attnsel import select
from attnsel.cache import ResultCache
from attnsel.selection import SelectionError
from attnsel.spec import AttentionSpec
from attnsel.validate import runner
from tests.fixtures.fault_backends import BROKEN_CONTEXT, FAULTS

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
    "sticky": f"raised RuntimeError: {BROKEN_CONTEXT}",
    "poison": "the process could not compute after it ran",
}
DEATHS = ("segfault", "abort", "hang")
RESTARTS = ("import_error", "raise", "sticky", "poison")  # the worker survives, but is not trusted afterwards
# One fault of each kind the runner tells apart: a death by signal, a timeout, a raise (the worker survives, is
# not trusted), a process left unable to compute (the health probe), a wrong output (no fault: a verdict).
KINDS = ("segfault", "hang", "raise", "poison", "nan")


@pytest.fixture(scope="module", params=[pytest.param((KINDS, ("prefill",)), id="kinds-prefill"),
                                        pytest.param((FAULTS, ("prefill", "decode")), id="all-both",
                                                     marks=pytest.mark.slow)])
def faulty(request, tmp_path_factory):
    faults, phases = request.param
    mp = pytest.MonkeyPatch()
    mp.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:ALL")
    cache_dir = tmp_path_factory.mktemp("cache")
    mp.setenv("ATTNSEL_CACHE_DIR", str(cache_dir))
    order = {p: [f"{f}_{p}" for f in faults if p in phases] + ["torch"] for p in ("prefill", "decode")}
    spawns_before = runner.spawn_count
    t0 = time.monotonic()
    sel = select(SPEC, policy="priority", prefill_priority=order["prefill"], decode_priority=order["decode"],
                 timeout=TIMEOUT)
    elapsed = time.monotonic() - t0
    mp.undo()
    return types.SimpleNamespace(sel=sel, elapsed=elapsed, spawns=runner.spawn_count - spawns_before,
                                 entries=ResultCache(cache_dir).entries(), faults=faults, phases=phases)


def test_fault_is_rejected_with_its_reason(faulty):
    wrong = []
    for phase in faulty.phases:
        cands = {c.name: c for c in faulty.sel.candidates[phase]}
        for fault in faulty.faults:
            cand = cands[f"{fault}_{phase}"]
            if cand.status != "rejected" or EXPECTED[fault].format(phase=phase) not in cand.reason:
                wrong.append(f"{fault}_{phase}: {cand.status}: {cand.reason}")
    assert not wrong, "\n".join(wrong)


def test_death_reasons_carry_the_stderr_tail(faulty):
    cands = {c.name: c for c in faulty.sel.candidates["prefill"]}
    # faulthandler in the worker prints the Python stack of the crash to stderr
    assert "stderr tail:" in cands["segfault_prefill"].reason
    assert "Segmentation fault" in cands["segfault_prefill"].reason
    if "abort" in faulty.faults:
        assert "Aborted" in cands["abort_prefill"].reason
    # a hung worker is asked for its stack before it is killed: the reason shows where it hung
    assert "fault_backends.py" in cands["hang_prefill"].reason


def test_auto_falls_back_and_parent_is_unharmed(faulty):
    assert (faulty.sel.prefill, faulty.sel.decode) == ("torch", "torch")
    assert faulty.sel.prefill_source == faulty.sel.decode_source == "auto"


def test_worker_respawned_only_after_faults(faulty):
    deaths = len(faulty.phases) * len(set(DEATHS) & set(faulty.faults))
    restarts = len(faulty.phases) * len(set(RESTARTS) & set(faulty.faults))
    assert faulty.sel.stats["deaths"] == deaths
    assert faulty.spawns == faulty.sel.stats["spawns"] == deaths + restarts + 1


def test_total_time_bounded_by_timeouts(faulty):
    # each hang costs a timeout; every other spawn costs a torch import (a few seconds on CPU)
    assert faulty.elapsed < len(faulty.phases) * TIMEOUT + faulty.spawns * 15


def test_a_broken_process_blames_no_later_candidate(faulty):
    """sticky/poison break the process as a CUDA fault breaks a context: every later call there raises. The next
    candidates run in a fresh worker, torch is valid in both phases, and that is what the cache holds."""
    verdicts = {(e["backend"], e["phase"]): e["status"] for e in faulty.entries.values() if "backend" in e}
    for phase in ("prefill", "decode"):
        assert {c.name: c.status for c in faulty.sel.candidates[phase]}["torch"] == "selected"
        assert verdicts[("torch", phase)] == "valid"
    for phase in faulty.phases:
        for fault in set(faulty.faults) & {"sticky", "poison"}:
            assert verdicts[(f"{fault}_{phase}", phase)] == "rejected"
    assert not any("could not build" in e.get("reason", "") for e in faulty.entries.values())


def test_crashes_are_cached_timeouts_are_not(faulty):
    cached = {(e["backend"], e["phase"]) for e in faulty.entries.values() if "backend" in e}
    for phase in faulty.phases:
        assert (f"segfault_{phase}", phase) in cached
        assert (f"hang_{phase}", phase) not in cached  # a timeout may be a slow first JIT build


# Faults whose handling is the selecting process's take thread_or_process_worker (conftest.py): the worker runs in
# a thread of the test process by default (tests/fixtures/inproc_worker.py), in a spawned process in the slow stage.


@pytest.mark.slow
def test_timeouts_are_not_cached_but_crashes_are(monkeypatch):
    from attnsel.cache import ResultCache

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:ALL")
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


@pytest.mark.usefixtures("thread_or_process_worker")
def test_rejections_are_logged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:ALL")
    with caplog.at_level(logging.WARNING):
        sel = select(SPEC, policy="priority", prefill_priority=["raise_prefill", "torch"],
                     decode_priority=["nan_decode", "torch"])
    assert sel.prefill == "torch"
    text = caplog.text
    assert "raise_prefill prefill: rejected: raised RuntimeError: injected failure" in text
    assert "nan_decode decode: rejected" in text


# ---- faults about the machine: reported, retried once, never cached --------------------------------------------

PRIO = dict(policy="priority", prefill_priority=["torch"], decode_priority=["torch"])


def _cached() -> dict:
    return {(e["backend"], e["phase"]): e for e in ResultCache().entries().values() if "backend" in e}


def test_failed_start_is_retried_once_and_not_cached(tmp_path, monkeypatch):
    """A worker that exits before "ready" (here: a plugin import kills it) is about the machine: the first failure
    is retried; two in a row reject the tasks as transient, nothing is cached, and the next selection works
    without `attnsel cache clear`."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_start:BACKENDS")
    monkeypatch.setenv("ATTNSEL_TEST_FAIL_START", "3")
    monkeypatch.setenv("ATTNSEL_TEST_FAIL_START_COUNT", str(tmp_path / "starts"))
    with pytest.raises(SelectionError) as err:
        select(SPEC, **PRIO)
    cand = err.value.selection.candidates["prefill"][0]
    assert cand.status == "rejected"
    assert "validation worker failed before it was ready: worker exited with code 17" in cand.reason
    assert "not cached" in cand.reason
    assert _cached() == {}
    sel = select(SPEC, **PRIO)  # third start fails too, its retry works
    assert sel.stats["spawns"] == 2 and sel.stats["deaths"] == 1
    assert (sel.prefill, sel.decode) == ("torch", "torch")
    assert {k: e["status"] for k, e in _cached().items()} == {("torch", "prefill"): "valid",
                                                              ("torch", "decode"): "valid",
                                                              ("torch", "extend"): "valid"}


def test_case_that_cannot_be_built_blames_no_candidate(tmp_path, monkeypatch):
    """make_case failing is attnsel's or the machine's fault: retried in a fresh worker, never blamed on the
    candidate about to run."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_case:BACKENDS")
    monkeypatch.setenv("ATTNSEL_TEST_FAIL_CASE_COUNT", str(tmp_path / "cases"))
    monkeypatch.setenv("ATTNSEL_TEST_FAIL_CASE", "1")
    sel = select(SPEC, **PRIO)
    assert (sel.prefill, sel.decode) == ("torch", "torch")
    assert _cached()[("torch", "decode")]["status"] == "valid"


@pytest.mark.slow
def test_case_that_cannot_be_built_twice_is_not_cached(tmp_path, monkeypatch):
    """Failing twice rejects that phase's tasks as transient (not cached)."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_case:BACKENDS")
    monkeypatch.setenv("ATTNSEL_TEST_FAIL_CASE_COUNT", str(tmp_path / "cases"))
    monkeypatch.setenv("ATTNSEL_TEST_FAIL_CASE", "2")
    with pytest.raises(SelectionError) as err:
        select(SPEC, **PRIO)
    cand = err.value.selection.candidates["decode"][0]
    assert cand.status == "rejected"
    assert "could not build the decode validation case: RuntimeError: injected case failure" in cand.reason
    assert "not cached" in cand.reason
    assert set(_cached()) == {("torch", "prefill"), ("torch", "extend")}  # decode alone failed


@pytest.mark.usefixtures("thread_or_process_worker")
def test_out_of_memory_is_retried_once_and_not_cached(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:OOM")
    before = runner.spawn_count
    sel = select(SPEC, policy="priority", prefill_priority=["oom", "torch"], decode_priority=["torch"])
    cand = sel.candidates["prefill"][0]
    assert cand.status == "rejected" and "OutOfMemoryError" in cand.reason
    assert "out of memory in two workers" in cand.reason
    assert runner.spawn_count - before == 3  # oom, oom again in a fresh worker, then the rest
    assert sel.prefill == "torch"
    assert ("oom", "prefill") not in _cached() and _cached()[("torch", "prefill")]["status"] == "valid"


def _probe_oom(monkeypatch, tmp_path, workers: int) -> dict:
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_probe:BACKENDS")
    monkeypatch.setenv("ATTNSEL_TEST_PROBE_OOM", str(workers))
    monkeypatch.setenv("ATTNSEL_TEST_PROBE_OOM_COUNT", str(tmp_path / "probe_ooms"))
    return dict(policy="priority", prefill_priority=["probe_oom", "torch"], decode_priority=["torch"])


def test_health_probe_out_of_memory_after_a_candidate_is_retried_not_cached(tmp_path, monkeypatch, caplog):
    """The probe after a candidate runs out of memory: about the machine, not the candidate; it is validated again
    in a fresh worker, where the probe passes, and that is what the cache keeps."""
    kw = _probe_oom(monkeypatch, tmp_path, workers=1)
    with caplog.at_level(logging.WARNING, logger="attnsel"):
        sel = select(SPEC, **kw)
    assert "probe_oom prefill: out of memory" in caplog.text and "retrying once in a fresh worker" in caplog.text
    assert sel.stats["spawns"] == 2 and sel.stats["deaths"] == 0
    assert sel.prefill == "probe_oom" and sel.candidates["prefill"][0].status == "selected"
    assert _cached()[("probe_oom", "prefill")]["status"] == "valid"
    again = select(SPEC, **kw)
    assert again.stats["spawns"] == 0 and again.prefill == "probe_oom" and again.candidates["prefill"][0].from_cache


@pytest.mark.slow
def test_health_probe_out_of_memory_twice_is_not_cached(tmp_path, monkeypatch):
    """Out of memory in the probe in two workers: the candidate is rejected for this selection only (transient);
    the next selection validates it again."""
    kw = _probe_oom(monkeypatch, tmp_path, workers=2)
    sel = select(SPEC, **kw)
    cand = sel.candidates["prefill"][0]
    assert cand.name == "probe_oom" and cand.status == "rejected", cand
    assert "health probe" in cand.reason and "CUDA out of memory" in cand.reason, cand.reason
    assert "out of memory in two workers" in cand.reason and "not cached" in cand.reason, cand.reason
    assert sel.prefill == "torch"
    assert ("probe_oom", "prefill") not in _cached()
    again = select(SPEC, **kw)
    assert again.prefill == "probe_oom" and not again.candidates["prefill"][0].from_cache


def test_a_worker_killed_from_outside_is_reported_not_cached(monkeypatch):
    """SIGKILL (the kernel's OOM killer) or SIGTERM says nothing about the backend: the candidate is
    rejected for this start, with the signal in its reason, and tried again at the next start."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:OOM_KILLED")
    sel = select(SPEC, policy="priority", prefill_priority=["oom_killed", "torch"], decode_priority=["torch"])
    cand = sel.candidates["prefill"][0]
    assert cand.status == "rejected" and "SIGKILL" in cand.reason
    assert sel.prefill == "torch"
    assert ("oom_killed", "prefill") not in _cached() and _cached()[("torch", "prefill")]["status"] == "valid"
    assert not any(c.from_cache for c in select(SPEC, policy="priority", prefill_priority=["oom_killed", "torch"],
                                                 decode_priority=["torch"]).candidates["prefill"][:1])


@pytest.mark.usefixtures("thread_or_process_worker")
def test_out_of_memory_while_timing_is_retried_and_not_cached(monkeypatch, caplog):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:OOM_TIMING")
    with caplog.at_level(logging.WARNING, logger="attnsel"):
        sel = select(SPEC, policy="measure", prefill_priority=["oom_timing", "torch"], decode_priority=["torch"])
    assert "@timing prefill: out of memory" in caplog.text and "retrying once in a fresh worker" in caplog.text
    assert sel.prefill in ("oom_timing", "torch")
    kinds = [e.get("kind") for e in ResultCache().entries().values()]
    assert "dispatch" not in kinds  # a table with an out-of-memory hole is not remembered


def test_worker_that_cannot_exit_is_killed_after_done(monkeypatch):
    """A library leaves a non-daemon thread: the worker cannot exit. Once "done" arrives it is killed, far below
    the validation timeout."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:NO_EXIT")
    t0 = time.monotonic()
    sel = select(SPEC, policy="priority", prefill_priority=["noexit", "torch"], decode_priority=["torch"],
                 timeout=60.0)
    elapsed = time.monotonic() - t0
    assert sel.prefill == "noexit" and sel.stats["spawns"] == 1
    assert elapsed < 25, elapsed
    workers = [p for p in psutil.Process().children(recursive=True)
               if "attnsel.validate.worker" in " ".join(p.cmdline())]
    assert workers == []


@pytest.mark.usefixtures("thread_or_process_worker")
def test_worker_path_reports_input_mutation(monkeypatch):
    """A candidate that writes into its inputs after computing its output is rejected (cases.run_case's input
    check, helper "correctness"), and the next candidate gets the case intact."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:MUTATE")
    sel = select(SPEC, policy="priority", prefill_priority=["mutate", "torch"], decode_priority=["mutate", "torch"])
    for phase in ("prefill", "decode"):
        cand = {c.name: c for c in sel.candidates[phase]}
        assert cand["mutate"].status == "rejected" and "changed its input" in cand["mutate"].reason
        assert cand["torch"].status == "selected"


_INTERRUPTED = """
import logging, signal, sys
# Ctrl-C as an interactive user's process gets it: a job started in the background by a non-interactive shell
# inherits SIGINT ignored (CI launched with `bash -c '... &'` did), and then the signal never reaches Python
signal.signal(signal.SIGINT, signal.default_int_handler)
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
from attnsel import select
from attnsel.spec import AttentionSpec
select(AttentionSpec(4, 2, 64, "fp32", page_size=4), policy="priority", prefill_priority=["hang_prefill", "torch"],
       decode_priority=["torch"], timeout=300)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_interrupted_parent_leaves_no_worker_and_no_log(tmp_path, sig):
    """Ctrl-C (SIGINT) or SIGTERM to the selecting process while a candidate runs: the worker is killed (and, for
    SIGINT, reaped by the parent) and no attnsel-worker-*.log is left in the temp directory."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), ATTNSEL_BACKENDS="tests.fixtures.fault_backends:ALL")
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED], env=env, stderr=subprocess.PIPE, text=True)
    worker = None
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            match = re.search(r"validation worker 1 started \(pid (\d+)\)", line)
            if match:
                worker = int(match.group(1))
            if "validating hang_prefill prefill" in line:
                break
        assert worker is not None, "".join(lines)
        time.sleep(0.5)  # inside the candidate's sleep
        proc.send_signal(sig)
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while not _gone(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(worker)
        assert list(tmp.glob("attnsel-worker-*")) == []
    finally:
        proc.kill()
        if worker is not None and not _gone(worker):
            os.kill(worker, signal.SIGKILL)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_gpu_real_cuda_fault_blames_only_its_candidate(monkeypatch):
    """A real device-side assert breaks the CUDA context of the worker: the candidates after it run in a fresh
    worker and are valid; the faulty one is rejected; the cache holds torch as valid."""
    import torch

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:CUDA_FAULT")
    spec = AttentionSpec(8, 2, 128, "bf16", 16)
    sel = select(spec, policy="priority", prefill_priority=["cuda_fault", "torch"],
                 decode_priority=["cuda_fault", "torch"], device=f"cuda:{torch.cuda.current_device()}")
    for phase in ("prefill", "decode"):
        cand = {c.name: c for c in sel.candidates[phase]}
        assert cand["cuda_fault"].status == "rejected", cand["cuda_fault"]
        assert cand["torch"].status == "selected", cand["torch"]
        assert _cached()[("torch", phase)]["status"] == "valid"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fingerprint_and_capability_of_the_device_used():
    import torch

    from attnsel.device import capability_reason, fingerprint, resolve

    here = f"cuda:{torch.cuda.current_device()}"
    assert resolve("cuda") == here and fingerprint("cuda") == fingerprint(here)
    assert fingerprint(here)["capability"] == "{}.{}".format(*torch.cuda.get_device_capability())
    assert capability_reason(">= 8.0", lambda cap: True, torch.device("cpu")).endswith("got device cpu")
    assert capability_reason(">= 8.0", lambda cap: True, torch.device(here)) is None
