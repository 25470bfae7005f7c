"""CLI: exit codes 0/2/3, the messages a user sees, and the --json schema."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attnsel import backends
from attnsel.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
LLAMA = str(ROOT / "examples" / "configs" / "llama-3-8b.json")
SMALL = ["--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--dtype", "fp16"]
# The commands run in this process validate in a worker thread (tests/fixtures/inproc_worker.py): the CLI is under
# test, not the worker process (the tests that start attnsel as a subprocess spawn real workers).
pytestmark = pytest.mark.usefixtures("inproc_worker")
# The default candidates on a large spec take Triton's interpreter minutes: by default torch alone is validated
# there (what the CLI prints does not depend on which backend won); the slow stage runs the default candidates.
PRIORITY = pytest.mark.parametrize("priority", [
    pytest.param(["--prefill-priority", "torch", "--decode-priority", "torch", "--extend-priority", "torch"],
                 id="torch"),
    # default prefill and decode candidates; extend's Triton kernel on these specs is tests/test_triton_extend.py's
    pytest.param(["--extend-priority", "torch"], id="default", marks=pytest.mark.slow)])


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


def test_report_json_is_strict_json(capsys, monkeypatch):
    """json.dumps writes float('inf') and NaN as Infinity/NaN, which strict parsers (and other languages) refuse;
    the report writes null for them (a cached time of Infinity would otherwise reach the output)."""
    import attnsel.render as render

    real = render.report_json
    monkeypatch.setattr(render, "report_json", lambda sel: {**real(sel), "odd": [float("inf"), float("nan"), 1.5]})
    code, out, _ = run(capsys, "report", *SMALL, "--json", "--policy", "priority")

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    assert code == 0 and json.loads(out, parse_constant=refuse)["odd"] == [None, None, 1.5]


@PRIORITY
def test_report_table_ends_with_the_two_choices(capsys, priority):
    code, out, _ = run(capsys, "report", "--config", LLAMA, "--policy", "priority", *priority)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[-3].startswith("prefill: ") and lines[-3].endswith("(auto)")
    assert lines[-2].startswith("decode: ") and lines[-2].endswith("(auto)")
    assert lines[-1].startswith("extend: ") and lines[-1].endswith("(auto)")
    assert "32/8 heads, head_dim 128, bf16" in out
    assert "cache: miss" in out


def test_graph_mode_without_cuda_exits_3_naming_the_flag(capsys):
    code, out, err = run(capsys, "select", "--num-heads", "8", "--head-dim", "64", "--mode", "graph", "--device", "cpu")
    assert (code, out) == (3, "")
    assert err.strip() == ("attnsel: cannot run: --mode graph times CUDA-graph replays and needs a CUDA device; the "
                           "device is cpu (use --mode eager)")


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
     "triton, torch, fa3_packgqa, fa3_split, flashinfer_fa2, flashinfer_fa3, flashinfer_xqa"),
    (["--num-heads", "8", "--head-dim", "64", "--decode-priority", "torch,nope"], "unknown backend 'nope'"),
    (["--num-heads", "8", "--head-dim", "64", "--timeout", "0"], "--timeout must be a positive number of seconds, got 0"),
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


@pytest.mark.parametrize("name, short", [("bfloat16", "bf16"), ("Float16", "fp16"), ("half", "fp16"),
                                         ("float32", "fp32"), ("bf16", "bf16")])
def test_dtype_takes_torch_names_as_aliases(name, short):
    args = build_parser().parse_args(["report", "--num-heads", "4", "--dtype", name])
    assert args.dtype == short


def test_serve_dtype_takes_the_same_aliases():
    args = build_parser().parse_args(["serve", "/nonexistent", "--dtype", "BFloat16"])
    assert args.dtype == "bf16"
    assert build_parser().parse_args(["serve", "/nonexistent"]).dtype == "auto"


def test_dtype_alias_reaches_the_report(capsys):
    code, out, err = run(capsys, "report", *SMALL[:-1], "bfloat16", "--policy", "priority", "--json")
    assert code == 0, err
    assert json.loads(out)["spec"]["dtype"] == "bf16"


def test_a_flag_the_command_does_not_take_is_named_with_that_commands_usage(capsys):
    """`select --json` (report's flag): exit 2, the command's own usage (its flags), not the top-level one."""
    with pytest.raises(SystemExit) as exc:
        main(["select", *SMALL, "--json"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: attnsel select") and "--prefill-priority" in err
    assert "attnsel select: error: unrecognized arguments: --json" in err


def test_explicit_unavailable_backend_exits_3(capsys):
    code, out, err = run(capsys, "report", *SMALL, "--llm_prefill_att_backend", "fa3")
    assert code == 3
    assert "prefill backend 'fa3' was requested explicitly but is unavailable: flash_attn_interface is not " \
           "installed" in " ".join(err.split())


def test_explicit_backend_failing_validation_exits_3_and_is_not_replaced(capsys, monkeypatch):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:NAN_DECODE")
    code, out, err = run(capsys, "select", *SMALL, "--llm_decode_att_backend", "nan_decode")
    assert code == 3
    assert "decode backend 'nan_decode' was requested explicitly but is rejected" in " ".join(err.split())


def test_explicit_backends_are_reported_as_explicit(capsys):
    code, out, _ = run(capsys, "select", *SMALL, "--llm_prefill_att_backend", "torch",
                       "--llm_decode_att_backend", "triton")
    assert code == 0
    assert out.splitlines() == ["prefill: torch (explicit)", "decode: triton (explicit)", "extend: torch (auto)"]


def test_console_script_on_a_cpu_machine(tmp_path):
    """The README's main job, as a subprocess: on CPU it picks torch and says why the others are unavailable."""
    env = dict(os.environ, ATTNSEL_CACHE_DIR=str(tmp_path), COLUMNS="200")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "attnsel.cli", "report", "--config", LLAMA], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if "CPU" in proc.stdout.splitlines()[0]:
        assert proc.stdout.strip().splitlines()[-3:] == ["prefill: torch (auto)", "decode: torch (auto)",
                                                         "extend: torch (auto)"]
        assert "no CUDA device" in proc.stdout
        # the legend explains what is shown: blank times (torch alone is valid: not timed), the check time of the
        # wide layout; no dispatch tables, no HBM (a newcomer read those as missing output)
        legend = " ".join(proc.stdout.split())
        assert "A blank eager us: not timed" in legend and "check s:" in legend
        assert "HBM" not in legend and "Dispatch tables" not in legend


