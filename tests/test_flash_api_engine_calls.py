"""FA-compatible calls as engines make them, with the options engines set: outputs judged against a float64
reference written here (no attnsel code)."""
import pytest
import torch

import attnsel
from attnsel import flash_api

pytestmark = pytest.mark.usefixtures("inproc_worker")
HQ, HK, D = 4, 2, 16


@pytest.fixture(autouse=True)
def _fresh():
    flash_api.configure(policy="priority")
    yield
    flash_api.configure()


def _reference(q, k, v, causal):
    """float64 attention of q [lq, HQ, D] over k/v [lk, HK, D]; causal: bottom-right aligned."""
    lq, lk = q.shape[0], k.shape[0]
    k, v = k.double().repeat_interleave(HQ // HK, 1), v.double().repeat_interleave(HQ // HK, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * D ** -0.5
    if causal:
        s = s.masked_fill(torch.arange(lk)[None] > torch.arange(lk - lq, lk)[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("how", ["environment", "configure"])
def test_a_non_causal_varlen_call_is_served_with_an_extend_backend_named(monkeypatch, how):
    """An engine names the extend backend for its decoder (ATTNSEL_EXTEND_BACKEND or configure(extend=)); its
    vision encoder calls flash_attn_varlen_func(causal=False). That call never plans extend (extend is causal), yet
    its selection asked for the named extend backend on the non-causal spec and raised SelectionError."""
    if how == "environment":
        monkeypatch.setenv("ATTNSEL_EXTEND_BACKEND", "torch")
    else:
        flash_api.configure(extend="torch", policy="priority")
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, HQ, D, generator=g), torch.randn(7, HK, D, generator=g), torch.randn(7, HK, D, generator=g)
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 3, 7], dtype=torch.int32)
    out = attnsel.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, causal=False)
    for b in range(2):
        ref = _reference(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]], causal=False)
        assert (out[cu_q[b]:cu_q[b + 1]].double() - ref).abs().max() < 1e-5
