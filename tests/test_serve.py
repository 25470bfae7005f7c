"""`attnsel serve`: transformers' OpenAI-compatible server on attnsel, started as a real process on 127.0.0.1 with a
tiny random model (and a tokenizer built here, no Hub), talked to with a real HTTP client."""
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
from attnsel import serve  # noqa: E402

pytestmark = pytest.mark.skipif(serve.unavailable() is not None, reason=f"{serve.unavailable()} (CI installs it)")

WORDS = ["hello", "world", "how", "are", "you", "fine", "thanks", "the", "a", "cat", "sat", "on", "mat", "yes", "no"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def save_tiny_model(path, family: str = "llama") -> None:
    """A 2-layer model (GQA 4/2) with random weights and a WordLevel tokenizer with a chat template: a Llama, or a
    Gemma 2 whose first layer slides over 4 keys and whose second attends to all (softcap, query_pre_attn_scalar;
    untied embeddings, so that its tokens depend on the attention)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS + [f"w{i}" for i in range(100)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    common = dict(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(head_dim=16, sliding_window=4, attn_logit_softcapping=50.0,
                                        query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
                                        tie_word_embeddings=False, **common)
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        raise ValueError(f"family must be llama or gemma2, got {family!r}")
    model.eval().save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(path, *extra):
    """`attnsel serve` on the model at ``path`` (torch backends, fp32) until the block ends; yields (base URL, log).
    The server is stopped with SIGTERM; the log file (``log.name``) stays, with what it printed on the way out."""
    port = free_port()
    log = open(path / f"server-{port}.log", "w+")
    env = {**os.environ, "ATTNSEL_CACHE_DIR": str(path / "cache")}
    proc = subprocess.Popen([sys.executable, "-m", "attnsel", "serve", str(path), "--port", str(port),
                             "--prefill-backend", "torch", "--decode-backend", "torch", "--policy", "priority",
                             "--dtype", "fp32", *extra], stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"server did not answer within 240 s:\n{log.read()[-4000:]}")
            time.sleep(0.5)
        yield base, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("served")
    save_tiny_model(path)
    with serving(path) as (base, log):
        yield base, str(path), log


def chat(base, model, **extra):
    body = {"model": model, "messages": [{"role": "user", "content": "hello how are you"}], "max_tokens": 6,
            "temperature": 0, **extra}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def test_startup_prints_the_selection(server):
    _, _, log = server
    log.seek(0)
    text = log.read()
    assert "prefill: torch, decode: torch, extend: torch" in text
    assert "prefill (explicit):" in text and "torch: selected" in text
    from attnsel.integrations import hf_kernels  # transformers >= 5.25 serves attnsel only as its Hub-kernel name

    name = hf_kernels.KERNEL_NAME if hf_kernels.kernel_unsupported() is None else "attnsel"
    assert f"attn_implementation={name} on http" in text


def test_chat_completion_stream_and_bad_request(server):
    base, model, _ = server
    reply = chat(base, model)
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str) and message["content"]

    chunks, done = [], False
    with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": [{"role": "user", "content": "the cat sat"}],
                            "max_tokens": 6, "temperature": 0, "stream": True}) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[len("data: "):]))
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert done or chunks[-1]["choices"][0].get("finish_reason")

    bad = httpx.post(f"{base}/v1/chat/completions", content=b"{not json", timeout=30,
                     headers={"content-type": "application/json"})
    assert 400 <= bad.status_code < 500 and "JSON" in bad.text, bad.text
    # No messages: transformers' handler does not validate it and answers 500 (its behaviour, left as is).
    missing = httpx.post(f"{base}/v1/chat/completions", json={"model": model}, timeout=30)
    assert missing.status_code >= 400, missing.text
    again = chat(base, model)  # still serving
    assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"]


def test_openai_client(server):
    openai = pytest.importorskip("openai")
    base, model, _ = server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "yes no"}],
                                         max_tokens=4, temperature=0)
    assert out.choices[0].message.content


def test_continuous_batching_server_gives_the_same_tokens(server):
    """`--continuous-batching`: transformers' batching scheduler with attnsel's name for this version (5.17:
    paged|attnsel; 5.25: the Hub-kernel name), the same greedy tokens as the server without it."""
    from attnsel.integrations import hf_kernels

    base, model, _ = server
    expected = chat(base, model).json()["choices"][0]["message"]["content"]
    with serving(Path(model), "--continuous-batching") as (cb_base, log):
        reply = chat(cb_base, model)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] == expected
        log.seek(0)
        text = log.read()
    name = (hf_kernels.KERNEL_NAME if hf_kernels.kernel_unsupported() is None
            else "paged|attnsel" if transformers.__version__.startswith("5.17") else hf_kernels.NAME)
    assert f"attn_implementation={name} on http" in text


def exit_counts(text: str, what: str) -> dict[str, int]:
    """The counts of one line of `attnsel serve`'s exit summary, ``attnsel: attention calls {what}: N at X; M at Y``
    (served: by spec; handed back to transformers: by reason), {} for ``none``."""
    lines = [line for line in text.splitlines() if f"attnsel: attention calls {what}: " in line]
    assert len(lines) == 1, f"no single {what!r} line in the server's log:\n{text[-4000:]}"
    rest = lines[0].split(f"attention calls {what}: ", 1)[1].strip()
    if rest == "none":
        return {}
    counts = {}
    for part in rest.split("; "):
        n, _, key = part.partition(" at " if what == "served" else " for ")
        counts[key] = int(n)
    return counts


def test_served_requests_reach_attnsel(server):
    """The server's generate (tokenizer=, streamer=) reaches attnsel's kernels: no call handed back to transformers
    (transformers' server passes its tokenizer to generate, which forwards it to every attention call), the calls
    counted in the summary `attnsel serve` prints when it stops. (Every call was handed back to the model's eager
    attention: "argument tokenizer=TokenizersBackend(...) (not implemented by attnsel)".)"""
    from attnsel.integrations import hf_kernels

    if hf_kernels.kernel_unsupported() is None:
        pytest.skip("transformers >= 5.25 serves attnsel as its Hub kernel, in a model process of its own")
    _, model, _ = server
    with serving(Path(model)) as (base, log):
        reply = chat(base, model)
        assert reply.status_code == 200, reply.text
        tokens = reply.json()["usage"]["completion_tokens"]
        with httpx.stream("POST", f"{base}/v1/chat/completions", timeout=120,
                          json={"model": model, "messages": [{"role": "user", "content": "the cat sat"}],
                                "max_tokens": 4, "temperature": 0, "stream": True}) as stream:
            assert stream.status_code == 200
            chunks = [json.loads(line[len("data: "):]) for line in stream.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        tokens += chunks[-1]["usage"]["completion_tokens"]
    text = Path(log.name).read_text()
    assert "handing the call back" not in text, text[-4000:]
    assert exit_counts(text, "handed back to transformers") == {}
    # one forward per generated token, 2 layers each
    assert exit_counts(text, "served") == {"4/2 heads, head_dim 16, fp32, page 16": 2 * tokens} and tokens > 0


def test_a_model_with_sliding_and_full_layers_is_served(tmp_path):
    """Gemma 2 (a sliding layer of window 4, then a full one): one selection per layer kind at start-up, as
    `attnsel report --config` makes, and the served request's attention calls reach attnsel in both kinds (counted
    in the exit summary), none handed back. (It exited with 2: "layers differ".) On transformers >= 5.25 the calls
    run in the server's model process, where this process cannot count them."""
    from attnsel.integrations import hf_kernels

    save_tiny_model(tmp_path, "gemma2")
    with serving(tmp_path) as (base, log):
        reply = chat(base, str(tmp_path))
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
        tokens = reply.json()["usage"]["completion_tokens"]
    text = Path(log.name).read_text()
    assert "sliding_attention (layers 0):" in text and "full_attention (layers 1):" in text, text[-4000:]
    assert text.count("prefill: torch, decode: torch") >= 2
    if hf_kernels.kernel_unsupported() is None:
        return
    assert "handing the call back" not in text, text[-4000:]
    assert exit_counts(text, "handed back to transformers") == {}
    served = exit_counts(text, "served")
    sliding = [n for spec, n in served.items() if "sliding window 4" in spec]
    full = [n for spec, n in served.items() if "sliding window" not in spec]
    assert len(sliding) == 1 and len(full) == 1, served
    assert sliding == full == [tokens] and tokens > 0  # one forward per generated token, calling both layers
