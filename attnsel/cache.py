"""Persistent cache of validation results: one JSON file, file lock, atomic replace, schema version.

One entry per (device fingerprint, spec, backend, backend identity, phase); the fingerprint holds the device actually
used, package versions, a hash of attnsel's sources and TRITON_INTERPRET (device.fingerprint), the identity the
backend's version and a hash of its module's source (backends.availability). Selections are derived from the entries,
so changing a priority list or an explicit choice needs no new validation. Timings are stored per mode
("eager", "graph") inside the entry.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
from pathlib import Path

import filelock
import platformdirs

from . import settings
from .errors import InvalidArgument

log = logging.getLogger(__name__)

SCHEMA = 1
FILENAME = "results.json"


def default_dir() -> Path:
    """$ATTNSEL_CACHE_DIR, else the user cache directory."""
    return Path(settings.read("cache_dir") or platformdirs.user_cache_dir("attnsel"))


def entry_key(fingerprint: dict, spec: dict, backend: str, identity: dict | str | None, phase: str) -> str:
    blob = json.dumps({"device": fingerprint, "spec": spec, "backend": backend, "version": identity, "phase": phase},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class ResultCache:
    """The results file in ``directory``; every write holds the lock and replaces the file atomically."""

    def __init__(self, directory: str | Path | None = None):
        self.dir = Path(directory) if directory is not None else default_dir()
        self.path = self.dir / FILENAME
        self.lock = filelock.FileLock(str(self.path) + ".lock", timeout=120)
        self._warned: tuple | None = None  # the file state (size, mtime) last warned about: put_many re-reads it
        self._foreign = None  # the schema of another attnsel version's results file, as last read (else None)

    def prepare(self) -> None:
        """Make the cache directory if it is missing; ValueError naming it when it cannot be one (a file is in the
        way, a path it may not create): checked before a selection spends minutes validating, whose results it
        could not keep. An existing directory passes even when read-only (a complete cache shipped read-only is
        usable; new entries that cannot be stored there are a warning, store.Store)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            given = settings.read("cache_dir") and self.dir == default_dir()
            where = f"${settings.ENV['cache_dir']}" if given else "the cache directory"
            raise InvalidArgument(f"{where} {str(self.dir)!r} cannot be used as a directory ({exc.strerror or exc}); "
                                  "give a directory attnsel may write to, or turn the cache off (--no-cache, "
                                  "use_cache=False)") from None
        self.check_file()

    def check_file(self) -> None:
        """InvalidArgument naming the results file when something other than a file is in its place (a directory): it
        could be neither read nor replaced."""
        if self.path.exists() and not self.path.is_file():
            raise InvalidArgument(f"the cache's results file {str(self.path)!r} is not a file; remove it, or give "
                                  "another cache directory (--cache-dir, $ATTNSEL_CACHE_DIR) or --no-cache")

    def _read(self) -> dict:
        self._foreign = None
        try:
            raw = self.path.read_bytes()
            state = (len(raw), self.path.stat().st_mtime_ns)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("cache %s unreadable (%s); ignoring it", self.path, exc)
            return {}
        entries, problem, self._foreign = _parse(raw)
        if problem and state != self._warned:  # once per file state: a run reads it, then re-reads it to write
            self._warned = state
            log.warning("cache %s: %s", self.path, problem)
        return entries

    def get_many(self, keys: list[str]) -> dict[str, dict]:
        entries = self._read()
        return {k: entries[k] for k in keys if k in entries}

    def put_many(self, new: dict[str, dict]) -> None:
        """Merge entries into the file (re-read under the lock so that concurrent writers lose nothing)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.check_file()
        with self.lock:
            entries = self._read()
            if self._kept():
                return
            for key, entry in new.items():
                merged = dict(entries.get(key, {}))
                timings = {**merged.get("timings", {}), **entry.get("timings", {})}
                merged.update(entry)
                if timings:
                    merged["timings"] = timings
                entries[key] = merged
            self._write(entries)

    def drop(self, keys: list[str]) -> list[str]:
        """Remove entries (a verdict the serving canary found wrong) so that the next selection validates them
        again; returns the keys that were there."""
        if not self.path.is_file():
            return []
        with self.lock:
            entries = self._read()
            removed = [k for k in keys if k in entries]
            if removed and not self._kept():
                self._write({k: e for k, e in entries.items() if k not in removed})
        return removed

    def _kept(self) -> bool:
        """True (with a warning) when the file just read is another attnsel version's (another schema): it is not
        replaced, which would wipe that version's results on every run of this one."""
        if self._foreign is None:
            return False
        log.warning("cache %s was written by another attnsel version (schema %r; this one reads and writes %d): "
                    "left as it is, so this run's results are not stored; give each version its own --cache-dir "
                    "($%s), or `attnsel cache clear` to let this one replace it", self.path, self._foreign, SCHEMA,
                    settings.ENV["cache_dir"])
        return True

    def _write(self, entries: dict) -> None:
        """Replace the file atomically (the caller holds the lock), first removing the temporary files of writers
        that died mid-write (SIGKILL): only a writer holding the lock makes one, so any there now is a dead one's."""
        for stale in self.dir.glob(".results-*.tmp"):
            stale.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".results-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"schema": SCHEMA, "entries": entries}, fh, indent=1, sort_keys=True)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise

    def entries(self) -> dict[str, dict]:
        return self._read()

    def clear(self) -> int:
        """Remove the results file; returns how many entries it held (0 when there is no cache directory). ValueError
        when the directory cannot be one (see prepare)."""
        if not self.dir.is_dir():
            if self.dir.exists() or any(parent.exists() and not parent.is_dir() for parent in self.dir.parents):
                self.prepare()  # raises, naming the path
            return 0
        self.check_file()
        with self.lock:
            count = len(self._read())
            self.path.unlink(missing_ok=True)
        return count


