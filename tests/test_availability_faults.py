"""availability() on a plugin's faults: what must propagate (Ctrl-C), what becomes a reason, and a version whose
text is no stable cache key."""
import math

import pytest

import attnsel
from attnsel import backends
from attnsel.cache import entry_key


class _Plugin:
    name = "faulty"

    def __init__(self, check=None, version=None):
        self._check, self.version = check, version

    def unsupported(self, spec, phase):
        return self._check() if self._check else None


def _raises(exc):
    def fn():
        raise exc
    return fn


SPEC = attnsel.AttentionSpec(4, 2, 64, "fp32")


def test_keyboard_interrupt_in_a_check_propagates():
    with pytest.raises(KeyboardInterrupt):
        backends.availability(_Plugin(check=_raises(KeyboardInterrupt())), SPEC, "prefill")
    with pytest.raises(KeyboardInterrupt):
        backends.availability(_Plugin(version=_raises(KeyboardInterrupt())), SPEC, "prefill")


def test_generator_exit_in_a_check_is_a_reason():
    """GeneratorExit is no user's Ctrl-C: a plugin raising it loses the backend, not the server's start."""
    reason, identity = backends.availability(_Plugin(check=_raises(GeneratorExit("x"))), SPEC, "prefill")
    assert identity is None and "GeneratorExit" in reason


class _BadStr:
    def __str__(self):
        raise RuntimeError("no text")


class _Opaque:  # object's repr: "<...._Opaque object at 0x7f...>", another address every run
    pass


def test_a_version_whose_str_raises_is_a_reason():
    reason, identity = backends.availability(_Plugin(version=_BadStr()), SPEC, "prefill")
    assert identity is None and "version" in reason and "no text" in reason


def test_a_version_keyed_by_an_object_address_is_refused():
    """str() of an object without its own __str__ holds its address: the cache key would change every run and the
    selection re-time forever."""
    reason, identity = backends.availability(_Plugin(version=lambda: _Opaque()), SPEC, "prefill")
    assert identity is None and "version" in reason and "_Opaque" in reason


def test_a_nan_version_keys_alike_every_time():
    _, a = backends.availability(_Plugin(version=math.nan), SPEC, "prefill")
    _, b = backends.availability(_Plugin(version=float("nan")), SPEC, "prefill")
    assert entry_key({}, {}, "faulty", a, "prefill") == entry_key({}, {}, "faulty", b, "prefill")
