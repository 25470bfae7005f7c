"""Dispatch tables through select(): built, cached and reused (with the worker replaced by injected results, and the
real worker on the CPU grid), timing budgets and their shares, the outlier rule, argument errors; GPU: graph mode."""
import logging

import pytest
import torch

from attnsel import AttentionSpec, SelectionError, select
from attnsel.selection import build_table
from attnsel.validate import grid as bucket_grid
from attnsel.validate import runner, timing
from tests.fixtures.dispatch import DEC, GPU_SPEC, PRE, SPEC, fake_worker, measured


def test_select_builds_and_caches_the_tables(monkeypatch):
    calls = []
    fake_worker(monkeypatch, {"prefill": measured("prefill", "eager", PRE),
                              "decode": measured("decode", "eager", DEC)}, calls)
    order = ["triton", "torch"]
    cold = select(SPEC, prefill_priority=order, decode_priority=order)
    assert cold.cache == "miss" and len(calls) == 1
    tasks = calls[0][0]
    assert tasks[-3:] == [(timing.TIMING_TASK, p) for p in ("prefill", "decode", "extend")]  # after validation
    assert calls[0][1]["decode"]["backends"] == order
    assert cold.dispatch["decode"].backend_for((1, 300)) == "torch"
    assert cold.dispatch["decode"].backend_for((100, 300)) == "triton"
    assert cold.prefill_backend_for(1, 64, 64) == "torch" and cold.prefill_backend_for(20, 1200, 60) == "triton"
    statuses = {c.name: c.status for c in cold.candidates["decode"]}
    assert statuses[cold.decode] == "selected"
    assert all(c.score_us for c in cold.candidates["decode"])
    warm = select(SPEC, prefill_priority=order, decode_priority=order)
    assert len(calls) == 1  # no worker: validation and tables from the cache
    assert warm.cache == "hit"
    for phase in ("prefill", "decode"):
        assert warm.dispatch[phase].to_json() == cold.dispatch[phase].to_json()
    # another bucket grid version is another table: timed again, validation still cached
    monkeypatch.setattr(timing, "GRID_VERSION", timing.GRID_VERSION + 1)
    again = select(SPEC, prefill_priority=order, decode_priority=order)
    assert len(calls) == 2 and all(t[0] == timing.TIMING_TASK for t in calls[1][0])
    assert calls[1][1]["decode"]["vouched"] == order
    assert again.cache == "miss"


def test_priority_and_explicit_choices_have_no_table(monkeypatch):
    calls = []
    fake_worker(monkeypatch, {}, calls)
    sel = select(SPEC, policy="priority", prefill_priority=["triton", "torch"], decode_priority=["triton", "torch"])
    assert sel.dispatch == {"prefill": None, "decode": None, "extend": None}
    assert all(t[0] != timing.TIMING_TASK for t in calls[0][0])
    assert sel.decode_backend_for(1, 10) == sel.decode_backend_for(256, 10**5) == "triton"
    explicit = select(SPEC, prefill="torch", decode="torch", extend="torch")
    assert explicit.dispatch == {"prefill": None, "decode": None, "extend": None}
    assert explicit.prefill_backend_for(64, 4096, 64) == "torch"


def test_timing_failure_falls_back_to_priority_with_a_reason(monkeypatch):
    def run_tasks(spec, tasks, *, device, timeout=None, measure=False, mode="eager"):
        out = {t: {"status": "valid", "reason": "", "max_abs_err": 1e-3, "tolerance": 1e-2, "time_s": 0.1}
               for t in tasks if t[0] != timing.TIMING_TASK}
        for t in tasks:
            if t[0] == timing.TIMING_TASK:
                out[t] = {"status": "rejected", "reason": "worker died with SIGSEGV while running @timing decode",
                          "time_s": None}
        return out, runner.RunStats(spawns=1)

    monkeypatch.setattr(runner, "run_tasks", run_tasks)
    sel = select(SPEC, prefill_priority=["triton", "torch"], decode_priority=["triton", "torch"])
    assert sel.dispatch["decode"] is None and sel.decode == "triton"
    assert "not timed: worker died with SIGSEGV" in sel.candidates["decode"][0].reason


