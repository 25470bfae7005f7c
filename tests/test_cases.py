"""The validation cases and checks (attnsel/validate/cases.py) against real faulty backends
(tests/fixtures/fault_numerics.py): decode traps, zero-length rows, a tolerance independent of every backend, the
cross-candidate outlier rule, inputs changed by a candidate, and every spec feature (a backend that gets a feature
wrong is rejected)."""
import math

import pytest
import torch

from attnsel import select
from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.backends.torch_sdpa import TorchBackend
from attnsel.selection import SelectionError
from attnsel.spec import AttentionSpec
from attnsel.validate import cases, paged_cases, spot, yardstick
from tests.fixtures import fault_numerics as faults

CPU = torch.device("cpu")
SPEC = AttentionSpec(4, 2, 64, "fp16", page_size=4)
DTYPES = ["fp32", "fp16", "bf16"]


def judge(backend, spec: AttentionSpec, phase: str, case=None) -> dict:
    """What the worker does with one candidate: run it on the case, reject what raises, check the output."""
    case = case if case is not None else cases.make_case(spec, phase, CPU)
    try:
        out = cases.run_case(backend, spec, case)
    except Exception as exc:
        return {"status": "rejected", "reason": f"raised {type(exc).__name__}: {exc}"}
    return cases.check_output(spec, out, case)


def _used_pages(case, ps):
    return [math.ceil(n / ps) for n in case.seq_lens.tolist()]


# --- item 1: decode never reads past a sequence -------------------------------------------------------------------

def test_decode_case_plants_the_traps():
    case = cases.decode_case(SPEC, CPU)
    ps, num_pages = SPEC.page_size, case.k_cache.shape[0]
    lens = case.seq_lens.tolist()
    assert 0 in lens  # a zero-length row
    assert (case.ref[lens.index(0)] == 0).all()
    unused_columns, last_slots = set(), []
    for b, (n, used) in enumerate(zip(lens, _used_pages(case, ps))):
        unused_columns.update(case.page_table[b, used:].tolist())
        if n % ps:
            last = int(case.page_table[b, used - 1])
            last_slots.append(case.k_cache[last, n % ps:].float())
            last_slots.append(case.v_cache[last, n % ps:].float())
    assert {-1, num_pages} <= unused_columns  # out-of-range sentinels
    garbage_pages = unused_columns - {-1, num_pages}
    assert any(case.k_cache[p].float().isnan().all() for p in garbage_pages)  # a page of NaN
    assert any(case.k_cache[p].float().abs().max() > 100 for p in garbage_pages)  # a page of large garbage
    slots = torch.cat([s.flatten() for s in last_slots])
    assert slots.isnan().any() and (slots == float("inf")).any() and (slots == float("-inf")).any()


def test_old_torch_decode_fails_the_new_case():
    result = judge(faults.OLD_TORCH, SPEC, "decode")
    assert result["status"] == "rejected"
    assert "seq_lens must be >= 1" in result["reason"]  # the zero-length row


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_decode_trap_catches_the_old_decode(dtype, monkeypatch):
    """Without the zero-length row, the old decode still fails on the sentinels (index error), then on NaN/inf in
    unused slots once the sentinels point at a real page; without both traps it passes: the traps catch it."""
    spec = AttentionSpec(4, 2, 64, dtype, page_size=4)
    lengths = cases.decode_lengths
    monkeypatch.setattr(paged_cases, "decode_lengths", lambda s, d: ([n for n in lengths(s, d)[0] if n], 0))
    case = cases.decode_case(spec, CPU)
    assert judge(TORCH, spec, "decode", case)["status"] == "valid"
    result = judge(faults.OLD_TORCH, spec, "decode", case)
    assert result["status"] == "rejected" and "raised IndexError" in result["reason"]

    lens, ps = case.seq_lens.tolist(), spec.page_size
    full_page = int(case.page_table[lens.index(2 * ps), 0])  # a page of real, finite values
    for b, used in enumerate(_used_pages(case, ps)):
        case.page_table[b, used:] = full_page
    assert judge(TORCH, spec, "decode", case)["status"] == "valid"
    result = judge(faults.OLD_TORCH, spec, "decode", case)
    assert result["status"] == "rejected" and "NaN or inf" in result["reason"]

    case.k_cache.copy_(case.k_cache.float().nan_to_num(0.0, 0.0, 0.0).to(case.k_cache.dtype))
    case.v_cache.copy_(case.v_cache.float().nan_to_num(0.0, 0.0, 0.0).to(case.v_cache.dtype))
    assert judge(faults.OLD_TORCH, spec, "decode", case)["status"] == "valid"


