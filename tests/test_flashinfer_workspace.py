"""The float workspace attnsel gives FlashInfer's wrappers against what FlashInfer's plans carve out of it.

No GPU: a port of FlashInfer 0.6.4's schedulers (include/flashinfer/attention/scheduler.cuh), the float-buffer part
only: PrefillPlan (with PrefillSplitQOKVIndptr, PrefillBinarySearchKVChunkSize, FA2DetermineCtaTileQ) serves the
ragged prefill, the paged extend, tensor-core decode (one query per row) and the attention-sink wrapper (a
BatchPrefillWithPagedKVCacheWrapper subclass: its plan is PrefillPlan with the FA2 template, PrefillSM90Plan, which
takes no float workspace, with FA3's); DecodePlan serves CUDA-core decode (its grid bound from the kernel's
occupancy, at most 32 blocks per SM). No CUDA graphs (attnsel plans without use_cuda_graph). A plan that does not
fit raises, so ``plan_bytes`` must cover the most any batch of the spec may take, on every SM count."""
import itertools
import random

import pytest

import attnsel.backends.flashinfer as fi
from attnsel.spec import AttentionSpec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _aligned(nbytes: int) -> int:  # AlignedAllocator: each allocation starts 16-byte aligned
    return _cdiv(nbytes, 16) * 16


def _cta_tile_q(avg_packed_qo_len: int, head_dim: int) -> int:
    """FA2DetermineCtaTileQ (utils.cuh), compute capability 8 or more."""
    if avg_packed_qo_len > 64 and head_dim < 256:
        return 128
    return 64 if avg_packed_qo_len > 16 else 16


