"""A cache directory that cannot take new results (a full disk, a read-only mount of a partial cache): the
selection, valid and complete, is still served; the warning names the directory and what to do."""
import errno
import logging

import filelock
import pytest

import attnsel.cache as cache_mod
from attnsel import select
from attnsel.spec import AttentionSpec

SPEC = AttentionSpec(4, 2, 64, "fp16")
PAIR = dict(prefill_priority=["torch_copy", "torch"], decode_priority=["torch_copy", "torch"],
            extend_priority=["torch_copy", "torch"])


@pytest.fixture
def pair(monkeypatch, inproc_worker):
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:TORCH_COPY")


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _read_only(self, *args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied", self.lock_file)


def _lock_held(self, *args, **kwargs):
    raise filelock.Timeout(self.lock_file)


@pytest.mark.usefixtures("pair")
@pytest.mark.parametrize("policy", ["priority", "measure"])
@pytest.mark.parametrize("fault", ["full", "read_only", "lock_held"])
def test_results_that_cannot_be_stored_do_not_fail_the_selection(fault, policy, monkeypatch, caplog):
    """Was: select() validated (and timed) every candidate, then raised the OSError of the write (ENOSPC, EACCES on
    the lock file) or filelock.Timeout: a server could not start because its cache could not grow."""
    if fault == "full":
        monkeypatch.setattr(cache_mod.tempfile, "mkstemp", _full)
    else:
        monkeypatch.setattr(filelock.FileLock, "acquire", _read_only if fault == "read_only" else _lock_held)
    with caplog.at_level(logging.WARNING):
        sel = select(SPEC, policy=policy, **PAIR, budget_s=1)
    assert sel.prefill and sel.decode and sel.cache == "miss"
    assert "could not be stored" in caplog.text and str(cache_mod.ResultCache().dir) in caplog.text, caplog.text
    assert "--no-cache" in caplog.text, caplog.text
