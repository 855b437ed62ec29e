"""The tuning cache's key (code and candidates), its path (XDG), enabled() and the logging of searches, in this
process (tests/test_autotune.py runs choose in subprocesses)."""

import json
import logging

import pytest

from m2ops.kernels import autotune

CANDS = [{"t": 1}, {"t": 2}]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache file of its own, a fixed environment key, no switch set; forgotten before and after."""
    for name in ("M2OPS_AUTOTUNE", "M2OPS_TUNE_BUDGET_S"):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("M2OPS_TUNING_CACHE", str(path))
    monkeypatch.setattr(autotune, "environment_key", lambda device_index=0: "test-gpu")
    autotune.forget()
    yield path
    autotune.forget()


def _timer(calls, times=None):
    times = times or {1: 2.0, 2: 1.0, 3: 0.5, 4: 0.25}

    def time_config(cfg):
        calls.append(cfg)
        return times[cfg["t"]]
    return time_config


def test_enabled_only_when_asked(cache, monkeypatch):
    assert autotune.enabled() is False
    with autotune.searching():
        assert autotune.enabled() is True
        with autotune.searching(budget_s=3):  # (nested: the inner budget, then the outer's again)
            assert autotune.budget_s() == 3.0
        assert autotune.budget_s() == 20.0
    assert autotune.enabled() is False
    monkeypatch.setenv("M2OPS_AUTOTUNE", "1")
    assert autotune.enabled() is True
    with pytest.raises(ValueError, match="budget_s"):
        with autotune.searching(budget_s=-1):
            pass


def test_searching_is_per_thread(cache):
    """A pretune in one thread lets no plain call of another thread search."""
    import threading
    seen = []
    with autotune.searching():
        t = threading.Thread(target=lambda: seen.append(autotune.enabled()))
        t.start()
        t.join()
    assert seen == [False]


def test_a_kernel_edit_invalidates_the_cache(cache, tmp_path, monkeypatch):
    """The key hashes the .py files of the kernels' folder (pointed at a copy here): a stored result is found
    until a kernel's text changes, then no longer (a plain call runs the default; nothing is timed)."""
    src = tmp_path / "kernels"
    src.mkdir()
    (src / "a_kernel.py").write_text("BLOCK = 64\n")
    (src / "notes.txt").write_text("not a kernel\n")
    monkeypatch.setattr(autotune, "KERNELS_DIR", str(src))
    autotune.forget()
    calls = []
    with autotune.searching():
        assert autotune.choose("op", "s", {"t": 1}, CANDS, _timer(calls)) == {"t": 2}
    assert len(calls) == 2
    key = autotune.full_key("op", "s", 0, CANDS)
    assert autotune.lookup(key) == {"t": 2}
    (src / "notes.txt").write_text("edited, but not a .py file\n")
    autotune.forget()
    assert autotune.full_key("op", "s", 0, CANDS) == key
    (src / "a_kernel.py").write_text("BLOCK = 128\n")
    autotune.forget()  # (the hash is computed once per process: a new process, or forget(), sees the edit)
    new_key = autotune.full_key("op", "s", 0, CANDS)
    assert new_key != key and autotune.lookup(new_key) is None
    calls.clear()
    assert autotune.choose("op", "s", {"t": 1}, CANDS, _timer(calls)) == {"t": 1} and calls == []
    assert key in json.loads(cache.read_text())  # (the old entry stays in the file, unused)


def test_the_sources_are_hashed_once_per_process(cache, monkeypatch):
    counted = []
    real = autotune.sources_hash
    monkeypatch.setattr(autotune, "sources_hash", lambda folder: counted.append(folder) or real(folder))
    autotune.forget()
    for _ in range(3):
        autotune.full_key("op", "s", 0, CANDS)
        autotune.choose("op", "s", {"t": 1}, CANDS, _timer([]))
    assert counted == [autotune.KERNELS_DIR]


