"""The tuning cache: a search runs once per key, its winner persists across processes, and the switches work."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    from m2ops.kernels import autotune
    calls = []
    def time_config(cfg):
        calls.append(cfg)
        return {1: 3.0, 2: 1.0, 3: 2.0}[cfg["tile"]]
    best = autotune.choose("op", "shape-a", {"tile": 1}, [{"tile": 2}, {"tile": 3}], time_config)
    print(json.dumps({"best": best, "searched": len(calls)}))
""")


def _run(tmp_path, **env):
    full_env = {**os.environ, "M2OPS_TUNING_CACHE": str(tmp_path / "tuning.json"), **env}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=full_env,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(autouse=True)
def _needs_kernels_package():
    pytest.importorskip("m2ops.kernels.autotune")


def test_search_once_then_reuse_across_processes(tmp_path):
    first, progress = _run(tmp_path)
    assert first == {"best": {"tile": 2}, "searched": 3}
    assert "m2ops autotune op [shape-a]: 3/3 configs" in progress
    second, _ = _run(tmp_path)
    assert second == {"best": {"tile": 2}, "searched": 0}  # read back from the file, no search
    stored = json.loads((tmp_path / "tuning.json").read_text())
    (key,) = stored
    assert key.endswith("|op|shape-a") and "cuda-tile" in key and stored[key]["ms"] == 1.0


def test_autotune_off_uses_the_default_without_search(tmp_path):
    got, _ = _run(tmp_path, M2OPS_AUTOTUNE="0")
    assert got == {"best": {"tile": 1}, "searched": 0}
    assert not (tmp_path / "tuning.json").exists()


def test_budget_stops_the_search_after_the_default(tmp_path):
    got, _ = _run(tmp_path, M2OPS_TUNE_BUDGET_S="0")
    # Over budget after the first timing: only the default was measured and it wins.
    assert got == {"best": {"tile": 1}, "searched": 1}