def test_cache_commands(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one table row per entry
    run(capsys, "report", *SMALL, "--policy", "priority")
    code, out, _ = run(capsys, "cache", "show")
    assert code == 0 and "6 entries" in " ".join(out.split())  # triton, torch x prefill, decode, extend
    assert "4/2 heads, head_dim 64, fp16, page 16" in " ".join(out.split())  # the spec in words
    run(capsys, "report", *SMALL, "--sliding-window", "8", "--policy", "priority")
    code, out, _ = run(capsys, "cache", "show")
    words = " ".join(out.split())  # the windowed spec's entries are told apart from the plain ones
    assert "12 entries" in words and "sliding window 8" in words
    run(capsys, "cache", "clear")
    run(capsys, "report", *SMALL, "--policy", "priority")
    code, out, _ = run(capsys, "cache", "clear")
    assert code == 0 and out.startswith("removed 6 entries")


# ---- configs with several layer kinds; errors that name their source; --version; -q --------------------------------
CONFIGS = ROOT / "examples" / "configs"


@PRIORITY
def test_report_json_one_object_per_layer_kind(capsys, priority):
    code, out, err = run(capsys, "report", "--config", str(CONFIGS / "gpt-oss-20b.json"), "--json", "--policy",
                         "priority", "--device", "cpu", *priority)
    assert code == 0, err
    data = json.loads(out)
    assert list(data) == ["layer_kinds"]
    sliding, full = data["layer_kinds"]
    assert (sliding["kind"], sliding["layers"]) == ("sliding_attention", list(range(0, 24, 2)))
    assert (full["kind"], full["layers"]) == ("full_attention", list(range(1, 24, 2)))
    assert sliding["spec"]["sliding_window"] == 128 and full["spec"]["sliding_window"] is None
    for kind in (sliding, full):
        assert kind["spec"]["sinks"] is True
        assert kind["selection"]["spec"] == kind["spec"]  # each kind selected for its own spec
        for phase in ("prefill", "decode"):
            statuses = {c["name"]: c["status"] for c in kind["selection"][phase]["candidates"]}
            assert statuses[kind["selection"][phase]["backend"]] == "selected"


@PRIORITY
def test_select_and_report_label_each_layer_kind(capsys, priority):
    code, out, _ = run(capsys, "select", "--config", str(CONFIGS / "gemma-3-1b.json"), "--policy", "priority",
                       "--device", "cpu", *priority)
    assert code == 0
    assert [line.split(": ")[0] for line in out.splitlines()] == [
        "sliding_attention (22 layers)"] * 3 + ["full_attention (4 layers)"] * 3
    assert re.fullmatch(r"sliding_attention \(22 layers\): prefill: \w+ \(auto\)", out.splitlines()[0])
    code, out, _ = run(capsys, "report", "--config", str(CONFIGS / "gemma-3-1b.json"), "--policy", "priority",
                       "--device", "cpu", *priority)
    assert code == 0
    assert "sliding_attention (22 layers): layers 0-4, 6-10, 12-16, 18-22, 24-25" in out
    assert "full_attention (4 layers): layers 5, 11, 17, 23" in out
    assert "4/1 heads, head_dim 256, bf16, page 16, sliding window 512" in out


def test_one_kind_configs_keep_the_single_object_json(capsys):
    # explicit torch: the JSON's shape is under test, not the interpreted Triton kernels on a 4096-token window case
    code, out, _ = run(capsys, "report", "--config", str(CONFIGS / "mistral-7b-v0.1.json"), "--json",
                       "--prefill-backend", "torch", "--decode-backend", "torch", "--extend-backend", "torch",
                       "--device", "cpu")
    assert code == 0
    data = json.loads(out)
    assert {"prefill", "decode", "spec"} <= set(data) and data["spec"]["sliding_window"] == 4096


@pytest.mark.parametrize("argv, message", [
    (["--config", str(CONFIGS / "deepseek-v3.json")],
     "attnsel: error: config: kv_lora_rank 512, q_lora_rank 1536, qk_rope_head_dim 64, qk_nope_head_dim 128: "
     "multi-head latent attention, which AttentionSpec cannot express (model_type 'deepseek_v3'); attnsel cannot "
     "serve this model's attention"),
    (["--config", LLAMA, "--num-heads", "30"],
     "attnsel: error: --num-heads (30) must be a multiple of the config's num_kv_heads (8)"),
    (["--num-heads", "8", "--head-dim", "64", "--prefill-priority", "tritn"],
     "attnsel: error: --prefill-priority: unknown backend 'tritn'; valid: fa3, flashinfer, flashinfer_cuda_cores, "
     "triton, torch, fa3_packgqa, fa3_split, flashinfer_fa2, flashinfer_fa3, flashinfer_xqa"),
    (["--num-heads", "8", "--head-dim", "64", "--sliding-window", "0"],
     "attnsel: error: --sliding-window must be a positive number of tokens (leave the flag out for no window), got 0"),
])
def test_config_and_flag_errors_exit_2(capsys, argv, message):
    code, out, err = run(capsys, "report", *argv)
    assert (code, out) == (2, "")
    assert err.strip() == message


@pytest.mark.parametrize("config, message", [
    ({"num_attention_heads": 32, "num_key_value_heads": 0, "head_dim": 128},
     "config: num_key_value_heads must be a positive integer, got 0 (--num-kv-heads overrides it)"),
    ({"num_attention_heads": 32, "num_key_value_heads": "32", "head_dim": 128},
     "config: num_key_value_heads must be a positive integer, got '32' (--num-kv-heads overrides it)"),
    ({"num_attention_heads": 8, "head_dim": 64, "torch_dtype": "float8_e4m3fn"},
     "config: torch_dtype 'float8_e4m3fn' is not supported; allowed: bf16, bfloat16, float, float16, float32, fp16, "
     "fp32, half (--dtype overrides it)"),
])
def test_bad_config_values_exit_2_naming_the_key_and_the_flag(capsys, tmp_path, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    code, out, err = run(capsys, "select", "--config", str(path))
    assert (code, out) == (2, "")
    assert err.strip() == f"attnsel: error: {message}"


def test_flags_override_the_config_and_config_dir(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2,
                                                      "head_dim": 64, "torch_dtype": "float8_e4m3fn"}))
    code, out, err = run(capsys, "select", "--config", str(tmp_path), "--dtype", "fp32", "--policy", "priority",
                         "--device", "cpu", "-q")
    assert code == 0, err
    assert out.splitlines() == ["prefill: torch (auto)", "decode: torch (auto)", "extend: torch (auto)"]


