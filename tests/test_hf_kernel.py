"""transformers >= 5.25: attnsel as the Hub kernel "attnsel/flash-attn", loaded by transformers through the kernels
library from the local repository attnsel writes (LOCAL_KERNELS), with the Hub offline: the same tokens as sdpa for
generate (with padding) and generate_batch, and a fresh process (as transformers serve spawns) needs only the
environment."""
import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from attnsel import flash_api  # noqa: E402
from attnsel.integrations import hf, hf_kernels  # noqa: E402
from tests.fixtures.cb_config import small_cache  # noqa: E402

pytestmark = pytest.mark.skipif(hf_kernels.kernel_unsupported() is not None,
                                reason=f"{hf_kernels.kernel_unsupported()} (.ci/run tests the newest transformers)")

from tests.test_hf_current import PROMPTS, tiny_llama  # noqa: E402,F401  (the same model and prompts)


@pytest.fixture(autouse=True)
def _registered(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # kernels reads it when get_kernel is called
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.delenv("ATTNSEL_PREFILL_BACKEND", raising=False)
    monkeypatch.delenv("ATTNSEL_DECODE_BACKEND", raising=False)
    names = hf.register("torch", "torch", policy="priority")
    assert hf_kernels.KERNEL_NAME in names
    flash_api.reset()
    yield


def load(path, implementation):
    return transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation=implementation,
                                                         dtype=torch.float32).eval()


def test_generate_with_padding_matches_sdpa(tiny_llama):
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    gen = dict(attention_mask=(ids != 0).long(), max_new_tokens=12, do_sample=False, pad_token_id=0)
    ours = load(tiny_llama, hf_kernels.KERNEL_NAME)
    assert ours.config._attn_implementation == hf_kernels.KERNEL_NAME
    assert torch.equal(load(tiny_llama, "sdpa").generate(input_ids=ids, **gen), ours.generate(input_ids=ids, **gen))
    assert any(key[0] == "prefill" for key in flash_api.default()._plans)  # the varlen calls went through attnsel
    kernel = sys.modules["_attnsel_flash_attn"]  # what kernels imported from the local repository
    assert kernel.flash_attn_varlen_func is hf_kernels.flash_attn_varlen_func


def test_generate_batch_matches_builtin(tiny_llama):
    gen = transformers.GenerationConfig(max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)

    def tokens(model):
        out = model.generate_batch(PROMPTS, generation_config=gen, progress_bar=False,
                                   continuous_batching_config=small_cache())
        return [out[r].generated_tokens for r in sorted(out, key=lambda r: int(r.split("_")[-1]))]

    expected = tokens(load(tiny_llama, "sdpa"))
    model = load(tiny_llama, hf_kernels.KERNEL_NAME)
    assert tokens(model) == expected
    assert model.config._attn_implementation == hf_kernels.KERNEL_NAME
    assert any(key[0] == "prefill" for key in flash_api.default()._plans)


def test_a_fresh_process_needs_only_the_environment(tiny_llama):
    """What transformers serve's model process does: no attnsel import, no register(); the name resolves through
    LOCAL_KERNELS and the selection options come from ATTNSEL_KERNEL_OPTIONS."""
    script = (
        "import json, sys, torch, transformers\n"
        "m = transformers.LlamaForCausalLM.from_pretrained(sys.argv[1], attn_implementation='attnsel/flash-attn', "
        "dtype=torch.float32).eval()\n"
        "out = m.generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8, do_sample=False, pad_token_id=0)\n"
        "from attnsel import flash_api\n"
        "fa = flash_api.default()\n"
        "print(json.dumps({'tokens': out.tolist(), 'options': fa.options, 'plans': len(fa._plans),"
        " 'kernel': sys.modules['_attnsel_flash_attn'].__file__}))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script, tiny_llama], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    expected = load(tiny_llama, "sdpa").generate(input_ids=torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8,
                                                 do_sample=False, pad_token_id=0)
    assert got["tokens"] == expected.tolist()
    assert got["options"] == {"policy": "priority", "prefill": "torch", "decode": "torch"} and got["plans"] >= 1
    assert got["kernel"].startswith(os.environ["ATTNSEL_CACHE_DIR"])  # the repository register() wrote


def test_transformers_passes_sinks_and_page_table():
    """transformers passes only the arguments a kernel function declares: s_aux (sinks) and the block table must not
    be dropped silently."""
    from transformers.modeling_flash_attention_utils import _lazy_define_process_function

    for func, table in ((hf_kernels.flash_attn_varlen_func, None), (hf_kernels.flash_attn_with_kvcache, "page_table")):
        process = _lazy_define_process_function(func)
        kwargs = process(query_length=1, key_length=4, is_causal=True, s_aux=torch.zeros(4),
                         block_table=torch.zeros(1, 1, dtype=torch.int32))
        assert "s_aux" in kwargs
        assert (table in kwargs) if table else "page_table" not in kwargs


def test_other_local_kernels_are_kept(monkeypatch):
    monkeypatch.setenv("LOCAL_KERNELS", "someone/other=/x/y:attnsel/flash-attn=/stale")
    hf_kernels.register_kernel()
    entries = os.environ["LOCAL_KERNELS"].split(":")
    assert entries[0] == "someone/other=/x/y" and len(entries) == 2
    name, root = entries[1].split("=")
    assert name == hf_kernels.KERNEL_NAME and root.startswith(os.environ["ATTNSEL_CACHE_DIR"] + "/hub-kernel-")


def test_kernel_repo_is_written_once_whole_and_ignores_leftovers(tmp_path):
    """A writer killed midway leaves a temporary directory beside the repository, never a stray file inside it
    (kernels checks every file of a variant against the digest); a second write keeps the first repository."""
    pytest.importorskip("kernels")
    stray = tmp_path / ".hub-kernel-000000000000.4242" / "build"  # another process's half-built copy
    stray.mkdir(parents=True)
    root = hf_kernels.write_kernel_repo(tmp_path)
    assert root.name.startswith("hub-kernel-") and not any(p.name.startswith(".") for p in root.rglob("*"))
    mtime = (root / "build" / "torch-cpu" / "metadata.json").stat().st_mtime_ns
    assert hf_kernels.write_kernel_repo(tmp_path) == root
    assert (root / "build" / "torch-cpu" / "metadata.json").stat().st_mtime_ns == mtime


def test_options_that_cannot_cross_processes_are_refused():
    with pytest.raises(TypeError, match="option prefill_priority=.*cannot reach processes transformers spawns"):
        hf_kernels._json_options({"prefill_priority": {"torch"}})
    assert hf_kernels._json_options({"prefill_priority": ("triton", "torch"), "timeout": 30, "cache_dir": None}) == {
        "prefill_priority": ["triton", "torch"], "timeout": 30, "cache_dir": None}
