"""The automatic candidates of each phase, in the order that breaks ties (a timed bucket within 1% of its fastest goes
to the earlier one) and that policy "priority" follows: attnsel's defaults, or a caller's list."""
from __future__ import annotations

from . import backends
from .backends import Phase

# flashinfer_fa2 (FlashInfer's FA2 template) is a prefill candidate: on short prompts (up to a few hundred tokens
# a batch) it was the fastest backend, up to 2.7x ahead of the others (results file, "Held-out prefill and decode");
# and an extend candidate: on multi-token decode and short chunks it led FA3's variants by up to 1.46x (results
# file, "The extend phase");
# flashinfer_fa3 (FlashInfer's FA3 template) is a decode candidate: the fastest on batches of 1-6 rows, 5-20% ahead.
# Each is a further JIT build (about two minutes on a fresh machine) in validation, not timing.
# flashinfer_xqa is opt-in: it wins small uniform CUDA-graph decode buckets but splits every row alike, so a
# ragged batch (one long row among short ones) or a long context served by it is slower than Triton's decode, and
# the table with it is worse over all (see the results file).
DEFAULT_PRIORITY: dict[str, tuple[str, ...]] = {
    "prefill": ("fa3", "flashinfer", "fa3_split", "fa3_packgqa", "flashinfer_fa2", "triton", "torch"),
    "decode": ("flashinfer", "flashinfer_cuda_cores", "fa3", "fa3_packgqa", "triton", "flashinfer_fa3", "torch"),
    "extend": ("fa3", "flashinfer", "triton", "fa3_split", "fa3_packgqa", "flashinfer_fa2", "torch"),
}


def priority_list(phase: Phase, given: list[str] | tuple[str, ...] | None) -> list[str]:
    """The auto candidates of a phase in order: given names (a list, or one comma-separated string as the CLI
    takes them), or the default list with plugins before torch."""
    if isinstance(given, str):  # iterated, "fa3,torch" would be the names "f", "a", "3", ...
        given = [n.strip() for n in given.split(",") if n.strip()]
    if given:
        for name in given:
            if not isinstance(name, str) or name not in backends.names():
                raise backends.UnknownBackendError(f"{phase}_priority: unknown backend {name!r}; valid names: "
                                                   f"{', '.join(backends.names())}")
        return list(dict.fromkeys(given))
    default = list(DEFAULT_PRIORITY[phase])
    plugins = [n for n in backends.names() if n not in backends.BUILTINS]
    return default[:-1] + plugins + default[-1:]


def identities(spec, names: dict[str, list[str]], mode: str, device: str) -> dict[str, dict[str, str]]:
    """Per phase, each candidate's identity here: its version and source hash (the cache key's), or "unavailable".
    Part of the question ranks agree on (dist.agree): rank 0 validates its own install, so a backend of one name
    that is other code, or missing, on another rank (another node's image) must stop every rank instead of serving
    there unvalidated."""
    import torch

    out: dict[str, dict[str, str]] = {}
    for phase, phase_names in names.items():
        out[phase] = {}
        for name in phase_names:
            reason, identity = backends.availability_in(backends.get(name), spec, phase, mode, torch.device(device))
            out[phase][name] = ("unavailable" if reason else
                                f"version {identity['version']!r}, source {str(identity['source'])[:12]}")
    return out