def test_environment_backend_error_names_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "bogus")
    code, out, err = run(capsys, "select", *SMALL)
    assert code == 2
    assert err.strip() == ("attnsel: error: ATTNSEL_DECODE_BACKEND=bogus (environment variable): unknown backend "
                           "'bogus'; valid: auto, fa3, flashinfer, flashinfer_cuda_cores, triton, torch, fa3_packgqa, "
                           "fa3_split, flashinfer_fa2, flashinfer_fa3, flashinfer_xqa")
    monkeypatch.setenv("ATTNSEL_DECODE_BACKEND", "torch")  # the variable still sets the default; the flag wins
    code, out, _ = run(capsys, "select", *SMALL, "--llm_prefill_att_backend", "torch", "-q")
    assert out.splitlines() == ["prefill: torch (explicit)", "decode: torch (explicit)", "extend: torch (auto)"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the machine without CUDA")
def test_bench_without_cuda_exits_3(capsys):
    code, out, err = run(capsys, "bench", *SMALL)
    assert code == 3
    assert err.strip() == "attnsel: cannot run: attnsel bench times kernels on a CUDA device; none was found"
    code, out, err = run(capsys, "bench", "--num-heads", "0", "--head-dim", "64")  # bad input stays 2
    assert code == 2 and "--num-heads must be a positive integer, got 0" in err
    code, out, err = run(capsys, "bench", *SMALL, "--repeats", "0")
    assert code == 2 and "--repeats must be a whole number of passes, at least 1; got 0" in err


def test_bench_hands_its_flags_to_run_bench(capsys, monkeypatch):
    """The flags reach the bench (its timing needs CUDA: the bench itself is replaced here)."""
    import torch

    from attnsel import bench

    got = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_bench", lambda base, names, mode, out, quick, console, repeats, priority:
                        got.update(base=base, names=names, mode=mode, out=out, quick=quick, repeats=repeats,
                                   priority=priority) or 0)
    code, _, _ = run(capsys, "bench", *SMALL, "--backends", "torch,triton", "--mode", "eager", "--repeats", "3",
                     "--out", "somewhere")
    assert code == 0 and got["repeats"] == 3 and got["names"] == ["torch", "triton"] and got["mode"] == "eager"
    assert got["out"] == "somewhere" and not got["quick"] and got["base"].num_q_heads == 4
    code, _, _ = run(capsys, "bench", "--quick")
    assert code == 0 and got["repeats"] == 1 and got["base"] is None and got["quick"] and got["priority"] == {}