def prefill_plan_float_bytes(spec: AttentionSpec, sms: int, qo_lens: list[int], kv_lens: list[int],
                             page_size: int = 1, window_left: int = -1) -> int:
    """PrefillPlan's float workspace (0 without a KV split). kv_lens in tokens; FlashInfer counts them in pages
    (the ragged wrapper: page size 1)."""
    heads, kvh, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    batch = len(qo_lens)
    packed = [q * (heads // kvh) for q in qo_lens]
    pages = [_cdiv(k, page_size) for k in kv_lens]
    cta = _cta_tile_q(sum(packed) // batch, d)
    eff = [min(_cdiv(window_left + cta, page_size), p) if window_left >= 0 else p for p in pages]
    most_per_kv_head = (2 * sms) // kvh  # two CTAs per SM, no colocated CTAs

    def tiles(chunk: int) -> int:
        return sum(_cdiv(p, cta) * _cdiv(max(e, 1), chunk) for p, e in zip(packed, eff))

    low, high = max(128 // page_size, 1), max([1] + eff)
    max_kv = high
    while low < high:
        mid = (low + high) // 2
        if tiles(mid) > most_per_kv_head:
            low = mid + 1
        else:
            high = mid
    if not low < max_kv:  # no split: no float workspace
        return 0
    n = tiles(low)
    return _aligned(heads * n * cta * d * 4) + _aligned(heads * n * cta * 4)


def decode_plan_float_bytes(spec: AttentionSpec, sms: int, kv_lens: list[int], page_size: int,
                            blocks_per_sm: int) -> int:
    """DecodePlan's float workspace (CUDA-core decode; 0 without a KV split)."""
    heads, kvh, d = spec.num_q_heads, spec.num_kv_heads, spec.head_dim
    batch, grid = len(kv_lens), blocks_per_sm * sms
    if batch * kvh >= grid:
        return 0
    pages = [_cdiv(k, page_size) for k in kv_lens]
    low, high = max(128 // page_size, 1), max(pages)
    while low < high:
        mid = (low + high) // 2
        if sum(_cdiv(p, mid) for p in pages) * kvh > grid:
            low = mid + 1
        else:
            high = mid
    n = sum(_cdiv(max(p, 1), low) for p in pages)
    if n == batch:
        return 0
    return _aligned(heads * n * d * 4) + _aligned(heads * n * 4)


def _batches(sms: int, kvh: int, rng: random.Random):
    """(qo_lens, kv_lens): batches that push the split plan to its bound (one row of many query tiles over long
    keys, rows just filling the split grid, rows of 0 keys) and random ones."""
    most = max(1, 2 * sms // kvh)
    for q, k in itertools.product((1, 2, 17, 65, 128, 129, 640, 4096), (1, 129, 1000, 8192, 131072)):
        yield [q], [k]
    for n in (1, 2, most // 4, most // 2, most - 1, most):
        for q, k in ((1, 131072), (65, 65536), (129, 32768), (4, 4096)):
            yield [q] * max(n, 1), [k] * max(n, 1)
    for _ in range(40):
        n = rng.randint(1, most)
        yield [rng.randint(0, 300) for _ in range(n)], [rng.randint(0, 40000) for _ in range(n)]
    yield [3, 0, 2], [0, 5000, 9000]


SPECS = [AttentionSpec(kvh * g, kvh, d, "bf16") for d in (64, 128, 256) for kvh in (1, 2, 8) for g in (1, 4, 16)]


@pytest.mark.parametrize("sms", [78, 108, 132, 148])
def test_plan_bytes_holds_every_split_plan_of_the_spec(sms):
    """Ragged prefill (page size 1), paged extend (page size 16, with and without a window), tensor-core decode
    (one query a row) and CUDA-core decode (any occupancy up to 32 blocks per SM): no batch's plan takes more
    float workspace than plan_bytes."""
    rng = random.Random(sms)
    for spec in SPECS:
        bound = fi.plan_bytes(spec, sms)
        for qo, kv in _batches(sms, spec.num_kv_heads, rng):
            for page, window in ((1, -1), (16, -1), (16, 255)):
                need = prefill_plan_float_bytes(spec, sms, qo, kv, page, window)
                assert need <= bound, (spec, sms, qo[:4], kv[:4], page, window, need, bound)
            need = prefill_plan_float_bytes(spec, sms, [1] * len(kv), kv, 16)  # tensor-core decode
            assert need <= bound, (spec, sms, kv[:4], need, bound)
            for blocks in (1, 8, 32):
                need = decode_plan_float_bytes(spec, sms, kv, 16, blocks)
                assert need <= bound, (spec, sms, kv[:4], blocks, need, bound)


def test_plan_bytes_is_reached_by_a_prefill_plan():
    """The bound is FlashInfer's own, not a guess: on an H100 the 8-query-head, 1-KV-head spec of the held-out run
    takes within a MiB of it (one row of 2112 queries, 132 tiles of 128 packed rows, over 32768 keys in 2 chunks:
    all 264 tiles the grid allows)."""
    spec, sms = AttentionSpec(8, 1, 128, "bf16"), 132
    need = max(prefill_plan_float_bytes(spec, sms, [q], [k]) for q in (640, 2048, 2112, 4096) for k in (8192, 32768))
    assert fi.plan_bytes(spec, sms) - (1 << 20) < need <= fi.plan_bytes(spec, sms)


def test_the_sink_wrapper_gets_what_its_prefill_plans_take(monkeypatch):
    """FlashInfer's BatchAttentionWithAttentionSinkWrapper is a BatchPrefillWithPagedKVCacheWrapper: it plans with
    PrefillPlan (FA2 template; FA3's PrefillSM90Plan takes no float workspace), never with the persistent
    BatchAttention kernel's holistic plan. Its need is the prefill bound of the spec, so a sinks spec gets the
    workspace the same spec without sinks gets: sized for the holistic plan (4 x SMs x 144 splits per KV head), a
    32-query-head, 8-KV-head, head_dim-128 sinks spec got 151 MiB on an H100 where its plans take at most 67 MiB
    (the 128 MiB floor), a second buffer beside every other spec's."""
    import torch

    h100 = 132
    monkeypatch.setattr(fi, "_sms", lambda device: h100)
    cuda = torch.device("cuda", 0)  # only its SM count is read (patched)
    assert fi.workspace_bytes(AttentionSpec(32, 8, 128, "bf16", sinks=True), cuda) >> 20 == 128
    for heads, kvh, d in ((64, 8, 64), (32, 8, 128), (16, 4, 256), (8, 1, 128)):
        spec, sinks = AttentionSpec(heads, kvh, d, "bf16"), AttentionSpec(heads, kvh, d, "bf16", sinks=True)
        assert fi.plan_bytes(sinks, h100) == fi.plan_bytes(spec, h100), sinks


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kvh,d,sinks", [(8, 1, 128, False), (32, 8, 128, True), (16, 4, 256, False)])
def test_flashinfer_fa2_plans_fit_plan_bytes_and_the_port_is_exact(heads, kvh, d, sinks):
    """On this GPU, with FlashInfer itself: the FA2 plans of the batch that takes the most (per the port above) fit
    a buffer of plan_bytes (the paged prefill, the ragged prefill, and with sinks the attention-sink wrapper, a
    BatchPrefillWithPagedKVCacheWrapper), and 16 bytes less than the port's need is refused (the port is
    FlashInfer's scheduler). Plans only: nothing runs, the wrappers JIT-compile their modules on first use."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    flashinfer = pytest.importorskip("flashinfer")
    assert issubclass(flashinfer.BatchAttentionWithAttentionSinkWrapper, flashinfer.BatchPrefillWithPagedKVCacheWrapper)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    spec = AttentionSpec(heads, kvh, d, "bf16", sinks=sinks)
    page = 16
    need, q, k = max((prefill_plan_float_bytes(spec, sms, [q], [k], page), q, k)
                     for q in range(16, 4097, 16) for k in (8192, 32768))
    assert fi.plan_bytes(spec, sms) - (1 << 20) < need <= fi.plan_bytes(spec, sms)
    pages = _cdiv(k, page)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32, device=dev)

    def paged(wrapper):
        wrapper.plan(i32([0, q]), i32([0, pages]), torch.arange(pages, dtype=torch.int32, device=dev),
                     i32([k - (pages - 1) * page]), heads, kvh, d, page, causal=True, q_data_type=torch.bfloat16,
                     kv_data_type=torch.bfloat16)

    def makers(buffer):
        yield lambda: paged(flashinfer.BatchPrefillWithPagedKVCacheWrapper(buffer, "NHD", backend="fa2"))
        if sinks:
            yield lambda: paged(flashinfer.BatchAttentionWithAttentionSinkWrapper(
                buffer, "NHD", backend="fa2", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
                head_dim_qk=d, head_dim_vo=d, window_left=-1))

    for plan in makers(torch.empty(fi.plan_bytes(spec, sms), dtype=torch.uint8, device=dev)):
        plan()
    for plan in makers(torch.empty(need - 16, dtype=torch.uint8, device=dev)):
        with pytest.raises(Exception, match="Buffer overflow"):
            plan()
    ragged_need = prefill_plan_float_bytes(spec, sms, [q], [k], 1)
    for nbytes, fits in ((fi.plan_bytes(spec, sms), True), (ragged_need - 16, False)):
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            torch.empty(nbytes, dtype=torch.uint8, device=dev), "NHD", backend="fa2")
        call = lambda: wrapper.plan(i32([0, q]), i32([0, k]), heads, kvh, d, causal=True,  # noqa: E731
                                    q_data_type=torch.bfloat16)
        if fits:
            call()
        elif ragged_need:
            with pytest.raises(Exception, match="Buffer overflow"):
                call()
