"""The extend phase (ragged queries over the paged cache) of FA3 and FlashInfer on the GPU, judged row by row
(every query token) against the float32 reference within the validation's per-token tolerance
(tests/fixtures/extend_cases.py): the CPU suite's traps at page sizes 1, 16 and 64 with every feature, realistic sizes
(8 x 512 new tokens over 8k prefixes, MTP 64 rows x 4k x 2 queries, page size 1), LightLLM's call (the caches
viewed as [-1, 1, kvh, d] with a token-level table), and for FA3 a CUDA graph captured once and replayed after the
engine rewrites seq_lens, page_table, cu_seqlens_q, q and the caches in place. torch runs the same cases as the
yardstick of this file: if it fails, the case is wrong, not the backend.

FlashInfer JIT-compiles one module per template and feature set (a minute or two each on a fresh machine):
ATTNSEL_GPU_FLASHINFER=main limits it to the plain bf16/d128 family, =all (default) builds every one.
"""
import os

import pytest
import torch

from attnsel.backends import get
from attnsel.spec import AttentionSpec
from tests.fixtures.extend_cases import make_batch, row_failures

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CUDA = torch.device("cuda")
NAMES = ["torch", "fa3", "fa3_packgqa", "fa3_split", "flashinfer", "flashinfer_fa2"]
FA3_NAMES = ["fa3", "fa3_packgqa", "fa3_split"]
FEATURES = {
    "plain": {},
    "window40": {"sliding_window": 40},
    "softcap30": {"softcap": 30.0},
    "sinks": {"sinks": True},
    "fp8kv": {"kv_dtype": "fp8_e4m3"},
    "window-fp8": {"sliding_window": 40, "kv_dtype": "fp8_e4m3"},
    "gptoss-like": {"sliding_window": 128, "sinks": True},
}


def _spec(feature: str, page_size: int, dtype: str = "bf16") -> AttentionSpec:
    head_dim, heads = (64, 64) if feature == "gptoss-like" else (128, 32)
    return AttentionSpec(heads, 8, head_dim, dtype, page_size=page_size, **FEATURES[feature])


def _backend(name: str, spec: AttentionSpec):
    backend = get(name)
    reason = backend.unsupported(spec, "extend", device=CUDA) if name != "torch" else None
    if reason:
        pytest.skip(reason)
    jit_limited = os.environ.get("ATTNSEL_GPU_FLASHINFER") == "main"
    if name.startswith("flashinfer") and jit_limited and (spec.features() or spec.head_dim != 128):
        pytest.skip("FlashInfer JIT for this feature set: run with ATTNSEL_GPU_FLASHINFER=all")
    return backend


def _judge(name: str, spec: AttentionSpec, batch, *, k_cache=None, v_cache=None, page_table=None,
           run_spec: AttentionSpec | None = None) -> None:
    """Plan, run twice, check the inputs unchanged, the runs equal and every row against the reference."""
    backend = _backend(name, run_spec or spec)
    k_cache = batch.k_cache if k_cache is None else k_cache
    v_cache = batch.v_cache if v_cache is None else v_cache
    page_table = batch.page_table if page_table is None else page_table
    before = [t.clone() for t in (batch.q, k_cache, v_cache, page_table, batch.seq_lens, batch.cu_seqlens_q)]
    run = backend.plan_extend(run_spec or spec, batch.cu_seqlens_q, page_table, batch.seq_lens, batch.max_seqlen_q,
                              batch.max_seq_len)
    out = run(batch.q, k_cache, v_cache, **batch.run_kwargs())
    again = run(batch.q, k_cache, v_cache, **batch.run_kwargs())
    torch.cuda.synchronize()
    total = batch.total_q
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    after = (batch.q, k_cache, v_cache, page_table, batch.seq_lens, batch.cu_seqlens_q)
    for old, new in zip(before, after):
        assert torch.equal(old.view(torch.uint8) if old.element_size() == 1 else old.nan_to_num(),
                           new.view(torch.uint8) if new.element_size() == 1 else new.nan_to_num()), "input changed"
    assert torch.equal(out[:total], again[:total]), "a second run of the plan differs"
    failures = row_failures(batch, out)
    assert not failures, f"{name}: " + "\n".join(failures)


def _small_rows(ps: int) -> list[tuple[int, int]]:
    """The CPU suite's rows: fresh prompts, a few-token prefix, a ~1000-token prefix, prefixes ending mid-page, a row
    without queries, padding rows (seq_len 0, with and without queries), one-token rows."""
    return [(7, 7), (3, 6), (9, 1009), (4, ps + 5 + 4), (0, 13), (0, 0), (2, 0), (1, 1), (5, 2 * ps + 5)]


