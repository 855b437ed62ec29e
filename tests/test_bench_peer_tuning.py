"""TileGym's searches kept on disk (m2ops/bench/peer_tuning.py): a search runs once, later processes take its
choice from the file, and anything the choice depends on changing makes it search again."""

import json
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from m2ops.bench import peer_tuning


def _configs():
    return [SimpleNamespace(BLOCK=b, occupancy=o) for b in (16, 32) for o in (1, 2)]


class _Search:
    """A stand-in for cuTile's exhaustive_search: picks the config at `pick` and counts its calls."""

    def __init__(self, pick=2):
        self.pick, self.calls = pick, 0

    def __call__(self, configs, stream, grid_fn, kernel, args_fn, hints_fn=None, **kw):
        self.calls += 1
        configs = list(configs)
        for cfg in configs:  # as the real one does: every config's grid, arguments and hints
            grid_fn(cfg), args_fn(cfg), hints_fn(cfg)
        best = SimpleNamespace(config=configs[self.pick], mean_us=12.5)
        return SimpleNamespace(best=best)


def _kernel_a():
    pass


def _kernel_b():
    pass


def _search(kept, kernel=_kernel_a, x=None, configs=None):
    x = torch.zeros(4, 8) if x is None else x
    return kept(configs or _configs(), None, lambda c: (2, 1, 1), kernel, lambda c: (x, 7, c.BLOCK),
                lambda c: {"occupancy": c.occupancy}).best.config


def test_a_search_runs_once_and_its_choice_is_stored(tmp_path):
    path = str(tmp_path / "kept.json")
    real = _Search(pick=2)
    kept = peer_tuning.KeptSearches(real, path)
    assert repr(_search(kept)) == repr(_configs()[2])
    assert real.calls == 1 and kept.counts == {"stored": 0, "searched": 1}
    table = json.loads(open(path).read())
    (key, entry), = table.items()
    assert entry["config"] == repr(_configs()[2]) and entry["mean_us"] == 12.5 and entry["search_s"] >= 0
    assert json.loads(key)["kernel"].endswith("_kernel_a")

    fresh = peer_tuning.KeptSearches(_Search(pick=0), path)  # a later process: the file answers
    cfg = _search(fresh)
    assert repr(cfg) == repr(_configs()[2]) and fresh.real.calls == 0
    assert fresh.counts == {"stored": 1, "searched": 0}


def test_a_later_process_takes_the_stored_choice(tmp_path):
    path = tmp_path / "kept.json"
    _search(peer_tuning.KeptSearches(_Search(pick=3), str(path)))
    code = f"""
import sys
sys.path.insert(0, {str(tmp_path)!r})
sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})
from test_bench_peer_tuning import _search
from m2ops.bench import peer_tuning

def refuse(*a, **k):
    raise AssertionError("searched although the file holds the choice")

kept = peer_tuning.KeptSearches(refuse, {str(path)!r})
print(repr(_search(kept)), kept.counts)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == f"{_configs()[3]!r} {{'stored': 1, 'searched': 0}}"


@pytest.mark.parametrize("change", ["shape", "dtype", "kernel", "search space"])
def test_a_change_of_what_the_choice_depends_on_searches_again(tmp_path, change):
    path = str(tmp_path / "kept.json")
    _search(peer_tuning.KeptSearches(_Search(pick=1), path))
    real = _Search(pick=0)
    kept = peer_tuning.KeptSearches(real, path)
    if change == "shape":
        cfg = _search(kept, x=torch.zeros(4, 16))
    elif change == "dtype":
        cfg = _search(kept, x=torch.zeros(4, 8, dtype=torch.float16))
    elif change == "kernel":
        cfg = _search(kept, kernel=_kernel_b)
    else:
        cfg = _search(kept, configs=_configs()[:3])
    assert real.calls == 1 and repr(cfg) == repr(_configs()[0])
    assert len(json.loads(open(path).read())) == 2  # both choices kept


def test_a_stored_choice_outside_the_search_space_searches_again(tmp_path):
    path = tmp_path / "kept.json"
    _search(peer_tuning.KeptSearches(_Search(pick=1), str(path)))
    table = json.loads(path.read_text())
    for entry in table.values():
        entry["config"] = "namespace(BLOCK=64, occupancy=9)"
    path.write_text(json.dumps(table))
    real = _Search(pick=0)
    assert repr(_search(peer_tuning.KeptSearches(real, str(path)))) == repr(_configs()[0])
    assert real.calls == 1


def test_a_file_that_is_not_a_table_is_refused(tmp_path):
    path = tmp_path / "kept.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="kept.json: expected a JSON object of kept searches, got list"):
        _search(peer_tuning.KeptSearches(_Search(), str(path)))


def test_keep_tilegym_searches_wraps_the_module_once(tmp_path, monkeypatch):
    real = _Search()
    mamba2 = types.ModuleType("tilegym.ops.cutile.mamba2")
    mamba2.exhaustive_search = real
    for name in ("tilegym", "tilegym.ops", "tilegym.ops.cutile"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "tilegym.ops.cutile.mamba2", mamba2)
    sys.modules["tilegym.ops.cutile"].mamba2 = mamba2
    first = peer_tuning.keep_tilegym_searches(str(tmp_path / "kept.json"))
    assert mamba2.exhaustive_search is first and first.real is real
    assert peer_tuning.keep_tilegym_searches(str(tmp_path / "kept.json")) is first  # not wrapped twice
    assert peer_tuning.search_counts() == {"stored": 0, "searched": 0}
    _search(first)
    assert peer_tuning.search_counts() == {"stored": 0, "searched": 1}
