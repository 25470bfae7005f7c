"""tests/fixtures/inproc_worker.py stands in for the spawned worker in most tests: the same job gives the same
results in a thread of this process as in a real worker, and what runner reads of a worker (events, exit code,
a traceback as the stderr tail) it reads the same way."""
import pytest

from attnsel.spec import AttentionSpec
from attnsel.validate import runner, worker
from tests.fixtures.inproc_worker import InProcessWorker

SPEC = AttentionSpec(4, 2, 64, "fp32", page_size=4)
TASKS = [("torch", "prefill"), ("wrong_prefill", "prefill"), ("nan_decode", "decode"), ("torch", "decode")]


def _comparable(results: dict) -> dict:
    return {key: (r["status"], r.get("reason", "").split(" (")[0], "fault" in r) for key, r in results.items()}


def test_a_job_gives_the_same_results_in_a_thread_as_in_a_process(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:ALL")
    spawned, real_stats = runner.run_tasks(SPEC, TASKS, device="cpu")
    monkeypatch.setattr(runner, "_Worker", InProcessWorker)
    before = runner.spawn_count
    threaded, stats = runner.run_tasks(SPEC, TASKS, device="cpu")
    assert _comparable(threaded) == _comparable(spawned)
    assert [r["status"] for r in threaded.values()] == ["valid", "rejected", "rejected", "valid"]
    assert (stats.spawns, runner.spawn_count - before) == (real_stats.spawns, 1) == (1, 1)


def test_a_job_that_raises_is_a_worker_that_exited_with_its_traceback(monkeypatch):
    def broken(job, emit):
        emit(event="ready", pid=0)
        raise RuntimeError("the job loop itself failed")

    monkeypatch.setattr(worker, "run", broken)
    with InProcessWorker({"tasks": []}) as fake:
        assert fake.next_event(5) == {"event": "ready", "pid": 0}
        assert fake.next_event(5) is None
    assert fake.proc.returncode == 1 and fake.proc.poll() == 1
    assert fake.tail().endswith("RuntimeError: the job loop itself failed")


def test_a_device_that_cannot_compute_exits_with_start_failed(monkeypatch):
    monkeypatch.setattr(worker, "probe", lambda device: "a small SDPA differs from matmul + softmax by 1")
    with InProcessWorker({"spec": SPEC.to_dict(), "device": "cpu", "tasks": []}) as fake:
        assert fake.next_event(30) is None
    assert fake.proc.returncode == worker.START_FAILED


@pytest.mark.parametrize("code", [0, worker.START_FAILED])
def test_the_spawned_worker_exits_with_the_job_loops_code(monkeypatch, code):
    """worker.main() exits with what worker.run returned (the exit code runner reads for a failed start)."""
    monkeypatch.setattr(worker.json, "load", lambda stdin: {"tasks": []})
    monkeypatch.setattr(worker, "run", lambda job, emit: code)
    monkeypatch.setattr(worker.os, "dup2", lambda a, b: None)
    monkeypatch.setattr(worker.faulthandler, "register", lambda *a: None)
    monkeypatch.setattr(worker.sys, "stdout", worker.sys.stdout)
    if code:
        with pytest.raises(SystemExit) as exc:
            worker.main()
        assert exc.value.code == code
    else:
        worker.main()