def test_the_key_holds_the_version_and_candidates(cache, monkeypatch):
    import m2ops
    key = autotune.full_key("op", "s", 0, CANDS)
    assert key.startswith(f"test-gpu|m2ops {m2ops.__version__}|kernels ")
    assert autotune.full_key("op", "s", 0, list(reversed(CANDS))) == key  # (order does not matter)
    assert autotune.full_key("op", "s", 0, [*CANDS, {"t": 3}]) != key
    assert autotune.full_key("op", "s", 0) == key.rsplit("|candidates ", 1)[0]
    with pytest.raises(TypeError, match="candidates"):
        autotune.full_key("op", "s", 0, [{"t": object()}])


def test_a_stale_candidate_is_ignored(cache):
    """A stored configuration that is not among the caller's candidates (nor its default) is ignored: a plain
    call runs the default, a search replaces it."""
    key = autotune.full_key("op", "s", 0, CANDS)
    cache.write_text(json.dumps({key: {"config": {"t": 9}, "ms": 0.1}}))
    autotune.forget()
    assert autotune.lookup(key) == {"t": 9}  # (no candidates given: as stored)
    assert autotune.lookup(key, CANDS) is None
    calls = []
    assert autotune.choose("op", "s", {"t": 1}, CANDS, _timer(calls)) == {"t": 1} and calls == []
    with autotune.searching():
        assert autotune.choose("op", "s", {"t": 1}, CANDS, _timer(calls)) == {"t": 2}
    assert json.loads(cache.read_text())[key]["config"] == {"t": 2}
    # a candidate list that changed: its own key, searched afresh (the old list's entry stays for the old list)
    more = [*CANDS, {"t": 3}]
    calls.clear()
    with autotune.searching():
        assert autotune.choose("op", "s", {"t": 1}, more, _timer(calls)) == {"t": 3} and len(calls) == 3
    assert autotune.choose("op", "s", {"t": 1}, CANDS, _timer(calls)) == {"t": 2}


def test_stored_finds_the_newest_entry_for_a_shape_whatever_the_candidates(cache):
    base = autotune.full_key("op", "s")
    cache.write_text(json.dumps({
        autotune.full_key("op", "s", 0, CANDS): {"config": {"t": 2}, "when": "2026-01-01 00:00:00"},
        autotune.full_key("op", "s", 0, [{"t": 3}]): {"config": {"t": 3}, "when": "2026-02-01 00:00:00"},
        autotune.full_key("op", "s2", 0, [{"t": 4}]): {"config": {"t": 4}, "when": "2026-03-01 00:00:00"}}))
    autotune.forget()
    got = autotune.stored("op", "s")
    assert got["config"] == {"t": 3} and got["key"].startswith(base + "|candidates ")
    assert autotune.stored("op", "s3") is None


@pytest.mark.parametrize("xdg", ["absolute", "relative", "unset", "empty"])
def test_the_cache_path_honours_xdg_cache_home(tmp_path, monkeypatch, xdg):
    """M2OPS_TUNING_CACHE, else $XDG_CACHE_HOME/m2ops/tuning.json (an absolute path, as the XDG specification
    asks), else ~/.cache/m2ops/tuning.json."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("M2OPS_TUNING_CACHE", raising=False)
    value = {"absolute": str(tmp_path / "xdg"), "relative": "xdg", "empty": ""}.get(xdg)
    if value is None:
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    else:
        monkeypatch.setenv("XDG_CACHE_HOME", value)
    want = (tmp_path / "xdg" if xdg == "absolute" else home / ".cache") / "m2ops" / "tuning.json"
    assert autotune.cache_path() == str(want)
    monkeypatch.setenv("M2OPS_TUNING_CACHE", "")  # (empty: as unset)
    assert autotune.cache_path() == str(want)
    monkeypatch.setenv("M2OPS_TUNING_CACHE", str(tmp_path / "mine.json"))
    assert autotune.cache_path() == str(tmp_path / "mine.json")


def test_a_search_stores_under_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.delenv("M2OPS_TUNING_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(autotune, "environment_key", lambda device_index=0: "test-gpu")
    autotune.forget()
    try:
        with autotune.searching():
            autotune.choose("op", "s", {"t": 1}, CANDS, _timer([]))
        assert len(json.loads((tmp_path / "xdg" / "m2ops" / "tuning.json").read_text())) == 1
    finally:
        autotune.forget()


def test_search_progress_goes_to_the_m2ops_tuning_logger(cache, caplog):
    calls = []
    with caplog.at_level(logging.INFO, logger="m2ops.tuning"), autotune.searching(budget_s=60):
        autotune.choose("op", "s", {"t": 1}, [*CANDS, {"t": 3}],
                        lambda cfg: 1 / 0 if cfg["t"] == 3 else _timer(calls)(cfg))
    lines = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert ("m2ops.tuning", "INFO", "op [s]: searching 3 configurations (budget 60 s)") in lines
    assert ("m2ops.tuning", "INFO", "op [s]: 2/3 {'t': 2}: 1.0000 ms") in lines
    assert ("m2ops.tuning", "INFO", "op [s]: 3/3 {'t': 3} failed: ZeroDivisionError: division by zero") in lines
    assert any(m.startswith("op [s]: chose {'t': 2} at 1.0000 ms (default 2.0000 ms; 3 configurations timed")
               for _, _, m in lines)


def test_a_plain_call_without_an_entry_says_so_once(cache, caplog):
    with caplog.at_level(logging.INFO, logger="m2ops.tuning"):
        for _ in range(3):
            autotune.choose("op", "s", {"t": 1}, CANDS, _timer([]))
    (msg,) = [r.getMessage() for r in caplog.records]
    assert "no stored configuration, using the default {'t': 1}" in msg and "M2OPS_AUTOTUNE=1" in msg


def test_the_library_adds_no_log_handler():
    import m2ops  # noqa: F401
    import m2ops.tuning  # noqa: F401
    assert not logging.getLogger("m2ops").handlers and not logging.getLogger("m2ops.tuning").handlers


def test_the_command_line_shows_progress(cache, monkeypatch, capsys):
    """python -m m2ops.tuning shows the search's progress at INFO on stderr (its own handler, removed after the
    run) and the results on stdout. pretune's GPU call is stood in for by a search of choose's."""
    import torch
    from m2ops import tuning

    def fake_pretune(shapes, dtype, budget_s):
        assert budget_s == 7.0 and autotune.enabled() is False
        with autotune.searching(budget_s=budget_s):
            best = autotune.choose("chunk_scan", "k", {"t": 1}, CANDS, _timer([]))
        return [dict(shape=s, key="k", config=best, ms=1.0) for s in shapes]

    monkeypatch.setattr(tuning, "pretune", fake_pretune)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    tuning.main(["--seqlens", "1K", "--dstates", "64", "--budget-s", "7"])
    out, err = capsys.readouterr()
    assert "m2ops: chunk_scan [k]: searching 2 configurations (budget 7 s)" in err
    assert "m2ops: chunk_scan [k]: chose {'t': 2}" in err
    assert out.splitlines() == ["k: {'t': 2} (1.0000 ms)", f"stored in {cache}"]
    assert not logging.getLogger("m2ops").handlers
    autotune.forget()
    tuning.main(["--seqlens", "1K", "--dstates", "64", "--budget-s", "7", "--quiet"])
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("k: {'t': 2}")


def test_the_command_line_needs_a_gpu(monkeypatch):
    import torch
    from m2ops import tuning
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        tuning.main(["--seqlens", "1K"])


def test_pretune_names_a_bad_budget():
    import m2ops
    with pytest.raises(ValueError, match="pretune: budget_s"):
        m2ops.pretune([dict(seqlen=1024)], budget_s=-1)


def test_autotune_writes_nothing_to_stderr_itself():
    source = open(autotune.__file__).read()
    assert "sys.stderr" not in source and "print(" not in source