# --- item 5: zero-length rows give zeros ----------------------------------------------------------------------------

@pytest.mark.parametrize("features", [{}, {"sinks": True}, {"softcap": 20.0}, {"sliding_window": 3},
                                      {"kv_dtype": "fp8_e4m3"}], ids=lambda f: ",".join(f) or "plain")
def test_zero_length_rows_give_zeros(features):
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=4, **features)
    case = cases.decode_case(spec, CPU)
    out = cases.run_case(TORCH, spec, case)
    assert cases.check_output(spec, out, case)["status"] == "valid"
    zero = case.seq_lens.tolist().index(0)
    assert out[zero].eq(0).all()


def test_a_batch_of_padding_rows_only():
    spec = AttentionSpec(4, 2, 64, "fp16", page_size=4)
    q = torch.randn(3, 4, 64, dtype=torch.float16)
    cache = torch.full((2, 4, 2, 64), float("nan"), dtype=torch.float16)
    for table in (torch.tensor([[-1], [2], [7]], dtype=torch.int32), torch.zeros(3, 0, dtype=torch.int32)):
        out = TORCH.plan_decode(spec, table, torch.zeros(3, dtype=torch.int32))(q, cache, cache)
        assert out.eq(0).all()


def test_nan_rows_are_named_in_the_reason():
    case = cases.decode_case(SPEC, CPU)
    out = case.ref.to(SPEC.torch_dtype)
    out[2] = float("nan")
    reason = cases.check_output(SPEC, out, case)["reason"]
    assert "output values are NaN or inf, in sequence 2 (seq_len 0)" in reason


# --- item 3: a tolerance no backend sets, the torch backend judged like any other -----------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_top_left_causal_is_rejected(dtype):
    spec = AttentionSpec(4, 2, 64, dtype)
    result = judge(faults.TOP_LEFT, spec, "prefill")
    assert result["status"] == "rejected" and "exceeds tolerance" in result["reason"]
    assert "k_len 40" in result["reason"]  # the sequence whose queries are the last of its keys


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_output_off_by_one_is_rejected(dtype, phase):
    result = judge(faults.OFF_BY_ONE, AttentionSpec(4, 2, 64, dtype, page_size=4), phase)
    assert result["status"] == "rejected" and "exceeds tolerance" in result["reason"]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_tolerance_comes_from_no_backend(phase, monkeypatch):
    """Cases are built without any backend (a torch that raises changes nothing), and a broken torch is rejected on
    them like any other backend while the real one passes."""
    def broken(*args, **kwargs):
        raise RuntimeError("torch backend unavailable")

    monkeypatch.setattr(TorchBackend, "plan_prefill", broken)
    monkeypatch.setattr(TorchBackend, "plan_decode", broken)
    case = cases.make_case(SPEC, phase, CPU)
    monkeypatch.undo()
    assert judge(faults.BROKEN_TORCH, SPEC, phase, case)["status"] == "rejected"
    assert judge(TORCH, SPEC, phase, case)["status"] == "valid"
    assert case.yard_err.shape == case.ref.shape[:1] and (case.yard_err > 0).any()
    assert torch.equal(yardstick.row_tolerance(SPEC, case.yard_err), 4 * case.yard_err + yardstick.TOL_FLOOR["fp16"])


