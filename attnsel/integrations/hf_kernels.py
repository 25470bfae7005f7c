"""Continuous batching on transformers >= 5.18 (checked on 5.18, 5.24 and 5.25): the flash-named implementation
``"attnsel_flash"``.

Those versions accept only ``sdpa``, ``paged|eager``, names containing "flash", or Hub kernels for
``generate_batch`` (custom ``paged|X`` names are refused; 5.18 switches a flash-named model to ``"paged|<name>"``
and accepts it where registered: there ``register()`` also registers ``"paged|attnsel_flash"`` to transformers' own
paged flash forward). The Hub-kernel route would need the ``kernels`` package at 0.18.2 to < 0.19 on these versions
(5.24's bound; 5.25 pins kernels >= 0.19.1); the flash route needs no package of its own, so attnsel takes it:
``register()`` registers transformers' own ``flash_attention_forward`` under
``"attnsel_flash"`` and makes transformers' lazy flash-attention import return attnsel's FA3-compatible functions
(``attnsel.flash_api``) for that name. transformers then does what it does for FlashAttention: unpads, packs the
continuous batch, updates its paged cache, and calls ``flash_attn_varlen_func``; attnsel selects and dispatches.
The name has no "2"/"3", so transformers' FA2/FA3-only decode fast path (``flash_attn_with_kvcache`` with its block
table) stays off: every step, decode included, goes through the varlen call. Where transformers would gather a
step's cached prefix for that call (>= 5.24), ``hf_extend_hook`` keeps it in the paged cache and the call reads the
pages in place (the decode and extend phases).

The hook replaces ``transformers.modeling_flash_attention_utils._lazy_imports`` with a wrapper that answers for
``"attnsel_flash"`` only and defers to the original for every other name; it checks that the function it wraps has
the signature it knows and refuses to install otherwise, with the reason.

CUDA graphs: transformers' continuous batching captures by default for flash-named implementations on CUDA
(``ContinuousBatchingConfig.use_cuda_graph`` left None): each new batch shape runs once eagerly, then the whole step is
captured and later steps of that shape replay it after transformers rewrote cu_seqlens and the cache indices in
place, with nothing called in between. So every varlen call is either eager or being captured, and
``attnsel.flash_api`` plans a captured call on a selection made in mode "graph" (``attnsel.graph_selection``: with the
default mode "eager", a second selection made at the spec's first captured call). ``register(mode="graph")`` makes
the graph-mode selection the only one (needed with several torch.distributed ranks, which cannot select during a
capture); ``use_cuda_graph=False`` in transformers' config keeps every call eager.

Usage: ``attnsel.integrations.hf_kernels.register()`` (or ``attnsel.integrations.hf.register()``, which calls it on
these versions) before ``from_pretrained(..., attn_implementation="attnsel_flash")``, then ``generate_batch``.

transformers >= 5.25 (kernels >= 0.19.1): the Hub-kernel name ``"attnsel/flash-attn"`` (``register_kernel()``), the
only kind of custom name its server accepts. No Hub: attnsel writes a local kernel repository in the kernels layout
(``build/torch-{cpu,cuda}/metadata.json`` with a digest of its files, and a package that re-exports this module's
three functions) under attnsel's cache directory and maps the name to it in ``LOCAL_KERNELS``, which kernels'
``get_kernel`` resolves before the Hub (no publisher-trust check applies to a local path). transformers then loads it
and registers its own ``flash_attention_forward`` for the name, as for any Hub flash kernel; the environment
(``LOCAL_KERNELS``, ``ATTNSEL_KERNEL_OPTIONS``: the selection options) carries the route into processes transformers
spawns, such as ``transformers serve``'s model process.
"""
from __future__ import annotations

import base64
import hashlib
import inspect
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from .. import flash_api, settings
from ..cache import default_dir
from . import hf_extend_hook

log = logging.getLogger(__name__)

NAME = "attnsel_flash"
_KNOWN_PARAMS = ["implementation", "attention_wrapper", "allow_all_kernels"]
KERNEL_NAME = "attnsel/flash-attn"  # no "2"/"3": transformers' FA2/FA3-only block-table decode path stays off
PAGED_NAME = f"paged|{NAME}"  # transformers 5.18: generate_batch switches a flash-named model to "paged|<name>" and
# accepts it only if registered (5.19 dropped the prefix); registered there, to transformers' own paged flash forward
KERNEL_FROM = (5, 25)  # checked on 5.25 with kernels 0.19.1
ENV_OPTIONS = settings.ENV["kernel_options"]  # carries the selection options into processes transformers spawns
_KERNEL_BACKENDS = ("cpu", "cuda")  # kernels' noarch variants torch-<backend>: the devices attnsel is tested on
_SHIM = ('"""attnsel.integrations.hf_kernels\' functions in the kernels layout (written by that module)."""\n'
         "from attnsel.integrations.hf_kernels import _configure_from_env, flash_attn_func, flash_attn_varlen_func, "
         "flash_attn_with_kvcache  # noqa: F401\n\n_configure_from_env()\n")


