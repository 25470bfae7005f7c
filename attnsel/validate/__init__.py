"""Validation (cases.py, yardstick.py, graph_replay.py), the timed shapes (grid.py), timing (timing.py,
host_probe.py), the worker process (worker.py) and its runner (runner.py)."""

TIMING_TASK = "@timing"  # worker task name: time every candidate of a phase, interleaved (not a backend name)