@pytest.mark.usefixtures("thread_or_process_worker")
def test_broken_torch_is_rejected_in_a_real_worker(monkeypatch):
    """A plugin named "torch" replaces the built-in: the worker rejects it in both phases (nothing is derived from
    it) and the selection falls back to a correct backend. (A worker thread by default, a process in the slow
    stage.)"""
    monkeypatch.setenv("ATTNSEL_BACKENDS",
                       "tests.fixtures.fault_numerics:BROKEN_TORCH,tests.fixtures.fault_numerics:TORCH_COPY")
    sel = select(SPEC, policy="priority", prefill_priority=["torch", "torch_copy"],
                 decode_priority=["torch", "torch_copy"])
    cands = {p: {c.name: c for c in sel.candidates[p]} for p in ("prefill", "decode")}
    assert cands["prefill"]["torch"].status == "rejected"
    assert "exceeds tolerance" in cands["prefill"]["torch"].reason
    assert cands["decode"]["torch"].status == "rejected"
    assert "seq_lens must be >= 1" in cands["decode"]["torch"].reason
    assert (sel.prefill, sel.decode) == ("torch_copy", "torch_copy")
    with pytest.raises(SelectionError, match="torch"):
        select(SPEC, prefill="torch", decode="torch_copy")


def test_outlier_rule_rejects_an_error_far_above_the_best():
    """Plain bf16 matmul/softmax with softcapped large logits is far worse than the torch backend: the rows' check
    rejects it (when it set the tolerance, it passed), and the cross-candidate rule would too."""
    spec = AttentionSpec(4, 2, 64, "bf16", softcap=50.0)
    case = cases.make_case(spec, "prefill", CPU)
    sloppy = judge(faults.SLOPPY, spec, "prefill", case)
    good = judge(TORCH, spec, "prefill", case)
    assert good["status"] == "valid"
    assert sloppy["status"] == "rejected" and "exceeds tolerance" in sloppy["reason"]
    best = min(sloppy["max_abs_err"], good["max_abs_err"])
    assert yardstick.outlier_reason(good["max_abs_err"], best, spec) is None
    reason = yardstick.outlier_reason(sloppy["max_abs_err"], best, spec)
    assert reason and "far above the best candidate's" in reason


def test_outlier_rule_keeps_errors_near_the_best():
    spec = AttentionSpec(4, 2, 64, "fp16")
    assert yardstick.outlier_reason(0.0015, 0.0, spec) is None  # below the floor
    assert yardstick.outlier_reason(0.01, 0.002, spec) is None
    assert yardstick.outlier_reason(0.03, 0.002, spec) is not None


def test_output_dtype_is_checked():
    case = cases.prefill_case(SPEC, CPU)
    result = cases.check_output(SPEC, case.ref.clone(), case)
    assert result["status"] == "rejected" and "output dtype torch.float32, expected torch.float16" in result["reason"]


# --- item 4: a candidate that writes into its inputs ----------------------------------------------------------------

@pytest.mark.parametrize("plugin,phase,changed", [
    (faults.MUTATE_PREFILL, "prefill", "q"), (faults.MUTATE_DECODE, "decode", "q"),
    (faults.SCRIBBLE_CACHE, "decode", "k_cache")], ids=lambda x: getattr(x, "name", str(x)))
def test_input_changing_candidate_is_rejected_and_the_next_is_not_blamed(plugin, phase, changed):
    case = cases.make_case(SPEC, phase, CPU)
    before = {name: getattr(case, name).clone() for name in case.INPUTS if getattr(case, name) is not None}
    result = judge(plugin, SPEC, phase, case)
    assert result["status"] == "rejected"
    assert f"changed its input(s) {changed} during plan/run" in result["reason"]
    for name, tensor in before.items():  # restored bit for bit (NaN traps included)
        assert cases._same_bits(getattr(case, name), tensor), name
    assert judge(TORCH, SPEC, phase, case)["status"] == "valid"


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_inputs_are_restored_when_the_candidate_raises(phase):
    case = cases.make_case(SPEC, phase, CPU)
    q = case.q.clone()
    result = judge(faults.MUTATE_THEN_RAISE, SPEC, phase, case)
    assert result["status"] == "rejected" and "injected failure" in result["reason"]
    assert torch.equal(case.q, q) and case.changed_inputs == ["q"]
    assert judge(TORCH, SPEC, phase, case)["status"] == "valid"


