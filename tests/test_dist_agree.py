"""Ranks that ask different questions, or do not come: two real gloo ranks, each scenario in turn in one spawn; and
rank 0's errors that do not pickle, in a spawn of their own.

Every rank records, per scenario, what it got back or what it raised (type, message, seconds taken); the tests
below judge those records. The parent kills the ranks if they do not finish in time, so a hang fails, not blocks.
"""
import json
import os
import threading
import time

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from attnsel.spec import AttentionSpec

SLIDING = AttentionSpec(8, 4, 64, "fp16", sliding_window=4096)  # a Gemma-like pipeline stage: sliding layers first
FULL = AttentionSpec(8, 4, 64, "fp16")
DEADLINE_S = 90  # the ranks are killed after this: a hang


def _record(results: dict, name: str, call) -> None:
    start = time.monotonic()
    try:
        value = call()
        results[name] = {"value": value, "s": time.monotonic() - start}
    except Exception as exc:
        results[name] = {"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - start}


def _scenarios(rank: int, world: int, store: str, out_dir: str) -> None:
    os.environ["ATTNSEL_DIST_TIMEOUT_S"] = "3"  # short waits for this test (read at each call)
    import datetime

    from attnsel import select  # imported before the rendezvous: the ranks then ask in step
    from attnsel.dist import agree

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DEADLINE_S))

    results: dict = {}

    def picked(sel):
        return {"prefill": sel.prefill, "decode": sel.decode, "spec": sel.spec.to_dict()}

    # (b) the same question: rank 0's answer on every rank; rank 1's decide never runs
    _record(results, "same", lambda: agree(lambda: f"decided by rank {rank}", {"spec": FULL, "phase": "decode"}))
    # (a) pipeline stages whose first layer differs: rank 0 asks for its sliding layers, rank 1 for its full ones
    _record(results, "different", lambda: picked(select(SLIDING if rank == 0 else FULL, prefill="torch",
                                                       decode="torch", policy="priority")))
    # (d) rank 0's decision fails (fa3 needs a CUDA GPU; nothing to validate): every rank raises rank 0's error
    _record(results, "decide_raises", lambda: picked(select(FULL, prefill="fa3", decode="fa3", policy="priority")))

    # rank 0 decides for longer than the other ranks wait for it
    def slow() -> str:
        time.sleep(2.5)
        return "late"

    _record(results, "slow_decide", lambda: agree(slow, "slow", decide_timeout=1))
    # (c) rank 1 never asks: rank 0 must not wait for ever
    if rank == 0:
        _record(results, "absent", lambda: picked(select(FULL, prefill="torch", decode="torch", policy="priority")))
    dist.barrier()  # rank 1 waits here (the default group, not agree's) until rank 0 is done
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    dist.destroy_process_group()


