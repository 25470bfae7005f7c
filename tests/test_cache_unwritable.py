"""A cache directory that cannot take new results (a full disk, a read-only mount of a partial cache): the
selection, valid and complete, is still served; the warning names the directory and what to do."""
import errno
import logging

import filelock
import pytest

import attnsel.cache as cache_mod
from attnsel import select
from tests.test_cache import PAIR, SPEC, pair  # noqa: F401 (pair: the fixture, used by name)


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
    """A write that fails (ENOSPC, EACCES on the lock file, filelock.Timeout) after every candidate was validated
    (and timed) costs the cache entry, not the selection: a server starts although its cache cannot grow."""
    if fault == "full":
        monkeypatch.setattr(cache_mod.tempfile, "mkstemp", _full)
    else:
        monkeypatch.setattr(filelock.FileLock, "acquire", _read_only if fault == "read_only" else _lock_held)
    with caplog.at_level(logging.WARNING):
        sel = select(SPEC, policy=policy, **PAIR, budget_s=1)
    assert sel.prefill and sel.decode and sel.cache == "miss"
    assert "could not be stored" in caplog.text and str(cache_mod.ResultCache().dir) in caplog.text, caplog.text
    assert "--no-cache" in caplog.text, caplog.text