@pytest.mark.usefixtures("thread_or_process_worker")
def test_faults_in_a_real_worker(monkeypatch):
    """One auto selection over the numerical faults, in a worker (a thread by default, a process in the slow stage),
    plugins loaded like a user's: each rejected with its reason, torch after the input-changing candidates is valid
    and selected."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:ALL")
    sel = select(SPEC, policy="priority",
                 prefill_priority=["mutate_prefill", "top_left", "off_by_one", "mutate_then_raise", "stale_plan",
                                   "wrong_when_alone", "torch"],
                 decode_priority=["mutate_decode", "scribble_cache", "old_torch", "off_by_one", "stale_plan",
                                  "wrong_when_alone", "torch"])
    expected = {
        "prefill": {"mutate_prefill": "changed its input(s) q during plan/run", "top_left": "exceeds tolerance",
                    "off_by_one": "exceeds tolerance", "mutate_then_raise": "injected failure",
                    "stale_plan": "a second run of the same plan differs",
                    "wrong_when_alone": "on prefill q_lens=[83] k_lens=[83]: max abs error"},
        "decode": {"mutate_decode": "changed its input(s) q during plan/run",
                   "scribble_cache": "changed its input(s) k_cache during plan/run",
                   "old_torch": "seq_lens must be >= 1", "off_by_one": "exceeds tolerance",
                   "stale_plan": "a second run of the same plan differs",
                   "wrong_when_alone": "on decode seq_lens=[157] "},
    }
    for phase, reasons in expected.items():
        cands = {c.name: c for c in sel.candidates[phase]}
        for name, reason in reasons.items():
            assert cands[name].status == "rejected" and reason in cands[name].reason, (name, cands[name].reason)
        assert cands["torch"].status == "selected"
    assert (sel.prefill, sel.decode) == ("torch", "torch")


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_plan_that_goes_wrong_on_its_second_run_is_rejected(phase):
    """Engines run one plan for every layer: a plan right only on its first run (stale kernel state) is rejected,
    and its first output alone would have passed."""
    case = cases.make_case(SPEC, phase, CPU)
    result = judge(faults.STALE_PLAN, SPEC, phase, case)
    assert result["status"] == "rejected"
    assert "a second run of the same plan differs from the first" in result["reason"]
    assert (case.rerun_diff > yardstick.row_tolerance(SPEC, case.yard_err)).any()
    assert judge(TORCH, SPEC, phase)["status"] == "valid"
    fresh = cases.make_case(SPEC, phase, CPU)  # its first run alone is right: only the second run shows the fault
    plan = faults.STALE_PLAN.plan_prefill if phase == "prefill" else faults.STALE_PLAN.plan_decode
    args = ((fresh.cu_q, fresh.cu_k, fresh.max_q, fresh.max_k), (fresh.q, fresh.k, fresh.v)) if phase == "prefill" \
        else ((fresh.page_table, fresh.seq_lens), (fresh.q, fresh.k_cache, fresh.v_cache))
    assert cases.check_output(SPEC, plan(SPEC, *args[0])(*args[1]), fresh)["status"] == "valid"


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_plan_that_skips_its_work_after_the_first_run_is_rejected(phase):
    """A second run that writes nothing and hands back the first run's (right) buffer must not pass: the first output
    is NaN-filled before the second run."""
    result = judge(faults.SKIP_WORK, SPEC, phase)
    assert result["status"] == "rejected"
    assert "a second run of the same plan differs from the first by inf" in result["reason"]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_plan_that_recomputes_into_one_buffer_is_valid(phase):
    assert judge(faults.ONE_BUFFER, SPEC, phase)["status"] == "valid"


def test_rerun_difference_ignores_matching_nan_and_inf():
    a = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])

    def diff(b):
        return cases._row_difference(a, torch.tensor(b)).tolist()

    assert diff([[1.0, float("nan")], [float("inf"), 2.0]]) == [0.0, 0.0]
    assert diff([[1.0, 0.0], [float("inf"), 2.5]]) == [float("inf"), 0.5]
    assert diff([[1.0, float("nan")], [float("inf"), 2.5]]) == [0.0, 0.5]
    assert diff([[1.0, float("inf")], [float("inf"), 2.0]]) == [float("inf"), 0.0]  # nan vs inf


def test_grouped_reference_matches_a_per_head_loop():
    """reference_attention computes the heads of a GQA group as rows of one matmul; against a loop over heads with
    the KV head h // group, every feature on."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(5, 8, 16, generator=gen), torch.randn(9, 2, 16, generator=gen), torch.randn(9, 2, 16,
                                                                                                      generator=gen)
    sinks = torch.randn(8, generator=gen)
    got = cases.reference_attention(q, k, v, 0.3, True, window=4, softcap=2.0, sinks=sinks)
    for h in range(8):
        one = cases.reference_attention(q[:, h:h + 1], k[:, h // 4:h // 4 + 1], v[:, h // 4:h // 4 + 1], 0.3, True,
                                        window=4, softcap=2.0, sinks=sinks[h:h + 1])
        assert torch.allclose(got[:, h], one[:, 0], atol=1e-6)


def test_decode_table_is_much_wider_than_the_longest_sequence():
    """An engine's page table is sized for the longest possible sequence; FA3 sizes its split plan by the table's
    width, so the case's table has more unused columns than used ones."""
    case = cases.decode_case(SPEC, CPU)
    used = max(_used_pages(case, SPEC.page_size))
    assert case.page_table.shape[1] > 2 * used


@pytest.mark.parametrize("phase,shape", [("prefill", [5, 12, 1]), ("decode", (3, 9)), ("decode", [0, 7, 13])])
def test_spot_check_passes_right_outputs_and_names_a_wrong_row(phase, shape):
    from attnsel.validate import grid as bucket_grid

    plan_args, sets = bucket_grid.rotated_workloads(SPEC, phase, shape, CPU)
    plan = TORCH.plan_prefill if phase == "prefill" else TORCH.plan_decode
    out = plan(SPEC, *plan_args)(*sets[0])
    assert spot.spot_check(SPEC, phase, plan_args, sets[0], out, {}) is None
    bad = out.clone()
    bad[-1, 0, 0] += 0.5
    reason = spot.spot_check(SPEC, phase, plan_args, sets[0], bad, {})
    assert reason and "exceeds tolerance" in reason and f"row {out.shape[0] - 1}" in reason
    bad[0] = float("nan")
    assert "NaN or inf" in spot.spot_check(SPEC, phase, plan_args, sets[0], bad, {})


# --- every feature in the reference and the cases -------------------------------------------------------------------

FEATURE_CASES = [
    ("no_window", {"sliding_window": 5}), ("no_window", {"sliding_window": 300}),
    ("window_plus_one", {"sliding_window": 5}), ("window_plus_one", {"sliding_window": 300}),
    ("window_minus_one", {"sliding_window": 5}), ("window_minus_one", {"sliding_window": 300}),
    ("no_softcap", {"softcap": 50.0}), ("no_softcap", {"softcap": 30.0}),
    ("no_sinks", {"sinks": True}),
    ("no_window", {"sliding_window": 4, "softcap": 50.0, "sinks": True}),
]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("bug,features", FEATURE_CASES, ids=[f"{b}-{'-'.join(map(str, f.values()))}"
                                                              for b, f in FEATURE_CASES])
def test_a_backend_that_gets_a_feature_wrong_is_rejected(bug, features, phase):
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=4, **features)
    case = cases.make_case(spec, phase, CPU)
    assert judge(TORCH, spec, phase, case)["status"] == "valid"
    result = judge(faults.FEATURE_BUGS[bug], spec, phase, case)
    assert result["status"] == "rejected" and "exceeds tolerance" in result["reason"], result