def unsupported() -> str | None:
    """Why the flash route cannot be installed on the installed transformers, or None."""
    try:
        import transformers
        from transformers import modeling_flash_attention_utils as mfau
    except ImportError as exc:
        return f"transformers is not importable ({exc})"
    original = getattr(mfau._lazy_imports, "_attnsel_original", mfau._lazy_imports) \
        if hasattr(mfau, "_lazy_imports") else None
    if original is None:
        return f"transformers {transformers.__version__} has no modeling_flash_attention_utils._lazy_imports"
    params = list(inspect.signature(original).parameters)
    if params != _KNOWN_PARAMS:
        return (f"transformers {transformers.__version__}: _lazy_imports{tuple(params)} is not the known "
                f"{tuple(_KNOWN_PARAMS)}")
    return None


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False, dropout_p=0.0,
                           s_aux=None):
    """attnsel.flash_attn_varlen_func under the parameter names transformers probes for (it passes only the
    features a function declares and silently drops the others, so every feature a model may use is declared here:
    ``s_aux`` is its name for attention sinks, ``dropout_p`` is refused when non-zero)."""
    layer = hf_extend_hook.default().take(k)  # this layer's cached prefix stayed in the paged cache (>= 5.24)
    if dropout_p:
        raise flash_api.UnsupportedArgument(f"attnsel_flash: dropout_p={dropout_p!r}: attention dropout is not "
                                            "supported (attnsel serves inference)")
    if layer is not None:
        return hf_extend_hook.default().attend(layer, q, cu_seqlens_q, max_seqlen_q, max_seqlen_k, softmax_scale,
                                               causal, window_size, softcap, deterministic, s_aux)
    return flash_api.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                            softcap=softcap, deterministic=deterministic, sinks=s_aux)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    deterministic=False, dropout_p=0.0, s_aux=None):
    """Dense batch (``generate`` without padding): q ``[B, Sq, H, D]``, k/v ``[B, Sk, KVH, D]`` as one ragged batch
    of equal lengths through the varlen call; out ``[B, Sq, H, D]``."""
    batch, len_q, heads, dim = q.shape
    len_k = k.shape[1]
    steps = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    out = flash_attn_varlen_func(q.reshape(-1, heads, dim), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
                                 steps * len_q, steps * len_k, len_q, len_k, softmax_scale=softmax_scale,
                                 causal=causal, window_size=window_size, softcap=softcap, deterministic=deterministic,
                                 dropout_p=dropout_p, s_aux=s_aux)
    return out.view(batch, len_q, heads, dim)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, page_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, s_aux=None):
    """attnsel.flash_attn_with_kvcache under the names transformers probes for (``s_aux``: sinks). transformers calls
    it only on its FA2/FA3-named block-table decode path, which KERNEL_NAME does not take."""
    return flash_api.flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                             page_table=page_table, softmax_scale=softmax_scale, causal=causal,
                                             window_size=window_size, softcap=softcap, sinks=s_aux)


def _install_lazy_import_hook() -> None:
    from transformers import modeling_flash_attention_utils as mfau

    if hasattr(mfau._lazy_imports, "_attnsel_original"):
        return
    original = mfau._lazy_imports

    def _lazy_imports(implementation, attention_wrapper=None, allow_all_kernels=False):
        if implementation in (NAME, PAGED_NAME):
            return flash_attn_func, flash_attn_varlen_func, None, mfau._pad_input, mfau._unpad_input
        return original(implementation, attention_wrapper, allow_all_kernels)

    _lazy_imports._attnsel_original = original
    mfau._lazy_imports = _lazy_imports


