"""A plugin module that makes building the decode validation case fail in the validation worker (never in the
selecting process): attnsel's or the machine's fault, which must not be blamed on any candidate.

ATTNSEL_TEST_FAIL_CASE=N: the first N decode cases built (counted in the file ATTNSEL_TEST_FAIL_CASE_COUNT) raise.
"""
import os
from pathlib import Path

from tests.fault_backends import in_worker

BACKENDS: list = []

if in_worker():
    from attnsel.validate import cases

    _make_case = cases.make_case

    def _failing_make_case(spec, phase, device):
        counter = Path(os.environ["ATTNSEL_TEST_FAIL_CASE_COUNT"])
        failed = int(counter.read_text()) if counter.exists() else 0
        if phase == "decode" and failed < int(os.environ["ATTNSEL_TEST_FAIL_CASE"]):
            counter.write_text(str(failed + 1))
            raise RuntimeError("injected case failure")
        return _make_case(spec, phase, device)

    cases.make_case = _failing_make_case
