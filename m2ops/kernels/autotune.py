"""Launch configurations chosen per shape class, with searched results that persist across processes.

A launcher names its op, a key describing the shape class, a default configuration and a short list of
candidates, and calls `choose`. A plain call never searches: it takes the stored result for its key when there
is one, else the default. Searching happens only when asked for:

    m2ops.pretune(...) / python -m m2ops.tuning ...   (m2ops/tuning.py: calls made inside `searching()`)
    with autotune.searching(): ...                    any call in this block may search (this thread)
    M2OPS_AUTOTUNE=1                                  every eager call may search (unset or 0: none does)

A search times the candidates within a budget (M2OPS_TUNE_BUDGET_S, default 20 s per key) and stores the
winner in a JSON file: M2OPS_TUNING_CACHE, else $XDG_CACHE_HOME/m2ops/tuning.json, else
~/.cache/m2ops/tuning.json. An entry's key names where and with what it was measured: the GPU, the cuda-tile and
tileiras versions, the m2ops version, a hash of the kernel sources (the .py files of this folder), the op, the
shape class and a hash of the candidate list. A result measured on other code or over other candidates is
therefore not reused, and a stored configuration that is not among the caller's candidates is ignored.

Progress and results go to the logger "m2ops.tuning" (INFO; a result that cannot be stored: WARNING). The
library adds no handler, so nothing shows unless the application configures logging; the CLI does.
No search runs while a CUDA graph captures or torch.compile traces (the launcher's can_search says so).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from typing import Callable, Sequence

from .. import envvars, jsonstore

log = logging.getLogger("m2ops.tuning")

_lock = threading.Lock()
_memory: dict[str, dict] = {}  # this process's view of the file, plus its own results
_seen: list = [None]  # (path, modification time) of the file when _memory last read it
_looked: list = [None, 0.0]  # the path, and time.monotonic(), of the last look at its modification time
# An absent key looks at the file's modification time at most this often (per path): a forward asks on every
# call, and the look (os.stat) cost the H200's host about 9 us a call with tuning off (measure/plan_cost.py).
RECHECK_S = 0.5

# The folder whose .py files the key's source hash covers (a test points it at a copy).
KERNELS_DIR = os.path.dirname(os.path.abspath(__file__))

# Set (to a _Search) inside searching(): a ContextVar, so that a pretune in one thread does not let another
# thread's plain calls search.
_searching: contextvars.ContextVar = contextvars.ContextVar("m2ops_autotune_searching", default=None)
_told: set = set()  # keys whose "no stored configuration" this process has logged


class _Search:
    __slots__ = ("budget_s",)

    def __init__(self, budget_s):
        self.budget_s = budget_s


@contextlib.contextmanager
def searching(budget_s: float | None = None):
    """Within this block (in this thread or task), a call whose key has no stored configuration may search, as
    with M2OPS_AUTOTUNE=1. budget_s: seconds one key may spend searching (default: M2OPS_TUNE_BUDGET_S)."""
    if budget_s is not None:
        if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or not budget_s >= 0:
            raise ValueError(f"searching: budget_s must be a number of seconds >= 0 or None, got {budget_s!r}")
        budget_s = float(budget_s)
    token = _searching.set(_Search(budget_s))
    try:
        yield
    finally:
        _searching.reset(token)


def enabled() -> bool:
    """Whether a call that finds no stored entry may search now: inside searching(), or with M2OPS_AUTOTUNE=1."""
    return _searching.get() is not None or envvars.switch("M2OPS_AUTOTUNE", False)


def budget_s() -> float:
    """Seconds one key may spend searching: searching()'s budget_s, else M2OPS_TUNE_BUDGET_S (default 20)."""
    ctx = _searching.get()
    if ctx is not None and ctx.budget_s is not None:
        return ctx.budget_s
    return envvars.seconds("M2OPS_TUNE_BUDGET_S", 20.0)


def cache_path() -> str:
    """M2OPS_TUNING_CACHE, else $XDG_CACHE_HOME/m2ops/tuning.json, else ~/.cache/m2ops/tuning.json."""
    return os.environ.get("M2OPS_TUNING_CACHE") or _default_path(os.environ.get("XDG_CACHE_HOME"),
                                                                   os.environ.get("HOME"))