def register(prefill: str | None = None, decode: str | None = None, **select_options) -> list[str]:
    """Register ``"attnsel_flash"`` with transformers; returns ``[NAME]``. prefill/decode/select_options: as
    ``attnsel.integrations.hf.register`` (they configure ``attnsel.flash_api``). RuntimeError with the reason on a
    transformers this route does not know."""
    settings.Settings.from_env()  # a bad ATTNSEL_* variable is named now, not at the first attention call
    reason = unsupported()
    if reason:
        raise RuntimeError(f"attnsel: cannot register {NAME}: {reason}")
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    flash_api.configure(prefill, decode, **select_options)
    _install_lazy_import_hook()
    _install_extend_hook((NAME, PAGED_NAME))
    AttentionInterface.register(NAME, flash_attention_forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    if _minor(transformers.__version__) == (5, 18):
        from transformers.integrations.flash_paged import paged_attention_forward

        AttentionInterface.register(PAGED_NAME, paged_attention_forward)
        AttentionMaskInterface.register(PAGED_NAME, flash_attention_mask)
    return [NAME]


def _install_extend_hook(names, restart_counts: bool = True) -> None:
    """hf_extend_hook for ``names`` where this transformers has the cache update it knows (its counts restart with a
    registration); else the reason, logged."""
    reason = hf_extend_hook.unsupported()
    if reason is None:
        hf_extend_hook.install(names)
        if restart_counts:
            hf_extend_hook.default().reads.clear()
    else:
        log.info("attnsel: steps with a cached prefix read the keys transformers gathers: %s", reason)


def kernel_versions() -> bool:
    """Whether the installed transformers is one the Hub-kernel route is for (>= 5.25)."""
    import transformers

    return _minor(transformers.__version__) >= KERNEL_FROM


def _minor(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "5.25.0" or "5.26.0.dev0"."""
    return tuple(int(x) for x in version.split(".")[:2])


def kernel_unsupported() -> str | None:
    """Why the Hub-kernel name cannot be registered with the installed transformers, or None."""
    import transformers

    if not kernel_versions():
        return f"the Hub-kernel route needs transformers >= 5.25 (found {transformers.__version__})"
    from transformers.utils.import_utils import is_kernels_available

    if not is_kernels_available():
        return (f"transformers {transformers.__version__} finds no usable kernels package "
                "(pip install 'kernels>=0.19.1')")
    return None


def write_kernel_repo(parent: Path) -> Path:
    """The local kernel repository under ``parent``, written once: its directory is named after the digest of what it
    holds, built beside it under a temporary name and renamed into place whole, so a reader (another process, a
    later attnsel) never sees it half-written or changed, and a writer killed midway leaves only a temporary
    directory that no one loads. Each variant's metadata records the sha256 of the package file, which kernels
    checks at every load (it counts every file in the variant, so nothing else may live there)."""
    from kernels import Metadata

    digest = base64.b64encode(hashlib.sha256(_SHIM.encode()).digest()).decode()
    root = parent / f"hub-kernel-{hashlib.sha256(_SHIM.encode()).hexdigest()[:12]}"
    if root.is_dir():
        return root
    tmp = parent / f".{root.name}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    for backend in _KERNEL_BACKENDS:
        variant = tmp / "build" / f"torch-{backend}"
        (variant / "attnsel_flash_attn").mkdir(parents=True)
        (variant / "attnsel_flash_attn" / "__init__.py").write_text(_SHIM)
        meta = {"name": "attnsel-flash-attn", "id": "_attnsel_flash_attn", "version": 1, "license": "Apache-2.0",
                "python-depends": [], "backend": {"type": backend},
                "digest": {"algorithm": "sha256", "files": {"attnsel_flash_attn/__init__.py": digest}}}
        (variant / "metadata.json").write_text(json.dumps(meta, indent=1) + "\n")
        Metadata.read_from_file(variant / "metadata.json")  # raises if this kernels cannot read it
    try:
        os.rename(tmp, root)
    except OSError:  # another process renamed its copy first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not root.is_dir():
            raise
    return root


def _json_options(options: dict) -> dict:
    """The selection options as they survive JSON (tuples become lists); TypeError naming an option that does not."""
    out = {}
    for key, value in options.items():
        if isinstance(value, (tuple, list)) and all(isinstance(x, str) for x in value):
            value = list(value)
        elif isinstance(value, Path):
            value = str(value)
        elif not (value is None or isinstance(value, (str, int, float, bool))):
            raise TypeError(f"attnsel: option {key}={value!r} cannot reach processes transformers spawns (environment "
                            "JSON): use a string, a number, a bool or a list of strings")
        out[key] = value
    return out


def register_kernel(prefill: str | None = None, decode: str | None = None, **select_options) -> list[str]:
    """Make ``attn_implementation="attnsel/flash-attn"`` load attnsel (transformers >= 5.25); returns
    ``[KERNEL_NAME]``. Options: as ``register``. RuntimeError with the reason where the route is unavailable."""
    settings.Settings.from_env()  # a bad ATTNSEL_* variable is named now, not at the first attention call
    reason = kernel_unsupported()
    if reason:
        raise RuntimeError(f"attnsel: cannot register {KERNEL_NAME}: {reason}")
    parent = default_dir().resolve()
    if ":" in str(parent):
        raise RuntimeError(f"attnsel: LOCAL_KERNELS separates its entries with ':', so the kernel repository cannot "
                           f"live under {parent}; set {settings.ENV['cache_dir']} to a path without ':'")
    root = write_kernel_repo(parent)
    flash_api.configure(prefill, decode, **_json_options(select_options))
    os.environ[ENV_OPTIONS] = json.dumps(flash_api.default().options)
    entries = [e for e in os.environ.get("LOCAL_KERNELS", "").split(":") if e and e.split("=")[0] != KERNEL_NAME]
    os.environ["LOCAL_KERNELS"] = ":".join(entries + [f"{KERNEL_NAME}={root}"])
    _install_extend_hook((KERNEL_NAME,))
    return [KERNEL_NAME]


def _configure_from_env() -> None:
    """In a process that did not call ``register_kernel`` (one transformers spawned), the options of the one that
    did and the cache-update hook; the options are left alone where already in force or the environment carries
    none."""
    _install_extend_hook((KERNEL_NAME,), restart_counts=False)
    options = settings.read("kernel_options")
    if options is None:
        return
    if options != _json_options(flash_api.default().options):
        flash_api.configure(**options)
