"""`attnsel serve MODEL_DIR`: transformers' own OpenAI-compatible server (``transformers serve``) on attnsel.

Registers attnsel's attention with transformers in this process, runs the backend selection for the model's
attention shape at start-up, one per kind of layer (full and sliding attention, as ``attnsel report --config``), and
prints it (``prefill: X, decode: Y`` and why, per candidate), then starts ``transformers.cli.serve.Serve`` with the
model preloaded. When it stops (Ctrl-C or SIGTERM) it prints how many attention calls attnsel served (by spec) and
handed back to transformers (by reason), where those calls ran in this process (the ``attnsel`` and
``paged|attnsel`` names). transformers' CLI would refuse the name (its
``ModelManager`` accepts only its built-in names or Hub kernels) and could not see a registration made elsewhere, so
the only change made to it is that check: for the duration of the start-up, ``ModelManager`` is a subclass that
validates its other arguments as usual and lets attnsel's registered names through. transformers >= 5.25 validates
in ``ModelLoader`` and loads the model in a process of its own, where only a Hub-kernel name survives: there attnsel
serves as ``"attnsel/flash-attn"`` (``hf_kernels.register_kernel``; needs ``kernels>=0.19.1``), with and without
continuous batching, and no check is changed.

Needs ``pip install 'attnsel[serve]'`` (transformers, accelerate, and fastapi, uvicorn, openai, pydantic: what
transformers' ``is_serve_available`` checks); without it the command cannot run (CannotRun, exit 3).
Implementations: ``attnsel`` (dense ``generate``, the default), or with ``--continuous-batching`` ``paged|attnsel`` on
transformers 5.17 and ``attnsel_flash`` on 5.18 to 5.24; ``attnsel/flash-attn`` for both on >= 5.25.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import signal
import threading
from pathlib import Path

import torch

from .errors import CannotRun, InvalidArgument
from .selection import Selection, default_device
from .spec import DTYPES as SPEC_DTYPES, short_dtype_name

log = logging.getLogger(__name__)

SERVE_PACKAGES = ("transformers", "accelerate", "fastapi", "uvicorn", "openai", "pydantic")  # the serve extra's
DTYPES = {"auto": None, **SPEC_DTYPES}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", help="a local transformers model directory (config.json, weights, tokenizer)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    p.add_argument("--dtype", type=short_dtype_name, choices=list(DTYPES), default="auto",
                   help="model dtype (default: the config's torch_dtype, else fp32; bfloat16, float16/half, "
                        "float32/float also accepted)")
    p.add_argument("--continuous-batching", action="store_true",
                   help="transformers' continuous batching (paged|attnsel on 5.17, attnsel_flash on 5.18 to 5.24, "
                        "attnsel/flash-attn on >= 5.25)")


def unavailable() -> str | None:
    missing = [p for p in SERVE_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        return f"attnsel serve needs the serve extra (missing: {', '.join(missing)}): pip install 'attnsel[serve]'"
    return None


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 4] -> "0-2, 4"."""
    out: list[list[int]] = []
    for i in layers:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def describe(sel: Selection) -> list[str]:
    """LightLLM-style start-up lines: the choice per phase, then why (every candidate with its status)."""
    lines = [sel.backends_line(),
             f"  for {sel.spec.describe()} on {sel.device.get('gpu') or 'cpu'} (policy {sel.policy}, mode "
             f"{sel.mode}, cache {sel.cache})"]
    for phase, choice in sel.phases.items():
        lines.append(f"  {phase} ({choice.source}):")
        for c in choice.candidates:
            facts = []
            if c.score_us is not None:
                facts.append(f"{c.score_us:.1f} us")
            if c.max_abs_err is not None and c.tolerance is not None:
                facts.append(f"err {c.max_abs_err:.2g} <= {c.tolerance:.2g}" if c.status in ("selected", "valid")
                             else f"err {c.max_abs_err:.2g} vs tol {c.tolerance:.2g}")
            if c.reason:
                facts.append(c.reason)
            lines.append(f"    {c.name}: {c.status}" + (f" ({'; '.join(facts)})" if facts else ""))
    return lines


@contextlib.contextmanager
def _accept_names(names: list[str]):
    """transformers' ModelManager with its attention-name check widened to ``names`` (restored on exit)."""
    from transformers.cli.serving import model_manager

    base = model_manager.ModelManager

    class Manager(base):
        def _validate_args(self):
            impl = self.attn_implementation
            if impl in names:
                self.attn_implementation = None  # the remaining checks as transformers does them
            try:
                super()._validate_args()
            finally:
                self.attn_implementation = impl

    model_manager.ModelManager = Manager
    try:
        yield
    finally:
        model_manager.ModelManager = base


