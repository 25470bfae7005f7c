"""`attnsel serve` takes the selection flags of `attnsel select`: each one reaches the selections it starts (the
integration's ``register``), extend's as prefill's and decode's."""
import sys
import types

import pytest

from attnsel import serve
from attnsel.cli import build_parser


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
