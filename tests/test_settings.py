"""attnsel's environment variables: every one read and validated in one place (attnsel.settings), a bad value named
(variable, value, what is allowed) at select() and CLI start-up, before any worker starts."""
import os
import subprocess
import sys

import pytest
import torch

from attnsel import AttentionSpec, select
from attnsel.cli import main
from attnsel.errors import AttnselError
from attnsel.settings import ENV, Settings, SettingsError, read
from attnsel.validate import runner, timing

SPEC = AttentionSpec(4, 2, 64, "fp32")

# field -> (a good value, what it reads as, a bad value or None where any text is a value)
CASES = {
    "prefill_backend": ("torch", "torch", None),
    "decode_backend": ("triton", "triton", None),
    "extend_backend": ("fa3", "fa3", None),
    "backends": ("tests.fixtures.fault_backends:ALL, tests.fixtures.fault_numerics:SLOPPY",
                 ("tests.fixtures.fault_backends:ALL", "tests.fixtures.fault_numerics:SLOPPY"),
                 "tests.fixtures.fault_backends"),
    "cache_dir": ("/tmp/attnsel-cache", "/tmp/attnsel-cache", None),
    "validation_timeout_s": ("90", 90.0, "soon"),
    "check_timeout_s": ("inf", float("inf"), "0"),
    "timing_budget_s": ("2.5", 2.5, "-1"),
    "flashinfer_workspace_mb": ("256", 256, "4"),
    "check_metadata": ("On", True, "maybe"),
    "dist_timeout_s": ("30", 30.0, "nan"),
    "dist_decide_timeout_s": ("7200", 7200.0, "1h"),
    "kernel_options": ('{"policy": "priority"}', {"policy": "priority"}, "[1, 2]"),
    "canary": ("3", 3, "-1"),
}
BAD = [(f, c[2]) for f, c in CASES.items() if c[2] is not None]


def test_every_variable_has_a_case():
    assert set(CASES) == set(ENV) and all(v.startswith("ATTNSEL_") for v in ENV.values())


def test_unset_and_empty_are_the_defaults():
    assert Settings.from_env({}) == Settings()
    assert Settings.from_env({v: "  " for v in ENV.values()}) == Settings()
    assert Settings().canary == 0 and Settings().timing_budget_s == 75.0 and Settings().prefill_backend == "auto"


@pytest.mark.parametrize("field", list(CASES))
def test_a_good_value_is_read(field):
    raw, value, _ = CASES[field]
    assert getattr(Settings.from_env({ENV[field]: raw}), field) == value
    assert read(field, {ENV[field]: raw}) == value


@pytest.mark.parametrize("field, bad", BAD)
def test_a_bad_value_names_the_variable_its_value_and_what_is_allowed(field, bad):
    with pytest.raises(SettingsError) as exc:
        Settings.from_env({ENV[field]: bad})
    assert exc.value.variable == ENV[field]
    assert str(exc.value).startswith(f"{ENV[field]}={bad!r}: expected ")
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, AttnselError)


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("ATTNSEL_CANARY", "5")
    assert Settings.from_env().canary == 5 and read("canary") == 5
    assert Settings.from_env({}).canary == 0  # an explicit mapping is all that is read


@pytest.mark.parametrize("field, bad", BAD)
def test_select_refuses_a_bad_variable_before_any_worker(monkeypatch, field, bad):
    """Every variable is read when select() starts, whether or not this selection would read it (a warm cache,
    an explicit backend, a machine without FlashInfer, one process)."""
    monkeypatch.setenv(ENV[field], bad)
    spawned = runner.spawn_count
    with pytest.raises(SettingsError, match=f"^{ENV[field]}="):
        select(SPEC, prefill="torch", decode="torch", policy="priority", use_cache=False)
    assert runner.spawn_count == spawned


@pytest.mark.parametrize("field, bad", BAD)
def test_the_cli_refuses_a_bad_variable_at_start_up(capsys, monkeypatch, field, bad):
    """Even `attnsel cache path`, which reads none of them: one line naming it, exit 2."""
    monkeypatch.setenv(ENV[field], bad)
    assert main(["cache", "path"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"attnsel: error: {ENV[field]}={bad!r}: expected ")


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_an_unknown_backend_in_the_variable_is_named_by_the_cli(capsys, monkeypatch, phase):
    monkeypatch.setenv(ENV[f"{phase}_backend"], "bogus")
    code = main(["select", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "64", "--device", "cpu"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and err.startswith(f"attnsel: error: {ENV[f'{phase}_backend']}=bogus (environment variable): "
                                        "unknown backend 'bogus'")


def test_a_cache_dir_that_cannot_be_one_is_named_by_select(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ATTNSEL_CACHE_DIR", str(blocker))
    with pytest.raises(ValueError, match=r"^\$ATTNSEL_CACHE_DIR .* cannot be used as a directory"):
        select(SPEC, prefill="torch", decode="torch")


def test_the_integrations_refuse_a_bad_variable_when_registering(monkeypatch):
    pytest.importorskip("transformers")
    from attnsel.integrations import hf

    monkeypatch.setenv("ATTNSEL_CANARY", "often")
    with pytest.raises(SettingsError, match="^ATTNSEL_CANARY='often': expected a whole number >= 0"):
        hf.register()


def test_timing_leaves_the_environment_alone(monkeypatch):
    """timing.measure popped ATTNSEL_FLASHINFER_WORKSPACE_MB from the worker's environment: the user's workspace
    did not apply to the timing (or to anything after it in that process)."""
    monkeypatch.setenv("ATTNSEL_FLASHINFER_WORKSPACE_MB", "64")
    before = dict(os.environ)
    timing.measure(SPEC, "decode", ["torch"], torch.device("cpu"), "eager", reps=1, grid=[(0, (1, 16))])
    assert dict(os.environ) == before


def test_a_bad_variable_in_a_fresh_process_is_one_line():
    """The installed entry point, as a user runs it: one line on stderr, exit 2, no traceback."""
    env = {**os.environ, "ATTNSEL_DIST_DECIDE_TIMEOUT_S": "later"}
    run = subprocess.run([sys.executable, "-m", "attnsel", "cache", "path"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip() == ("attnsel: error: ATTNSEL_DIST_DECIDE_TIMEOUT_S='later': expected a positive number "
                                  "of seconds (inf: no limit; default 3600)")