def test_the_real_worker_times_the_cpu_grid_interleaved():
    sel = select(SPEC, prefill_priority=["triton", "torch"], decode_priority=["triton", "torch"])
    for phase in ("prefill", "decode"):
        table = sel.dispatch[phase]
        assert table is not None and table.grid_version == timing.GRID_VERSION
        labels = [b.label for b in table.buckets]
        assert labels == ([bucket_grid.prefill_label(l) for l in bucket_grid.CPU_PREFILL] if phase == "prefill"
                          else [f"{b}x{c}" for b, c in bucket_grid.CPU_DECODE])
        for b in table.buckets:
            assert set(b.times_us) == {"triton", "torch"} and all(v > 0 for v in b.times_us.values())
            assert set(b.spread) == {"triton", "torch"}
    assert sel.stats["spawns"] == 1 and sel.stats["timing_wall_s"] > 0


@pytest.mark.usefixtures("inproc_worker")
def test_selection_error_carries_what_was_found(monkeypatch):
    with pytest.raises(SelectionError) as exc:
        select(SPEC, prefill="fa3", policy="priority", decode_priority=["torch"])
    found = exc.value.selection
    assert found is not None and found.phases["prefill"].backend == ""
    assert "requested explicitly but is unavailable" in found.phases["prefill"].error
    assert found.decode == "torch"
    import pickle

    assert pickle.loads(pickle.dumps(exc.value)).selection.decode == "torch"  # survives the rank-0 broadcast


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graph_mode_rejects_a_backend_that_cannot_be_captured(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.dispatch:SYNCING")
    eager = select(GPU_SPEC, prefill="syncing", decode="syncing", cache_dir=str(tmp_path))
    assert eager.prefill == "syncing"  # valid in eager mode
    with pytest.raises(SelectionError, match="requested explicitly but is rejected: cannot serve under CUDA graphs: "
                                             "CUDA graph capture failed"):
        select(GPU_SPEC, prefill="syncing", decode="torch", mode="graph", cache_dir=str(tmp_path))
    auto = select(GPU_SPEC, mode="graph", policy="priority", prefill_priority=["syncing", "torch"],
                  decode_priority=["syncing", "torch"], cache_dir=str(tmp_path))
    assert auto.prefill == "torch" and auto.candidates["prefill"][0].status == "rejected"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_gpu_dispatch_table_serves_correct_outputs(tmp_path, mode):
    from attnsel.validate import cases
    from attnsel.validate.cases import check_output

    sel = select(GPU_SPEC, mode=mode, cache_dir=str(tmp_path), prefill_priority=["triton", "torch"],
                 decode_priority=["triton", "torch"])
    for phase in ("prefill", "decode"):
        table = sel.dispatch[phase]
        assert table is not None and len(table.buckets) >= 4, phase
        if phase == "decode":
            assert table.axes == (("batch",) if mode == "graph" else ("batch", "context"))
        assert all(min(b.spread.values()) < 1.0 for b in table.buckets)
    dev = torch.device("cuda")
    case = cases.make_case(GPU_SPEC, "decode", dev)
    run = sel.plan_decode(case.page_table, case.seq_lens, int(case.seq_lens.max()))
    assert check_output(GPU_SPEC, run(case.q, case.k_cache, case.v_cache), case)["status"] == "valid"
    case = cases.make_case(GPU_SPEC, "prefill", dev)
    run = sel.plan_prefill(case.cu_q, case.cu_k, case.max_q, case.max_k, case.q.shape[0])
    assert check_output(GPU_SPEC, run(case.q, case.k, case.v), case)["status"] == "valid"
    with pytest.raises(ValueError, match=r"^q: expected \[.*\] bf16 on cuda:0, got .* on cpu$"):
        run(case.q.cpu(), case.k, case.v)
    warm = select(GPU_SPEC, mode=mode, cache_dir=str(tmp_path), prefill_priority=["triton", "torch"],
                  decode_priority=["triton", "torch"])
    assert warm.cache == "hit" and warm.dispatch["decode"].to_json() == sel.dispatch["decode"].to_json()


def test_candidates_validated_by_a_worker_that_died_are_still_timed(monkeypatch, caplog):
    """triton decode passes in worker 1, then segfault_decode kills it; the runner vouches in worker 2's timing job
    for what worker 1 validated, so no third worker is needed: the table covers triton and torch, and it is
    cached."""
    import logging

    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:ALL")
    kw = dict(prefill="torch", decode_priority=["triton", "segfault_decode", "torch"])
    with caplog.at_level(logging.INFO):
        sel = select(SPEC, **kw)
    assert sel.stats["deaths"] == 1 and sel.stats["spawns"] == 2
    table = sel.dispatch["decode"]
    assert table is not None and all(set(b.times_us) == {"triton", "torch"} for b in table.buckets)
    assert "timing the decode candidates on the bucket grid" in caplog.text  # the progress line says what runs
    again = select(SPEC, **kw)
    assert again.stats["spawns"] == 0 and again.dispatch["decode"].to_json() == table.to_json()


@pytest.mark.usefixtures("thread_or_process_worker")  # the cache's business: a thread by default
def test_a_table_whose_candidate_the_outlier_rule_rejects_is_reused(monkeypatch, tmp_path):
    """biased is rejected (by its own rows' check; the cross-candidate outlier rule, applied on every selection from
    the cached errors, would reject it too); the table of the others is stored under the key the lookup asks with,
    biased included, so the second run is a hit, no worker (under a key without biased every run would time
    again)."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:PRECISE_AND_BIASED")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=16)
    kw = dict(budget_s=2, prefill="torch", decode_priority=["precise", "biased", "torch"])
    first = select(spec, **kw)
    biased = next(c for c in first.candidates["decode"] if c.name == "biased")
    assert biased.status == "rejected" and "exceeds tolerance" in biased.reason
    assert first.dispatch["decode"] is not None and first.stats["spawns"] == 1
    again = select(spec, **kw)
    assert again.cache == "hit" and again.stats["spawns"] == 0
    assert again.dispatch["decode"].to_json() == first.dispatch["decode"].to_json()
    assert next(c for c in again.candidates["decode"] if c.name == "biased").status == "rejected"


@pytest.mark.usefixtures("thread_or_process_worker")  # the cache's business: a thread by default
def test_a_table_whose_candidate_got_no_time_is_reused_with_its_reason(monkeypatch, tmp_path):
    """stale_when_timed is valid but wrong in every timed bucket: the table (torch alone timed) is complete in the
    sense that matters, every missing time has its recorded reason, so it is stored and the next run reuses it
    (before: never stored, every run spawned a worker and timed again)."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:STALE_WHEN_TIMED")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(4, 2, 64, "fp32", page_size=16)
    kw = dict(budget_s=2, prefill_priority=["stale_when_timed", "torch"], decode="torch")
    first = select(spec, **kw)
    stale = next(c for c in first.candidates["prefill"] if c.name == "stale_when_timed")
    assert stale.reason.startswith("computed a wrong output at a timed shape") and "1x16: wrong output" in stale.reason
    again = select(spec, **kw)
    assert again.cache == "hit" and again.stats["spawns"] == 0
    assert next(c for c in again.candidates["prefill"] if c.name == "stale_when_timed").reason == stale.reason
    assert again.prefill == first.prefill == "torch"


