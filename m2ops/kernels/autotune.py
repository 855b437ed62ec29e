"""Autotuning of kernel launch configurations, with results that persist across processes.

A launcher names its op, a key describing the shape class it tunes for, a default configuration and a short
list of candidates. The first call for a key times the candidates (within a time budget, showing progress)
and stores the winner in a JSON file keyed by GPU name, cuda-tile and tileiras versions, op, dtype and shape
class; later calls and later processes read it back.

    M2OPS_AUTOTUNE=0          never search: use the stored winner if any, else the default
    M2OPS_TUNING_CACHE=path   where results live (default ~/.cache/m2ops/tuning.json)
    M2OPS_TUNE_BUDGET_S=20    seconds one new key may spend searching

No search runs while a CUDA graph captures or torch.compile traces: the default is used then, and the
shape can be tuned ahead of time with m2ops.pretune (m2ops/tuning.py) or any eager call. The launcher that
tunes today: chunk_scan (m2ops.kernels.launch.chunk_scan_configs).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from .. import envvars, jsonstore

_lock = threading.Lock()
_memory: dict[str, dict] = {}  # this process's view of the file, plus its own results
_seen: list = [None]  # (path, modification time) of the file when _memory last read it
_looked: list = [None, 0.0]  # the path, and time.monotonic(), of the last look at its modification time
# An absent key looks at the file's modification time at most this often (per path): a forward asks on every
# call, and the look (os.stat) cost the H200's host about 9 us a call with tuning off (tests/gpu/plan_cost.py).
RECHECK_S = 0.5


def cache_path() -> str:
    return os.environ.get("M2OPS_TUNING_CACHE") or _default_path(os.environ.get("HOME"))


@functools.lru_cache(maxsize=4)
def _default_path(home) -> str:
    """~/.cache/m2ops/tuning.json, kept per value of HOME (home: the cache key; expanduser reads HOME itself)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "m2ops", "tuning.json")


def enabled() -> bool:
    return envvars.switch("M2OPS_AUTOTUNE", True)


def budget_s() -> float:
    return envvars.seconds("M2OPS_TUNE_BUDGET_S", 20.0)


@functools.lru_cache(maxsize=None)
def environment_key(device_index: int = 0) -> str:
    """GPU name and compiler versions: a result is reused only where it was measured."""
    try:
        import torch
        gpu = torch.cuda.get_device_name(device_index) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - no CUDA runtime: key by "cpu"
        gpu = "cpu"
    return f"{gpu}|cuda-tile {_version('cuda-tile')}|tileiras {tileiras_version()}"


def tileiras_version() -> str:
    """The version of the tileiras that compiles the kernels: its pip package's, else what the binary cuda.tile
    would find (on PATH, then under CUDA_HOME) reports. A toolchain unpacked outside pip, as on a machine without
    network, has no package, and its results would otherwise be stored under "tileiras none"."""
    v = _version("nvidia-cuda-tileiras")
    if v != "none":
        return v
    binary = shutil.which("tileiras") or os.path.join(os.environ.get("CUDA_HOME", ""), "bin", "tileiras")
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "none"
    m = re.search(r"\bV(\d+(?:\.\d+)+)", out)  # "Cuda compilation tools, release 13.4, V13.4.92"
    return m.group(1) if m else "none"


def _version(dist: str) -> str:
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:  # noqa: BLE001 - not installed: part of the key all the same
        return "none"


def _load() -> dict:
    return _read(cache_path())


def _read(path: str) -> dict:
    """The cache file's table; {} where it is missing or not a JSON object (a damaged cache is rebuilt)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _store(key: str, entry: dict) -> None:
    """Add entry to the file, keeping what other processes stored meanwhile (jsonstore: locked, replaced whole)."""
    jsonstore.update(cache_path(), key, entry, _read)


def _stamp(path):
    try:
        return path, os.stat(path).st_mtime_ns
    except OSError:
        return path, None


def lookup(key: str):
    """The stored configuration for a full key, or None. A key this process has not seen rereads the file only
    when it changed since the last read, and looks whether it changed at most every RECHECK_S seconds: a
    launcher asks on every call, and reading the JSON each time a key is absent (tuning off, or a call inside
    graph capture) cost tens of microseconds."""
    with _lock:
        if key not in _memory:
            path, now = cache_path(), time.monotonic()
            if path != _looked[0] or now - _looked[1] >= RECHECK_S:
                _looked[0], _looked[1] = path, now
                stamp = _stamp(path)
                if stamp != _seen[0]:
                    _memory.update(_load())
                    _seen[0] = stamp
        entry = _memory.get(key)
    return None if entry is None else entry["config"]


def full_key(op: str, shape_key: str, device_index: int = 0) -> str:
    return f"{environment_key(device_index)}|{op}|{shape_key}"


def choose(op: str, shape_key: str, default: dict, candidates: Sequence[dict], time_config: Callable[[dict], float],
           can_search=True, device_index: int = 0) -> dict:
    """The configuration to launch with: stored winner, else a fresh search (when allowed), else default.

    time_config(config) returns milliseconds (inf for a configuration that fails). can_search: a bool, or a
    function giving one, called only when no stored winner exists."""
    key = full_key(op, shape_key, device_index)
    found = lookup(key)
    if found is not None:
        return found
    if callable(can_search):
        can_search = can_search()
    if not (can_search and enabled()) or len(candidates) <= 1:
        return default
    best, timings = search(op, shape_key, [default, *[c for c in candidates if c != default]], time_config)
    entry = {"config": best, "ms": timings[json.dumps(best, sort_keys=True)], "searched": len(timings),
             "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    with _lock:
        _memory[key] = entry
        _store(key, entry)
    return best


def search(op: str, shape_key: str, candidates: Sequence[dict], time_config: Callable[[dict], float]):
    """Time candidates in order until the budget is spent; the default comes first so it is always timed."""
    start = time.perf_counter()
    timings: dict[str, float] = {}
    best, best_ms = candidates[0], float("inf")
    for i, config in enumerate(candidates):
        if i and time.perf_counter() - start > budget_s():
            break
        try:
            ms = time_config(config)
        except Exception:  # noqa: BLE001 - a candidate that does not compile or launch loses
            ms = float("inf")
        timings[json.dumps(config, sort_keys=True)] = ms
        if ms < best_ms:
            best, best_ms = config, ms
        _progress(op, shape_key, i + 1, len(candidates), best_ms)
    print(file=sys.stderr)
    return best, timings


def _progress(op, shape_key, done, total, best_ms):
    sys.stderr.write(f"\rm2ops autotune {op} [{shape_key}]: {done}/{total} configs, best {best_ms:.4f} ms")
    sys.stderr.flush()


def forget() -> None:
    """Drop this process's in-memory view (tests; after editing the file by hand)."""
    with _lock:
        _memory.clear()
        _seen[0] = None
        _looked[0] = None