def implementation(continuous_batching: bool, registered: list[str]) -> str:
    from .integrations import hf, hf_kernels

    if hf_kernels.KERNEL_NAME in registered:  # transformers >= 5.25: the one name its server (and model process) takes
        return hf_kernels.KERNEL_NAME
    if hf_kernels.kernel_versions():
        raise CannotRun(f"transformers' server accepts attnsel only as the Hub kernel {hf_kernels.KERNEL_NAME}: "
                        f"{hf_kernels.kernel_unsupported()}")
    if not continuous_batching:
        return hf.NAME
    for name in (hf.PAGED_NAME, "attnsel_flash"):
        if name in registered:
            return name
    raise CannotRun(f"continuous batching: none of {hf.PAGED_NAME}, attnsel_flash could be registered with this "
                    "transformers")


def start_selections(model_dir: Path, impl: str, dtype: torch.dtype | None,
                     device: str) -> list[tuple[str, list[int], Selection]]:
    """Run the selections the served model's first attention calls would run, now, so that they are cached: one per
    kind of layer of its config (``spec.layer_specs``: full and sliding attention), as (kind, layers, Selection)."""
    from transformers import AutoConfig

    from . import flash_api
    from .integrations import hf, hf_kernels
    from .spec import dtype_name, layer_specs

    config = AutoConfig.from_pretrained(model_dir)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if impl in (hf_kernels.NAME, hf_kernels.KERNEL_NAME):
        select, page_size = flash_api.selection_for, flash_api.DEFAULT_PAGE_SIZE
    else:  # attnsel's attention functions: dense pages, or 5.17's continuous batching with its blocks of 256
        select, page_size = hf.selection_for, hf.DENSE_PAGE_SIZE if impl == hf.NAME else 256
    kinds = layer_specs(config.to_dict(), dtype=dtype_name(dtype), page_size=page_size)
    return [(kind, layers, select(spec, dev)) for kind, spec, layers in kinds]


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """SIGTERM stops the server as Ctrl-C does: uvicorn shuts down, then raises the signal again, which this handler
    turns into KeyboardInterrupt (the default handler would end the process before the exit summary)."""
    if threading.current_thread() is not threading.main_thread():  # signals are the main thread's
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_serve(args: argparse.Namespace, out) -> int:
    from .cli_backends import check_backend_args

    # the selection flags as `attnsel select` checks them (names, a priority list a named backend would drop), on a
    # copy: an unset backend flag still reaches register as None (the environment's choice at selection time)
    check_backend_args(argparse.Namespace(**vars(args)))
    reason = unavailable()
    if reason:
        raise CannotRun(reason)
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        raise InvalidArgument(f"{model_dir} is not a model directory (no config.json)")
    from transformers.cli.serve import Serve

    from .integrations import hf

    extend = {} if args.extend is None else {"extend": args.extend}  # None: the environment's choice, else auto
    registered = hf.register(args.prefill, args.decode, policy=args.policy, mode=args.mode,
                             prefill_priority=args.prefill_priority, decode_priority=args.decode_priority,
                             extend_priority=args.extend_priority, timeout=args.timeout, cache_dir=args.cache_dir,
                             use_cache=not args.no_cache, **extend)
    impl = implementation(args.continuous_batching, registered)
    device = args.device or default_device()
    kinds = start_selections(model_dir, impl, DTYPES[args.dtype], device)
    for kind, layers, sel in kinds:
        if len(kinds) > 1:
            out.print(f"{kind} (layers {layer_ranges(layers)}):", markup=False, highlight=False, soft_wrap=True)
        for line in describe(sel):
            out.print(line, markup=False, highlight=False, soft_wrap=True)
    out.print(f"serving {model_dir} with attn_implementation={impl} on http://{args.host}:{args.port}/v1 "
              "(transformers serve)", markup=False, highlight=False, soft_wrap=True)
    dtype = "auto" if DTYPES[args.dtype] is None else str(DTYPES[args.dtype]).removeprefix("torch.")
    try:
        with _sigterm_as_interrupt(), _accept_names(registered):  # blocks while serving (uvicorn in this thread)
            Serve(force_model=str(model_dir), attn_implementation=impl, continuous_batching=args.continuous_batching,
                  device=device, dtype=dtype, host=args.host, port=args.port, log_level="info")
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM, once uvicorn has stopped
        pass
    finally:
        if impl in (hf.NAME, hf.PAGED_NAME):  # attnsel's attention functions, called in this process
            for line in hf.call_summary():
                out.print(line, markup=False, highlight=False, soft_wrap=True)
    return 0
