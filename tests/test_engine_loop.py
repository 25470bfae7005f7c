"""An engine-shaped end-to-end test, LightLLM-style: a small random Llama-shaped model in plain torch whose attention
is attnsel's FA-compatible ``flash_attn_with_kvcache`` varlen call exactly as LightLLM makes it (token-level KV pool,
page size 1, a page table per request from ``req_to_token``, the new tokens written into the pool before the call).

Scenario, in mixed ragged batches: request A's 300-token prompt; request B sharing A's 300 tokens (a prompt-cache hit:
its page table reuses A's slots) plus its own; a 2000-token prompt prefilled in 4 chunks; MTP-style decode with 2
queries per request per step (the pending greedy token and a draft: accepted when it is the model's next token, else
its slot is given back). Greedy tokens must equal a dense reference: the same model with plain full causal attention
over each whole sequence, no cache. CPU: float32, the torch backend, tokens identical. CUDA: bf16, each GPU backend
forced in turn for the extend phase; a token may differ only where the dense top-2 logits are within bf16 noise.
"""
import math

import pytest
import torch

import attnsel
from attnsel import flash_api
from attnsel.backends import availability, get

pytestmark = pytest.mark.usefixtures("inproc_worker")
CUDA = torch.cuda.is_available()
VOCAB, LAYERS = 256, 2
HQ, HK = 4, 2
D = 64 if CUDA else 16  # FlashInfer serves head_dim 64, 128, 256
PROMPT_A, OWN_B, LONG, CHUNKS, MTP_STEPS = 300, 37, 2000, 4, 5