@pytest.mark.parametrize("bug", ["ignore_kv_scale", "swap_kv_scale"])
def test_a_backend_that_gets_fp8_scales_wrong_is_rejected(bug):
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=4, kv_dtype="fp8_e4m3")
    case = cases.make_case(spec, "decode", CPU)
    assert judge(TORCH, spec, "decode", case)["status"] == "valid"
    result = judge(faults.FEATURE_BUGS[bug], spec, "decode", case)
    assert result["status"] == "rejected" and "exceeds tolerance" in result["reason"]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_window_cases_straddle_the_window(phase):
    w = 9
    spec = AttentionSpec(4, 2, 64, "fp16", page_size=4, sliding_window=w)
    if phase == "prefill":
        _, k_lens, boundary = cases.prefill_lengths(spec, CPU)
    else:
        k_lens, boundary = cases.decode_lengths(spec, CPU)
    assert boundary and {w - 1, w} <= set(k_lens[-boundary:])
    assert any(n < w for n in k_lens) and any(n > w for n in k_lens)


def test_fp8_case_stores_scaled_values_and_the_reference_dequantises():
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=4, kv_dtype="fp8_e4m3")
    case = cases.decode_case(spec, CPU)
    assert case.k_cache.dtype == case.v_cache.dtype == torch.float8_e4m3fn
    assert case.k_scale.dtype == case.v_scale.dtype == torch.float32
    assert case.k_scale.shape == case.v_scale.shape == (1,)
    assert float(case.k_scale) != 1.0 and float(case.v_scale) != 1.0 and float(case.k_scale) != float(case.v_scale)
    b = case.seq_lens.tolist().index(spec.page_size + 1)
    pages = case.page_table[b, :2].tolist()
    k = case.k_cache[pages].flatten(0, 1)[:spec.page_size + 1].float() * case.k_scale
    v = case.v_cache[pages].flatten(0, 1)[:spec.page_size + 1].float() * case.v_scale
    ref = cases.reference_attention(case.q[b:b + 1], k, v, spec.scale, True)[0]
    assert torch.allclose(ref, case.ref[b], atol=1e-5)