@pytest.mark.parametrize("command, flag", [("select", "--decode-priority"), ("report", "--extend-priority"),
                                           ("bench", "--prefill-priority"), ("bench", "--backends")])
@pytest.mark.parametrize("value", ["", ",", " , "])
def test_a_list_of_backends_that_names_none_exits_2(capsys, command, flag, value):
    """--decode-priority "" (a shell variable left empty) named no candidate and the selection silently took
    attnsel's default order (bench's --backends "": every backend); as --phases "" it is refused, by select and bench
    alike, before bench's CUDA check."""
    code, out, err = run(capsys, command, *SMALL, flag, value)
    assert (code, out) == (2, "")
    assert err.strip() == f"attnsel: error: {flag} names no backend; give A,B,..., or leave the flag out for the " \
                          "default"


@pytest.mark.parametrize("argv, env, where", [
    (["--decode-backend", "torch"], {}, "--decode-backend"),
    (["--llm_decode_att_backend", "torch"], {}, "--llm_decode_att_backend"),
    ([], {"ATTNSEL_DECODE_BACKEND": "torch"}, "ATTNSEL_DECODE_BACKEND=torch (environment variable)")])
def test_select_refuses_a_priority_list_for_a_phase_named_explicitly(capsys, monkeypatch, argv, env, where):
    """An explicit decode backend (flag or environment variable) and --decode-priority: the selection served torch
    and dropped the list without a word (bench, which always selects automatically, takes the list)."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for command in ("select", "report"):
        code, out, err = run(capsys, command, *SMALL, *argv, "--decode-priority", "triton,torch")
        assert (code, out) == (2, "")
        assert err.strip() == (f"attnsel: error: --decode-priority sets decode's auto candidates, but {where} names "
                               "torch: give the backend or the list, not both")


def test_bench_refuses_a_priority_name_that_backends_leaves_untimed(capsys, monkeypatch):
    """--backends torch,triton --decode-priority fa3,triton: the selection may pick fa3, which no cell times; every
    such pick was a miss (no time) in the summary, with no word why. Exit 2 on any machine."""
    import torch

    from attnsel import bench

    code, out, err = run(capsys, "bench", *SMALL, "--backends", "torch,triton", "--decode-priority", "fa3,triton")
    assert (code, out) == (2, "")
    assert err.strip() == ("attnsel: error: --decode-priority names fa3, which --backends does not time: the bench "
                           "could not judge the selection's picks; add it to --backends")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_bench", lambda *a: 0)
    assert run(capsys, "bench", *SMALL, "--backends", "torch,triton", "--decode-priority", "triton,torch")[0] == 0


def test_bench_hands_the_priority_lists_to_both_benches(capsys, monkeypatch):
    """The --PHASE-priority lists reach the fixed grid's bench and the held-out one (select_modes hands them to
    select())."""
    import torch

    from attnsel import bench, bench_heldout

    got = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_bench", lambda *a: got.update(fixed=a[-1]) or 0)
    monkeypatch.setattr(bench_heldout, "run_heldout", lambda *a: got.update(heldout=a[-1]) or 0)
    argv = ["--decode-priority", "triton, torch,triton", "--prefill-priority", "fa3_split"]
    assert run(capsys, "bench", *SMALL, *argv)[0] == 0
    assert got["fixed"] == {"prefill_priority": ["fa3_split"], "decode_priority": ["triton", "torch", "triton"]}
    assert run(capsys, "bench", *SMALL, *argv, "--extend-priority", "torch", "--heldout", "5",
               "--phases", "decode,extend")[0] == 0
    assert got["heldout"] == {**got["fixed"], "extend_priority": ["torch"]}


def test_quiet_after_the_subcommand_and_version(capsys):
    code, out, err = run(capsys, "select", *SMALL, "-q", "--policy", "priority")
    assert code == 0 and err == ""  # no progress lines
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == "attnsel 0.2.0\n"


def test_no_numpy_warning_numpy_is_a_dependency():
    """torch without numpy prints `UserWarning: Failed to initialize NumPy` at import: attnsel depends on numpy."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "numpy" for d in deps)
    proc = subprocess.run([sys.executable, "-W", "error::UserWarning", "-m", "attnsel", "--version"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "attnsel 0.2.0\n", "")


@PRIORITY
def test_a_layer_kind_that_cannot_be_served_is_shown_and_exits_3(capsys, monkeypatch, priority):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_backends:NAN_DECODE")
    code, out, err = run(capsys, "report", "--config", str(CONFIGS / "gemma-3-1b.json"), "--json", "--policy",
                         "priority", "--device", "cpu", "--llm_decode_att_backend", "nan_decode", *priority[:2])
    assert code == 3
    kinds = json.loads(out)["layer_kinds"]
    assert [k["kind"] for k in kinds] == ["sliding_attention", "full_attention"]
    for kind in kinds:  # the error, and what was found (the report still shows it)
        assert "decode backend 'nan_decode' was requested explicitly but is rejected" in kind["error"]
        nan = next(c for c in kind["selection"]["decode"]["candidates"] if c["name"] == "nan_decode")
        assert nan["status"] == "rejected" and "NaN" in nan["reason"]
    assert "attnsel: cannot serve sliding_attention (22 layers): decode backend 'nan_decode'" in " ".join(err.split())


def test_help_names_the_built_in_backends(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0
    assert "built-in backends:" in out
    for name in backends.BUILTINS:
        assert name in out, name
    # the opt-in variants are named as such (the help said `attnsel report` lists all, but its default candidates
    # leave them out)
    assert re.search(r"'auto' tries all but flashinfer_xqa \(opt- ?in", out), out


def test_a_closed_output_pipe_exits_quietly(tmp_path):
    """`attnsel cache path | head -0`: the reader is gone before attnsel writes; no traceback, exit 141 (SIGPIPE).
    (Tables go through rich, which handles a closed pipe itself: exit 1, no traceback.)"""
    env = dict(os.environ, ATTNSEL_CACHE_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "attnsel.cli", "cache", "path"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # long before the child has imported torch and written anything
    _, err = proc.communicate(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 141


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("argv", [["cache", "path"], ["report", *SMALL, "--policy", "priority", "--no-cache",
                                                      "--prefill-priority", "torch", "--decode-priority", "torch"],
                                  pytest.param(["report", *SMALL, "--policy", "priority", "--no-cache"],
                                               marks=pytest.mark.slow)],
                         ids=["print", "rich-table", "rich-table-default"])
def test_output_that_stdout_cannot_take_is_one_line_exit_1(tmp_path, argv):
    """`attnsel cache path > /dev/full`: writing stdout fails with ENOSPC. Was a traceback; now one line naming
    stdout and the OS's reason, exit 1 (the command's own OS errors keep their tracebacks)."""
    env = dict(os.environ, ATTNSEL_CACHE_DIR=str(tmp_path))
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "attnsel.cli", *argv], env=env, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "attnsel: error: cannot write the output to stdout: No space left on device" in proc.stderr
    assert proc.returncode == 1


def test_a_closed_stdout_is_no_error(tmp_path):
    """Started with stdout closed (`>&-`): Python sets sys.stdout to None and print() writes nothing. The stdout
    wrapper of the /dev/full fix raised AttributeError there (a traceback, exit 1); it is not installed then."""
    env = dict(os.environ, ATTNSEL_CACHE_DIR=str(tmp_path))
    proc = subprocess.run(["sh", "-c", f"'{sys.executable}' -m attnsel.cli cache path >&-"], env=env,
                          stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_a_broken_pipe_on_a_stream_without_a_descriptor_is_raised_as_such(monkeypatch):
    """main() called from Python with a stdout that has no file descriptor: the BrokenPipeError is not ours to
    handle and is raised as it is (was io.UnsupportedOperation from the fileno() probe)."""
    import io

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    with pytest.raises(BrokenPipeError):
        main(["cache", "path"])


def test_a_bad_flashinfer_workspace_variable_is_refused_without_flashinfer(capsys, monkeypatch):
    """ATTNSEL_FLASHINFER_WORKSPACE_MB is read only where FlashInfer runs: on a machine without it (or with an
    explicit backend) a bad value went unnoticed until FlashInfer ran. Now refused by every selection, exit 2."""
    monkeypatch.setenv("ATTNSEL_FLASHINFER_WORKSPACE_MB", "lots")
    code, _, err = run(capsys, "report", *SMALL, "--prefill-backend", "torch", "--decode-backend", "torch")
    assert code == 2
    assert "ATTNSEL_FLASHINFER_WORKSPACE_MB='lots': expected a whole number of MiB, at least 8" in " ".join(err.split())
    monkeypatch.setenv("ATTNSEL_FLASHINFER_WORKSPACE_MB", "4")
    code, _, err = run(capsys, "report", *SMALL, "--policy", "priority")
    assert code == 2 and "ATTNSEL_FLASHINFER_WORKSPACE_MB='4': expected a whole number of MiB, at least 8" in \
        " ".join(err.split())


def test_a_bad_validation_timeout_variable_is_refused_even_on_a_cache_hit(capsys, monkeypatch):
    from attnsel.validate import runner

    assert run(capsys, "report", *SMALL, "--policy", "priority")[0] == 0  # the cache is warm: no worker next time
    monkeypatch.setenv("ATTNSEL_VALIDATION_TIMEOUT", "soon")
    spawned = runner.spawn_count
    code, _, err = run(capsys, "report", *SMALL, "--policy", "priority")
    assert code == 2 and "ATTNSEL_VALIDATION_TIMEOUT='soon': expected a positive number of seconds" in \
        " ".join(err.split())
    assert runner.spawn_count == spawned  # refused before a worker started


def test_a_bad_check_timeout_variable_is_one_line_exit_2(capsys, monkeypatch):
    """ATTNSEL_CHECK_TIMEOUT_S is read by every backend's availability check, which turns what it raises into a
    reason; a bad value gave a traceback per backend and exit 3. Now: refused up front, one line, exit 2."""
    monkeypatch.setenv("ATTNSEL_CHECK_TIMEOUT_S", "abc")
    code, out, err = run(capsys, "report", *SMALL, "--policy", "priority", "--no-cache")
    assert code == 2 and out == ""
    assert err.strip() == ("attnsel: error: ATTNSEL_CHECK_TIMEOUT_S='abc': expected a positive number of seconds "
                           "(inf: no limit; default 10)")


@pytest.mark.parametrize("via", ["env", "flag"])
def test_a_cache_dir_that_is_a_file_is_refused_before_validation(capsys, monkeypatch, tmp_path, via):
    """A cache directory that cannot be one raised FileExistsError after the whole validation (exit 1); now a clear
    error before any worker starts, exit 2."""
    from attnsel.validate import runner

    blocker = tmp_path / "file"
    blocker.write_text("")
    spawned = runner.spawn_count
    if via == "env":
        monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(blocker))
        code, _, err = run(capsys, "report", *SMALL, "--policy", "priority")
        where = "$ATTNSEL_CACHE_DIR"
    else:
        code, _, err = run(capsys, "report", *SMALL, "--policy", "priority", "--cache-dir", str(blocker / "sub"))
        where = "the cache directory"
    text = " ".join(err.split())
    assert code == 2 and text.startswith(f"attnsel: error: {where} '{blocker}") and "cannot be used as a directory" \
        in text and "--no-cache" in text
    assert runner.spawn_count == spawned


@pytest.mark.parametrize("typed", ["--decode-backend", "--decode-backend=", "--llm_decode_att_backend", "--decode-b"])
def test_an_unknown_backend_error_names_the_flag_as_typed(capsys, typed):
    argv = [typed + "nope"] if typed.endswith("=") else [typed, "nope"]
    code, _, err = run(capsys, "report", *SMALL, *argv)
    name = typed.rstrip("=") if typed != "--decode-b" else "--decode-backend"
    assert code == 2 and err.startswith(f"attnsel: error: {name}: unknown backend 'nope'")


def test_an_infinite_check_timeout_means_no_limit(capsys, monkeypatch):
    """ATTNSEL_CHECK_TIMEOUT_S=inf passed the up-front check, then every backend's availability check raised
    OverflowError (thread.join(inf)) and the report exited 3 with every backend unavailable."""
    monkeypatch.setenv("ATTNSEL_CHECK_TIMEOUT_S", "inf")
    code, out, err = run(capsys, "report", *SMALL, "--policy", "priority", "--no-cache", "--json")
    assert code == 0, err
    data = json.loads(out)
    for phase in ("prefill", "decode"):
        status = {c["name"]: c["status"] for c in data[phase]["candidates"]}
        assert status["torch"] in ("selected", "valid")
    assert "OverflowError" not in out + err


def test_a_device_torch_cannot_use_is_refused_even_on_a_cache_hit(capsys):
    """--device xpu:0 / mps / meta on a machine without them: the worker died twice (exit 3) on a cold cache, and on
    a warm one the report said 'cache: hit' for the CPU and exited 0. Now one line either way: exit 3 for a device
    this machine lacks (as --device cuda without CUDA), exit 2 for meta, which is never a device to validate on."""
    assert run(capsys, "report", *SMALL, "--policy", "priority")[0] == 0  # a warm cache for the CPU
    for device, words, expected in (("xpu:0", "cannot run: device 'xpu:0' was requested but torch cannot use xpu "
                                              "devices on this machine", 3),
                                    ("meta", "error: device 'meta' holds no data", 2)):
        code, out, err = run(capsys, "report", *SMALL, "--policy", "priority", "--device", device)
        assert code == expected and out == "" and words in " ".join(err.split()), err


def test_cache_clear_on_a_file_is_a_clear_error(capsys, monkeypatch, tmp_path):
    """`attnsel cache clear` with ATTNSEL_CACHE_DIR naming a regular file raised FileExistsError from the file lock
    (traceback, exit 1); a missing directory has nothing to clear."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(blocker))
    code, _, err = run(capsys, "cache", "clear")
    assert code == 2 and "cannot be used as a directory" in " ".join(err.split())
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(tmp_path / "missing"))
    code, out, _ = run(capsys, "cache", "clear")
    assert code == 0 and out.startswith("removed 0 entries")


@pytest.mark.parametrize("flag,value,expected", [
    ("--softcap", "-1", "--softcap must be a positive finite number (leave the flag out for none), got -1.0"),
    ("--softmax-scale", "-1", "--softmax-scale must be a positive finite number (leave the flag out for the default), "
                              "got -1.0")])
def test_flag_errors_do_not_say_none(capsys, flag, value, expected):
    """The spec's messages say "must be None or ..." (Python's words); a command line has no None."""
    code, _, err = run(capsys, "report", *SMALL, flag, value)
    assert code == 2 and " ".join(err.split()) == f"attnsel: error: {expected}"


def test_an_internal_error_is_a_traceback_not_bad_input(monkeypatch):
    """Only attnsel's own errors (SpecError, SettingsError, UnknownBackendError, ...) are bad input (exit 2): a
    ValueError from attnsel's own code or a library is a bug and keeps its traceback (main() re-raises it; a process
    exits 1). Before, every ValueError was printed as one line, exit 2, and the bug was hidden."""
    import attnsel.cli as cli

    def broken(args, out):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(cli, "cmd_cache", broken)
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main(["cache", "path"])


def test_an_internal_error_in_a_process_exits_1_with_its_traceback(tmp_path):
    script = ("import sys, attnsel.cli as cli\n"
              "def broken(args, out):\n"
              "    raise ValueError('an internal invariant broke')\n"
              "cli.cmd_cache = broken\n"
              "sys.exit(cli.main(['cache', 'path']))\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, ATTNSEL_CACHE_DIR=str(tmp_path)))
    assert run.returncode == 1 and run.stdout == ""
    assert "Traceback (most recent call last)" in run.stderr
    assert run.stderr.strip().splitlines()[-1] == "ValueError: an internal invariant broke"
    assert "attnsel: error:" not in run.stderr


def test_attnsel_errors_are_one_line_exit_2(capsys, monkeypatch):
    """The other side: each of attnsel's own error types raised by a command is one line, exit 2."""
    import attnsel.cli as cli
    from attnsel.dist import AgreementError
    from attnsel.errors import InvalidArgument
    from attnsel.flash_masks import UnsupportedArgument
    from attnsel.settings import SettingsError
    from attnsel.spec import SpecError

    for error in (SpecError("bad spec"), backends.UnknownBackendError("bad name"), InvalidArgument("bad argument"),
                  SettingsError("ATTNSEL_CANARY", "x", "a whole number"), UnsupportedArgument("bad flash argument"),
                  AgreementError("ranks differ"), cli.UsageError("bad flag")):
        monkeypatch.setattr(cli, "cmd_cache", lambda args, out, error=error: (_ for _ in ()).throw(error))
        code, out, err = run(capsys, "cache", "path")
        assert code == 2 and out == "" and err.strip() == f"attnsel: error: {error}"


def test_no_command_prints_the_help(capsys):
    """`attnsel` / `python -m attnsel` with no arguments: the commands and what they do, exit 0 (not an argparse
    error naming its internal `command`)."""
    from attnsel.cli import main as cli_main

    assert cli_main([]) == 0
    out = capsys.readouterr().out
    assert "report" in out and "select" in out and "bench" in out and "serve" in out


START_SCRIPT = """import runpy, sys
sys.argv = ["attnsel", *sys.argv[1:]]
code = 0
try:
    runpy.run_module("attnsel", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "numpy", "triton", "transformers", "attnsel.selection") if m in sys.modules)
print(f"exit {code}, imported {heavy}", file=sys.stderr)
"""


@pytest.mark.parametrize("argv, shows", [(["--version"], "attnsel 0.2.0"), (["--help"], "usage: attnsel"),
                                         ([], "usage: attnsel")], ids=["--version", "--help", "no-args"])
def test_version_and_help_start_without_torch(argv, shows):
    """`python -m attnsel --version` / `--help` / no arguments: the package imported torch and every module before
    argparse ran (1.7 s on a CPU machine, nearly all of it torch); they need none of it."""
    proc = subprocess.run([sys.executable, "-c", START_SCRIPT, *argv], capture_output=True, text=True, timeout=300)
    assert proc.stderr.strip().splitlines()[-1] == "exit 0, imported []", proc.stderr
    assert shows in proc.stdout
    for command in ("report", "select", "bench", "cache", "serve"):  # the commands are still listed
        assert command in proc.stdout or argv == ["--version"]


def test_importing_attnsel_imports_no_torch_until_a_name_is_used():
    script = ("import sys, attnsel\n"
              "before = 'torch' in sys.modules\n"
              "from attnsel import AttentionSpec, select, SpecError\n"
              "import attnsel.spec\n"
              "print(before, 'torch' in sys.modules, attnsel.SpecError is attnsel.spec.SpecError,\n"
              "      attnsel.select is attnsel.selection.select, sorted(attnsel.__all__) == sorted(\n"
              "      n for n in attnsel.__all__ if hasattr(attnsel, n)))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["False", "True", "True", "True", "True"], proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_not_possible_here_exit_3(capsys):
    """`attnsel report --device cuda` on a machine without CUDA said 'error' and exited 2 (bad input); the input is
    fine, this machine cannot do it: exit 3, 'cannot run', as --mode graph without CUDA."""
    code, out, err = run(capsys, "report", *SMALL, "--device", "cuda", "--policy", "priority")
    assert (code, out) == (3, "")
    assert err.strip() == "attnsel: cannot run: device 'cuda' was requested but no CUDA device is available"


@pytest.mark.parametrize("package", ["fastapi", "transformers"])
def test_serve_without_its_extra_is_not_possible_here_exit_3(capsys, monkeypatch, tmp_path, package):
    """`attnsel serve` without the packages of the `serve` extra exited 2 as if the input were bad (fastapi), or
    raised ImportError with a traceback (transformers, which the check left out); now exit 3 naming the extra to
    install (sys.modules[name] = None: the package cannot be imported, as when absent)."""
    import tomllib

    from attnsel import serve

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    assert sorted(serve.SERVE_PACKAGES) == sorted(re.split(r"[<>=\[]", req)[0] for req in extra)
    monkeypatch.setitem(sys.modules, package, None)
    (tmp_path / "config.json").write_text("{}")
    code, out, err = run(capsys, "serve", str(tmp_path))
    assert (code, out) == (3, "")
    assert err.strip() == (f"attnsel: cannot run: attnsel serve needs the serve extra (missing: {package}): "
                           "pip install 'attnsel[serve]'")


@pytest.mark.parametrize("command", ["report", "serve"])
def test_a_timeout_that_is_no_number_names_the_flag_and_what_is_allowed(capsys, command):
    with pytest.raises(SystemExit) as exc:
        main([command, *(SMALL if command == "report" else ["/nonexistent"]), "--timeout", "abc"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert err.strip().splitlines()[-1] == (f"attnsel {command}: error: argument --timeout: must be a positive number "
                                            "of seconds (e.g. 600), got 'abc'")


def test_report_help_names_the_short_backend_flags_first(capsys, monkeypatch):
    """--prefill-backend / --decode-backend / --extend-backend are the primary names (usage shows them); LightLLM's
    --llm_prefill_att_backend / --llm_decode_att_backend stay as aliases (other tests here use both)."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    out = capsys.readouterr().out
    usage = out[:out.index("\n\n")]
    assert "--llm_" not in usage
    for phase in ("prefill", "decode", "extend"):
        assert f"[--{phase}-backend {phase.upper()}]" in usage
    assert "--prefill-backend PREFILL, --llm_prefill_att_backend PREFILL" in out
    assert "--decode-backend DECODE, --llm_decode_att_backend DECODE" in out


def test_the_readme_exit_codes_are_the_codes_main_returns():
    """The README listed 0, 2 and 3 but not 1 (an internal error: a bug, with its traceback)."""
    from attnsel import cli

    readme = " ".join((ROOT / "README.md").read_text().split())
    line = readme[readme.index("Exit codes:"):]
    line = line[:line.index(". ") + 1]
    assert (cli.EXIT_OUTPUT, cli.EXIT_USAGE, cli.EXIT_UNSERVED) == (1, 2, 3)
    for code, words in ((0, "success"), (1, "an internal error (a bug, with its traceback)"),
                        (2, "bad input"), (3, "not possible on this machine")):
        assert f"{code} {words}" in line, line


def test_the_readme_names_fa3s_package_where_it_lists_the_backends():
    readme = " ".join((ROOT / "README.md").read_text().split())
    backends_line = readme[readme.index("Backends: "):readme.index("entry point group")]
    assert "`fa3`" in backends_line and "tokenspeed-fa3" in backends_line and "flash_attn_interface" in backends_line


def test_flash_api_metadata_checks_raise_invalid_argument():
    """flash_checks raised plain ValueError for bad arguments: InvalidArgument is attnsel's error for them (a
    ValueError still, for callers that catch that)."""
    import torch

    import attnsel
    from attnsel.errors import InvalidArgument

    q = torch.zeros(4, 2, 8, dtype=torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(InvalidArgument, match="q, k, v must share a dtype"):
        attnsel.flash_attn_varlen_func(q, q.float(), q, cu, cu, 4, 4, causal=True)
    with pytest.raises(InvalidArgument, match="max_seqlen_q must be a Python int"):
        attnsel.flash_attn_varlen_func(q, q, q, cu, cu, 4.0, 4, causal=True)
    with pytest.raises(InvalidArgument, match="softmax_scale must be None"):
        attnsel.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, softmax_scale="0.5", causal=True)
    cache = torch.zeros(2, 16, 2, 8, dtype=torch.float16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(InvalidArgument, match="give both k and v"):
        attnsel.flash_attn_with_kvcache(q[:1].unsqueeze(1), cache, cache, k=q[:1].unsqueeze(1), cache_seqlens=3,
                                        page_table=table, causal=True)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_index_past_the_device_count_is_exit_3(capsys):
    """The GPU side of --device cuda without CUDA: an index this machine does not have is not bad input either."""
    import torch

    count = torch.cuda.device_count()
    code, out, err = run(capsys, "report", *SMALL, "--device", f"cuda:{count}", "--policy", "priority")
    assert (code, out) == (3, "")
    assert err.strip() == (f"attnsel: cannot run: device 'cuda:{count}' was requested but this machine has {count} "
                           "CUDA device(s)")