class TinyLlama:
    """Embedding, LAYERS x (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU MLP), RMSNorm, lm_head. ``forward``
    takes ``attend(layer, q, k, v) -> o`` for the tokens given (q ``[T, HQ, D]``, k/v ``[T, HK, D]``, RoPE applied)."""

    def __init__(self, dtype, device, seed=0):
        g = torch.Generator().manual_seed(seed)
        hidden, mlp = HQ * D, 2 * HQ * D
        self.dtype, self.device = dtype, device

        def w(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale / math.sqrt(shape[0])).to(device, dtype)

        def norm():
            return (1 + 0.1 * torch.randn(hidden, generator=g)).to(device)

        self.embed = (torch.randn(VOCAB, hidden, generator=g)).to(device, dtype)
        self.layers = [dict(ln1=norm(), wq=w(hidden, HQ * D, scale=2.0), wk=w(hidden, HK * D, scale=2.0),
                            wv=w(hidden, HK * D), wo=w(HQ * D, hidden), ln2=norm(), gate=w(hidden, mlp),
                            up=w(hidden, mlp), down=w(mlp, hidden)) for _ in range(LAYERS)]
        self.norm, self.lm_head = norm(), w(hidden, VOCAB, scale=4.0)
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, device=device).float() / D))

    def _rms(self, x, weight):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(self.dtype)

    def _rope(self, x, positions):
        angles = positions.float()[:, None] * self.inv_freq[None]  # [T, D / 2]
        cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
        xf = x.float()
        rotated = torch.cat([-xf[..., D // 2:], xf[..., :D // 2]], -1)
        return (xf * cos + rotated * sin).to(self.dtype)

    def forward(self, tokens, positions, attend):
        x = self.embed[tokens]
        for i, p in enumerate(self.layers):
            h = self._rms(x, p["ln1"])
            q = self._rope((h @ p["wq"]).view(-1, HQ, D), positions)
            k = self._rope((h @ p["wk"]).view(-1, HK, D), positions)
            v = (h @ p["wv"]).view(-1, HK, D)
            x = x + attend(i, q, k, v).reshape(-1, HQ * D) @ p["wo"]
            h = self._rms(x, p["ln2"])
            x = x + (torch.nn.functional.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
        return (self._rms(x, self.norm) @ self.lm_head).float()

    def dense_logits(self, tokens):
        """The reference: one whole sequence, plain causal attention, no cache."""
        tokens = torch.tensor(tokens, device=self.device)

        def attend(layer, q, k, v):
            kk, vv = (t.repeat_interleave(HQ // HK, 1).transpose(0, 1) for t in (k, v))
            return torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv,
                                                                    is_causal=True).transpose(0, 1)

        return self.forward(tokens, torch.arange(len(tokens), device=self.device), attend)


class Request:
    def __init__(self, index, prompt):
        self.index, self.prompt = index, list(prompt)
        self.fed: list[int] = []  # tokens whose KV is in the pool, in order
        self.slots: list[int] = []  # their pool slots
        self.generated: list[int] = []  # accepted greedy tokens
        self.pending: int | None = None  # the next greedy token, not yet fed


class Engine:
    """LightLLM's shapes: per layer a KV buffer ``[pool, 2 * HK, D]``, ``req_to_token`` ``[requests, max_len]``
    (int32 pool slots), a free list; each step's metadata made once and shared by the layers."""

    def __init__(self, model, pool, max_len, requests):
        self.model, dev = model, model.device
        self.kv_buffer = [torch.full((pool, 2 * HK, D), float("nan"), device=dev, dtype=model.dtype)
                          for _ in range(LAYERS)]
        self.req_to_token = torch.zeros(requests, max_len, dtype=torch.int32, device=dev)
        self.free = list(range(pool))[::-1]
        self.steps = 0

    def share_prefix(self, src: Request, dst: Request, n: int):
        """A prompt-cache hit: dst's first n tokens are src's, at src's slots."""
        dst.fed, dst.slots = src.fed[:n], src.slots[:n]
        self.req_to_token[dst.index, :n] = torch.tensor(src.slots[:n], dtype=torch.int32)

    def step(self, work):
        """One forward over [(request, new tokens)]: returns each request's logits ``[new tokens, VOCAB]``."""
        dev = self.model.device
        tokens, positions, mem_index, q_lens, seq_lens = [], [], [], [], []
        for req, new in work:
            start = len(req.fed)
            slots = [self.free.pop() for _ in new]
            req.fed, req.slots = req.fed + list(new), req.slots + slots
            self.req_to_token[req.index, start:start + len(new)] = torch.tensor(slots, dtype=torch.int32)
            tokens += new
            positions += range(start, start + len(new))
            mem_index += slots
            q_lens.append(len(new))
            seq_lens.append(len(req.fed))
        b_req_idx = torch.tensor([req.index for req, _ in work], device=dev)
        b_seq_len = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        cu_seqlens_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        cu_seqlens_k = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        max_seq_len = max(seq_lens)
        page_table = torch.empty((len(work), max_seq_len), dtype=torch.int32, device=dev)
        page_table.copy_(self.req_to_token[b_req_idx, :max_seq_len])
        mem_index = torch.tensor(mem_index, device=dev)

        def attend(layer, q, k, v):
            self.kv_buffer[layer][mem_index] = torch.cat([k, v], 1)  # LightLLM's copy_kv_index_to_req
            cache_k = self.kv_buffer[layer][:, 0:HK, :].reshape(-1, 1, HK, D)
            cache_v = self.kv_buffer[layer][:, HK:2 * HK, :].reshape(-1, 1, HK, D)
            return attnsel.flash_attn_with_kvcache(
                q=q, k_cache=cache_k, v_cache=cache_v, page_table=page_table, cache_seqlens=b_seq_len,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k_new=cu_seqlens_k, max_seqlen_q=max(q_lens),
                softmax_scale=1.0 / (D ** 0.5), causal=True, window_size=(-1, -1), softcap=0.0, k_descale=None,
                v_descale=None, return_softmax_lse=False)

        logits = self.model.forward(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev), attend)
        self.steps += 1
        return logits.split(q_lens)

    def roll_back(self, req: Request):
        """A rejected draft: its token leaves the sequence and its slot goes back to the pool (its KV stays there)."""
        req.fed.pop()
        self.free.append(req.slots.pop())


def reference_continuation(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(model.dense_logits(tokens)[-1].argmax()))
    return tokens[len(prompt):]


def run_scenario(model):
    """The scenario of the module docstring; returns (requests, reference continuations, engine, drafts taken
    and drafts rejected)."""
    g = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(VOCAB, (PROMPT_A,), generator=g).tolist()
    prompt_b = prompt_a + torch.randint(VOCAB, (OWN_B,), generator=g).tolist()
    prompt_c = torch.randint(VOCAB, (LONG,), generator=g).tolist()
    a, b, c = Request(0, prompt_a), Request(1, prompt_b), Request(2, prompt_c)
    want = 2 * (CHUNKS + MTP_STEPS) + 2  # the most tokens A (the longest decoding) can accept, + its drafts
    refs = {r.index: reference_continuation(model, r.prompt, want) for r in (a, b, c)}
    engine = Engine(model, pool=PROMPT_A + OWN_B + LONG + 3 * want + 8, max_len=LONG + 3 * want, requests=3)
    drafts = {"accepted": 0, "rejected": 0}

    def mtp(req):
        """Feed [pending, draft]: the draft is the reference's next token on even steps, a wrong one on odd."""
        nxt = refs[req.index][len(req.generated) + 1]
        draft = nxt if engine.steps % 2 == 0 else (nxt + 1) % VOCAB
        return req, [req.pending, draft]

    def settle(req, logits, mtp_step):
        if not mtp_step:  # a prompt (or its last chunk): the first greedy token
            req.pending = int(logits[-1].argmax())
            return
        draft, after_pending = req.fed[-1], int(logits[0].argmax())
        req.generated.append(req.pending)
        if draft == after_pending:
            drafts["accepted"] += 1
            req.generated.append(draft)
            req.pending = int(logits[1].argmax())
        else:
            drafts["rejected"] += 1
            engine.roll_back(req)
            req.pending = after_pending

    chunk = LONG // CHUNKS
    (la,) = engine.step([(a, prompt_a)])
    settle(a, la, False)
    engine.share_prefix(a, b, PROMPT_A)
    for i in range(CHUNKS):  # the long prompt's chunks beside A's (and from the second step B's) decode
        work = [mtp(a), (b, prompt_b[PROMPT_A:]) if i == 0 else mtp(b), (c, prompt_c[i * chunk:(i + 1) * chunk])]
        out = engine.step(work)
        settle(a, out[0], True)
        settle(b, out[1], i > 0)
        if i == CHUNKS - 1:
            settle(c, out[2], False)
    for _ in range(MTP_STEPS):
        out = engine.step([mtp(a), mtp(b), mtp(c)])
        for req, logits in zip((a, b, c), out):
            settle(req, logits, True)
    return (a, b, c), refs, engine, drafts


def _cases():
    if CUDA:
        return [pytest.param("cuda", torch.bfloat16, name, marks=pytest.mark.gpu)
                for name in ("torch", "triton", "fa3", "flashinfer")]
    return [pytest.param("cpu", torch.float32, "torch")]


@pytest.mark.parametrize("device,dtype,backend", _cases())
def test_engine_loop_matches_dense_greedy(device, dtype, backend, tmp_path, monkeypatch):
    spec = attnsel.AttentionSpec(HQ, HK, D, {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype], page_size=1)
    reason = availability(get(backend), spec, "extend", torch.device(device))[0]
    if reason:
        pytest.skip(f"{backend} cannot serve extend here: {reason}")
    planned = []
    real = attnsel.Selection.plan_extend
    monkeypatch.setattr(attnsel.Selection, "plan_extend", lambda self, *a, **kw: planned.append(self.extend) or real(
        self, *a, **kw))
    flash_api.configure(prefill="torch", decode="torch", extend=backend, policy="priority", cache_dir=str(tmp_path))
    try:
        model = TinyLlama(dtype, device)
        requests, refs, engine, drafts = run_scenario(model)
    finally:
        flash_api.configure()
    assert planned == [backend] * engine.steps  # one plan per step, shared by the layers, on the forced backend
    assert drafts["accepted"] and drafts["rejected"]  # both sides of the MTP verify ran
    for req in requests:
        sequence = req.prompt + req.generated
        assert len(req.generated) >= MTP_STEPS
        if dtype == torch.float32:
            assert req.generated == refs[req.index][:len(req.generated)], f"request {req.index}"
            continue
        # bf16: the engine's tokens against the dense model on the engine's own sequence (teacher forced); a token
        # may differ only where the dense model's top two are within bf16 noise
        dense = model.dense_logits(sequence)[len(req.prompt) - 1:-1]
        chosen = torch.tensor(req.generated, device=device)
        top = dense.max(-1).values
        gap = top - dense.gather(1, chosen[:, None])[:, 0]
        assert (gap <= 0.25).all(), f"request {req.index}: gaps {gap.tolist()}"
        assert (gap > 0).sum().item() <= 2, f"request {req.index}: {int((gap > 0).sum())} near-tie flips"