def test_sinks_are_large_and_small_per_head():
    spec = AttentionSpec(8, 2, 64, "bf16", sinks=True)
    case = cases.prefill_case(spec, CPU)
    assert case.sinks.dtype == torch.float32 and case.sinks.shape == (8,)
    assert case.sinks.max() >= 6 and case.sinks.min() <= -4


def test_softcap_case_has_logits_that_capping_changes():
    spec = AttentionSpec(4, 2, 64, "bf16", softcap=50.0)
    case = cases.prefill_case(spec, CPU)
    n = int(case.cu_q[4])  # the first four sequences: queries and keys aligned
    scores = torch.einsum("qhd,khd->hqk", case.q[:n].float(), case.k[:n].float().repeat_interleave(2, 1))
    assert (scores * spec.scale).abs().max() > 2 * spec.softcap


def test_run_inputs_are_passed_only_with_the_feature():
    plain = cases.decode_case(SPEC, CPU)
    assert cases.run_kwargs(SPEC, plain) == {}
    spec = AttentionSpec(4, 2, 64, "bf16", page_size=4, sinks=True, kv_dtype="fp8_e4m3")
    decode, prefill = cases.decode_case(spec, CPU), cases.prefill_case(spec, CPU)
    assert set(cases.run_kwargs(spec, decode)) == {"sinks", "k_scale", "v_scale"}
    assert set(cases.run_kwargs(spec, prefill)) == {"sinks"}  # prefill takes k/v in the activation dtype

    class Legacy:  # a plugin written before the features: run takes the tensors only
        name = "legacy"

        def plan_decode(self, spec, page_table, seq_lens):
            run = TORCH.plan_decode(spec, page_table, seq_lens)
            return lambda q, k_cache, v_cache: run(q, k_cache, v_cache)

    assert judge(Legacy(), SPEC, "decode", plain)["status"] == "valid"


@pytest.mark.usefixtures("inproc_worker")
def test_selection_rejects_the_sloppy_candidate(monkeypatch):
    """Wired into selection: the sloppy candidate comes first in priority; the selection rejects it (its own rows'
    check; when it set the tolerance, only the outlier rule did) and serves torch."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:SLOPPY")
    spec = AttentionSpec(4, 2, 64, "bf16", softcap=50.0)
    sel = select(spec, policy="priority", prefill_priority=["sloppy", "torch"], decode="torch")
    sloppy = next(c for c in sel.candidates["prefill"] if c.name == "sloppy")
    assert sloppy.status == "rejected" and "exceeds tolerance" in sloppy.reason
    assert sel.prefill == "torch"


def test_selection_applies_the_outlier_rule_to_valid_candidates():
    """The selector rejects a valid candidate whose error is far above the best valid one's (the rows' check leaves
    little room for one: see attnsel/validate/yardstick.py); it is given the valid candidates' errors only."""
    from attnsel.selector import _outliers

    spec = AttentionSpec(4, 2, 64, "bf16")
    reasons = _outliers(spec, {"a": 0.002, "b": 0.05, "unknown": None})
    assert set(reasons) == {"b"} and "far above the best candidate's" in reasons["b"]
    assert _outliers(spec, {"a": 0.002}) == {}  # one candidate: nothing to compare with