@functools.lru_cache(maxsize=4)
def _default_path(xdg_cache_home, home) -> str:
    """The default path, kept per value of XDG_CACHE_HOME and HOME (the cache key; expanduser reads HOME
    itself): a lookup asks for the path on every call. A relative XDG_CACHE_HOME is ignored, as the XDG base
    directory specification says."""
    base = xdg_cache_home if xdg_cache_home and os.path.isabs(xdg_cache_home) else None
    return os.path.join(base or os.path.join(os.path.expanduser("~"), ".cache"), "m2ops", "tuning.json")


@functools.lru_cache(maxsize=None)
def environment_key(device_index: int = 0) -> str:
    """GPU name and compiler versions: a result is reused only where it was measured."""
    try:
        import torch
        gpu = torch.cuda.get_device_name(device_index) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - no CUDA runtime: key by "cpu"
        gpu = "cpu"
    return f"{gpu}|cuda-tile {_version('cuda-tile')}|tileiras {tileiras_version()}"


def code_key() -> str:
    """The m2ops version and a hash of the kernel sources: a result measured on other code is not reused."""
    return _code_key(KERNELS_DIR)


@functools.lru_cache(maxsize=4)
def _code_key(folder: str) -> str:
    # Once per process (and folder): reading and hashing the folder's few hundred KB takes about a millisecond.
    return f"m2ops {_m2ops_version()}|kernels {sources_hash(folder)}"


def sources_hash(folder: str) -> str:
    """A hash of the names and text of the .py files directly in folder (12 hex digits)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:12]


def _m2ops_version() -> str:
    # Read when first needed, not at import: this module is imported while m2ops/__init__.py still runs.
    try:
        from .. import __version__
        return __version__
    except ImportError:
        return _version("m2ops")


def candidates_hash(candidates: Sequence[dict]) -> str:
    """A hash of the candidate configurations, whatever their order (12 hex digits). Remembered per list object:
    the launchers pass the same kept list on every call, and hashing it afresh would cost tens of microseconds
    a call; so a list, once passed, must not be changed in place."""
    hit = _hashed.get(id(candidates))
    if hit is not None and hit[0] is candidates:
        return hit[1]
    try:
        text = json.dumps(sorted(json.dumps(c, sort_keys=True) for c in candidates))
    except TypeError:
        raise TypeError(f"candidates: each configuration must be a JSON-serialisable dict, got "
                        f"{list(candidates)!r}") from None
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    if len(_hashed) >= 256:  # (a caller building a new list per call: keep the memo small)
        _hashed.clear()
    _hashed[id(candidates)] = (candidates, digest)  # (holding the list keeps its id from naming another)
    return digest


_hashed: dict = {}


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


def full_key(op: str, shape_key: str, device_index: int = 0, candidates: Sequence[dict] | None = None) -> str:
    """The cache key of op's shape class on this device and code. candidates: the caller's candidate list,
    hashed into the key (choose passes its own); a caller that looks up what choose stored must pass the same
    list (same configurations, any order)."""
    key = f"{environment_key(device_index)}|{code_key()}|{op}|{shape_key}"
    return key if candidates is None else f"{key}|candidates {candidates_hash(candidates)}"


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


def _store(key: str, entry: dict) -> bool:
    """Add entry to the file, keeping what other processes stored meanwhile (jsonstore: locked, replaced whole).
    A file that cannot be written, or a lock held past jsonstore.LOCK_TIMEOUT_S, costs only the persistence:
    a warning is logged and False returned, rather than failing the user's call that searched."""
    path = cache_path()
    try:
        jsonstore.update(path, key, entry, _read)
    except (OSError, jsonstore.LockTimeout) as e:
        log.warning("tuning result not stored in %s (kept for this process only): %s", path, e)
        return False
    return True


def _stamp(path):
    try:
        return path, os.stat(path).st_mtime_ns
    except OSError:
        return path, None


def _refresh(force: bool) -> None:
    """Reread the file if it changed since the last read; unless force, look at most every RECHECK_S. (Under
    _lock.)"""
    path, now = cache_path(), time.monotonic()
    if force or path != _looked[0] or now - _looked[1] >= RECHECK_S:
        _looked[0], _looked[1] = path, now
        stamp = _stamp(path)
        if stamp != _seen[0]:
            _memory.update(_load())
            _seen[0] = stamp