def _run_ranks(fn, out) -> list[dict]:
    """fn on two spawned ranks (a file store under ``out``); each rank's JSON record, or a failure after
    DEADLINE_S (the ranks killed) where they hang."""
    ctx = mp.spawn(fn, args=(2, str(out / "store"), str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail(f"the ranks hung: not done after {DEADLINE_S} s")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    return _run_ranks(_scenarios, tmp_path_factory.mktemp("agree"))


def test_same_question_gets_rank0s_answer(records):
    assert [r["same"] for r in records] == [{"value": "decided by rank 0", "s": r["same"]["s"]} for r in records]


def test_different_specs_raise_on_every_rank_naming_both(records):
    for rank, r in enumerate(records):
        got = r["different"]
        assert got.get("error") == "AgreementError", (rank, got)
        message = got["message"]
        assert "rank 0 asked: " in message and "rank 1 asked: " in message
        assert "sliding_window=4096" in message and "sliding_window=None" in message, message
        assert "They differ in: spec." in message, message
        assert "same calls in the same order" in message, message


def test_rank0s_decide_error_reaches_every_rank(records):
    errors = [(r["decide_raises"].get("error"), r["decide_raises"].get("message")) for r in records]
    assert errors[0][0] == "SelectionError" and "fa3" in errors[0][1], errors
    assert errors[1] == errors[0]


def test_waiting_for_a_slow_decision_times_out(records):
    waiting, deciding = records[1]["slow_decide"], records[0]["slow_decide"]
    assert waiting.get("error") == "AgreementError", waiting
    assert "rank 1 of 2 (asking: 'slow') waited 1 s for rank 0's answer" in waiting["message"], waiting
    assert waiting["s"] < 2.4, waiting  # not rank 0's 2.5 s
    assert deciding.get("error") == "AgreementError", deciding  # rank 0 does not go on alone either
    assert "rank 0 of 2" in deciding["message"] and "waited for the other ranks to take its answer" in deciding["message"]


def test_a_rank_that_never_asks_times_out(records):
    got = records[0]["absent"]
    assert got.get("error") == "AgreementError", got
    message = got["message"]
    assert message.startswith("rank 0 of 2 (asking: spec=AttentionSpec(num_q_heads=8"), message
    assert "waited 3 s for every rank to ask ($ATTNSEL_DIST_TIMEOUT_S) and at least one rank never did" in message
    assert got["s"] < 10, got
    assert "absent" not in records[1]


class _TwoArgError(RuntimeError):
    """An exception whose constructor takes two arguments but passes one message up (a plugin's, a library's): its
    pickle does not load again."""

    def __init__(self, what, why):
        super().__init__(f"{what}: {why}")


class _HoldsLock(RuntimeError):
    """An exception carrying an unpicklable attribute."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def _agree_ranks(rank: int, world: int, store: str, out_dir: str) -> None:
    import datetime

    from attnsel.dist import agree

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=DEADLINE_S))
    results = {}
    for name, exc_type in (("two_args", lambda: _TwoArgError("backend x", "kernel crashed")),
                           ("lock", lambda: _HoldsLock("backend y: kernel crashed"))):
        def decide():
            raise exc_type()
        start = time.monotonic()
        try:
            agree(decide, "q", timeout=10, decide_timeout=10)
            results[name] = {"value": "no error"}
        except Exception as exc:
            results[name] = {"error": type(exc).__name__, "message": str(exc), "s": time.monotonic() - start}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
    dist.destroy_process_group()


def test_rank0_errors_that_do_not_pickle_reach_every_rank_with_their_message(tmp_path):
    """rank 0's decide raises an exception that cannot make the trip (its pickle does not load, or does not dump):
    every rank must still raise promptly with rank 0's message, not wait out decide_timeout or blame the others."""
    r = _run_ranks(_agree_ranks, tmp_path)
    for name, text in (("lock", "kernel crashed"), ("two_args", "kernel crashed")):
        for rank in range(2):
            got = r[rank][name]
            assert "error" in got, (rank, name, got)
            assert text in got["message"], (rank, name, got)
            assert got["s"] < 8, (rank, name, got)


def test_timeouts_are_checked():
    from attnsel.dist import agree

    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds or None .*got 0"):
        agree(lambda: 1, "q", timeout=0)
    with pytest.raises(ValueError, match=r"decide_timeout must be .*got 'long'"):
        agree(lambda: 1, "q", decide_timeout="long")


def test_timeout_from_the_environment_is_checked(monkeypatch):
    from attnsel.dist import agree

    monkeypatch.setenv("ATTNSEL_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match=r"^ATTNSEL_DIST_TIMEOUT_S='soon': expected a positive number of seconds"):
        agree(lambda: 1, "q")
    monkeypatch.delenv("ATTNSEL_DIST_TIMEOUT_S")
    assert agree(lambda: 1, "q") == 1  # without a process group: just decide


def test_device_kind_of_the_cpu():
    from attnsel.device import kind

    assert kind("cpu") == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_gpu_device_kind_names_the_gpu():
    """Ranks on different GPUs ask different questions: the kind names the GPU, its capability and SM count."""
    import torch

    from attnsel.device import kind

    props = torch.cuda.get_device_properties(0)
    expected = f"cuda {props.name}, capability {props.major}.{props.minor}, {props.multi_processor_count} SMs"
    assert kind("cuda:0") == expected
    assert kind("cuda") == kind(f"cuda:{torch.cuda.current_device()}")
