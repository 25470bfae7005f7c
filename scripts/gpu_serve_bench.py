"""Tokens/s with attnsel vs sdpa: transformers' served model (`attnsel serve` vs the same server on sdpa) and
`generate_batch` (attnsel's continuous-batching implementation vs transformers' built-in paged sdpa).

Usage (GPU): python scripts/gpu_serve_bench.py OUT.json [--layers 4] [--requests 64] [--new-tokens 128]
A random Llama-3-8B-shaped model (32/8 heads, head_dim 128, hidden 4096, bf16, `--layers` layers) and a WordLevel
tokenizer with a chat template are written to a temporary directory (no Hub access). Each configuration runs in its
own process; a configuration that fails is recorded with its error and the others still run.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def save_model(path: Path, layers: int) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_size = 32000
    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|> {% endif %}")
    fast.save_pretrained(path)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                   max_position_embeddings=8192, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.generation_config.eos_token_id = None  # generate until max tokens: equal work for every configuration
    model.save_pretrained(path)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, 31000) for _ in range(rng.randrange(64, 1024))] for _ in range(n)]


def batch_child(path: str, impl: str, requests: int, new_tokens: int) -> dict:
    """generate_batch in this process; impl 'attnsel' picks attnsel's CB implementation for this transformers."""
    import torch
    import transformers

    from attnsel.integrations import hf

    names = hf.register()
    if impl == "attnsel":
        impl = hf.PAGED_NAME if hf.PAGED_NAME in names else "attnsel_flash"
    elif impl == "sdpa" and hf.PAGED_NAME in names:
        impl = "paged|sdpa"  # 5.17's built-in paged name
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl,
                                                              dtype=torch.bfloat16, device_map="cuda").eval()
    gen = transformers.GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                                        pad_token_id=0)
    inputs = prompts(requests)
    model.generate_batch(inputs[:4], generation_config=gen, progress_bar=False)  # warm-up (selection, graphs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate_batch(inputs, generation_config=gen, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.generated_tokens) for r in out.values())
    return {"implementation": impl, "transformers": transformers.__version__, "requests": requests,
            "new_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(path: str, impl: str, requests: int, concurrency: int, new_tokens: int, cb: bool) -> dict:
    """Start a server process (attnsel serve, or transformers' Serve on sdpa), send chat completions, tokens/s."""
    import httpx

    port = free_port()
    if impl == "attnsel":
        cmd = [sys.executable, "-m", "attnsel", "serve", path, "--port", str(port), "--dtype", "bf16"]
        cmd += ["--continuous-batching"] if cb else []
    else:
        code = ("import sys; from transformers.cli.serve import Serve; "
                f"Serve(force_model={path!r}, attn_implementation='sdpa', continuous_batching={cb}, device='cuda', "
                f"dtype='bfloat16', host='127.0.0.1', port={port}, log_level='warning')")
        cmd = [sys.executable, "-c", code]
    log = open(Path(path) / f"server-{impl}-{cb}.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), os.environ.get("PYTHONPATH", "")])})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"server did not come up (exit {proc.poll()}): {log.read()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        texts = [" ".join(f"w{t}" for t in p[:512]) for p in prompts(requests, seed=1)]

        def one(text: str) -> int:
            r = httpx.post(f"{base}/v1/chat/completions", timeout=900,
                           json={"model": path, "messages": [{"role": "user", "content": text}],
                                 "max_tokens": new_tokens, "temperature": 0})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        one(texts[0])  # warm-up
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            tokens = sum(pool.map(one, texts))
        wall = time.perf_counter() - t0
        log.seek(0)
        startup = [line.strip() for line in log.read().splitlines() if line.startswith(("prefill:", "serving"))]
        return {"server": impl, "continuous_batching": cb, "requests": requests, "concurrency": concurrency,
                "completion_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 1),
                "startup": startup}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def in_child(kind: str, *args) -> dict:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); sys.argv = ['x']; "
            f"from scripts.gpu_serve_bench import {kind}; print('RESULT ' + json.dumps({kind}(*{args!r})))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-3000:]}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON output path")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--serve-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--parts", default="batch,serve", help="which benchmarks: batch (generate_batch), serve")
    parser.add_argument("--impls", default="attnsel,sdpa")
    parser.add_argument("--serve-cb", default="false,true",
                        help="server runs without/with --continuous-batching: false, true or false,true")
    args = parser.parse_args()
    import torch
    import transformers

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        save_model(Path(tmp), args.layers)
        impls = args.impls.split(",")
        for impl in impls if "batch" in args.parts else ():
            row = {"bench": "generate_batch", "impl": impl,
                   **in_child("batch_child", tmp, impl, args.requests, args.new_tokens)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        cbs = [{"false": False, "true": True}[c] for c in args.serve_cb.split(",")]
        for cb in cbs if "serve" in args.parts else ():
            for impl in impls:
                try:
                    row = served(tmp, impl, args.serve_requests, args.concurrency, args.new_tokens, cb)
                except Exception as exc:  # recorded, the other configurations still run
                    row = {"server": impl, "continuous_batching": cb, "error": f"{type(exc).__name__}: {exc}"}
                row["bench"] = "serve"
                print(json.dumps(row), flush=True)
                rows.append(row)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "transformers": transformers.__version__, "command": " ".join(sys.argv),
              "model": f"random Llama-3-8B-shaped, {args.layers} layers, bf16", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
