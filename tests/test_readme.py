"""The README's facts, checked against the code and the files, so the docs cannot drift: every ```python block runs
as written (CPU: tiny shapes), every `attnsel` command parses with the real CLI, every repository path it names
exists, the test command is the one CI runs, the transformers routes agree with the code and `serve --help`, and
the headline results equal what the raw bench files give."""
import argparse
import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from attnsel import cli
from attnsel.backends import BUILTINS, get
from attnsel.integrations import hf, hf_kernels
from attnsel.spec import layer_specs

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = (ROOT / "bench" / "results" / "README.md").read_text()
BLOCKS = re.findall(r"^```python\n(.*?)^```", README, flags=re.S | re.M)
SHELL = re.findall(r"^```bash\n(.*?)^```", README, flags=re.S | re.M)
MAX_WORDS = 1500


def shell_commands(block: str) -> list[list[str]]:
    """The commands of a bash block: continuation lines joined, comments dropped, split at `&&`."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            out.append(words[:cut])
            words = words[cut + 1:]
    return out


def attnsel_commands() -> list[list[str]]:
    """argv (after the program) of every `attnsel` command in the README's bash blocks."""
    return [words[1:] for block in SHELL for words in shell_commands(block)
            if words and (words[0] == "attnsel" or words[0].endswith("/attnsel"))]


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 3  # select + plan/run, the FA-compatible call, transformers generate


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    code = BLOCKS[index]
    env = dict(os.environ, ATTNSEL_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)  # as a user runs it
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"README python block {index} failed:\n{code}\n--- stderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr


def test_readme_stays_short():
    assert len(README.split()) <= MAX_WORDS, f"README.md has {len(README.split())} words, at most {MAX_WORDS}"


def test_the_fresh_machine_commands_come_first_and_ci_runs_the_test_command():
    first = shell_commands(SHELL[0])
    assert README.index("```bash") < README.index("## How it works")
    main_job, tests = first[:3], first[3:]
    assert main_job[0] == ["python3", "-m", "venv", ".venv"] and tests[0] == main_job[0]
    assert main_job[2] == [".venv/bin/attnsel", "report", "--config", "examples/configs/llama-3-8b.json"]
    assert tests[-1] == [".venv/bin/python", "-m", "pytest", "-q"]
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = SHELL[0].strip().splitlines()[-1].replace("pip install ", "pip install -q ")
    assert test_command in ci, f".ci/run does not run the README's test command:\n{test_command}"


def test_ci_runs_the_slow_tests_the_readme_command_leaves_out():
    """The README's command runs pytest's default selection, which pyproject.toml makes `-m "not slow"`; the CI stage
    right after it runs exactly the slow ones (set -e: no test collected, exit 5, fails it like a failure)."""
    import tomllib

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["addopts"] == ["-m", "not slow"]
    assert any(m.startswith("slow:") for m in options["markers"])
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "set -euo pipefail" in ci
    readme_stage = next(i for i, line in enumerate(ci) if line.endswith(".venv/bin/python -m pytest -q"))
    assert ci[readme_stage + 1] == ".venv/bin/python -m pytest -q -m slow"


@pytest.mark.parametrize("argv", attnsel_commands(), ids=" ".join)
def test_readme_attnsel_command_parses(argv):
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"`attnsel {' '.join(argv)}` does not parse (exit {exc.code})")
    if getattr(args, "config", None):  # the config exists, is read, and gives a dtype the fast backends take
        kinds = cli.layer_specs_from_args(args)
        assert kinds and all(spec.dtype in ("bf16", "fp16") for _, spec, _ in kinds), kinds


def test_the_readme_shows_every_entry_point():
    commands = {argv[0] for argv in attnsel_commands()}
    assert {"report", "select", "bench", "serve"} <= commands
    code = "\n".join(BLOCKS)
    for call in ("attnsel.select(", ".plan_prefill(", ".plan_decode(", "attnsel.flash_attn_with_kvcache(",
                 'attn_implementation="attnsel"'):
        assert call in code, call


def test_gemma_2_config_is_fp32_which_every_fast_backend_refuses():
    """The README: gemma-2-27b.json declares fp32 and needs --dtype bf16 on a GPU."""
    kinds = layer_specs(ROOT / "examples" / "configs" / "gemma-2-27b.json")
    assert {spec.dtype for _, spec, _ in kinds} == {"fp32"}
    assert "--dtype bf16" in README and "gemma-2-27b.json" in README
    spec = kinds[0][1]
    for name in BUILTINS:
        reasons = [get(name).unsupported(spec, phase) or "" for phase in ("prefill", "decode")]
        if name == "torch":
            assert reasons == ["", ""]
        else:  # a variant that serves one phase only says so for the other
            assert any("dtype fp32 is not supported" in str(r) for r in reasons), (name, reasons)


def test_the_serve_demo_model_exists():
    tree = ast.parse((ROOT / "tests" / "test_serve.py").read_text())
    assert "save_tiny_model" in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert "from tests.test_serve import save_tiny_model" in README and "`test` extra" in README