@pytest.mark.parametrize("sentinel", ["-1", "num_pages"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("name", NAMES)
def test_small_batches_with_traps(name, feature, page_size, sentinel):
    if sentinel == "num_pages" and feature != "plain":
        pytest.skip("sentinels are a layout matter: checked on the plain spec")
    spec = _spec(feature, page_size)
    _judge(name, spec, make_batch(spec, _small_rows(page_size), seed=page_size, sentinel=sentinel, device=CUDA))


REALISTIC = {
    "chunks-8x512-over-8k-page16": (16, [(512, 8192 + 512)] * 8),
    "mtp-64x4k-2q-page16": (16, [(2, 4000 + (b * 37) % 200) for b in range(64)]),
    "ragged-page1": (1, [(256, 2304), (1, 3000), (64, 64), (0, 10), (128, 1000), (3, 0)]),
}


@pytest.mark.parametrize("feature", ["plain", "fp8kv", "window40", "sinks"])
@pytest.mark.parametrize("shape", list(REALISTIC))
@pytest.mark.parametrize("name", NAMES)
def test_realistic_sizes(name, shape, feature):
    page_size, rows = REALISTIC[shape]
    spec = _spec(feature, page_size)
    _judge(name, spec, make_batch(spec, rows, seed=1, device=CUDA))


@pytest.mark.parametrize("feature", ["plain", "fp8kv"])
@pytest.mark.parametrize("name", NAMES)
def test_lightllm_token_level_table(name, feature):
    """LightLLM's call: k_cache.view(-1, 1, kvh, d) and a page table of token slots (page size 1)."""
    spec16 = _spec(feature, 16)
    batch = make_batch(spec16, [(4, 40), (3, 3), (0, 7), (2, 21), (33, 530), (2, 0)], seed=6, device=CUDA)
    ps, kvh, d = 16, spec16.num_kv_heads, spec16.head_dim
    pages = batch.page_table.long().clamp(min=0)
    token_table = (pages[:, :, None] * ps + torch.arange(ps, device=CUDA)).flatten(1)
    columns = torch.arange(token_table.shape[1], device=CUDA)[None, :]
    token_table = torch.where(columns < batch.seq_lens[:, None], token_table, -1).to(torch.int32)
    _judge(name, spec16, batch, k_cache=batch.k_cache.view(-1, 1, kvh, d), v_cache=batch.v_cache.view(-1, 1, kvh, d),
           page_table=token_table, run_spec=_spec(feature, 1))


# ---------------------------------------------------------------- FA3 under CUDA graphs: in-place updates at replay

ROUNDS = [  # 4 rows each: lengths moving, rows crossing pages, rows to and from 0 tokens and 0 queries, MTP <-> ragged
    [(3, 40), (1, 17), (2, 0), (4, 100)],
    [(1, 41), (4, 16), (0, 0), (2, 129)],
    [(4, 4), (2, 300), (3, 19), (0, 50)],
    [(2, 0), (0, 0), (1, 1), (4, 260)],
]


@pytest.mark.parametrize("metadata", ["int32", "int64-and-wider-table"])
@pytest.mark.parametrize("feature", ["plain", "fp8kv", "gptoss-like"])
@pytest.mark.parametrize("name", FA3_NAMES)
def test_fa3_graph_replays_in_place_updates(name, feature, metadata):
    spec = _spec(feature, 16)
    backend = _backend(name, spec)
    width = max(-(-n // 16) for rows in ROUNDS for _, n in rows) + 2
    num_pages = max(sum(-(-n // 16) for _, n in rows) for rows in ROUNDS) + 5
    q_rows = max(sum(q for q, _ in rows) for rows in ROUNDS) + 3
    batches = [make_batch(spec, rows, seed=i, device=CUDA, num_pages=num_pages, width=width, q_rows=q_rows)
               for i, rows in enumerate(ROUNDS)]
    first = batches[0]
    wide = metadata != "int32"
    meta_dtype = torch.int64 if wide else torch.int32
    engine_table = torch.full((4, width + (5 if wide else 0)), -1, dtype=torch.int32, device=CUDA)
    table = engine_table[:, :width]  # a column slice of the engine's table when wide
    lens = first.seq_lens.to(meta_dtype).clone()
    cu = first.cu_seqlens_q.to(meta_dtype).clone()
    q, k_cache, v_cache = first.q.clone(), first.k_cache.clone(), first.v_cache.clone()
    table.copy_(first.page_table)
    kwargs = {key: value.clone() for key, value in first.run_kwargs().items()}
    run = backend.plan_extend(spec, cu, table, lens, 4, max(n for rows in ROUNDS for _, n in rows))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(q, k_cache, v_cache, **kwargs)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(q, k_cache, v_cache, **kwargs)
    for batch in batches[1:] + batches[:1]:
        updates = [(q, batch.q), (k_cache, batch.k_cache), (v_cache, batch.v_cache), (table, batch.page_table),
                   (lens, batch.seq_lens), (cu, batch.cu_seqlens_q)]
        updates += [(kwargs[key], value) for key, value in batch.run_kwargs().items()]  # sinks, k/v scales
        for dst, src in updates:
            dst.copy_(src)
        out.fill_(float("nan"))  # the replay must write the output
        graph.replay()
        torch.cuda.synchronize()
        failures = row_failures(batch, out)
        assert not failures, f"{name} replay of {batch.rows}: " + "\n".join(failures)