def _parse(raw: bytes) -> tuple[dict, str | None, object]:
    """The results file's valid entries, when anything was dropped what and why (for the warning), and the schema
    of another attnsel version's file (else None; put_many leaves such a file: ResultCache._kept)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:  # bytes that are no text: as corrupt as broken JSON
        return {}, f"corrupt (not UTF-8: {exc}); ignoring it, it will be rewritten", None
    except json.JSONDecodeError as exc:
        return {}, f"corrupt ({exc}); ignoring it, it will be rewritten", None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("entries"), dict):
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        foreign = _foreign_schema(data)
        if foreign is not None:
            return {}, (f"schema {found!r}, expected {SCHEMA}: another attnsel version's file; its entries are not "
                        "read"), foreign
        return {}, f"schema {found!r}, expected {SCHEMA}; ignoring it, it will be rewritten", None
    entries, bad = {}, []
    for key, entry in data["entries"].items():
        problem = entry_problem(entry)
        if problem:
            bad.append(f"{key[:12]}: {problem}")
        else:
            entries[key] = entry
    if not bad:
        return entries, None, None
    # each is validated or timed again and its new entry replaces it
    return entries, (f"{len(bad)} malformed entr{'y' if len(bad) == 1 else 'ies'} ignored ({'; '.join(bad[:3])}); "
                     "they will be rewritten"), None


def _foreign_schema(data):
    """The schema of a results file (parsed JSON) that another attnsel version wrote (an object with entries and a
    schema other than SCHEMA), else None (a stray file: rewritten)."""
    if isinstance(data, dict) and isinstance(data.get("entries"), dict) and data.get("schema", SCHEMA) != SCHEMA:
        return data["schema"]
    return None


def entry_problem(entry) -> str | None:
    """What is wrong with one cache entry (a hand edit, another program's file), or None: a validation result needs a
    status ("valid" or "rejected"), a text reason, numbers (or null) for its error, tolerance and time, an object of
    timings per mode; a dispatch entry needs its measured buckets in the form timing.measure gives them. What
    selection.py and ``attnsel cache show`` read of an entry is checked here, so that a malformed one is validated
    again instead of failing every run."""
    if not isinstance(entry, dict):
        return f"a {type(entry).__name__}, not an object"
    for field in ("backend", "phase", "device"):
        if not isinstance(entry.get(field, ""), str):
            return f"{field} {entry[field]!r} is not text"
    if entry.get("kind") == "dispatch":
        return _dispatch_problem(entry)
    if entry.get("status") not in ("valid", "rejected"):
        return f"status {entry.get('status')!r}, expected 'valid' or 'rejected'"
    if not isinstance(entry.get("reason", ""), str):
        return "a reason that is not text"
    for field in ("max_abs_err", "tolerance", "time_s"):
        if not _number_or_none(entry.get(field)):
            return f"{field} {entry[field]!r} is not a number"
    timings = entry.get("timings", {})
    if not isinstance(timings, dict) or not all(isinstance(m, str) and isinstance(t, dict)
                                                for m, t in timings.items()):
        return "timings that are not an object of mode -> timing"
    return None


def _dispatch_problem(entry: dict) -> str | None:
    measured = entry.get("measured")
    if not isinstance(entry.get("status"), str):
        return f"a dispatch entry with status {entry.get('status')!r}"
    if not isinstance(measured, dict) or not all(k in measured for k in ("phase", "mode", "axes", "buckets",
                                                                         "grid_version")):
        return "a dispatch entry without phase, mode, axes, buckets and grid_version"
    if not isinstance(measured["phase"], str) or not isinstance(measured["mode"], str):
        return "a dispatch entry whose phase or mode is not text"
    if (not isinstance(measured["buckets"], list) or not isinstance(measured["axes"], list)
            or not all(isinstance(a, str) for a in measured["axes"])):
        return "a dispatch entry whose buckets are not a list or axes not a list of names"
    pruned = measured.get("pruned", {})
    if (not isinstance(pruned, dict)  # a ratio: a least time over the fastest's (timing.prune), >= 1
            or not all(_number_or_none(r) and r is not None and r >= 1 for r in pruned.values())
            or not isinstance(measured.get("skipped", []), list)
            or not all(isinstance(x, str) for x in measured.get("skipped", []))):
        return ("a dispatch entry whose pruned or skipped candidates are malformed (pruned: candidate -> ratio, "
                ">= 1; skipped: bucket labels)")
    near = measured.get("pruned_near", {})  # the selector's reasons read {candidate: finer buckets it skipped}
    if not isinstance(near, dict) or not all(isinstance(n, str) and type(c) is int and c >= 0
                                             for n, c in near.items()):
        return "a dispatch entry whose pruned_near is not an object of candidate -> finer buckets skipped (an int)"
    if not _number_or_none(measured.get("wall_s")) or not _number_or_none(entry.get("budget_s")):
        return f"a dispatch entry with wall_s {measured.get('wall_s')!r} or budget_s {entry.get('budget_s')!r}"
    axes = len(measured["axes"])
    for b in measured["buckets"]:
        if not (isinstance(b, dict) and isinstance(b.get("us"), dict) and isinstance(b.get("label"), str)
                and isinstance(b.get("key"), list) and len(b["key"]) == axes
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in b["key"])
                and all(_number_or_none(t) for t in b["us"].values())
                and isinstance(b.get("spread", {}), dict)
                and all(isinstance(b.get(f, {}), dict) and all(isinstance(n, str) and isinstance(r, str)
                                                               for n, r in b.get(f, {}).items())
                        for f in ("errors", "left_out"))
                and all(_number_or_none(s) for s in b.get("spread", {}).values())
                and all(_number_or_none(b.get(f)) for f in ("host", "host_us"))
                and isinstance(b.get("ragged", False), bool)
                and isinstance(b.get("pruned_near", []), list)
                and all(isinstance(n, str) for n in b.get("pruned_near", []))):
            return ("a dispatch bucket without us (times: finite, >= 0, or null), key (one int >= 1 per axis) and "
                    "label, or with a ragged flag that is not true/false, a host probe that is not a number, "
                    "pruned_near candidates that are not a list of names, or errors / left_out that are not "
                    "objects of candidate -> reason")
    return None


def _number_or_none(value) -> bool:
    """null, or a finite number >= 0 (times, errors, ratios: NaN, Infinity and negatives are hand edits)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and math.isfinite(value) and value >= 0)