@pytest.mark.usefixtures("thread_or_process_worker")
def test_a_candidate_wrong_at_a_timed_shape_serves_no_shape_of_the_phase(monkeypatch, tmp_path):
    """wrong_at_4 passes validation (no case has 4 sequences) and computes garbage on batches of 4: timing caught it
    there, but it still won the other buckets and served the batches a lookup takes to them, including batches of 4
    by interpolation or near a bucket it won. A candidate that computed a wrong output at any timed shape now
    serves none of the phase, with the reason in the report; the cached table keeps that verdict."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:WRONG_AT_BATCH_4")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(4, 2, 64, "fp32", page_size=16)
    kw = dict(budget_s=4, prefill="torch", decode_priority=["wrong_at_4", "torch"])
    for run in ("cold", "cached"):
        sel = select(spec, **kw)
        bad = next(c for c in sel.candidates["decode"] if c.name == "wrong_at_4")
        assert bad.status == "rejected" and "wrong output" in bad.reason and "serves no decode batch" in bad.reason, run
        table = sel.dispatch["decode"]
        assert {b.backend for b in table.buckets} == {"torch"}, run
        assert {table.backend_for((n, c)) for n in range(1, 40) for c in (16, 32, 256)} == {"torch"}, run
    assert sel.cache == "hit"


@pytest.mark.usefixtures("thread_or_process_worker")
def test_out_of_memory_in_the_timed_output_check_is_no_wrong_output(monkeypatch, tmp_path):
    """oom_at_check_4 computes right answers and runs out of memory when the output check after the timed runs of a
    batch of 4 holds a second output: the machine's memory, not a verdict. The check's raise was recorded as "wrong
    output after the timed eager runs: raised OutOfMemoryError", so the candidate was rejected for every decode
    shape as if it computed garbage. It only loses the buckets where it ran out of memory."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:OOM_AT_CHECK_4")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(4, 2, 64, "fp32", page_size=16)
    sel = select(spec, budget_s=4, prefill="torch", decode_priority=["oom_at_check_4", "torch"])
    cand = next(c for c in sel.candidates["decode"] if c.name == "oom_at_check_4")
    assert cand.status in ("valid", "selected"), cand
    assert "wrong output" not in cand.reason and "OutOfMemoryError" in cand.reason, cand
    table = sel.dispatch["decode"]
    assert all("oom_at_check_4" not in b.times_us for b in table.buckets if b.key[0] == 4)
    assert any("oom_at_check_4" in b.times_us for b in table.buckets)


