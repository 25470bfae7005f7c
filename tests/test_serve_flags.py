"""`attnsel serve`'s selection flags, those of `attnsel select`: each one reaches the selections it starts (the
integration's ``register``), extend's as prefill's and decode's; and they are checked as `attnsel select` checks them:
a bad backend name is named with its flag, a priority list that a named backend would silently drop (or that names
nothing) is refused, exit 2, before anything is registered. transformers' server is stubbed, never started."""
import sys
import types

import pytest

from attnsel import cli, serve
from attnsel.cli import build_parser


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
     "--extend-priority sets extend's auto candidates, but --extend-backend names torch: give the backend or the list, not both"),
    (["--decode-backend", "torch", "--decode-priority", "triton"],
     "--decode-priority sets decode's auto candidates, but --decode-backend names torch: give the backend or the list, not both"),
    (["--extend-priority", ","], "--extend-priority names no backend"),
    (["--extend-priority", "torch,bogus"], "--extend-priority: unknown backend 'bogus'"),
])
def test_serve_refuses_bad_selection_flags_with_the_flag_named(serve_main, flags, message):
    code, err, calls = serve_main(*flags)
    assert code == 2 and message in err and not calls, err


class Registered(Exception):
    pass


@pytest.fixture
def registered(monkeypatch, tmp_path):
    """cmd_serve's arguments to hf.register for the given flags (transformers' server stubbed, never started)."""
    from attnsel.integrations import hf

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(serve, "unavailable", lambda: None)
    monkeypatch.setitem(sys.modules, "transformers.cli.serve", types.SimpleNamespace(Serve=None))
    got = {}

    def register(prefill=None, decode=None, **options):
        got.update(options, prefill=prefill, decode=decode)
        raise Registered

    monkeypatch.setattr(hf, "register", register)

    def call(*flags):
        got.clear()
        args = build_parser({"serve"}).parse_args(["serve", str(tmp_path), *flags])
        with pytest.raises(Registered):
            serve.cmd_serve(args, None)
        return dict(got)
    return call


def test_serve_passes_extends_backend_and_priority_on(registered):
    got = registered("--extend-backend", "torch")
    assert got["extend"] == "torch"
    got = registered("--extend-priority", "triton,torch", "--decode-priority", "torch")
    assert got["extend_priority"] == ["triton", "torch"] and got["decode_priority"] == ["torch"]
    # not given: the integration's default (the environment's choice, else auto), as for prefill and decode
    got = registered()
    assert "extend" not in got and got.get("extend_priority") is None
