"""A plugin module whose import kills the validation worker before it is ready (never the selecting process).

ATTNSEL_TEST_FAIL_START=N: the first N worker starts exit with code 17 (counted in the file
ATTNSEL_TEST_FAIL_START_COUNT); later starts work. BACKENDS is empty: the module only breaks the start.
"""
import os
from pathlib import Path

from tests.fault_backends import in_worker

BACKENDS: list = []

if in_worker():
    counter = Path(os.environ["ATTNSEL_TEST_FAIL_START_COUNT"])
    failed = int(counter.read_text()) if counter.exists() else 0
    if failed < int(os.environ.get("ATTNSEL_TEST_FAIL_START", "0")):
        counter.write_text(str(failed + 1))
        os._exit(17)
