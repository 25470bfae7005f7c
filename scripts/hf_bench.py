"""End-to-end continuous batching on the GPU: transformers' generate_batch with "paged|attnsel" vs "paged|sdpa".

A bf16 model with Llama-3-8B attention shapes (32 q / 8 kv heads, head_dim 128, hidden 4096, MLP 14336) and fewer
layers, random weights; 64 concurrent requests with prompts of 256 to 2048 tokens. Both implementations run in this
one process on the same model, interleaved, so the ratio is measured in one run.
Usage: python3 scripts/hf_bench.py OUT.json [--layers N] [--requests N] [--new-tokens N]
"""
import argparse
import json
import logging
import statistics
import sys
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from attnsel.integrations import hf

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--requests", type=int, default=64)
parser.add_argument("--new-tokens", type=int, default=128)
parser.add_argument("--repeats", type=int, default=2)
args = parser.parse_args()
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)

hf.register()
cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                  torch_dtype="bfloat16", pad_token_id=0, bos_token_id=1, eos_token_id=None)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
gen = torch.Generator().manual_seed(1)
lengths = torch.randint(256, 2049, (args.requests,), generator=gen).tolist()
prompts = [torch.randint(2, 32000, (n,), generator=gen).tolist() for n in lengths]
gconf = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
cb = ContinuousBatchingConfig(block_size=256)


def run(name: str, inputs):
    model.set_attn_implementation(name)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    res = model.generate_batch(inputs=inputs, generation_config=gconf, continuous_batching_config=cb)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = [[int(t) for t in res[k].generated_tokens] for k in sorted(res)]
    return wall, tokens


names = ["paged|sdpa", "paged|attnsel"]
for name in names:  # warm-up: selection, JIT, allocator
    w, _ = run(name, prompts[:4])
    print(f"warm-up {name}: {w:.1f} s", flush=True)
walls = {n: [] for n in names}
tokens = {}
for _ in range(args.repeats):
    for name in names:
        w, tokens[name] = run(name, prompts)
        walls[name].append(w)
        print(f"{name}: {w:.2f} s, {sum(map(len, tokens[name])) / w:.0f} tokens/s", flush=True)
generated = sum(map(len, tokens[names[0]]))
same = sum(a == b for x, y in zip(tokens[names[0]], tokens[names[1]]) for a, b in zip(x, y))
sel = next(iter(hf._selections.values()))
result = {
    "date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
    "layers": args.layers, "requests": args.requests, "prompt_tokens": sum(lengths), "new_tokens": args.new_tokens,
    "walls_s": walls, "tokens_per_s": {n: generated / statistics.median(w) for n, w in walls.items()},
    "speedup_attnsel_vs_sdpa_paged": statistics.median(walls["paged|sdpa"]) / statistics.median(walls["paged|attnsel"]),
    "identical_token_fraction": same / generated, "fallbacks": hf.fallbacks(),
    "selection": {"prefill": sel.prefill, "decode": sel.decode, "page_size": sel.spec.page_size},
}
print(json.dumps(result, indent=1))
with open(args.out, "w") as fh:
    json.dump(result, fh, indent=1)
