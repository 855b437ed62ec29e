"""TileGym's own tuning searches, kept in a JSON file so that a later run of the benchmark times the
configuration TileGym's exhaustive search chose without searching again.

TileGym tunes each of its kernels with cuTile's `exhaustive_search` the first time a shape is launched, and
keeps the outcome only for the life of the process. The search costs 100-190 s per shape on an H200, so a
whole-grid run could not afford it at every tuned point. With `python -m m2ops.bench --peer-tuning FILE`, the
tilegym-tuned worker answers each search from FILE where it holds a choice for the same kernel, search space,
arguments, GPU and versions, and otherwise runs the search and adds its outcome to FILE. The kernels timed are
then exactly those TileGym would run after its own search in a long-lived process.
"""

from __future__ import annotations

import json
import sys
import time
from importlib import metadata
from types import SimpleNamespace

import torch

from .. import jsonstore

ENV = "M2OPS_BENCH_PEER_TUNING"  # the file's path, set by the bench for its workers


def search_key(kernel, configs, args) -> str:
    """What a search's outcome depends on: the kernel, the configurations searched, the arguments' shapes,
    strides and dtypes (scalars by value) for the first configuration, the GPU and the versions of TileGym,
    cuda-tile and torch."""
    name = getattr(getattr(kernel, "_pyfunc", kernel), "__qualname__", repr(kernel))
    sig = [(tuple(a.shape), tuple(a.stride()), str(a.dtype)) if torch.is_tensor(a) else repr(a) for a in args]
    return json.dumps({"kernel": name, "configs": [repr(c) for c in configs], "args": sig,
                       "gpu": _gpu_name(), "versions": _versions()}, sort_keys=True)


def _gpu_name():
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _versions() -> dict:
    out = {"torch": torch.__version__}
    for dist in ("tilegym", "cuda-tile"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


class KeptSearches:
    """exhaustive_search's stand-in: answers from the file, else searches with the real one and stores the
    choice. counts says how many searches of this process were answered each way."""

    def __init__(self, real, path: str):
        self.real, self.path = real, path
        self.counts = {"stored": 0, "searched": 0}

    def __call__(self, search_space, stream, grid_fn, kernel, args_fn, hints_fn=None, **kw):
        configs = list(search_space)
        key = search_key(kernel, configs, args_fn(configs[0]) if configs else ())
        kept = _read(self.path).get(key)
        if kept is not None:
            for cfg in configs:
                if repr(cfg) == kept["config"]:
                    self.counts["stored"] += 1
                    # what a caller of exhaustive_search reads from its result
                    return SimpleNamespace(best=SimpleNamespace(config=cfg, mean_us=kept.get("mean_us")))
        t0 = time.perf_counter()
        result = self.real(configs, stream, grid_fn, kernel, args_fn, hints_fn, **kw)
        entry = {"config": repr(result.best.config), "mean_us": getattr(result.best, "mean_us", None),
                 "search_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d")}
        jsonstore.update(self.path, key, entry, _read)  # (workers on several GPUs may store at once)
        self.counts["searched"] += 1
        return result


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            table = json.load(f)
    except FileNotFoundError:
        return {}
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object of kept searches, got {type(table).__name__}")
    return table


def keep_tilegym_searches(path: str) -> KeptSearches:
    """Route TileGym's Mamba-2 searches through the file at path (once per process; returns the stand-in)."""
    from tilegym.ops.cutile import mamba2
    current = mamba2.exhaustive_search
    if isinstance(current, KeptSearches):
        return current
    mamba2.exhaustive_search = KeptSearches(current, path)
    return mamba2.exhaustive_search


def search_counts() -> dict:
    """How many of TileGym's searches this process answered from the file ("stored") and ran ("searched"); zeros
    while its searches are not routed through one."""
    kept = getattr(sys.modules.get("tilegym.ops.cutile.mamba2"), "exhaustive_search", None)
    return dict(kept.counts) if isinstance(kept, KeptSearches) else {"stored": 0, "searched": 0}
