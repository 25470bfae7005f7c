import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One CPU thread per process (set before torch and numpy start their thread pools; the workers and subprocesses the
# tests start inherit it; a variable already set wins): on a 2-core machine pytest's process and the workers it
# spawns share the cores, and OpenMP's threads spin-waiting for each other made a tiny model's generate take 10 s
# instead of 0.3 s and the Triton interpreter tests 1.5x longer.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
# Triton decides at decoration time whether to interpret: set before any kernel module is imported. CUDA machines
# run the kernels compiled (the GPU tests), CPU machines in the interpreter.
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    """Every test gets its own cache directory, no plugins unless it sets them, and `tests` importable in workers."""
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ATTNSEL_BACKENDS", raising=False)
    monkeypatch.delenv("ATTNSEL_VALIDATION_TIMEOUT", raising=False)
    for name in ("LOCAL_KERNELS", "ATTNSEL_KERNEL_OPTIONS"):  # hf.register() sets these on transformers >= 5.25:
        monkeypatch.setenv(name, "")  # recorded (absent or not) so that teardown restores it, then removed
        monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


@pytest.fixture
def inproc_worker(monkeypatch):
    """Validation jobs run in a thread of this process (tests/fixtures/inproc_worker.py) instead of a spawned worker:
    for tests of what the selecting process does with the results, not of the process itself. CPU machines only:
    on a CUDA machine (the GPU tests) the real worker runs, so that no backend's fault can reach the test process."""
    if _cuda:
        return
    from attnsel.validate import runner
    from tests.fixtures.inproc_worker import InProcessWorker

    monkeypatch.setattr(runner, "_Worker", InProcessWorker)


@pytest.fixture(params=["thread", pytest.param("process", marks=pytest.mark.slow)])
def thread_or_process_worker(request, monkeypatch):
    """Each test that takes this runs twice: with the worker in a thread of this process (the default run) and with
    the spawned worker process (the slow stage). On a CUDA machine both spawn the real worker (inproc_worker)."""
    if request.param == "thread" and not _cuda:
        from attnsel.validate import runner
        from tests.fixtures.inproc_worker import InProcessWorker

        monkeypatch.setattr(runner, "_Worker", InProcessWorker)
    return request.param