def lookup(key: str, candidates: Sequence[dict] | None = None):
    """The stored configuration for a full key, or None; also None where candidates is given and the stored
    configuration is not among them. A key this process has not seen rereads the file only when it changed
    since the last read, and looks whether it changed at most every RECHECK_S seconds: a launcher asks on every
    call, and reading the JSON each time a key is absent cost tens of microseconds."""
    with _lock:
        if key not in _memory:
            _refresh(False)
        entry = _memory.get(key)
    if not isinstance(entry, dict) or "config" not in entry:
        return None
    config = entry["config"]
    if candidates is not None and config not in candidates:
        return None
    return config


def stored(op: str, shape_key: str, device_index: int = 0) -> dict | None:
    """The newest stored entry (with its "key" added) for op's shape class on this device and code, whatever
    candidate list it was searched over; None if there is none. For reports (pretune, the bench), not launchers:
    a launcher looks up its exact key."""
    base = full_key(op, shape_key, device_index)
    with _lock:
        _refresh(True)
        found = [(e.get("when", ""), k, e) for k, e in _memory.items()
                 if (k == base or k.startswith(base + "|candidates ")) and isinstance(e, dict) and "config" in e]
    if not found:
        return None
    _, key, entry = max(found, key=lambda t: t[0])
    return {**entry, "key": key}


def choose(op: str, shape_key: str, default: dict, candidates: Sequence[dict], time_config: Callable[[dict], float],
           can_search=True, device_index: int = 0) -> dict:
    """The configuration to launch with: the stored one for this key when it is the default or among the
    candidates; else, where a search may run now (enabled() and can_search), the winner of a search, stored;
    else the default.

    time_config(config) returns milliseconds (inf for a configuration that fails). can_search: a bool, or a
    function giving one, called only when no stored configuration exists and enabled() holds. candidates must
    not be changed in place after the call (candidates_hash)."""
    key = full_key(op, shape_key, device_index, candidates)
    found = lookup(key)
    if found is not None and (found == default or found in candidates):
        return found
    if not enabled():
        if key not in _told:  # (once per key and process: this runs on every call)
            _told.add(key)
            log.info("%s [%s]: no stored configuration, using the default %s (to search: m2ops.pretune, "
                     "python -m m2ops.tuning or M2OPS_AUTOTUNE=1)", op, shape_key, default)
        return default
    others = [c for c in candidates if c != default]
    if not others:
        return default
    if callable(can_search):
        can_search = can_search()
    if not can_search:
        return default
    best, timings = search(op, shape_key, [default, *others], time_config)
    entry = {"config": best, "ms": timings[json.dumps(best, sort_keys=True)], "searched": len(timings),
             "candidates": len(others) + 1, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    with _lock:
        _memory[key] = entry
        _store(key, entry)
    return best


def search(op: str, shape_key: str, candidates: Sequence[dict], time_config: Callable[[dict], float]):
    """Time candidates in order until the budget is spent; the default comes first so it is always timed.
    Returns the fastest and {json of each timed configuration: ms}."""
    budget = budget_s()
    start = time.perf_counter()
    timings: dict[str, float] = {}
    best, best_ms = candidates[0], float("inf")
    log.info("%s [%s]: searching %d configurations (budget %g s)", op, shape_key, len(candidates), budget)
    for i, config in enumerate(candidates):
        if i and time.perf_counter() - start > budget:
            log.info("%s [%s]: budget of %g s spent after %d of %d configurations (M2OPS_TUNE_BUDGET_S)",
                     op, shape_key, budget, i, len(candidates))
            break
        try:
            ms = time_config(config)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile or launch loses
            log.info("%s [%s]: %d/%d %s failed: %s: %s", op, shape_key, i + 1, len(candidates), config,
                     type(e).__name__, e)
            log.debug("%s [%s]: %s failed", op, shape_key, config, exc_info=True)
            ms = float("inf")
        else:
            log.info("%s [%s]: %d/%d %s: %.4f ms", op, shape_key, i + 1, len(candidates), config, ms)
        timings[json.dumps(config, sort_keys=True)] = ms
        if ms < best_ms:
            best, best_ms = config, ms
    log.info("%s [%s]: chose %s at %.4f ms (default %.4f ms; %d configurations timed in %.1f s)", op, shape_key,
             best, best_ms, timings[json.dumps(candidates[0], sort_keys=True)], len(timings),
             time.perf_counter() - start)
    return best, timings


def forget() -> None:
    """Drop this process's in-memory view and the kernel sources' hash (tests; after editing the file or a
    kernel by hand)."""
    with _lock:
        _memory.clear()
        _seen[0] = None
        _looked[0] = None
        _told.clear()
    _code_key.cache_clear()
