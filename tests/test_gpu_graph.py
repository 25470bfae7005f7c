"""The CUDA-graph contract on the GPU, the way engines use it: plan, capture once, then at every step write the new
lengths, page ids, queries and the new token's k/v into the same tensors and replay (validate/graph_replay.py states
the contract). Each backend graph mode can select is checked directly, through a Selection made in mode "graph" and
through flash_attn_with_kvcache captured; the backends that declare themselves stale under replay are refused, and
forcing them past that declaration shows why (they compute the old batch)."""
import math
import os

import pytest
import torch

import attnsel
from attnsel import AttentionSpec, SelectionError, flash_api
from attnsel.backends import BUILTINS, availability, get, graph_stale_reason
from attnsel.validate import graph_replay
from attnsel.validate.cases import reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPEC = AttentionSpec(num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bf16", page_size=16)
STEPS = 40
TOL = 0.03  # bf16 outputs of size ~1: correct kernels err 0.007-0.008 here, a stale batch errs ~3


def _device():
    return torch.device("cuda", torch.cuda.current_device())


def _reason(name, phase):
    return availability(get(name), SPEC, phase, _device())[0]


class Forced:
    """A backend with its graph_stale declaration hidden: what capturing it anyway computes."""

    def __init__(self, backend):
        self.name, self._b = backend.name, backend

    def plan_prefill(self, *args):
        return self._b.plan_prefill(*args)

    def plan_decode(self, *args):
        return self._b.plan_decode(*args)

    def plan_extend(self, *args):
        return self._b.plan_extend(*args)


@pytest.mark.parametrize("phase", ["decode", "prefill", "extend"])
@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_graph_contract_check(name, phase):
    reason = _reason(name, phase)
    if reason:
        pytest.skip(reason)
    backend = get(name)
    result = graph_replay.check(backend, SPEC, phase, _device())["graph_capture"]
    if graph_stale_reason(backend, phase):
        assert result.startswith("cannot serve CUDA-graph replays: ")
        # the declaration is true: captured anyway, it replays stale data 
        if name == "torch" or (phase == "decode" and os.environ.get("ATTNSEL_GPU_FORCE_STALE") == "1"):
            forced = graph_replay.check(Forced(backend), SPEC, phase, _device())["graph_capture"]
            assert forced.startswith("wrong under CUDA graph replay"), forced
    else:
        assert result == "ok"


class Engine:
    """An engine's decode state for one captured batch size: a block table wider than the batch's view of it, int32
    lengths, a cache of NaN pages. Row 0 starts empty (graph padding) and gets a sequence at step 5."""

    def __init__(self, batch=8, seed=0):
        gen = torch.Generator().manual_seed(seed)
        dev, ps = _device(), SPEC.page_size
        self.lens = [0] + [int(x) for x in torch.randint(3, 1000, (batch - 1,), generator=gen)]
        self.max_pages = math.ceil((max(self.lens) + STEPS + 64) / ps)
        pool = self.max_pages * batch + 16
        self.k_cache = torch.full((pool, ps, SPEC.num_kv_heads, SPEC.head_dim), float("nan"), device=dev,
                                  dtype=torch.bfloat16)
        self.v_cache = self.k_cache.clone()
        self.free = torch.randperm(pool, generator=gen).tolist()
        self.block_table = torch.full((batch + 3, self.max_pages + 5), -1, dtype=torch.int32, device=dev)
        self.page_table = self.block_table[:batch, :self.max_pages]  # what the engine passes: a slice
        self.seq_lens = torch.tensor(self.lens, dtype=torch.int32, device=dev)
        self.q = torch.empty(batch, SPEC.num_q_heads, SPEC.head_dim, device=dev, dtype=torch.bfloat16)
        self.keys = [[] for _ in range(batch)]  # (k, v) per token, for the reference
        for b, n in enumerate(self.lens):
            for _ in range(n):
                self._append(b)
        self.gen = gen

    def _append(self, b):
        n, ps = len(self.keys[b]), SPEC.page_size
        if n % ps == 0:
            self.page_table[b, n // ps] = self.free.pop()
        page = int(self.page_table[b, n // ps])
        k, v = (torch.randn(SPEC.num_kv_heads, SPEC.head_dim, device=self.q.device).bfloat16() for _ in range(2))
        self.k_cache[page, n % ps], self.v_cache[page, n % ps] = k, v
        self.keys[b].append((k, v))

    def step(self, i):
        """One decode step, in place: each live row (and row 0 from step 5 on) gets one more token and a new q."""
        for b in range(len(self.keys)):
            if b or i >= 5:
                self._append(b)
        self.seq_lens.copy_(torch.tensor([len(k) for k in self.keys], dtype=torch.int32))
        self.q.copy_(torch.randn(self.q.shape, generator=self.gen).bfloat16())

    def error(self, out):
        """Max abs error of out [B, H, D] against a float32 reference per row (zeros for an empty row)."""
        worst = 0.0
        for b, toks in enumerate(self.keys):
            if not toks:
                ref = torch.zeros_like(out[b], dtype=torch.float32)
            else:
                k = torch.stack([t[0] for t in toks])
                v = torch.stack([t[1] for t in toks])
                ref = reference_attention(self.q[b:b + 1], k, v, SPEC.scale, True)[0]
            worst = max(worst, (out[b].float() - ref).abs().max().item())
        return worst


def _replay_loop(run, engine, layout="bhd"):
    q = engine.q if layout == "bhd" else engine.q.unsqueeze(1)
    run(q, engine.k_cache, engine.v_cache)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(q, engine.k_cache, engine.v_cache)
    errors = []
    for i in range(STEPS):
        engine.step(i)
        graph.replay()
        torch.cuda.synchronize()
        errors.append(engine.error(out if layout == "bhd" else out[:, 0]))
    return errors


def _graph_decode_backends():
    return [n for n in sorted(BUILTINS)
            if not _reason(n, "decode") and not graph_stale_reason(get(n), "decode")]


def _prefill_for(name):
    return name if not _reason(name, "prefill") and not graph_stale_reason(get(name), "prefill") else "triton"


@pytest.mark.parametrize("name", ["fa3", "fa3_packgqa", "triton", "torch", "flashinfer_xqa"])
def test_engine_loop_direct(name):
    if name not in _graph_decode_backends():
        pytest.skip(_reason(name, "decode") or "stale under replay")
    engine = Engine()
    run = get(name).plan_decode(SPEC, engine.page_table, engine.seq_lens)
    errors = _replay_loop(run, engine)
    assert max(errors) < TOL, f"{name}: per-step max errors {[round(e, 4) for e in errors]}"


@pytest.mark.parametrize("name", ["fa3", "fa3_packgqa", "triton", "torch"])
def test_engine_loop_through_a_graph_mode_selection(name, tmp_path):
    if name not in _graph_decode_backends():
        pytest.skip(_reason(name, "decode") or "stale under replay")
    sel = attnsel.select(SPEC, prefill=_prefill_for(name), decode=name, mode="graph", cache_dir=str(tmp_path))
    engine = Engine(seed=1)
    run = sel.plan_decode(engine.page_table, engine.seq_lens, max_seq_len=engine.max_pages * SPEC.page_size)
    errors = _replay_loop(run, engine)
    assert max(errors) < TOL, f"{name}: per-step max errors {[round(e, 4) for e in errors]}"


def test_auto_graph_mode_selection_never_picks_a_stale_backend(tmp_path):
    sel = attnsel.select(SPEC, mode="graph", cache_dir=str(tmp_path), budget_s=20)
    for phase in ("prefill", "decode"):
        for cand in sel.phases[phase].candidates:
            if cand.name.startswith("flashinfer") and cand.name != "flashinfer_xqa":
                assert cand.status == "unavailable" and "cannot serve CUDA-graph replays" in cand.reason
    engine = Engine(seed=2)
    run = sel.plan_decode(engine.page_table, engine.seq_lens, max_seq_len=engine.max_pages * SPEC.page_size)
    errors = _replay_loop(run, engine)
    assert max(errors) < TOL, f"per-step max errors {[round(e, 4) for e in errors]}"


def test_flashinfer_is_refused_in_graph_mode_with_the_reason(tmp_path):
    if _reason("flashinfer", "decode"):
        pytest.skip(_reason("flashinfer", "decode"))
    with pytest.raises(SelectionError, match="cannot serve CUDA-graph replays: its plan copies the lengths"):
        attnsel.select(SPEC, prefill="triton", decode="flashinfer", mode="graph", cache_dir=str(tmp_path))


@pytest.mark.parametrize("name", ["fa3", "triton", "torch"])
def test_engine_loop_through_flash_attn_with_kvcache_captured(name, tmp_path):
    if name not in _graph_decode_backends():
        pytest.skip(_reason(name, "decode") or "stale under replay")
    flash_api.configure(prefill=_prefill_for(name), decode=name, mode="graph", cache_dir=str(tmp_path))
    try:
        engine = Engine(seed=3)

        def run(q, k_cache, v_cache):
            return flash_api.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=engine.seq_lens,
                                                     page_table=engine.page_table, causal=True)

        errors = _replay_loop(run, engine, layout="b1hd")
        assert max(errors) < TOL, f"{name}: per-step max errors {[round(e, 4) for e in errors]}"
    finally:
        flash_api.configure()
