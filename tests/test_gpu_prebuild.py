"""scripts/gpu_prebuild.py on CPU (torch only): the extend phase, a pPAGE --spec, and a rejected extend result
reported with its reason (a rejection need not carry numbers: changed inputs, a shape, a rerun difference)."""
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "gpu_prebuild.py")


def prebuild(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", [SCRIPT, *argv])
    runpy.run_path(SCRIPT, run_name="__main__")


def test_extend_runs_on_cpu_with_the_specs_page_size(monkeypatch, capsys):
    prebuild(monkeypatch, "--spec", "8/1/64/p1", "torch:bf16:extend")
    out = capsys.readouterr().out
    assert "torch:bf16:extend on 8/1 heads, head_dim 64, bf16, page 1: built and ran" in out


def test_a_rejected_extend_result_says_why(monkeypatch, capsys):
    from attnsel.validate import cases

    reason = "the backend changed its input(s) q during plan/run"
    monkeypatch.setattr(cases, "check_output", lambda spec, out, case: {"status": "rejected", "reason": reason})
    with pytest.raises(SystemExit) as exc:
        prebuild(monkeypatch, "torch:bf16:extend")
    out = capsys.readouterr().out
    assert reason in out and "None" not in out, out
    assert "torch:bf16:extend" in str(exc.value.code)


def test_spec_help_and_errors_name_the_page_field(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        prebuild(monkeypatch, "--spec", "32/8/p1,8/1", "torch:bf16:extend")
    assert "Q/KV[/HEAD_DIM][/DTYPE][/pPAGE]" in capsys.readouterr().err
