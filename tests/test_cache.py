"""Persistent cache: warm runs spawn nothing, version changes invalidate, corrupt files recover, concurrent writers.

The cache is the selecting process's business: the worker runs in a thread here (the inproc_worker fixture) except
in test_warm_run_spawns_no_worker, which spawns the real one."""
import json
import logging
import multiprocessing as mp

import pytest

import attnsel.selector as select_mod
from attnsel import select
from attnsel.cache import SCHEMA, ResultCache
from attnsel.spec import AttentionSpec
from attnsel.validate import runner

SPEC = AttentionSpec(4, 2, 64, "fp16")
# Two valid candidates that validate in a blink (torch and a copy of it under another name): the cache's behaviour
# does not depend on which backends are validated, and Triton's interpreter would take most of these tests' time.
PAIR = dict(prefill_priority=["torch_copy", "torch"], decode_priority=["torch_copy", "torch"],
            extend_priority=["torch_copy", "torch"])


@pytest.fixture
def pair(monkeypatch, inproc_worker):
    """PAIR's plugin loaded, the worker in a thread of this process."""
    monkeypatch.setenv("ATTNSEL_BACKENDS", "tests.fixtures.fault_numerics:TORCH_COPY")


@pytest.fixture
def no_spawn(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker was spawned on a warm cache")

    monkeypatch.setattr(runner, "_Worker", refuse)


def test_warm_run_spawns_no_worker(monkeypatch):
    cold = select(SPEC, policy="priority")
    assert cold.cache == "miss" and cold.stats["spawns"] == 1
    before = runner.spawn_count
    monkeypatch.setattr(runner, "_Worker", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    warm = select(SPEC, policy="priority")
    assert runner.spawn_count == before
    assert warm.cache == "hit" and warm.stats["spawns"] == 0
    assert (warm.prefill, warm.decode) == (cold.prefill, cold.decode)
    assert all(c.from_cache for p in ("prefill", "decode") for c in warm.candidates[p] if c.status != "unavailable")


@pytest.mark.usefixtures("pair")
def test_measure_timings_are_cached(monkeypatch):
    cold = select(SPEC, policy="measure", **PAIR)  # both valid: both are timed
    timed = [c for c in cold.candidates["decode"] if c.status in ("valid", "selected")]
    assert len(timed) == 2 and all(c.score_us for c in timed)
    monkeypatch.setattr(runner, "_Worker", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    warm = select(SPEC, policy="measure", **PAIR)
    assert warm.cache == "hit"
    assert [c.score_us for c in warm.candidates["decode"]] == [c.score_us for c in cold.candidates["decode"]]


@pytest.mark.usefixtures("pair")
def test_other_spec_or_explicit_choice(monkeypatch):
    select(SPEC, policy="priority", **PAIR)
    # an explicit choice of an already validated backend needs no new validation
    before = runner.spawn_count
    sel = select(SPEC, prefill="torch", decode="torch_copy", policy="priority", extend_priority=PAIR["extend_priority"])
    assert runner.spawn_count == before and sel.decode == "torch_copy" and sel.decode_source == "explicit"
    # another spec is another key
    other = select(AttentionSpec(4, 4, 64, "fp16"), policy="priority", **PAIR)
    assert other.cache == "miss"


@pytest.mark.usefixtures("pair")
def test_version_change_invalidates(monkeypatch):
    select(SPEC, policy="priority", **PAIR)
    fp = dict(select_mod.fingerprint("cpu"))
    monkeypatch.setattr(select_mod, "fingerprint", lambda device: {**fp, "packages": {**fp["packages"],
                                                                                      "triton": "99.0"}})
    sel = select(SPEC, policy="priority", **PAIR)
    assert sel.cache == "miss" and sel.stats["spawns"] == 1


@pytest.mark.usefixtures("pair")
@pytest.mark.parametrize("content", ["{not json", '{"schema": 1, "entr', '{"schema": 999}', "[]", ""])
def test_corrupt_file_is_logged_ignored_and_rewritten(content, caplog):
    cache = ResultCache()
    cache.dir.mkdir(parents=True, exist_ok=True)
    cache.path.write_text(content)
    with caplog.at_level(logging.WARNING):
        sel = select(SPEC, policy="priority", **PAIR)
    assert sel.cache == "miss"
    if content:  # once: the run reads the file, then re-reads it under the lock to write (was logged twice)
        assert caplog.text.count(f"cache {cache.path}") == 1, caplog.text
    data = json.loads(cache.path.read_text())
    assert data["schema"] == SCHEMA and len(data["entries"]) == 5  # two backends, two phases; extend: torch (torch_copy has no plan_extend)


@pytest.mark.usefixtures("pair")
def test_a_file_of_bytes_that_are_no_text_is_ignored_and_rewritten(caplog):
    """A results file with bytes that are not UTF-8: was a UnicodeDecodeError from every select() and from
    `attnsel cache clear` (the fault stayed until the file was removed by hand)."""
    cache = ResultCache()
    cache.dir.mkdir(parents=True, exist_ok=True)
    cache.path.write_bytes(b'{"schema": 1, "entries": {"\xff\xfe": 1}}')
    with caplog.at_level(logging.WARNING):
        assert select(SPEC, policy="priority", **PAIR).cache == "miss"
    assert "not UTF-8" in caplog.text
    assert len(json.loads(cache.path.read_text())["entries"]) == 5
    cache.path.write_bytes(b"\xff")
    assert ResultCache().clear() == 0 and not cache.path.exists()


@pytest.mark.usefixtures("pair")
@pytest.mark.parametrize("bad", [{}, "valid", None, {"status": "weird"}, {"status": "valid", "reason": 3},
                                 {"status": "valid", "max_abs_err": "x"}, {"status": "valid", "timings": [1]},
                                 {"status": "rejected", "backend": 5},
                                 {"kind": "dispatch", "measured": {"buckets": 1}},
                                 {"kind": "dispatch", "measured": {"phase": "decode", "mode": "eager", "axes": [],
                                                                   "grid_version": 3, "buckets": [{"us": "x"}]}}],
                         ids=["no-status", "string", "null", "unknown-status", "reason-not-text", "error-not-number",
                              "timings-not-object", "backend-not-text", "dispatch-no-fields",
                              "dispatch-bad-bucket"])
def test_a_malformed_entry_is_ignored_and_replaced(bad, caplog):
    """A schema-valid file with one malformed entry (a hand edit): was a KeyError/TypeError traceback from every
    select(), and the entry was never rewritten (its key counted as cached). Now: logged, validated again, replaced."""
    cache = ResultCache()
    select(SPEC, policy="priority", **PAIR)
    data = json.loads(cache.path.read_text())
    key = next(iter(data["entries"]))
    data["entries"][key] = bad
    cache.path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        sel = select(SPEC, policy="priority", **PAIR)
    assert sel.cache == "miss" and caplog.text.count("malformed entry ignored") == 1, caplog.text
    assert ResultCache().entries()[key]["status"] in ("valid", "rejected")
    assert select(SPEC, policy="priority", **PAIR).cache == "hit"


def test_entry_problem_reads_dispatch_entries_as_selection_does():
    """A dispatch entry as timing.measure writes it passes; each field selection.build_table or the report reads,
    malformed, is named (each of these crashed select() or `attnsel report` from a cached file)."""
    from attnsel.cache import entry_problem

    good = {"kind": "dispatch", "status": "2 buckets", "backend": "(dispatch table)", "phase": "decode",
            "measured": {"phase": "decode", "mode": "eager", "axes": ["batch", "context"], "grid_version": 3,
                         "skipped": [], "pruned": {"torch": 2.5}, "wall_s": 1.0,
                         "buckets": [{"key": [1, 256], "label": "1x256", "us": {"triton": 10.0, "torch": None},
                                      "spread": {"triton": 0.01}, "errors": {}}]}}
    assert entry_problem(good) is None
    edits = {"status": lambda e: e.update(status=5), "phase": lambda e: e["measured"].update(phase=7),
             "pruned": lambda e: e["measured"].update(pruned=[1]), "skipped": lambda e: e["measured"].update(skipped=5),
             "key-empty": lambda e: e["measured"]["buckets"][0].update(key=[]),
             "key-text": lambda e: e["measured"]["buckets"][0].update(key=["a", "b"]),
             "errors": lambda e: e["measured"]["buckets"][0].update(errors=[1]),
             "spread": lambda e: e["measured"]["buckets"][0].update(spread=[1]),
             # a list where the store reads a name -> reason dict: store.bucket_errors crashed on it
             "left-out": lambda e: e["measured"]["buckets"][0].update(left_out=["torch"]),
             "left-out-reason": lambda e: e["measured"]["buckets"][0].update(left_out={"torch": 3}),
             # labels build_table reads with str.startswith and the report joins: AttributeError / TypeError later
             "skipped-item": lambda e: e["measured"].update(skipped=[3]),
             "axes-item": lambda e: e["measured"].update(axes=[1, 2]),
             "us-bool": lambda e: e["measured"]["buckets"][0]["us"].update(torch=True),
             # each of these would pass the check, then crash every run (a null pruned ratio: the report's
             # format; keys below 1: math.log/sqrt at lookup) or put Infinity into `attnsel report --json`
             "pruned-null": lambda e: e["measured"].update(pruned={"torch": None}),
             "pruned-nan": lambda e: e["measured"].update(pruned={"torch": float("nan")}),
             "key-zero": lambda e: e["measured"]["buckets"][0].update(key=[0, 256]),
             "key-negative": lambda e: e["measured"]["buckets"][0].update(key=[-4, 256]),
             "us-inf": lambda e: e["measured"]["buckets"][0]["us"].update(triton=float("inf")),
             "us-nan": lambda e: e["measured"]["buckets"][0]["us"].update(triton=float("nan")),
             "us-negative": lambda e: e["measured"]["buckets"][0]["us"].update(triton=-1.0),
             "spread-nan": lambda e: e["measured"]["buckets"][0]["spread"].update(triton=float("nan")),
             "wall-inf": lambda e: e["measured"].update(wall_s=float("inf"))}
    for name, edit in edits.items():
        bad = json.loads(json.dumps(good))
        edit(bad)
        assert entry_problem(bad), name
    for field, value in (("max_abs_err", float("nan")), ("tolerance", float("inf")), ("time_s", -1.0)):
        entry = {"status": "valid", "reason": "", "max_abs_err": 0.001, "tolerance": 0.01, "time_s": 1.0}
        assert entry_problem(entry) is None
        entry[field] = value
        assert entry_problem(entry), field


@pytest.mark.usefixtures("pair")
def test_a_directory_in_place_of_the_results_file_is_a_clear_error(tmp_path):
    """results.json a directory: select() failed with IsADirectoryError after validating, and cache clear with a
    traceback. Now ValueError naming it, before anything runs."""
    cache = ResultCache(tmp_path)
    cache.path.mkdir()
    with pytest.raises(ValueError, match="results file .*results.json' is not a file"):
        select(SPEC, policy="priority", **PAIR, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="is not a file"):
        cache.clear()
    from attnsel.cli import main

    assert main(["cache", "show", "--cache-dir", str(tmp_path)]) == 2  # was "0 entries", exit 0


def _writer(directory: str, worker: int, rounds: int) -> None:
    cache = ResultCache(directory)
    for r in range(rounds):
        cache.put_many({f"w{worker}-r{r}": {"status": "valid", "backend": f"b{worker}", "phase": "prefill"}})


@pytest.mark.parametrize("writers", [3, pytest.param(8, marks=pytest.mark.slow)])
def test_concurrent_writers_leave_a_valid_file(tmp_path, writers):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, 15)) for w in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["schema"] == SCHEMA
    assert set(data["entries"]) == {f"w{w}-r{r}" for w in range(writers) for r in range(15)}


@pytest.mark.usefixtures("pair")
def test_no_cache_neither_reads_nor_writes():
    sel = select(SPEC, policy="priority", **PAIR, use_cache=False)
    assert sel.cache == "off"
    assert not ResultCache().path.exists()


@pytest.mark.usefixtures("pair")
def test_clear():
    select(SPEC, policy="priority", **PAIR)
    assert ResultCache().clear() == 5
    assert select(SPEC, policy="priority", **PAIR).cache == "miss"


# ---- the key changes when what a verdict depends on changes -------------------------------------------------------

def test_package_hash_follows_attnsel_sources(tmp_path):
    """A changed Triton kernel (any attnsel source) changes the fingerprint, so its old verdict is not served."""
    import shutil

    from attnsel.device import PACKAGE_ROOT, fingerprint, package_hash

    copy = tmp_path / "attnsel"
    shutil.copytree(PACKAGE_ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert package_hash(copy) == package_hash() == fingerprint("cpu")["attnsel_source"]
    kernels = copy / "backends" / "triton" / "kernels.py"
    kernels.write_text(kernels.read_text().replace("tl.dot", "tl.dot ", 1))
    assert package_hash(copy) != package_hash()


@pytest.mark.usefixtures("inproc_worker")
def test_triton_interpret_is_part_of_the_key(monkeypatch):
    prio = dict(policy="priority", prefill_priority=["torch"], decode_priority=["torch"])
    assert select(SPEC, **prio).cache == "miss"
    assert select(SPEC, **prio).cache == "hit"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert select(SPEC, **prio).cache == "miss"


PLUGIN = """
from tests.fixtures.fault_backends import Wrapped


class Plugin(Wrapped):
    pass


BACKEND = Plugin("srcplug")
"""


@pytest.mark.usefixtures("inproc_worker")
def test_plugin_source_change_invalidates_its_verdict(tmp_path, monkeypatch):
    """A plugin whose module file changed (same version string) is validated again; the others come from cache."""
    (tmp_path / "attnsel_src_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{__import__('os').environ['PYTHONPATH']}")
    monkeypatch.setenv("ATTNSEL_BACKENDS", "attnsel_src_plugin:BACKEND")
    prio = dict(policy="priority", prefill_priority=["srcplug", "torch"], decode_priority=["torch"])
    assert select(SPEC, **prio).cache == "miss"
    assert select(SPEC, **prio).cache == "hit"
    with open(tmp_path / "attnsel_src_plugin.py", "a") as fh:
        fh.write("# a changed kernel\n")
    sel = select(SPEC, **prio)
    assert sel.cache == "miss"
    cands = {c.name: c for c in sel.candidates["prefill"]}
    assert not cands["srcplug"].from_cache and cands["torch"].from_cache


def test_fingerprint_is_of_the_device_used():
    from attnsel.device import fingerprint, resolve

    assert resolve("cpu") == "cpu"
    fp = fingerprint("cpu")
    assert fp["gpu"] is None and fp["triton_interpret"] == __import__("os").environ.get("TRITON_INTERPRET", "")
