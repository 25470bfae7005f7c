"""Validation (cases.py, yardstick.py, graph_replay.py), the timed shapes (grid.py), timing (timing.py,
host_probe.py), the worker process (worker.py) and its runner (runner.py)."""

TIMING_TASK = "@timing"  # worker task name: time every candidate of a phase, interleaved (not a backend name)
WRONG_OUTPUT = "wrong output after the timed"  # how a timing error starts where the candidate computed garbage
