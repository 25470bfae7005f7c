"""`attnsel serve` checks its selection flags as `attnsel select` does: a bad backend name is named with its flag, a
priority list that a named backend would silently drop (or that names nothing) is refused, exit 2, before anything
is registered."""
import sys
import types

import pytest

from attnsel import cli, serve


@pytest.fixture
def serve_main(monkeypatch, tmp_path, capsys):
    from attnsel.integrations import hf

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(serve, "unavailable", lambda: None)
    monkeypatch.setitem(sys.modules, "transformers.cli.serve", types.SimpleNamespace(Serve=None))
    calls = []

    def register(*a, **k):
        calls.append(k)
        raise AssertionError("register reached with flags that should have been refused")

    monkeypatch.setattr(hf, "register", register)

    def call(*flags):
        code = cli.main(["serve", str(tmp_path), *flags])
        return code, capsys.readouterr().err, calls
    return call


@pytest.mark.parametrize("flags, message", [
    (["--extend-backend", "bogus"], "--extend-backend: unknown backend 'bogus'; valid: auto, "),
    (["--extend-backend", "torch", "--extend-priority", "triton"],
     "--extend-priority sets extend's auto candidates, but --extend-backend names torch: give one"),
    (["--decode-backend", "torch", "--decode-priority", "triton"],
     "--decode-priority sets decode's auto candidates, but --decode-backend names torch: give one"),
    (["--extend-priority", ","], "--extend-priority names no backend"),
    (["--extend-priority", "torch,bogus"], "--extend-priority: unknown backend 'bogus'"),
])
def test_serve_refuses_bad_selection_flags_with_the_flag_named(serve_main, flags, message):
    code, err, calls = serve_main(*flags)
    assert code == 2 and message in err and not calls, err
