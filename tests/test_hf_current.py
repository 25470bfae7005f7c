"""transformers >= 5.18 (CI: 5.18 and the newest, 5.25): continuous batching through "attnsel_flash" gives the
same tokens as the built-in paged implementation (sdpa), and so does plain generate with padding."""
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
from attnsel import flash_api  # noqa: E402
from attnsel.integrations import hf, hf_kernels  # noqa: E402
from tests.fixtures.cb_config import small_cache  # noqa: E402

MINOR = tuple(int(x) for x in transformers.__version__.split(".")[:2])
pytestmark = pytest.mark.skipif(MINOR < (5, 18), reason="transformers 5.17 serves continuous batching through "
                                "paged|attnsel (tests/test_hf.py); .ci/run runs this file on 5.18 and the newest")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [12, 13], [20, 21, 22, 23, 24], [7] * 19]
NEW_TOKENS = 24


@pytest.fixture
def tiny_llama(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "llama")
    return str(tmp_path / "llama")


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    monkeypatch.setenv("ATTNSEL_PREFILL_BACKEND", "torch")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")
    names = hf.register(policy="priority")
    assert hf_kernels.NAME in names  # hf.register adds the flash route where paged|attnsel is refused
    yield


def batch_tokens(path, implementation):
    model = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation=implementation,
                                                          dtype=torch.float32).eval()
    gen = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = model.generate_batch(PROMPTS, generation_config=gen, progress_bar=False,
                               continuous_batching_config=small_cache())
    return [out[r].generated_tokens for r in sorted(out, key=lambda r: int(r.split("_")[-1]))], model


def test_generate_batch_matches_builtin(tiny_llama, caplog):
    expected, _ = batch_tokens(tiny_llama, "sdpa")
    with caplog.at_level(logging.INFO, logger="attnsel"):
        got, model = batch_tokens(tiny_llama, hf_kernels.NAME)
    assert model.config._attn_implementation == hf_kernels.NAME  # not swapped for another implementation
    assert got == expected
    assert all(len(t) == NEW_TOKENS for t in got)
    assert "prefill: torch, decode: torch" in caplog.text
    assert any(key[0] == "prefill" for key in flash_api.default()._plans)  # the varlen calls went through attnsel


def test_generate_with_padding_matches_sdpa(tiny_llama):
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = (ids != 0).long()
    gen = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    ref = transformers.LlamaForCausalLM.from_pretrained(tiny_llama, attn_implementation="sdpa").eval()
    ours = transformers.LlamaForCausalLM.from_pretrained(tiny_llama, attn_implementation=hf_kernels.NAME).eval()
    assert torch.equal(ref.generate(input_ids=ids, attention_mask=mask, **gen),
                       ours.generate(input_ids=ids, attention_mask=mask, **gen))
    one = torch.tensor([PROMPTS[0]])  # no padding: transformers calls flash_attn_func
    assert torch.equal(ref.generate(input_ids=one, **gen), ours.generate(input_ids=one, **gen))


def test_other_flash_names_still_reach_transformers():
    from transformers import modeling_flash_attention_utils as mfau

    with pytest.raises(Exception) as info:  # FA2 is not installed here: transformers' own error, not attnsel's
        mfau._lazy_imports("flash_attention_2")
    assert "attnsel" not in str(info.value)
    assert mfau._lazy_imports(hf_kernels.NAME)[1] is hf_kernels.flash_attn_varlen_func
