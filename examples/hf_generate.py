"""Build a small Llama-shaped model with random weights, save it locally, and generate with attnsel's attention.

Runs anywhere (CPU: the torch backend; CUDA: whatever attnsel selects for the model's shapes). No downloads.
Usage: python examples/hf_generate.py [--device cuda] [--dtype bfloat16] [--out /tmp/attnsel-tiny-llama]
"""
import argparse
import logging

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from attnsel.integrations import hf

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--dtype", default="bfloat16" if torch.cuda.is_available() else "float32")
parser.add_argument("--out", default="/tmp/attnsel-tiny-llama")
args = parser.parse_args()
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
                     pad_token_id=0, bos_token_id=1, eos_token_id=None)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained(args.out)

hf.register()  # the one line: before from_pretrained, then attn_implementation="attnsel"
model = LlamaForCausalLM.from_pretrained(args.out, attn_implementation="attnsel",
                                         dtype=getattr(torch, args.dtype)).to(args.device).eval()
prompts = [[1, 17, 42, 99, 7, 300], [1, 5, 6]]
width = max(map(len, prompts))
ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=args.device)  # left padding
out = model.generate(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=16, do_sample=False,
                     pad_token_id=0)
for row in out[:, width:].tolist():
    print("generated:", row)
print("attention calls handed back to transformers:", hf.fallbacks() or "none")
