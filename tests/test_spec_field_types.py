"""AttentionSpec's causal and softmax_scale fields take only what they mean: a truthy string as causal, or a
numpy float32 / tensor / bool / text as the scale, was stored as given and failed later (a backend's TypeError at
validation, a JSON error storing the results) or meant something else (causal="False" is truthy)."""
import numpy as np
import pytest
import torch

import attnsel
from attnsel import AttentionSpec
from attnsel.errors import SpecError

pytestmark = pytest.mark.usefixtures("inproc_worker")


@pytest.mark.parametrize("given", ["False", "True", 0, 1, None, torch.tensor(False)])
def test_causal_must_be_true_or_false(given):
    with pytest.raises(SpecError, match=r"causal must be True or False, got "):
        AttentionSpec(4, 2, 16, causal=given)


@pytest.mark.parametrize("given", ["0.25", True, torch.tensor(0.25), np.float32(-1.0), float("nan"), [0.25]])
def test_a_scale_that_is_not_a_positive_real_number_is_named(given):
    with pytest.raises(SpecError, match=r"softmax_scale must be a positive finite number or None, got "):
        AttentionSpec(4, 2, 16, softmax_scale=given)


@pytest.mark.parametrize("given", [np.float32(0.25), np.float64(0.25), 0.25])
def test_a_real_scale_is_stored_as_a_float_and_selects(given):
    """A numpy scale (as a config or engine may compute it) is the same spec as the Python float: one cache key,
    and the selection stores its results (numpy float32 is not JSON)."""
    spec = AttentionSpec(4, 2, 16, dtype="fp32", softmax_scale=given)
    assert type(spec.softmax_scale) is float and spec == AttentionSpec(4, 2, 16, dtype="fp32", softmax_scale=0.25)
    sel = attnsel.select(spec, "torch", "torch", "torch")
    assert (sel.prefill, sel.decode, sel.extend) == ("torch", "torch", "torch")
