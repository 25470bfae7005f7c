"""Validation (cases.py), the timed shapes (grid.py), timing (timing.py, host_probe.py), the worker process
(worker.py) and its runner (runner.py)."""
import os


def seconds_from_env(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``name`` (``default`` when unset); ValueError
    naming the variable otherwise."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {raw!r}")
    return value
