"""Device fingerprint: what a validation result depends on besides the spec (part of the cache key).

The key covers the device actually used (the ``device`` argument, "cuda" resolved to the current index), the
installed packages, a hash of attnsel's own source files (a changed kernel must lose its old verdict) and
``TRITON_INTERPRET`` (interpreted and compiled Triton are different kernels).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Distribution names whose versions change what a backend does.
PACKAGES = ("torch", "triton", "tokenspeed-fa3", "flashinfer-python", "transformers")


def package_version(dist: str) -> str | None:
    """Installed version of a distribution, without importing it; None if missing."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def driver_version() -> str | None:
    """NVIDIA driver version from the kernel module, else NVML; None where there is none."""
    proc = Path("/proc/driver/nvidia/version")
    try:
        for word in proc.read_text().split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return word
    except OSError:
        pass
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception as exc:  # NVML missing or no driver: the fingerprint says "unknown"
        log.debug("NVML driver version unavailable: %s", exc)
        return None


PACKAGE_ROOT = Path(__file__).resolve().parent
_hashes: dict[tuple[str, int, int], str] = {}  # (path, mtime_ns, size) -> sha256 of the file


def resolve(device: torch.device | str) -> str:
    """The device as the worker will use it: "cuda" (no index) becomes "cuda:<current device>"."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return str(dev)


def cuda_capability(device: torch.device | str | int | None = None) -> tuple[int, int] | None:
    """Compute capability of ``device`` (default: the current CUDA device); None for a non-CUDA device or none."""
    if isinstance(device, (str, torch.device)) and torch.device(device).type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def _file_hash(path: Path) -> str:
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    if key not in _hashes:
        _hashes[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return _hashes[key]


def source_hash(files: list[Path], root: Path | None = None) -> str:
    """sha256 over the files' contents and names (relative to ``root`` when given); re-read when a file changes."""
    h = hashlib.sha256()
    for path in sorted(files):
        name = str(path.relative_to(root)) if root is not None else str(path)
        h.update(name.encode() + b"\0" + _file_hash(path).encode() + b"\0")
    return h.hexdigest()[:16]


def package_hash(root: Path = PACKAGE_ROOT) -> str:
    """Hash of every .py file of the attnsel package under ``root``: kernels, validation cases, the worker."""
    return source_hash([p for p in root.rglob("*.py") if "__pycache__" not in p.parts], root)


def fingerprint(device: str = "cuda") -> dict:
    """GPU name, compute capability, driver, torch/CUDA versions, backend package versions, attnsel version and
    source hash, TRITON_INTERPRET: everything besides the spec and the backend that a validation result depends on."""
    return {**_static_fingerprint(resolve(device)), "attnsel_source": package_hash(),
            "triton_interpret": os.environ.get("TRITON_INTERPRET", "")}


def kind(device: str = "cuda") -> str:
    """The kind of device, in words: "cpu", or the GPU's name, compute capability and multiprocessor count (what
    decides which kernels run and how fast). Ranks that share one selection must run on the same kind."""
    info = _static_fingerprint(resolve(device))
    if info["gpu"] is None:
        return torch.device(device).type
    return f"cuda {info['gpu']}, capability {info['capability']}, {info['sm_count']} SMs"


@functools.cache
def _static_fingerprint(device: str) -> dict:
    from . import __version__

    info: dict = {"attnsel": __version__, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2**30, 1), driver=driver_version())
    else:
        info.update(gpu=None, capability=None, driver=None)
    info["packages"] = {name: package_version(name) for name in PACKAGES}
    return info


def capability_reason(need: str, ok, device: torch.device | str | int | None = None) -> str | None:
    """None if the capability of ``device`` (default: the current CUDA device) passes ``ok((major, minor))``; else a
    reason naming ``need``."""
    if isinstance(device, (str, torch.device)) and torch.device(device).type != "cuda":
        return f"needs a CUDA device with compute capability {need}, got device {device}"
    cap = cuda_capability(device)
    if cap is None:
        return f"needs CUDA compute capability {need}, found none (no CUDA device)"
    if not ok(cap):
        return f"needs CUDA compute capability {need}, found {cap[0]}.{cap[1]}"
    return None
