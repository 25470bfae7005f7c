"""Device fingerprint: what a validation result depends on besides the spec (part of the cache key)."""
from __future__ import annotations

import functools
import importlib.metadata
import logging
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


def cuda_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


@functools.cache
def fingerprint(device: str = "cuda") -> dict:
    """GPU name, compute capability, driver, torch/CUDA versions, backend package versions, attnsel version."""
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


def capability_reason(need: str, ok) -> str | None:
    """None if the current CUDA device's capability passes ``ok((major, minor))``; else a reason naming ``need``."""
    cap = cuda_capability()
    if cap is None:
        return f"needs CUDA compute capability {need}, found none (no CUDA device)"
    if not ok(cap):
        return f"needs CUDA compute capability {need}, found {cap[0]}.{cap[1]}"
    return None
