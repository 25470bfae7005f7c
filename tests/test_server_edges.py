"""Edges a server's calls reach: settings read by the integrations, idle steps, metadata forms, caches and plugins."""
import pytest
import torch

import attnsel
from attnsel import flash_api
from attnsel.backends import UnknownBackendError


@pytest.mark.parametrize("phase", ["prefill", "decode", "extend"])
def test_flash_api_names_a_bad_backend_variable(monkeypatch, phase):
    """A bad ATTNSEL_<PHASE>_BACKEND reaching the FA-compatible functions is named, with what is allowed (as the CLI
    names it), not reported as a bare unknown name the caller never passed."""
    variable = f"ATTNSEL_{phase.upper()}_BACKEND"
    monkeypatch.setenv(variable, "bogus")
    fa = flash_api.FlashAttention()
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(UnknownBackendError, match=rf"{variable}='bogus' \(environment variable\).*'auto'.*torch"):
        fa.flash_attn_varlen_func(q, k, k, cu, cu, 5, 5, causal=True)


def test_hf_names_a_bad_backend_variable_and_an_option_overrides_it(monkeypatch):
    """The transformers integration names a bad ATTNSEL_DECODE_BACKEND too; a configured decode backend overrides the
    variable, which then is not read."""
    pytest.importorskip("transformers")
    from attnsel.integrations.hf import HFAttention

    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "bogus")
    spec = attnsel.AttentionSpec(4, 2, 64, "fp32")
    state = HFAttention()
    with pytest.raises(UnknownBackendError, match=r"ATTNSEL_DECODE_BACKEND='bogus' \(environment variable\)"):
        state.selection_for(spec, torch.device("cpu"))
    state.configure(decode="torch")
    assert state.selection_for(spec, torch.device("cpu")).decode == "torch"