@pytest.mark.usefixtures("thread_or_process_worker")
def test_a_phase_whose_every_candidate_computed_garbage_is_refused(monkeypatch, tmp_path):
    """Both decode candidates compute garbage on batches of 4: with no table the selection fell back to the first
    valid candidate, which served that garbage. They are rejected now, so the selection fails and names why."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:WRONG_AT_BATCH_4_PAIR")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(4, 2, 64, "fp32", page_size=16)
    with pytest.raises(SelectionError, match=r"no backend can serve decode: wrong_at_4_1: rejected: computed a wrong "
                                             r"output at a timed shape, so it serves no decode batch: 4x32: wrong"):
        select(spec, budget_s=2, prefill="torch", decode_priority=["wrong_at_4_1", "wrong_at_4_2"])


@pytest.mark.usefixtures("thread_or_process_worker")
def test_a_phase_whose_every_candidate_failed_its_timing_says_what_failed(monkeypatch, tmp_path):
    """Both decode candidates pass validation and raise in every timed run: no table. The report said "no candidate
    was timed in any bucket", as if nothing had run; it now quotes the first failure."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:RAISE_WHEN_TIMED")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(4, 2, 64, "fp32", page_size=16)
    sel = select(spec, budget_s=2, prefill="torch", decode_priority=["raise_when_timed_1", "raise_when_timed_2"])
    assert sel.dispatch.get("decode") is None
    for cand in sel.candidates["decode"]:
        assert "no candidate has a time on every shape of any bucket; first failure: 1x32: raised RuntimeError: " \
               "stand-in kernel failure" in cand.reason, cand


def test_the_time_budget_keeps_the_coarse_grid_and_skips_the_rest(monkeypatch):
    grid = [(0, (1, 16)), (0, (4, 16)), (1, (2, 16))]
    out = timing.measure(SPEC, "decode", ["torch"], torch.device("cpu"), "eager", budget_s=1e-9, reps=1, grid=grid)
    assert [b["label"] for b in out["buckets"]] == ["1x16"]  # the first bucket always runs
    assert out["skipped"] == ["4x16", "2x16"]
    table = build_table(out, ["torch"])
    assert table.skipped == ("4x16", "2x16") and table.backend_for((64, 10**5)) == "torch"
    monkeypatch.setenv("ATTNSEL_TIMING_BUDGET_S", "-1")
    with pytest.raises(ValueError, match=r"^ATTNSEL_TIMING_BUDGET_S='-1': expected a positive number of seconds"):
        select(SPEC)
    with pytest.raises(ValueError, match="budget_s must be a positive number of seconds"):
        select(SPEC, budget_s=0)


