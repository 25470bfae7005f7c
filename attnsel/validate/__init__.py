"""Validation (cases.py), timing (timing.py), the worker process (worker.py) and its runner (runner.py)."""

TIMING_TASK = "@timing"  # worker task name: time every candidate of a phase, interleaved (not a backend name)
