"""The opt-in canary: 1 in N planned batches (per phase and backend) recomputed by the float32 reference, judged by
the validation's check; a mismatch is logged with the batch's shape, counted, demotes the backend for that bucket in
this process and drops its cached verdict.

The fault is real: tests/fixtures/canary_backends.py's plugin passes validation (in the worker) and goes wrong after
its 50th run in the serving process, as kernels do that fail after many requests."""
import json
import logging

import pytest
import torch

import attnsel.canary as canary_mod
from attnsel import select
from attnsel.cache import ResultCache
from attnsel.canary import Canary
from attnsel.cli import main
from attnsel.selection import Candidate, PhaseChoice, Selection, build_table
from attnsel.spec import AttentionSpec
from attnsel.validate.cases import check_output, cumulative, decode_case, prefill_case


def max_abs_err(out, ref):
    return (out.float() - ref).abs().max().item()
from tests.fixtures.canary_backends import GOOD_CALLS, LATE, LateWrong

SPEC = AttentionSpec(4, 2, 64, "bf16", page_size=4)
CPU = torch.device("cpu")
LENS = [5, 17, 0, 9]  # decode rows (a zero-length padding row among them)
PLUGIN = "tests.fixtures.canary_backends:LATE"


@pytest.fixture
def late(monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", PLUGIN)
    LATE[0].calls = 0
    return LATE[0]


def _decode(sel, case, **kwargs):
    """One engine step: plan the batch, run one layer; returns the output."""
    run = sel.plan_decode(case.page_table, case.seq_lens, context_tokens=sum(LENS), longest=max(LENS), **kwargs)
    return run(case.q, case.k_cache, case.v_cache)


def _hand_made(decode: PhaseChoice, every: int, prefill: PhaseChoice | None = None, spec=SPEC,
               device: str = "cpu") -> Selection:
    """A Selection as select() makes it (no worker), with a canary checking one plan in ``every`` (0: none)."""
    phases = {"prefill": prefill or PhaseChoice("torch", "explicit", []), "decode": decode}
    canary = Canary(every, spec, fingerprint={}, device=device, cache=None) if every else None
    return Selection(spec, phases, "measure", "eager", "off", {}, {}, canary=canary)


def _auto(*names):
    return [Candidate(names[0], "selected")] + [Candidate(n, "valid") for n in names[1:]]


def test_late_wrong_plugin_diverges_from_the_reference_after_50_calls():
    """The fault the canary must catch, shown without it: 50 right outputs, then every one off by 1.0."""
    backend = LateWrong()
    case = decode_case(SPEC, CPU, lengths=LENS)
    errors, verdicts = [], []
    for _ in range(GOOD_CALLS + 3):
        run = backend.plan_decode(SPEC, case.page_table, case.seq_lens)
        out = run(case.q, case.k_cache, case.v_cache)
        errors.append(max_abs_err(out, case.ref))
        verdicts.append(check_output(SPEC, out, case)["status"])
    assert verdicts[:GOOD_CALLS] == ["valid"] * GOOD_CALLS, errors[:GOOD_CALLS]
    assert verdicts[GOOD_CALLS:] == ["rejected"] * 3
    assert all(e > 0.9 for e in errors[GOOD_CALLS:]), errors[GOOD_CALLS:]


@pytest.mark.parametrize("spec", [SPEC, AttentionSpec(4, 2, 64, "bf16", page_size=4, sliding_window=6, sinks=True),
                                  AttentionSpec(4, 1, 64, "fp16", page_size=4, softcap=20.0, kv_dtype="fp8_e4m3")],
                         ids=["plain", "window-sinks", "softcap-fp8"])
def test_served_reference_is_the_validation_reference(spec):
    """The canary's copy of a decode call (the validation case's traps included: NaN in unused slots, sentinel
    page ids) and of a prefill call gives the validation case's own float32 reference, and check_output's verdict."""
    from attnsel.validate import cases, served

    dec = decode_case(spec, CPU, lengths=[5, 17, 0, 9, 1])
    kwargs = cases.run_kwargs(spec, dec)
    snap = served.take("decode", (dec.page_table, dec.seq_lens), (dec.q.unsqueeze(1), dec.k_cache, dec.v_cache),
                       kwargs, dec.ref.to(spec.torch_dtype).unsqueeze(1), pages=5)
    refs = served.reference(spec, snap)
    assert torch.equal(refs.ref, dec.ref)
    assert served.judge(spec, snap, refs)["status"] == "valid"
    snap.out[3] += 5.0  # past any row's tolerance (an fp8 cache's rows allow up to ~0.9 on outputs of ~2)
    verdict = served.judge(spec, snap, refs)
    assert verdict["status"] == "rejected" and "in sequence 3 (seq_len 9)" in verdict["reason"]
    pre = prefill_case(spec, CPU, lengths=([3, 1, 6], [3, 4, 6]))
    kwargs = {k: v for k, v in cases.run_kwargs(spec, pre).items() if k == "sinks"}
    snap = served.take("prefill", (pre.cu_q, pre.cu_k), (pre.q, pre.k, pre.v), kwargs, pre.ref.to(spec.torch_dtype))
    refs = served.reference(spec, snap)
    assert torch.equal(refs.ref, pre.ref) and served.judge(spec, snap, refs)["status"] == "valid"


def test_canary_every_batch_detects_logs_counts_demotes_and_drops_the_verdict(late, caplog, capsys):
    sel = select(SPEC, "torch", "auto", policy="priority", decode_priority=["late_wrong", "torch"], canary_every=1,
                 device="cpu")
    assert sel.decode == "late_wrong" and sel.canary is not None
    case = decode_case(SPEC, CPU, lengths=LENS)
    served = []
    with caplog.at_level(logging.WARNING, logger="attnsel.canary"):
        for _ in range(60):
            before = late.calls
            _decode(sel, case)
            served.append("late_wrong" if late.calls > before else "torch")
    # plan 51 ran wrong; its check is read at plan 52 (no wait on the serving step), which torch serves from then on
    assert served == ["late_wrong"] * 51 + ["torch"] * 9
    assert sel.canary.mismatches() == {("decode", "late_wrong"): 1}
    [record] = [r for r in caplog.records if r.name == "attnsel.canary"]
    message = record.getMessage()
    assert record.levelno == logging.WARNING
    for words in ("decode backend late_wrong", "4 rows, mean context 8, longest 17", "exceeds tolerance",
                  "torch serves", "cached verdict dropped"):
        assert words in message, message
    sel.canary.drain()
    report = sel.to_json()["canary"]
    assert report["every"] == 1
    assert report["phases"]["decode"]["late_wrong"] == {"plans": 51, "sampled": 51, "checked": 51, "mismatches": 1,
                                                      "skipped": 0, "errors": 0}
    assert report["phases"]["decode"]["torch"]["checked"] == 9
    assert report["phases"]["decode"]["torch"]["mismatches"] == 0
    assert report["demoted"] == [{"phase": "decode", "bucket": "every shape", "backends": ["late_wrong"],
                                  "serves": "torch"}]
    assert report["mismatches"][0]["shape"] == "4 rows, mean context 8, longest 17"
    # the cached verdict is gone: the next selection validates late_wrong again (torch's verdict stays cached)
    cached = ResultCache().entries().values()
    assert not [e for e in cached if e.get("backend") == "late_wrong" and e.get("phase") == "decode"]
    again = select(SPEC, "torch", "auto", policy="priority", decode_priority=["late_wrong", "torch"], device="cpu")
    fresh = {c.name: c.from_cache for c in again.candidates["decode"]}
    assert fresh == {"late_wrong": False, "torch": True}
    assert again.canary is None  # off unless asked for
    # attnsel report --json carries the canary when $ATTNSEL_CANARY asks for it (cache warm: no worker)
    capsys.readouterr()
    argv = ["report", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "bf16",
            "--page-size", "4", "--prefill-backend", "torch", "--decode-backend", "torch", "--extend-backend", "torch"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNSEL_CANARY", "100")
        assert main([*argv, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
        assert main(argv) == 0
        text = capsys.readouterr().out
    assert data["canary"]["every"] == 100 and data["canary"]["mismatches"] == [] and data["cache"] == "hit"
    assert "canary: one plan in 100 per phase and backend checked against the float32 reference; 0 checked" in text


def test_canary_every_10_samples_plans_0_10_20_and_catches_the_51st(late):
    sel = _hand_made(PhaseChoice("late_wrong", "auto", _auto("late_wrong", "torch")), every=10)
    case = decode_case(SPEC, CPU, lengths=LENS)
    sampled = []
    for i in range(GOOD_CALLS + 1):  # plans 0..50: 0, 10, ..., 50 are sampled; 50 is the first wrong run
        _decode(sel, case)
        sampled.append(sel.canary.report()["phases"]["decode"]["late_wrong"]["sampled"])
    assert sampled == [i // 10 + 1 for i in range(GOOD_CALLS + 1)]
    assert late.calls == GOOD_CALLS + 1  # plan 51 (sampled) ran wrong
    before = late.calls
    _decode(sel, case)
    assert late.calls == before  # torch served plan 52
    assert sel.canary.mismatches() == {("decode", "late_wrong"): 1}
    stats = sel.canary.report()["phases"]["decode"]
    assert stats["late_wrong"]["plans"] == 51 and stats["late_wrong"]["checked"] == 6
    assert stats["torch"] == {"plans": 1, "sampled": 1, "checked": 1, "mismatches": 0, "skipped": 0, "errors": 0}


def test_demotion_is_per_bucket_of_the_dispatch_table(late):
    """late_wrong wins both timed buckets; a mismatch at batch 4 demotes it there only: torch, the bucket's runner-up,
    serves batch 4, late_wrong still serves batch 16."""
    cells = {(4, 8): {"late_wrong": 1.0, "torch": 2.0}, (16, 8): {"late_wrong": 1.0, "torch": 2.0}}
    buckets = [{"key": list(k), "label": f"batch {k[0]} x ctx {k[1]}", "us": t, "spread": {}, "errors": {}}
               for k, t in cells.items()]
    table = build_table({"phase": "decode", "mode": "eager", "grid_version": 8, "axes": ["batch", "context"],
                         "buckets": buckets, "skipped": [], "wall_s": 1.0}, ["late_wrong", "torch"])
    sel = _hand_made(PhaseChoice("late_wrong", "auto", _auto("late_wrong", "torch"), table), every=1)
    late.calls = GOOD_CALLS  # wrong from its next run on
    small = decode_case(SPEC, CPU, lengths=LENS)
    big = decode_case(SPEC, CPU, lengths=[7, 9, 8, 6] * 4)

    def step(case):
        before = late.calls
        run = sel.plan_decode(case.page_table, case.seq_lens, context_tokens=int(case.seq_lens.sum()))
        run(case.q, case.k_cache, case.v_cache)
        return "late_wrong" if late.calls > before else "torch"

    assert step(small) == "late_wrong"  # wrong, sampled
    assert step(small) == "torch"  # the check was read: demoted in bucket batch 4
    assert step(big) == "late_wrong"  # batch 16: not demoted there; wrong, sampled
    assert step(big) == "torch"
    assert step(small) == "torch"
    report = sel.canary.report()
    assert {(d["bucket"], d["serves"]) for d in report["demoted"]} == {("batch 4 x ctx 8", "torch"),
                                                                      ("batch 16 x ctx 8", "torch")}


def test_a_correct_backend_over_200_plans_gives_no_mismatch_and_copies_inputs_at_run_time():
    """torch (right) checked on every plan, decode and prefill; the engine overwrites q and the output right after
    each run (as it reuses buffers): the canary judges the copies taken at run time."""
    sel = _hand_made(PhaseChoice("torch", "explicit", []), every=1)
    case = decode_case(SPEC, CPU, lengths=LENS)
    pre = prefill_case(SPEC, CPU, lengths=([3, 1, 6], [3, 4, 6]))
    for i in range(200):
        q = case.q.clone()
        run = sel.plan_decode(case.page_table, case.seq_lens, max_seq_len=max(LENS))
        out = run(q, case.k_cache, case.v_cache)
        q.fill_(float("nan"))
        out.fill_(7.0)
        if i % 4 == 0:
            run = sel.plan_prefill(pre.cu_q, pre.cu_k, pre.max_q, pre.max_k, total_q=10)
            run(pre.q, pre.k, pre.v).fill_(-3.0)
    sel.canary.drain()
    report = sel.canary.report()
    assert report["phases"]["decode"]["torch"]["checked"] == 200
    assert report["phases"]["prefill"]["torch"]["checked"] == 50
    assert sel.canary.mismatches() == {} and report["demoted"] == [] and report["mismatches"] == []


def test_off_by_default_installs_nothing(late, monkeypatch):
    monkeypatch.delenv("ATTNSEL_CANARY", raising=False)
    sel = _hand_made(PhaseChoice("late_wrong", "auto", _auto("late_wrong", "torch")), every=0)
    assert sel.canary is None and sel.to_json()["canary"] is None
    case = decode_case(SPEC, CPU, lengths=LENS)
    run = sel.plan_decode(case.page_table, case.seq_lens, checked=False)
    assert run.__name__ == "late_run"  # the backend's own run function: no wrapper
    monkeypatch.setattr(Canary, "serve", lambda *a, **k: pytest.fail("the canary was consulted"))
    late.calls = GOOD_CALLS
    for _ in range(3):  # wrong, and nobody looks
        assert max_abs_err(_decode(sel, case), case.ref) > 0.9


def test_settings_are_checked_at_start_up(monkeypatch):
    for value, words in ((-1, "got -1"), (True, "got True"), (2.5, "got 2.5"), ("10", "got '10'")):
        with pytest.raises(ValueError, match=f"canary_every must be None, 0 .off. or a whole number of plans.*{words}"):
            select(SPEC, "torch", "torch", canary_every=value, device="cpu")
    for raw in ("ten", "-3", "1.5"):
        monkeypatch.setenv("ATTNSEL_CANARY", raw)
        with pytest.raises(ValueError, match=rf"ATTNSEL_CANARY='{raw}': expected a whole number >= 0"):
            select(SPEC, "torch", "torch", device="cpu")
    monkeypatch.setenv("ATTNSEL_CANARY", "0")
    assert canary_mod.every_from(None) == 0
    monkeypatch.setenv("ATTNSEL_CANARY", " 25 ")
    assert canary_mod.every_from(None) == 25
    assert canary_mod.every_from(0) == 0  # the argument wins over the environment


def test_no_sampling_while_capturing(late, monkeypatch):
    """A plan made while a CUDA graph is captured is neither counted nor sampled (CPU: capture simulated; the GPU test
    test_canary_gpu_capture captures for real)."""
    sel = _hand_made(PhaseChoice("late_wrong", "auto", _auto("late_wrong", "torch")), every=1)
    case = decode_case(SPEC, CPU, lengths=LENS)
    monkeypatch.setattr(canary_mod, "capturing", lambda t: True)
    for _ in range(3):
        run = sel.plan_decode(case.page_table, case.seq_lens, checked=False)
        assert run.__name__ == "late_run"
        run(case.q, case.k_cache, case.v_cache)
    assert sel.canary.report()["phases"] == {}


def test_prefill_mismatch_names_the_batch_shape(late, caplog):
    sel = _hand_made(PhaseChoice("torch", "explicit", []), every=1,
                     prefill=PhaseChoice("late_wrong", "auto", _auto("late_wrong", "torch")))
    late.calls = GOOD_CALLS
    lq, lk = [3, 1, 6], [3, 4, 6]
    pre = prefill_case(SPEC, CPU, lengths=(lq, lk))
    with caplog.at_level(logging.WARNING, logger="attnsel.canary"):
        for _ in range(2):
            sel.plan_prefill(pre.cu_q, pre.cu_k, max(lq), max(lk), total_q=sum(lq))(pre.q, pre.k, pre.v)
    assert sel.canary.mismatches() == {("prefill", "late_wrong"): 1}
    message = caplog.records[-1].getMessage()
    assert "prefill backend late_wrong" in message and "3 sequences, 10 query tokens, longest 6" in message
    assert cumulative(lq, CPU).tolist() == pre.cu_q.tolist()


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@GPU
def test_canary_gpu_sampled_run_makes_no_host_sync(late):
    """On the GPU the sampled run copies its inputs on a side stream without a host sync (torch's sync debug mode
    raises on one); the check is read by a later plan once the side stream is done, and demotes late_wrong."""
    spec = AttentionSpec(8, 2, 128, "bf16", page_size=16)
    sel = _hand_made(PhaseChoice("late_wrong", "auto", _auto("late_wrong", "torch")), every=1, spec=spec,
                     device="cuda")
    case = decode_case(spec, torch.device("cuda"), lengths=[300, 17, 0, 1000] * 8)
    late.calls = GOOD_CALLS
    run = sel.plan_decode(case.page_table, case.seq_lens, max_seq_len=1000)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run(case.q, case.k_cache, case.v_cache)  # wrong, sampled
        out.fill_(0.0)  # the engine reuses the buffer at once: the canary judges its copy
    finally:
        torch.cuda.set_sync_debug_mode(0)
    served = []
    for _ in range(100):  # later plans read the check once the side stream is done
        before = late.calls
        sel.plan_decode(case.page_table, case.seq_lens, max_seq_len=1000)(case.q, case.k_cache, case.v_cache)
        served.append("late_wrong" if late.calls > before else "torch")
        if served[-1] == "torch":
            break
        torch.cuda.synchronize()
    assert served[-1] == "torch", served
    assert sel.canary.mismatches()[("decode", "late_wrong")] >= 1
    sel.canary.drain()
    assert sel.canary.report()["phases"]["decode"]["torch"]["mismatches"] == 0


@pytest.mark.gpu
@GPU
def test_canary_gpu_capture_is_not_sampled():
    """A plan made while a CUDA graph is captured (Triton plans inside a capture) is neither counted nor sampled;
    the eager warm-up plan is."""
    spec = AttentionSpec(8, 2, 128, "bf16", page_size=16)
    sel = _hand_made(PhaseChoice("triton", "explicit", []), every=1, spec=spec, device="cuda")
    case = decode_case(spec, torch.device("cuda"), lengths=[300, 17, 0, 1000] * 8)
    static = case.q.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sel.plan_decode(case.page_table, case.seq_lens, max_seq_len=1000)(static, case.k_cache, case.v_cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run = sel.plan_decode(case.page_table, case.seq_lens, max_seq_len=1000, checked=False)
        out = run(static, case.k_cache, case.v_cache)
    graph.replay()
    sel.canary.drain()
    stats = sel.canary.report()["phases"]["decode"]["triton"]
    assert stats["plans"] == 1 and stats["checked"] == 1 and stats["mismatches"] == 0
    assert check_output(spec, out, case)["status"] == "valid"
