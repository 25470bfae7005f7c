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


def test_a_plugin_check_that_calls_sys_exit_costs_the_backend_not_the_server(monkeypatch):
    """A plugin whose unsupported() calls sys.exit() (a library without a device it can use) is unavailable with the
    exit as its reason; the selection goes on with torch instead of the server exiting."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.server_plugins:EXITS")
    spec = attnsel.AttentionSpec(4, 2, 64, "fp32")
    sel = attnsel.select(spec, policy="priority", prefill_priority=["exits", "torch"], decode_priority=["torch"],
                         extend_priority=["torch"])
    found = {c.name: c for c in sel.candidates["prefill"]}["exits"]
    assert sel.prefill == "torch"
    assert found.status == "unavailable"
    assert found.reason == "availability check raised SystemExit: no device this library supports"


def test_a_plugin_version_that_is_no_json_value_keys_the_cache_by_its_text(monkeypatch, inproc_worker):
    """A plugin's version as a packaging-style object (str() gives its text) keys the cache by that text; it does
    not crash the selection when the cache key is written."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.server_plugins:OBJECT_VERSION")
    spec = attnsel.AttentionSpec(4, 2, 64, "fp32")
    order = ["object_version", "torch"]
    sel = attnsel.select(spec, policy="priority", prefill_priority=order, decode_priority=order,
                         extend_priority=order)
    assert (sel.prefill, sel.decode, sel.extend) == ("object_version",) * 3
    again = attnsel.select(spec, policy="priority", prefill_priority=order, decode_priority=order,
                           extend_priority=order)
    assert again.cache == "hit" and again.prefill == "object_version"


@pytest.mark.parametrize("phase", ["prefill", "decode", "extend"])
@pytest.mark.parametrize("value", [None, "", "bogus"])
def test_select_names_the_phase_argument_of_a_bad_backend(phase, value):
    """A server passing None (meaning its default) or a bad name for a phase's backend is told which argument it
    was and what is allowed, not just "unknown backend None"."""
    spec = attnsel.AttentionSpec(4, 2, 64, "fp32")
    expected = rf"^{phase}: expected 'auto' or a backend name \(fa3, .*torch.*\), got {value!r}$"
    with pytest.raises(UnknownBackendError, match=expected):
        attnsel.select(spec, **{phase: value})


@pytest.mark.parametrize("phase", ["prefill", "decode", "extend"])
def test_select_refuses_a_priority_list_for_a_phase_that_names_a_backend(phase):
    """A *_priority list sets an automatic phase's candidates; given with a named backend for that phase it would be
    dropped unread, so select() refuses the pair, naming both (the CLI refuses --PHASE-priority with --PHASE-backend)."""
    spec = attnsel.AttentionSpec(4, 2, 64, "fp32")
    with pytest.raises(attnsel.InvalidArgument, match=rf"{phase}_priority.*{phase}='torch'.*give the backend or the list, not both"):
        attnsel.select(spec, policy="priority", **{phase: "torch", f"{phase}_priority": ["torch"]})


@pytest.mark.parametrize("phase", ["prefill", "decode", "extend"])
def test_a_misspelled_priority_entry_names_its_argument(phase):
    """select()'s *_priority lists are checked name by name; the error names the list it came from (the CLI names
    its flag) and the valid names."""
    spec = attnsel.AttentionSpec(4, 2, 64, "fp32")
    with pytest.raises(UnknownBackendError, match=rf"^{phase}_priority: unknown backend 'torhc'; valid names: .*torch"):
        attnsel.select(spec, policy="priority", **{f"{phase}_priority": ["torhc", "torch"]})