def test_every_repository_path_named_exists():
    named = set(re.findall(r"(?<![\w/.-])((?:examples|scripts|docs|bench|tests|\.ci)/[\w./-]*[\w-])", README))
    named |= {m for m in re.findall(r"\]\(([^)#]+)\)", README) if "://" not in m}
    assert named
    missing = sorted(p for p in named if "*" not in p and not (ROOT / p).exists())
    assert not missing, f"README.md names paths that do not exist: {missing}"


def test_scripts_readme_lists_every_script():
    text = (ROOT / "scripts" / "README.md").read_text()
    listed = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    present = {p.name for p in (ROOT / "scripts").iterdir() if p.name != "README.md" and p.name != "__pycache__"}
    assert listed == present, f"scripts/README.md lists {sorted(listed - present)} that do not exist and misses " \
                              f"{sorted(present - listed)}"


def _minor(text: str) -> tuple[int, int]:
    return tuple(int(x) for x in text.split(".")[:2])


def test_transformers_routes_agree_with_the_code_and_serve_help(monkeypatch):
    """Which name continuous batching takes per transformers version: one answer in the code (the versions where
    paged|attnsel registers, the first with the Hub-kernel route), `attnsel serve --help` and the README's table."""
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps help at the terminal's width, also inside names
    paged = max(_minor(v) for v in hf.PAGED_VERSIONS)
    first_flash, last_flash = (paged[0], paged[1] + 1), (hf_kernels.KERNEL_FROM[0], hf_kernels.KERNEL_FROM[1] - 1)
    kernel = hf_kernels.KERNEL_FROM
    fmt = "{}.{}".format
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    help_text = " ".join(sub.choices["serve"].format_help().split())
    expected = (f"{hf.PAGED_NAME} on {fmt(*paged)}, {hf_kernels.NAME} on {fmt(*first_flash)} to {fmt(*last_flash)}, "
                f"{hf_kernels.KERNEL_NAME} on >= {fmt(*kernel)}")
    assert expected in help_text, f"serve --help says:\n{help_text}"
    rows = {m[0]: m[1] for m in re.findall(r"^\| ([\d.]+(?: to [\d.]+| and later)?) \|(.*)$", README, flags=re.M)}
    assert hf.PAGED_NAME.replace("|", "\\|") in rows[fmt(*paged)]
    assert f'"{hf_kernels.NAME}"' in rows[f"{fmt(*first_flash)} to {fmt(*last_flash)}"]
    assert hf_kernels.KERNEL_NAME in rows[f"{fmt(*kernel)} and later"]


def _bench_totals(folder: str, mode: str) -> dict:
    """strategy -> [within 3%, timed, worst] over a recorded bench's files of one launch mode."""
    files = sorted((ROOT / "bench" / "results" / folder).glob(f"bench-*-{mode}*.json"))
    assert files, f"no bench-*-{mode}*.json in bench/results/{folder}"
    totals = {}
    for f in files:
        for r in json.loads(f.read_text())["summary"]:
            t = totals.setdefault(r["strategy"], [0, 0, 1.0])
            t[0], t[1], t[2] = t[0] + r["within_tie"], t[1] + r["timed"], max(t[2], r["worst"])
    return totals


DISPATCH_ROW = re.compile(r"^\| (eager|CUDA graphs) \| (H\d+) \| [\d-]+ \| \**(\d+)/(\d+) \(\d+%\)\** \| ([\d.]+)x \| "
                          r"(\d+)/\d+ \| (\d+)/\d+ \| `([^`]+)` \|$", flags=re.M)


def test_the_results_files_dispatch_figures_are_what_the_raw_files_give():
    rows = DISPATCH_ROW.findall(RESULTS)
    assert len(rows) >= 2
    for mode, _, within, timed, worst, one, static, folder in rows:
        t = _bench_totals(folder, "eager" if mode == "eager" else "graph")
        decimals = len(worst.split(".")[1])
        assert (t["selected"][0], t["selected"][1], round(t["selected"][2], decimals)) == \
            (int(within), int(timed), float(worst)), (folder, t["selected"])
        assert (t["one_backend"][0], t["static"][0]) == (int(one), int(static)), folder


def test_the_readme_results_are_the_results_files_latest():
    latest = {(mode, device): (within, timed, worst, one) for mode, device, within, timed, worst, one, *_ in
              DISPATCH_ROW.findall(RESULTS)}
    rows = re.findall(r"^\| (H\d+), [\d-]+ \| (eager|CUDA graphs) \| (\d+)/(\d+) \(\d+%\) \| ([\d.]+)x \| (\d+)/\d+ \|",
                      README, flags=re.M)
    assert len(rows) == 2
    for device, mode, *figures in rows:
        assert tuple(figures) == latest[(mode, device)], (device, mode)


def test_architecture_stays_short():
    """docs/ARCHITECTURE.md describes the design as it is, in at most 1,500 words."""
    words = len((ROOT / "docs" / "ARCHITECTURE.md").read_text().split())
    assert words <= 1500, f"docs/ARCHITECTURE.md has {words} words, at most 1500"
