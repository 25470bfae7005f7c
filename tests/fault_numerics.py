"""Plugin backends with real numerical faults, loaded like a user's plugin
(``ATTNSEL_BACKENDS="tests.fault_numerics:ALL"``) or used in-process by tests/test_cases.py.

- old_torch: the torch backend's decode before the fix (commit 880edb1): gathers every row up to the batch's longest
  sequence through the page table and relies on the mask (reads NaN in unused slots, indexes with sentinels).
- top_left: prefill with SDPA's own is_causal for every sequence, which aligns causal top-left when a sequence has
  fewer queries than keys (the contract is bottom-right).
- off_by_one: the torch output plus 1.0.
- stale_plan / stale_when_timed: right on the first one / two runs of a plan, then half the rows zero (a plan that
  cannot be reused: the validation runs a plan twice; the timing checks what its many runs computed).
- wrong_when_alone: heads swapped for a batch of one sequence only (the validation's second case).
- skip_work: every run returns one plan-owned buffer, computed on the first run only (later runs skip their work);
  one_buffer: the same buffer recomputed on every run (correct: must pass).
- mutate_prefill / mutate_decode: correct output, then ``q.mul_(2)``; scribble_cache: correct output, then NaN
  written into the key cache's first page; mutate_then_raise: ``q.mul_(2)`` then raises.
- sloppy: attention computed in the activation dtype by plain matmul/softmax (the old yardstick: with a softcap its
  bf16 scores are off by ~0.1 and the rows' check rejects it).
- Yardstick faults (YARDSTICK_FAULTS, tests/test_yardstick.py): ignore_scale, the torch backend with the default
  softmax scale 1/sqrt(head_dim) instead of the spec's (Gemma 2 27B: 1/sqrt(144) at head_dim 128); drop_last_keys,
  the torch backend without the last DROP_KEYS keys of the sequence with the most keys (a skipped last tile).
- Feature bugs (a backend that claims a feature and gets it wrong): no_window, window_plus_one, window_minus_one,
  no_softcap, no_sinks, ignore_kv_scale, swap_kv_scale.
- broken torch (BROKEN_TORCH, named "torch": it replaces the built-in): top_left prefill and old_torch decode;
  torch_copy: the real torch backend under another name.
- precise / biased (PRECISE_AND_BIASED): decode computed in float32 and rounded once; biased adds 0.0362 to one
  output element of batches of more than one row (the first row's: a one-key row, tolerance the bf16 floor 0.016):
  its own check rejects it (under one tolerance per case, 0.0379, only the cross-candidate outlier rule did).
"""
from __future__ import annotations

import dataclasses

import torch

from attnsel.backends.torch_sdpa import BACKEND as TORCH
from attnsel.backends.torch_sdpa import attend_math, sdpa, seq_bounds, visible
from attnsel.validate.yardstick import reference_attention


