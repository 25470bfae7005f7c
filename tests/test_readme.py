"""Every ```python block of the README runs as written on this machine (CPU: tiny shapes), so the docs cannot drift."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3  # the Python API, transformers generate, generate_batch


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    code = BLOCKS[index]
    env = dict(os.environ, ATTNSEL_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)  # as a user runs it
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"README python block {index} failed:\n{code}\n--- stderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr
