"""m2ops.jsonstore: entries that several processes store into one file at the same time are all kept."""

import json
import logging
import os
import subprocess
import sys
import time

import pytest

from m2ops import jsonstore
from m2ops.kernels import autotune

_WRITER = """
import sys
from m2ops import jsonstore
from m2ops.kernels import autotune
path, who, n, via = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
for i in range(n):
    if via == "autotune":
        autotune._store(f"{who}-{i}", {"config": {"i": i}})
    else:
        jsonstore.update(path, f"{who}-{i}", i, lambda p: autotune._read(p))
"""


@pytest.mark.parametrize("via", ["jsonstore", "autotune"])
def test_concurrent_writers_keep_every_entry(tmp_path, via):
    """Four processes store 60 keys each into one file at once; every key is there afterwards. (Without the lock
    a read-merge-write loses entries: with the lock switched off this test lost dozens.)"""
    path = tmp_path / "sub" / "table.json"
    env = {**os.environ, "M2OPS_TUNING_CACHE": str(path)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), f"w{k}", "60", via], env=env)
             for k in range(4)]
    assert all(p.wait(timeout=240) == 0 for p in procs)
    table = json.loads(path.read_text())
    assert sorted(table) == sorted(f"w{k}-{i}" for k in range(4) for i in range(60))
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_update_creates_the_folder_and_keeps_other_keys(tmp_path):
    path = tmp_path / "a" / "b.json"
    assert jsonstore.update(str(path), "x", 1, autotune._read) == {"x": 1}
    jsonstore.update(str(path), "y", [2], autotune._read)
    assert json.loads(path.read_text()) == {"x": 1, "y": [2]}


def test_a_failed_write_leaves_the_file_and_no_temporary(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('{"x": 1}')
    with pytest.raises(TypeError):
        jsonstore.update(str(path), "bad", object(), autotune._read)  # not JSON-serialisable
    assert json.loads(path.read_text()) == {"x": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.json.lock"]


def test_a_damaged_tuning_cache_is_rebuilt(tmp_path):
    """A cache file that is not a JSON object reads as empty, and the next store replaces it."""
    path = tmp_path / "tuning.json"
    path.write_text("[1, 2]")
    assert autotune._read(str(path)) == {}
    jsonstore.update(str(path), "k", {"config": {}}, autotune._read)
    assert json.loads(path.read_text()) == {"k": {"config": {}}}


def test_a_held_lock_times_out_with_an_error_naming_it(tmp_path):
    """A writer waits at most its timeout for the lock, then raises LockTimeout naming the lock file; the file
    is untouched."""
    path = tmp_path / "t.json"
    path.write_text('{"x": 1}')
    with jsonstore.locked(str(path)):  # (another holder: a second lock on the file conflicts in-process too)
        t0 = time.perf_counter()
        with pytest.raises(jsonstore.LockTimeout, match=f"{path}.lock: still held by another writer after 0.2 s"):
            jsonstore.update(str(path), "y", 2, autotune._read, timeout=0.2)
        assert time.perf_counter() - t0 < 10
    assert json.loads(path.read_text()) == {"x": 1}
    assert jsonstore.update(str(path), "y", 2, autotune._read, timeout=0.2) == {"x": 1, "y": 2}  # released
    assert issubclass(jsonstore.LockTimeout, TimeoutError)
    with pytest.raises(ValueError, match="timeout must be a number of seconds >= 0"):
        jsonstore.update(str(path), "y", 2, autotune._read, timeout=-1)


def test_the_tuning_cache_skips_storing_on_a_held_lock(tmp_path, monkeypatch, caplog):
    """For the tuning cache a lock that stays held costs only the persistence: choose returns its winner and
    keeps it for the process, and a warning names the file (a user's call that searched does not fail)."""
    path = tmp_path / "tuning.json"
    monkeypatch.setenv("M2OPS_TUNING_CACHE", str(path))
    monkeypatch.setattr(jsonstore, "LOCK_TIMEOUT_S", 0.2)
    monkeypatch.setattr(autotune, "environment_key", lambda device_index=0: "test-gpu")
    autotune.forget()
    try:
        with jsonstore.locked(str(path)), caplog.at_level(logging.WARNING, logger="m2ops.tuning"), \
                autotune.searching():
            best = autotune.choose("op", "s", {"t": 1}, [{"t": 2}], lambda cfg: float(3 - cfg["t"]))
        assert best == {"t": 2} and not path.exists()
        (record,) = caplog.records
        assert record.levelname == "WARNING" and f"not stored in {path}" in record.getMessage()
        assert f"{path}.lock: still held" in record.getMessage()
        assert autotune.lookup(autotune.full_key("op", "s", 0, [{"t": 2}])) == {"t": 2}  # (for this process)
    finally:
        autotune.forget()