def old_torch_plan_decode(spec, page_table, seq_lens):
    """Verbatim the torch backend's plan_decode of commit 880edb1 (the bug of issue 9 item 1)."""
    lens = seq_lens.tolist()
    if min(lens, default=1) < 1:
        raise ValueError("seq_lens must be >= 1 for decode (the cache holds the new token)")
    max_len = max(lens, default=1)
    ps = spec.page_size
    if max_len > page_table.shape[1] * ps:
        raise ValueError(f"page_table has {page_table.shape[1]} pages per sequence, too few for {max_len} "
                         f"tokens at page_size {ps}")
    t = torch.arange(max_len, device=page_table.device)
    slots = page_table[:, t // ps].long() * ps + t % ps  # [B, L] flat slot of each token
    mask = (t[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    scale = spec.scale

    def run(q, k_cache, v_cache):
        kvh, d = k_cache.shape[-2:]
        k = k_cache.reshape(-1, kvh, d)[slots].transpose(1, 2)  # [B, KVH, L, D]
        v = v_cache.reshape(-1, kvh, d)[slots].transpose(1, 2)
        return sdpa(q[:, :, None], k, v, scale, mask=mask)[:, :, 0]

    return run


def top_left_plan_prefill(spec, cu_q, cu_k, max_q, max_k):
    bounds = seq_bounds(cu_q, cu_k)

    def run(q, k, v, **kwargs):
        out = torch.empty_like(q)
        for qs, qe, ks, ke in bounds:
            if qe > qs:
                o = sdpa(q[qs:qe].transpose(0, 1)[None], k[ks:ke].transpose(0, 1)[None],
                         v[ks:ke].transpose(0, 1)[None], spec.scale, is_causal=spec.causal)
                out[qs:qe] = o[0].transpose(0, 1)
        return out

    return run


class Plugin:
    """A backend built from two plan functions (None: the torch backend's)."""

    def __init__(self, name, plan_prefill=None, plan_decode=None):
        self.name = name
        self.version = "test"
        self._prefill = plan_prefill or TORCH.plan_prefill
        self._decode = plan_decode or TORCH.plan_decode

    def unsupported(self, spec, phase):
        return None

    def plan_prefill(self, spec, cu_q, cu_k, max_q, max_k):
        return self._prefill(spec, cu_q, cu_k, max_q, max_k)

    def plan_decode(self, spec, page_table, seq_lens):
        return self._decode(spec, page_table, seq_lens)


def _after(plan, effect):
    """plan function whose run computes the torch result, then calls effect(result, *inputs)."""
    def wrapped(spec, *plan_args):
        run = plan(spec, *plan_args)

        def run_and_effect(*inputs, **kwargs):
            out = run(*inputs, **kwargs)
            return effect(out, *inputs)

        return run_and_effect

    return wrapped


def _double_q(out, q, *rest):
    q.mul_(2)
    return out


def _scribble(out, q, k_cache, v_cache):
    k_cache[0].fill_(float("nan"))
    return out


def _raise_after_mutating(out, q, *rest):
    q.mul_(2)
    raise RuntimeError("injected failure after writing into q")


def _sloppy_prefill(spec, cu_q, cu_k, max_q, max_k):
    cq, ck = cu_q.tolist(), cu_k.tolist()

    def run(q, k, v, *, sinks=None):
        out = torch.empty_like(q)
        for i in range(len(cq) - 1):
            out[cq[i]:cq[i + 1]] = reference_attention(
                q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]], spec.scale, spec.causal,
                window=spec.sliding_window, softcap=spec.softcap, sinks=sinks, dtype=q.dtype)
        return out

    return run


def _with_spec(plan, **changes):
    """plan function of the torch backend run as if the spec had ``changes`` (dropping run inputs it then lacks)."""
    def wrapped(spec, *plan_args):
        wrong = dataclasses.replace(spec, **changes)
        run = plan(wrong, *plan_args)

        def run_wrong(*inputs, sinks=None, k_scale=None, v_scale=None):
            extra = {}
            if wrong.sinks:
                extra["sinks"] = sinks
            if wrong.kv_dtype is not None:
                extra.update(k_scale=k_scale, v_scale=v_scale)
            return run(*inputs, **extra)

        return run_wrong

    return wrapped


def _window_shift(plan, delta):
    """plan function of the torch backend with the window ``delta`` keys wider (an off-by-one convention)."""
    def wrapped(spec, *plan_args):
        return _with_spec(plan, sliding_window=spec.sliding_window + delta)(spec, *plan_args)

    return wrapped


def _scales(transform):
    def wrapped(spec, *plan_args):
        run = TORCH.plan_decode(spec, *plan_args)

        def run_wrong(q, k_cache, v_cache, *, sinks=None, k_scale=None, v_scale=None):
            k_scale, v_scale = transform(k_scale, v_scale)
            return run(q, k_cache, v_cache, sinks=sinks, k_scale=k_scale, v_scale=v_scale)

        return run_wrong

    return wrapped


DROP_KEYS = 64


def _drop_last_prefill(spec, cu_q, cu_k, max_q, max_k):
    """torch's prefill, the sequence with the most keys computed without its last DROP_KEYS keys (every query that
    sees them loses them; float32 softmax, as torch's softcap path)."""
    run = TORCH.plan_prefill(spec, cu_q, cu_k, max_q, max_k)
    lk = (cu_k[1:] - cu_k[:-1]).tolist()
    b = max(range(len(lk)), key=lambda i: lk[i])
    qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1]) - DROP_KEYS
    seen = visible(spec, qe - qs, lk[b], cu_q.device)
    mask = None if seen is None else seen[:, :ke - ks][None, None]

    def run_dropping(q, k, v, **kwargs):
        out = run(q, k, v, **kwargs)
        if ke > ks and qe > qs:
            qb, kb, vb = (t.transpose(0, 1)[None] for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
            o = attend_math(qb, kb, vb, spec.scale, mask=mask, softcap=spec.softcap, sinks=kwargs.get("sinks"))
            out[qs:qe] = o[0].transpose(0, 1)
        return out

    return run_dropping


def _drop_last_decode(spec, page_table, seq_lens):
    """torch's decode, the longest sequence read without its last DROP_KEYS keys."""
    lens = seq_lens.clone()
    b = int(lens.argmax())
    lens[b] = max(1, int(lens[b]) - DROP_KEYS)
    return TORCH.plan_decode(spec, page_table, lens)


def _stale_after(first_good: int):
    """plan function of the torch backend whose first ``first_good`` runs are right and whose later runs leave the
    second half of the rows as zeros: a kernel that skips work once a scheduler counter it never resets has run up
    (FA3's scheduler metadata planned for another length did worse on the H200)."""
    def wrap(plan):
        def wrapped(spec, *plan_args):
            run, calls = plan(spec, *plan_args), [0]

            def run_stale(*inputs, **kwargs):
                out = run(*inputs, **kwargs)
                calls[0] += 1
                if calls[0] > first_good:
                    out[out.shape[0] // 2:] = 0
                return out

            return run_stale

        return wrapped

    return wrap


def _one_buffer(skip_after_first: bool):
    """plan function of the torch backend whose runs all return one plan-owned output buffer: recomputed on every
    run (a legitimate design), or computed on the first run only and handed back untouched afterwards (a kernel that
    skips its work: the buffer still holds a right answer unless someone cleared it)."""
    def wrap(plan):
        def wrapped(spec, *plan_args):
            run, buf = plan(spec, *plan_args), []

            def run_into_buffer(*inputs, **kwargs):
                if not buf:
                    buf.append(run(*inputs, **kwargs))
                elif not skip_after_first:
                    buf[0].copy_(run(*inputs, **kwargs))
                return buf[0]

            return run_into_buffer

        return wrapped

    return wrap


def _wrong_when_alone(plan):
    """plan function of the torch backend that is wrong (heads swapped) only for a batch of one sequence: the path a
    kernel takes when its grid or split count is sized by a batch of one."""
    def wrapped(spec, *plan_args):
        run = plan(spec, *plan_args)
        alone = plan_args[0].shape[0] == 2 if len(plan_args) == 4 else plan_args[1].shape[0] == 1

        def run_maybe_wrong(*inputs, **kwargs):
            out = run(*inputs, **kwargs)
            return torch.roll(out, shifts=1, dims=1) if alone else out

        return run_maybe_wrong

    return wrapped


OLD_TORCH = Plugin("old_torch", plan_decode=old_torch_plan_decode)
WRONG_WHEN_ALONE = Plugin("wrong_when_alone", _wrong_when_alone(TORCH.plan_prefill),
                          _wrong_when_alone(TORCH.plan_decode))
SKIP_WORK = Plugin("skip_work", _one_buffer(True)(TORCH.plan_prefill), _one_buffer(True)(TORCH.plan_decode))
ONE_BUFFER = Plugin("one_buffer", _one_buffer(False)(TORCH.plan_prefill), _one_buffer(False)(TORCH.plan_decode))
STALE_PLAN = Plugin("stale_plan", _stale_after(1)(TORCH.plan_prefill), _stale_after(1)(TORCH.plan_decode))
STALE_WHEN_TIMED = Plugin("stale_when_timed", _stale_after(2)(TORCH.plan_prefill), _stale_after(2)(TORCH.plan_decode))
TOP_LEFT = Plugin("top_left", plan_prefill=top_left_plan_prefill)
OFF_BY_ONE = Plugin("off_by_one", _after(TORCH.plan_prefill, lambda out, *a: out + 1.0),
                    _after(TORCH.plan_decode, lambda out, *a: out + 1.0))
MUTATE_PREFILL = Plugin("mutate_prefill", plan_prefill=_after(TORCH.plan_prefill, _double_q))
MUTATE_DECODE = Plugin("mutate_decode", plan_decode=_after(TORCH.plan_decode, _double_q))
SCRIBBLE_CACHE = Plugin("scribble_cache", plan_decode=_after(TORCH.plan_decode, _scribble))
MUTATE_THEN_RAISE = Plugin("mutate_then_raise", _after(TORCH.plan_prefill, _raise_after_mutating),
                           _after(TORCH.plan_decode, _raise_after_mutating))
SLOPPY = Plugin("sloppy", plan_prefill=_sloppy_prefill)
BROKEN_TORCH = Plugin("torch", top_left_plan_prefill, old_torch_plan_decode)

FEATURE_BUGS = {
    "no_window": Plugin("no_window", _with_spec(TORCH.plan_prefill, sliding_window=None),
                        _with_spec(TORCH.plan_decode, sliding_window=None)),
    "window_plus_one": Plugin("window_plus_one", _window_shift(TORCH.plan_prefill, 1),
                              _window_shift(TORCH.plan_decode, 1)),
    "window_minus_one": Plugin("window_minus_one", _window_shift(TORCH.plan_prefill, -1),
                               _window_shift(TORCH.plan_decode, -1)),
    "no_softcap": Plugin("no_softcap", _with_spec(TORCH.plan_prefill, softcap=None),
                         _with_spec(TORCH.plan_decode, softcap=None)),
    "no_sinks": Plugin("no_sinks", _with_spec(TORCH.plan_prefill, sinks=False),
                       _with_spec(TORCH.plan_decode, sinks=False)),
    "ignore_kv_scale": Plugin("ignore_kv_scale", plan_decode=_scales(lambda k, v: (torch.ones_like(k),
                                                                                   torch.ones_like(v)))),
    "swap_kv_scale": Plugin("swap_kv_scale", plan_decode=_scales(lambda k, v: (v, k))),
}

ALL = [OLD_TORCH, STALE_PLAN, SKIP_WORK, WRONG_WHEN_ALONE, TOP_LEFT, OFF_BY_ONE, MUTATE_PREFILL, MUTATE_DECODE,
       SCRIBBLE_CACHE, MUTATE_THEN_RAISE, SLOPPY, *FEATURE_BUGS.values()]
YARDSTICK_FAULTS = [Plugin("ignore_scale", _with_spec(TORCH.plan_prefill, softmax_scale=None),
                           _with_spec(TORCH.plan_decode, softmax_scale=None)),
                    Plugin("drop_last_keys", _drop_last_prefill, _drop_last_decode)]
TORCH_COPY = Plugin("torch_copy")  # the torch backend under another name (a fallback next to BROKEN_TORCH)


def _precise_decode(bias: float):
    def plan(spec, page_table, seq_lens):
        run = TORCH.plan_decode(spec, page_table, seq_lens)

        def precise(q, k_cache, v_cache, **kw):
            out = run(q.float(), k_cache.float(), v_cache.float(), **kw)
            if bias and out.shape[0] > 1:
                out[0, 0, 0] += bias
            return out.to(q.dtype)

        return precise

    return plan


PRECISE_AND_BIASED = [Plugin("precise", plan_decode=_precise_decode(0.0)),
                      Plugin("biased", plan_decode=_precise_decode(0.0362))]
