"""One cache directory shared by processes that die mid-write and by another attnsel version: nothing it holds is
destroyed, nothing a dead writer left behind piles up."""
import json
import logging
import multiprocessing as mp
import os
import signal
import time

import pytest

from attnsel.cache import SCHEMA, ResultCache

NEWER = {"schema": SCHEMA + 1, "entries": {"k": {"whatever": "a newer attnsel stores"}}}


def test_a_file_of_another_schema_is_not_overwritten(tmp_path, caplog):
    """Another attnsel version's results file (another schema) is left as it is, not read as corrupt and replaced
    (two versions sharing the default cache directory would wipe each other's results every run); the warning says
    why and what to do."""
    cache = ResultCache(tmp_path)
    cache.path.write_text(json.dumps(NEWER))
    with caplog.at_level(logging.WARNING):
        cache.put_many({"mine": {"status": "valid", "reason": ""}})
        assert cache.drop(["k"]) == []
    assert json.loads(cache.path.read_text()) == NEWER
    assert f"schema {SCHEMA + 1}" in caplog.text and "another attnsel version" in caplog.text, caplog.text
    assert "not stored" in caplog.text and "--cache-dir" in caplog.text, caplog.text
    assert cache.clear() == 0 and not cache.path.exists()  # an explicit clear still removes it


def _write_for_ever(directory: str) -> None:
    cache = ResultCache(directory)
    for i in range(10**9):
        cache.put_many({f"{os.getpid()}-{i}": {"status": "valid", "reason": "x" * 50000}})


def cache_written(directory) -> bool:
    return (directory / "results.json").exists()


def test_temporary_files_of_killed_writers_are_removed(tmp_path):
    """Writers killed mid-write (SIGKILL: an OOM kill, a node drain) left their temporary files, each as large as
    the results file, for ever. The file stays valid, and the next write removes what dead writers left."""
    ctx = mp.get_context("spawn")
    for _ in range(3):
        before = set(tmp_path.glob(".results-*.tmp"))
        procs = [ctx.Process(target=_write_for_ever, args=(str(tmp_path),)) for _ in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not (cache_written(tmp_path) and set(tmp_path.glob(".results-*.tmp"))
                                                    - before):
            time.sleep(0.002)  # kill while a new temporary file exists: mid-write
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            p.join()
    left = list(tmp_path.glob(".results-*.tmp"))
    if not left:
        pytest.skip("no writer was killed mid-write")
    cache = ResultCache(tmp_path)
    assert cache.entries()  # the results file is whole
    cache.put_many({"after": {"status": "valid", "reason": ""}})
    assert not list(tmp_path.glob(".results-*.tmp"))
    assert "after" in json.loads(cache.path.read_text())["entries"]