@pytest.mark.usefixtures("thread_or_process_worker")  # the cache's business: a thread by default
def test_a_table_cut_by_the_budget_is_timed_again_under_a_larger_one(monkeypatch, tmp_path):
    """A table the budget cut short (skipped buckets) is timed again by a run with a larger budget than the one that
    cut it, so raising ATTNSEL_TIMING_BUDGET_S takes effect without `attnsel cache clear`; the same or a smaller
    budget reuses it, and a table without skipped buckets is reused under any budget."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:TORCH_COPY")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    kw = dict(prefill="torch", decode_priority=["torch", "torch_copy"])
    cut = select(SPEC, budget_s=1e-6, **kw)
    assert cut.dispatch["decode"].skipped and cut.stats["spawns"] == 1
    same = select(SPEC, budget_s=1e-6, **kw)
    assert same.cache == "hit" and same.stats["spawns"] == 0
    larger = select(SPEC, budget_s=60, **kw)
    assert larger.cache == "miss" and larger.stats["spawns"] == 1
    assert not larger.dispatch["decode"].skipped
    assert select(SPEC, budget_s=1e-6, **kw).cache == "hit"  # the full table serves a smaller budget too


@pytest.mark.usefixtures("thread_or_process_worker")  # the cache's business: a thread by default
def test_the_budget_a_table_records_is_its_phases_share(monkeypatch, tmp_path):
    """Both phases timed share the budget; the table records the decode phase's share, so a later run that times
    decode alone under the same total (decode's share doubles) times it again; and an infinite budget ("no
    limit", capped by the worker) records null, not Infinity, which the cache would read back as malformed and
    time again on every run."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:TORCH_COPY")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    both = dict(prefill_priority=["torch", "torch_copy"], decode_priority=["torch", "torch_copy"], extend="torch")
    decode_only = dict(prefill="torch", decode_priority=["torch", "torch_copy"], extend="torch")

    def stored():
        from attnsel.cache import ResultCache
        return sorted((e["phase"], e["budget_s"]) for e in ResultCache().entries().values() if e.get("kind") == "dispatch")

    first = select(SPEC, budget_s=2e-6, **both)
    assert first.dispatch["decode"].skipped and stored() == [("decode", 1e-6), ("prefill", 1e-6)]
    again = select(SPEC, budget_s=2e-6, **decode_only)
    assert again.cache == "miss" and again.stats["spawns"] == 1 and ("decode", 2e-6) in stored()
    assert select(SPEC, budget_s=2e-6, **decode_only).cache == "hit"
    monkeypatch.setenv("ATTNSEL_TIMING_BUDGET_S", "inf")
    unlimited = select(SPEC, **decode_only)
    assert unlimited.cache == "miss" and ("decode", None) in stored()
    warm = select(SPEC, **decode_only)
    assert warm.cache == "hit" and warm.stats["spawns"] == 0


@pytest.mark.usefixtures("thread_or_process_worker")  # the cache's business: a thread by default
def test_no_table_is_timed_where_the_outlier_rule_leaves_one_candidate(monkeypatch, tmp_path):
    """biased is rejected (by its own rows' check, or the outlier rule), leaving one candidate and no table. A warm
    run applies the rejection before counting valid candidates: a hit, no worker (counting two would time the phase
    on every run, for a table then thrown away)."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:PRECISE_AND_BIASED")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path))
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=16)
    kw = dict(budget_s=2, prefill="torch", decode_priority=["precise", "biased"])
    first = select(spec, **kw)
    assert first.decode == "precise" and first.dispatch["decode"] is None
    assert {c.name: c.status for c in first.candidates["decode"]}["biased"] == "rejected"
    again = select(spec, **kw)
    assert again.cache == "hit" and again.stats["spawns"] == 0 and again.decode == "precise"


@pytest.mark.usefixtures("inproc_worker")
def test_select_names_arguments_of_a_wrong_type(tmp_path):
    """A priority given as the CLI's "a,b" text is split on commas (not read letter by letter: "unknown backend
    't'"); timeout="10" and budget_s="5" (else a bare TypeError) and a dict spec (else an AttributeError after every
    backend's check had logged a traceback) are refused, naming the argument."""
    spec = AttentionSpec(4, 2, 64, dtype="fp32")
    sel = select(spec, policy="priority", prefill_priority="triton, torch", decode_priority="torch",
                 cache_dir=str(tmp_path))
    assert sel.candidates["decode"][0].name == "torch"
    assert [c.name for c in sel.candidates["prefill"]] == ["triton", "torch"]
    for kwargs, message in (({"timeout": "10"}, r"^timeout must be a positive number of seconds or None, got '10'$"),
                            ({"budget_s": "5"}, r"^budget_s must be a positive number of seconds or None, got '5'$"),
                            ({"timeout": True}, r"^timeout must be a positive number")):
        with pytest.raises(ValueError, match=message):
            select(spec, policy="priority", cache_dir=str(tmp_path), **kwargs)
    with pytest.raises(TypeError, match=r"^spec must be an attnsel.AttentionSpec, got dict \(AttentionSpec.from_dict"):
        select({"num_q_heads": 4}, policy="priority", cache_dir=str(tmp_path))

