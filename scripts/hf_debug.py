"""Diagnose paged|attnsel vs paged|sdpa token differences (device run): NaN counts, zero tokens, plan cache off."""
import torch
from transformers import AttentionInterface, GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from attnsel.integrations import hf

hf.register(policy="priority")
stats = {"calls": 0, "nan_out": 0, "nan_in": 0, "decode": 0}
orig = hf.paged_attention_forward


def wrapped(module, query, key, value, attention_mask, **kw):
    stats["calls"] += 1
    stats["nan_in"] += int(torch.isnan(query).any())
    if kw.get("max_seqlen_q") == 1:
        stats["decode"] += 1
    out, _ = orig(module, query, key, value, attention_mask, **kw)
    stats["nan_out"] += int(torch.isnan(out).any())
    return out, None


AttentionInterface.register("paged|attnsel", wrapped)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, pad_token_id=0,
                  eos_token_id=None, bos_token_id=1)
LlamaForCausalLM(cfg).save_pretrained("/tmp/tl2")
prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [12, 13], [20, 21, 22, 23, 24]]
g = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=0)
for device, dtype, replan in [("cpu", torch.float32, False), ("cpu", torch.float32, True), ("cuda", torch.float32, False),
                              ("cuda", torch.bfloat16, False), ("cuda", torch.bfloat16, True)]:
    if replan:
        hf._paged_steps.get = lambda layer, key, make, device: make()
    cb = ContinuousBatchingConfig(block_size=16, num_blocks=64, max_batch_tokens=256)
    outs = {}
    for name in ("paged|sdpa", "paged|attnsel"):
        for k in stats:
            stats[k] = 0
        m = LlamaForCausalLM.from_pretrained("/tmp/tl2", attn_implementation=name, dtype=dtype).to(device).eval()
        r = m.generate_batch(inputs=prompts, generation_config=g, continuous_batching_config=cb)
        outs[name] = [[int(t) for t in r[k].generated_tokens] for k in sorted(r)]
    same = sum(a == b for x, y in zip(outs["paged|sdpa"], outs["paged|attnsel"]) for a, b in zip(x, y))
    zeros = {n: sum(t == 0 for x in o for t in x) for n, o in outs.items()}
    print(f"{device} {dtype} replan={replan}: same {same}/96 zeros {zeros} stats {stats} "
          f"sel {[(s.prefill, s.decode) for s in hf._selections.values()]}", flush=True)
    print("  sdpa   ", outs["paged|sdpa"][2][:16], "\n  attnsel", outs["paged|attnsel"][2][:16], flush=True)
