"""m2ops.jsonstore: entries that several processes store into one file at the same time are all kept."""

import json
import os
import subprocess
import sys

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
    a read-merge-write loses entries: with fcntl switched off this test lost dozens.)"""
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
