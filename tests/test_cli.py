"""CLI: exit codes 0/2/3, the messages a user sees, and the --json schema."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnsel.cli import main

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "examples" / "configs" / "llama-3-8b.json")
SMALL = ["--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "fp16"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_report_json_schema(capsys):
    code, out, err = run(capsys, "report", *SMALL, "--json", "--policy", "priority")
    assert code == 0
    data = json.loads(out)
    assert {"prefill", "decode", "cache", "device", "spec"} <= set(data)
    assert data["cache"] == "miss"
    for phase in ("prefill", "decode"):
        assert {"backend", "source", "candidates"} <= set(data[phase])
        assert data[phase]["source"] == "auto"
        for cand in data[phase]["candidates"]:
            assert {"name", "status", "reason", "max_abs_err", "time_s"} <= set(cand)
            assert cand["status"] in ("selected", "valid", "rejected", "unavailable")
        statuses = {c["name"]: c["status"] for c in data[phase]["candidates"]}
        assert statuses[data[phase]["backend"]] == "selected"
    fa3 = {c["name"]: c for c in data["prefill"]["candidates"]}["fa3"]
    assert fa3["status"] == "unavailable" and "flash_attn_interface is not installed" in fa3["reason"]
    assert data["spec"]["num_q_heads"] == 4
    # progress went to stderr while the worker ran
    assert "validating torch prefill" in err
    code, out, _ = run(capsys, "report", *SMALL, "--json", "--policy", "priority")
    assert json.loads(out)["cache"] == "hit"


def test_report_table_ends_with_the_two_choices(capsys):
    code, out, _ = run(capsys, "report", "--config", LLAMA, "--policy", "priority")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[-2].startswith("prefill: ") and lines[-2].endswith("(auto)")
    assert lines[-1].startswith("decode: ") and lines[-1].endswith("(auto)")
    assert "32/8 heads, head_dim 128, bf16" in out
    assert "cache: miss" in out


@pytest.mark.parametrize("argv, message", [
    (["--num-heads", "0", "--head-dim", "64"], "--num-heads must be a positive integer, got 0"),
    (["--num-heads", "32", "--num-kv-heads", "5", "--head-dim", "128"],
     "--num-heads (32) must be a multiple of --num-kv-heads (5)"),
    (["--num-heads", "8", "--head-dim", "-64"], "--head-dim must be a positive integer, got -64"),
    (["--num-heads", "8", "--head-dim", "64", "--page-size", "0"], "--page-size must be a positive integer, got 0"),
    (["--config", "/nonexistent/config.json"], "config: cannot read /nonexistent/config.json"),
    (["--num-heads", "8"], "missing --head-dim"),
    (["--num-heads", "8", "--head-dim", "64", "--llm_prefill_att_backend", "fast"],
     "--llm_prefill_att_backend: unknown backend 'fast'; valid: auto, fa3, flashinfer, flashinfer_cuda_cores, "
     "triton, torch, fa3_packgqa, fa3_split, flashinfer_fa2, flashinfer_fa3"),
    (["--num-heads", "8", "--head-dim", "64", "--decode-priority", "torch,nope"], "unknown backend 'nope'"),
    (["--num-heads", "8", "--head-dim", "64", "--timeout", "0"], "timeout must be a positive number of seconds"),
    (["--num-heads", "8", "--head-dim", "64", "--policy", "priority", "--mode", "graph", "--device", "cpu"],
     "mode 'graph' needs a CUDA device"),
])
def test_bad_input_exits_2_naming_the_field(capsys, argv, message):
    code, out, err = run(capsys, "report", *argv)
    assert code == 2
    assert err.count("\n") == 1  # one line
    assert message in err
    assert out == ""


def test_bad_dtype_is_refused_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["report", "--num-heads", "8", "--head-dim", "64", "--dtype", "fp8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.replace("'", "")  # Python versions differ in quoting the choices
    assert "argument --dtype: invalid choice: fp8 (choose from bf16, fp16, fp32)" in err


def test_explicit_unavailable_backend_exits_3(capsys):
    code, out, err = run(capsys, "report", *SMALL, "--llm_prefill_att_backend", "fa3")
    assert code == 3
    assert "prefill backend 'fa3' was requested explicitly but is unavailable: flash_attn_interface is not " \
           "installed" in " ".join(err.split())


def test_explicit_backend_failing_validation_exits_3_and_is_not_replaced(capsys, monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fault_backends:NAN_DECODE")
    code, out, err = run(capsys, "select", *SMALL, "--llm_decode_att_backend", "nan_decode")
    assert code == 3
    assert "decode backend 'nan_decode' was requested explicitly but is rejected" in " ".join(err.split())


def test_explicit_backends_are_reported_as_explicit(capsys):
    code, out, _ = run(capsys, "select", *SMALL, "--llm_prefill_att_backend", "torch",
                       "--llm_decode_att_backend", "triton")
    assert code == 0
    assert out.splitlines() == ["prefill: torch (explicit)", "decode: triton (explicit)"]


def test_console_script_on_a_cpu_machine(tmp_path):
    """The README's main job, as a subprocess: on CPU it picks torch and says why the others are unavailable."""
    env = dict(os.environ, ATTNSEL_CACHE_DIR=str(tmp_path), COLUMNS="200")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "attnsel.cli", "report", "--config", LLAMA], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if "CPU" in proc.stdout.splitlines()[0]:
        assert proc.stdout.strip().splitlines()[-2:] == ["prefill: torch (auto)", "decode: torch (auto)"]
        assert "no CUDA device" in proc.stdout


def test_cache_commands(capsys):
    run(capsys, "report", *SMALL, "--policy", "priority")
    code, out, _ = run(capsys, "cache", "show")
    assert code == 0 and "4 entries" in " ".join(out.split())
    code, out, _ = run(capsys, "cache", "clear")
    assert code == 0 and out.startswith("removed 4 entries")
