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
    """Was: another attnsel version's results file (another schema) was read as corrupt and replaced by this
    version's at its first write: two versions sharing the default cache directory wiped each other's results on
    every run. Now it is left as it is, and the warning says why and what to do."""
    cache = ResultCache(tmp_path)
    cache.path.write_text(json.dumps(NEWER))
    with caplog.at_level(logging.WARNING):
        cache.put_many({"mine": {"status": "valid", "reason": ""}})
        assert cache.drop(["k"]) == []
    assert json.loads(cache.path.read_text()) == NEWER
    assert f"schema {SCHEMA + 1}" in caplog.text and "another attnsel version" in caplog.text, caplog.text
    assert "not stored" in caplog.text and "--cache-dir" in caplog.text, caplog.text
    assert cache.clear() == 0 and not cache.path.exists()  # an explicit clear still removes it
