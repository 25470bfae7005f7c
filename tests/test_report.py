"""`attnsel report` as a person reads it: it fits an 80-column terminal, long reasons are summarised in one line (in
full in --json and the log), a phase that cannot be served still gets the table / JSON of what was found before exit 3,
and the dispatch table is shown and carried in --json."""
import json

import pytest

from attnsel.cli import main
from attnsel.priority import DEFAULT_PRIORITY
from attnsel.validate import timing

SMALL = ["--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "fp16"]
STACK = "\n".join(["Fatal Python error: Segmentation fault", "Current thread 0x7f (most recent call first):"]
                  + [f'  File "/site-packages/kernels/mod{i}.py", line {i} in launch_{i}' for i in range(38)])
# The reports validate in a worker thread (tests/fixtures/inproc_worker.py): what is printed is under test here.
pytestmark = pytest.mark.usefixtures("inproc_worker")


class Unavailable:
    """A plugin whose availability check fails with a 40-line reason (a library's import-time crash report)."""

    name = "stacky"
    version = "test"

    def unsupported(self, spec, phase):
        return STACK

    def plan_prefill(self, *args):
        raise AssertionError("never planned")

    plan_decode = plan_prefill


STACKY = Unavailable()


class Wordy(Unavailable):
    """A plugin whose one-line reason is three lines long at 80 columns."""

    name = "wordy"

    def unsupported(self, spec, phase):
        return "needs " + ", ".join(f"feature number {i} of the wordy kernel library" for i in range(5))


WORDY = Wordy()


def run(capsys, monkeypatch, columns, *argv):
    monkeypatch.setenv("COLUMNS", str(columns))
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_report_fits_80_columns_with_a_40_line_reason(capsys, monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.test_report:STACKY")
    code, out, err = run(capsys, monkeypatch, 80, "report", *SMALL, "--policy", "priority",
                         "--prefill-priority", "stacky,torch", "--decode-priority", "triton,torch")
    assert code == 0
    lines = out.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(line for line in lines if len(line) > 80)
    # every candidate is one table row; the stack is one summary line
    rows = [line for line in lines if line.startswith("│")]
    # prefill and decode: 2 each; extend: the default candidates and the plugin
    assert len(rows) == 4 + len(DEFAULT_PRIORITY["extend"]) + 1
    summary = [line for line in lines if "stacky: Fatal" in line]  # (extend: stacky has no plan_extend)
    assert len(summary) == 1 and "Fatal Python error: Segmentation fault (+39 lines: --json)" in summary[0]
    assert "launch_30" not in out
    assert "launch_30" in err  # the full reason went to the log
    assert lines[-3:] == ["prefill: torch (auto)", "decode: triton (auto)", "extend: triton (auto)"]
    # --json carries the whole reason
    code, out, _ = run(capsys, monkeypatch, 80, "report", *SMALL, "--policy", "priority", "--json",
                       "--prefill-priority", "stacky,torch", "--decode-priority", "triton,torch")
    cand = {c["name"]: c for c in json.loads(out)["prefill"]["candidates"]}["stacky"]
    assert cand["reason"] == STACK and cand["status"] == "unavailable"


def test_wide_terminal_shows_every_column_in_one_table(capsys, monkeypatch):
    code, out, _ = run(capsys, monkeypatch, 160, "report", *SMALL, "--policy", "priority")
    assert code == 0
    header = next(line for line in out.splitlines() if "backend" in line)
    for col in ("phase", "status", "max err", "tolerance", "check s", "eager us", "vs best", "reason"):
        assert col in header
    assert max(len(line) for line in out.splitlines()) <= 160


def test_exit_3_still_prints_what_was_found(capsys, monkeypatch):
    argv = ["report", *SMALL, "--llm_prefill_att_backend", "fa3", "--policy", "priority", "--decode-priority",
            "torch"]
    code, out, err = run(capsys, monkeypatch, 80, *argv)
    assert code == 3
    assert "prefill candidates" in out and "decode candidates" in out
    assert "flash_attn_interface is not installed" in out
    assert out.splitlines()[-3].startswith("prefill: cannot be served: prefill backend 'fa3' was requested")
    assert out.splitlines()[-2] == "decode: torch (auto)"
    assert err.strip().splitlines()[-1].startswith("attnsel: cannot serve: prefill backend 'fa3'")
    code, out, err = run(capsys, monkeypatch, 80, *argv, "--json")
    assert code == 3
    data = json.loads(out)
    assert data["prefill"]["backend"] == "" and "requested explicitly" in data["prefill"]["error"]
    assert data["decode"]["backend"] == "torch" and data["decode"]["error"] == ""
    assert "attnsel: cannot serve:" in err


PRE = {(1, 16, 16): {"torch": 5.0, "triton": 9.0}, (2, 32, 24): {"torch": 50.0, "triton": 20.0}}
DEC = {(1, 32): {"torch": 10.0, "triton": 20.0}, (4, 32): {"torch": 90.0, "triton": 30.0}}
EXT = {(1, 2, 16): {"torch": 10.0, "triton": 25.0}, (2, 5, 24): {"torch": 80.0, "triton": 20.0}}


@pytest.fixture
def injected(monkeypatch):
    """The worker replaced by fixed results: every candidate valid, the timings above."""
    from tests.fixtures.dispatch import fake_worker, measured

    fake_worker(monkeypatch, {"prefill": measured("prefill", "eager", PRE),
                              "decode": measured("decode", "eager", DEC),
                              "extend": measured("extend", "eager", EXT)}, [])


def test_report_shows_the_dispatch_table(capsys, monkeypatch, injected):
    code, out, _ = run(capsys, monkeypatch, 80, "report", *SMALL, "--prefill-priority", "triton,torch",
                       "--decode-priority", "triton,torch", "--extend-priority", "triton,torch")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "decode dispatch" in out and "prefill dispatch" in out and "extend dispatch" in out
    words = " ".join(out.split())
    assert "extend dispatch, eager: buckets over requests, q_len, context; wins: torch 1, triton 1" in words
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│ 4x32")]
    assert [c.strip() for c in rows[0]] == ["4x32", "triton", "30.0", "1%", "3.00x", "torch"]
    assert "eager us: time per call" in " ".join(out.split())
    assert "decode dispatch, eager: buckets over batch, context; wins: torch 1, triton 1" in " ".join(out.split())
    assert out.splitlines()[-2] == "decode: triton (auto), dispatch over 2 buckets (2 backends)"
    assert out.splitlines()[-1] == "extend: triton (auto), dispatch over 2 buckets (2 backends)"


def test_report_json_carries_the_dispatch_table(capsys, monkeypatch, injected):
    code, out, _ = run(capsys, monkeypatch, 80, "report", *SMALL, "--json", "--prefill-priority", "triton,torch",
                       "--decode-priority", "triton,torch", "--extend-priority", "triton,torch")
    assert code == 0
    data = json.loads(out)
    assert set(data["time_units"]) == {"score_us", "dispatch.buckets.us", "dispatch.buckets.host", "time_s"}
    for phase in ("prefill", "decode", "extend"):
        table = data[phase]["dispatch"]
        assert set(table) == {"phase", "mode", "axes", "default", "grid_version", "skipped", "wall_s", "pruned",
                              "buckets", "ragged"}
        assert table["ragged"] is None  # no ragged buckets timed (tests/test_ragged_dispatch.py has them)
        assert table["grid_version"] == timing.GRID_VERSION and table["mode"] == "eager"
        assert table["default"] == data[phase]["backend"]
        for b in table["buckets"]:
            assert set(b) == {"key", "label", "backend", "us", "runner_up", "runner_up_us", "ratio", "times_us",
                              "spread", "host"}
            assert b["host"] is None  # CPU: no host probe (eager on CUDA only)
            assert len(b["key"]) == len(table["axes"])
            assert b["us"] == min(b["times_us"].values()) and b["ratio"] >= 1
    assert data["decode"]["dispatch"]["axes"] == ["batch", "context"]
    assert data["prefill"]["dispatch"]["axes"] == ["num_seqs", "total_tokens", "longest"]
    assert data["extend"]["dispatch"]["axes"] == ["requests", "q_len", "context"]
    assert [c["name"] for c in data["extend"]["candidates"]] == ["triton", "torch"]


def test_select_prints_the_choice_per_phase(capsys, monkeypatch, injected):
    code, out, _ = run(capsys, monkeypatch, 80, "select", *SMALL, "--prefill-priority", "triton,torch",
                       "--decode-priority", "triton,torch", "--extend-priority", "triton,torch")
    assert code == 0
    assert out.splitlines() == ["prefill: triton (auto), dispatch over 2 buckets (2 backends)",
                                "decode: triton (auto), dispatch over 2 buckets (2 backends)",
                                "extend: triton (auto), dispatch over 2 buckets (2 backends)"]


def test_a_wrapped_reason_continues_under_itself_not_under_the_names(capsys, monkeypatch):
    """Piped to a file (80 columns), a reason's continuation lines are indented past the backend names, so that each
    line is seen to belong to its backend."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.test_report:WORDY")
    code, out, _ = run(capsys, monkeypatch, 80, "report", *SMALL, "--policy", "priority",
                       "--prefill-priority", "wordy,torch", "--decode-priority", "torch")
    assert code == 0
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.lstrip().startswith("wordy:"))
    start = lines[first].index("needs feature number 0")
    continued = lines[first + 1:first + 3]
    assert all(line[:start].strip() == "" and line[start] != " " for line in continued), "\n".join(lines)
    assert "feature number 4 of the wordy kernel library" in " ".join(
        line[start:].strip() for line in lines[first:first + 4])


def test_dispatch_table_with_long_names_fits_80_columns():
    from rich.console import Console

    from attnsel.render import dispatch_table
    from attnsel.selection import PhaseChoice, build_table
    from tests.fixtures.dispatch import _selection, measured

    cells = {(16, 3008, 2048): {"flashinfer_cuda_cores": 100.0, "flashinfer": 120.0},
             (1, 64, 64): {"flashinfer_cuda_cores": 10.0, "flashinfer": 9.0}}
    table = build_table(measured("prefill", "eager", cells), ["flashinfer", "flashinfer_cuda_cores"])
    sel = _selection({"prefill": PhaseChoice("flashinfer", "auto", [], table)})
    console = Console(width=80, record=True)
    console.print(dispatch_table(sel, "prefill", 80))
    lines = console.export_text().splitlines()
    assert max(map(len, lines)) <= 80
    row = next(line for line in lines if "16x3008x2048" in line)
    assert "100.0" in row and "1.20x" in row and "1%" in row  # the numbers are never cut
