"""Eager decode's short context (grid.DECODE_SHORT_CTX) is a bucket like the others: within the KV cap that the
device's free memory sets."""
import torch

from attnsel.spec import AttentionSpec
from attnsel.validate import grid


def test_the_short_context_keeps_to_the_memory_cap():
    spec = AttentionSpec(64, 64, 128, "bf16", 16)  # MHA: 32 KiB of KV a token
    free = 3 << 30  # a server that selects after loading its weights: a cap of 512 MiB, under 512 x 48 (768 MiB)
    cap = free // 6
    dec = grid.decode_grid(spec, torch.device("cuda"), free_bytes=free)
    base = dict(zip(grid.DECODE_CTX, grid.DECODE_CTX_POW2))
    over = [(b, c) for _, b, c in dec if grid.decode_bytes(spec, b, base.get(c, c)) > cap]
    assert not over, over
    assert (1, grid.DECODE_SHORT_CTX) in {(b, c) for _, b, c in dec}  # where it fits it stays
