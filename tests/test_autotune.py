"""The tuning cache: a search runs once per key, its winner persists across processes, and the switches work."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from knobs import knobs

SCRIPT = textwrap.dedent("""
    import contextlib, json, logging, sys
    from m2ops.kernels import autotune
    mode = sys.argv[1]
    if mode == "logging":  # an application that shows INFO
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
    calls = []
    def time_config(cfg):
        calls.append(cfg)
        return {1: 3.0, 2: 1.0, 3: 2.0}[cfg["tile"]]
    with autotune.searching() if mode in ("searching", "logging") else contextlib.nullcontext():
        best = autotune.choose("op", "shape-a", {"tile": 1}, [{"tile": 2}, {"tile": 3}], time_config)
    print(json.dumps({"best": best, "searched": len(calls)}))
""")


def _run(tmp_path, mode="plain", **env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("M2OPS_")}
    full_env = {**clean, "M2OPS_TUNING_CACHE": str(tmp_path / "tuning.json"), **env}
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env=full_env,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.fixture(autouse=True)
def _needs_kernels_package():
    pytest.importorskip("m2ops.kernels.autotune")


@pytest.mark.parametrize("autotune_env", [None, "0", "off"])
def test_a_plain_call_never_searches(tmp_path, autotune_env):
    """Unset or off, M2OPS_AUTOTUNE lets no plain call search: the default runs and nothing is stored."""
    env = {} if autotune_env is None else {"M2OPS_AUTOTUNE": autotune_env}
    got, stderr = _run(tmp_path, **env)
    assert got == {"best": {"tile": 1}, "searched": 0}
    assert not (tmp_path / "tuning.json").exists()
    assert stderr == ""


def test_search_once_then_reuse_across_processes(tmp_path):
    """M2OPS_AUTOTUNE=1: the first call searches and stores (silently: the library adds no log handler), a
    later process reads the winner back without searching."""
    first, stderr = _run(tmp_path, M2OPS_AUTOTUNE="1")
    assert first == {"best": {"tile": 2}, "searched": 3}
    assert stderr == ""
    second, _ = _run(tmp_path)  # (a plain call: the stored winner, no search)
    assert second == {"best": {"tile": 2}, "searched": 0}
    stored = json.loads((tmp_path / "tuning.json").read_text())
    (key,) = stored
    import m2ops
    assert re.search(r"\|op\|shape-a\|candidates [0-9a-f]{12}$", key), key
    assert "cuda-tile" in key and f"|m2ops {m2ops.__version__}|" in key
    assert re.search(r"\|kernels [0-9a-f]{12}\|", key), key
    assert stored[key]["ms"] == 1.0 and stored[key]["searched"] == 3


@pytest.mark.parametrize("autotune_env", [None, "0"])
def test_searching_context_searches_whatever_the_switch(tmp_path, autotune_env):
    """autotune.searching() (what pretune uses) is an explicit request: it searches with M2OPS_AUTOTUNE unset or
    0, and enabled() holds only inside it."""
    env = {} if autotune_env is None else {"M2OPS_AUTOTUNE": autotune_env}
    got, stderr = _run(tmp_path, "searching", **env)
    assert got == {"best": {"tile": 2}, "searched": 3} and stderr == ""
    assert (tmp_path / "tuning.json").exists()


def test_progress_is_logged_where_the_application_shows_info(tmp_path):
    got, stderr = _run(tmp_path, "logging")
    assert got["searched"] == 3
    assert "m2ops.tuning INFO op [shape-a]: searching 3 configurations" in stderr
    assert "op [shape-a]: 3/3 {'tile': 3}: 2.0000 ms" in stderr
    assert "op [shape-a]: chose {'tile': 2} at 1.0000 ms (default 3.0000 ms" in stderr


def test_budget_stops_the_search_after_the_default(tmp_path):
    got, _ = _run(tmp_path, M2OPS_AUTOTUNE="1", M2OPS_TUNE_BUDGET_S="0")
    # Over budget after the first timing: only the default was measured and it wins.
    assert got == {"best": {"tile": 1}, "searched": 1}


# ---- the tuner wired into the chunk_scan launcher (no GPU needed for these) ----

def test_kernel_chunk_size(monkeypatch):
    """The chunk size the public function runs a call at: a caller's 64 or 128 on chunks of 256 from
    SUPER_CHUNK_DEFAULT_SEQLEN tokens where the kernels serve the device; the caller's own elsewhere (other
    sizes, shorter sequences, the CPU reference, a device the kernels do not serve)."""
    pytest.importorskip("cuda.tile")
    import torch
    from m2ops.kernels import config, scan
    from m2ops.ops import dispatch
    T, cuda = config.current().super_chunk_min_seqlen, torch.device("cuda", 0)
    assert dispatch.kernel_chunk_size(128, T, torch.device("cpu")) == 128
    monkeypatch.setattr(dispatch, "_kernels_serve", lambda device_type, index: device_type == "cuda")
    for L in (64, 128):
        assert dispatch.kernel_chunk_size(L, T, cuda) == scan.SUPER_CHUNK == 256
        assert dispatch.kernel_chunk_size(L, 4 * T, cuda) == 256
        assert dispatch.kernel_chunk_size(L, T - 1, cuda) == L
    for L in (16, 32, 96, 256, 512):
        assert dispatch.kernel_chunk_size(L, 4 * T, cuda) == L
    assert dispatch.kernel_chunk_size(128, T, torch.device("cpu")) == 128
    monkeypatch.setattr(dispatch, "_kernels_serve", lambda device_type, index: False)
    assert dispatch.kernel_chunk_size(128, T, cuda) == 128


def test_chunk_scan_configs_default_and_candidates(monkeypatch):
    pytest.importorskip("cuda.tile")
    import torch
    from m2ops.kernels import config, runtime, scan, specialise
    from m2ops.kernels.common import STATE_BLOCKS
    cpu = torch.device("cpu")
    monkeypatch.setattr(runtime, "sm_count", lambda device: 132)  # an H200's SMs, without a GPU
    default, cands = scan.chunk_scan_configs(1, 16384, 80, 64, 128, 256, cpu)
    assert default in cands
    assert {c["path"] for c in cands} == {"split", "fused"}
    assert [c["state_block"] for c in cands if c["path"] == "split" and "chunk" not in c] == list(STATE_BLOCKS)
    # the two-op path on other chunk sizes: 256 cut into 64 or 128, 128 into 64, 64 no further; a caller's 128
    # or 64 also carried into chunks of 256, unless the sequence fits in one of its chunks
    for L, subs in ((256, [64, 128]), (128, [64, 256]), (64, [256])):
        _, cs = scan.chunk_scan_configs(1, 16384, 80, 64, 128, L, cpu)
        assert sorted(c["chunk"] for c in cs if "chunk" in c) == subs
    _, cs = scan.chunk_scan_configs(1, 100, 80, 64, 128, 128, cpu)
    assert sorted(c["chunk"] for c in cs if "chunk" in c) == [64]
    # without search a caller's 64 or 128 runs on chunks of 256 from SUPER_CHUNK_DEFAULT_SEQLEN tokens on (measured
    # faster there), its own chunk size below; 256 stays 256
    for L in (64, 128):
        long_default, cs = scan.chunk_scan_configs(1, config.current().super_chunk_min_seqlen, 80, 64, 128, L, cpu)
        assert long_default == {"path": "split", "state_block": specialise.forward_state_block(), "chunk": 256}
        assert long_default in cs
        short_default, _ = scan.chunk_scan_configs(1, config.current().super_chunk_min_seqlen - 1, 80, 64, 128, L, cpu)
        assert "chunk" not in short_default
        # (not for a training forward given that chunk size, whose backward reuses states kept at it; the public
        # function gives it 256 already, ops.dispatch.kernel_chunk_size)
        kept_default, kept_cs = scan.chunk_scan_configs(1, config.current().super_chunk_min_seqlen, 80, 64, 128, L, cpu,
                                                          keep_states=True)
        assert "chunk" not in kept_default and long_default in kept_cs
    assert "chunk" not in scan.chunk_scan_configs(1, 65536, 80, 64, 128, 256, cpu)[0]
    assert "chunk" not in scan.chunk_scan_configs(1, 65536, 80, 64, 128, 32, cpu)[0]  # (32: not measured)
    # dstate 256: the fused kernels cannot run, so they are no candidates
    default, cands = scan.chunk_scan_configs(1, 16384, 80, 64, 256, 256, cpu)
    assert default["path"] == "split" and all(c["path"] == "split" for c in cands)
    # short sequences default to the two-op kernels too (measured faster there since v19), and the fused
    # kernels stay a candidate for the tuner; forced, the default is fused
    default, cands = scan.chunk_scan_configs(1, 1024, 80, 64, 128, 256, cpu)
    assert default["path"] == "split" and any(c["path"] == "fused" for c in cands)
    knobs(monkeypatch, segments=True)
    default, _ = scan.chunk_scan_configs(1, 1024, 80, 64, 128, 256, cpu)
    assert default["path"] == "fused"


def test_chunk_scan_shape_key_buckets_seqlen():
    pytest.importorskip("cuda.tile")
    import torch
    from m2ops.kernels import scan
    x = torch.zeros(1, 3000, 4, 16, dtype=torch.bfloat16)
    B = torch.zeros(1, 3000, 2, 32, dtype=torch.bfloat16)
    k1 = scan.chunk_scan_shape_key(x, 64, B, None, None, None)
    k2 = scan.chunk_scan_shape_key(torch.zeros(1, 4096, 4, 16, dtype=torch.bfloat16), 64, B, None, None, None)
    assert k1 == k2 and "T4096" in k1 and "bfloat16" in k1 and "N32" in k1 and "G2" in k1


def test_pretune_needs_a_gpu():
    import m2ops
    import torch
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        m2ops.pretune([dict(seqlen=1024)])


def test_pretune_names_bad_shapes():
    import m2ops
    with pytest.raises(ValueError, match="with a seqlen"):
        m2ops.pretune([dict(dstate=128)])
    with pytest.raises(ValueError, match=r"unknown shape keys \['d_state'\]"):
        m2ops.pretune([dict(seqlen=1024, d_state=128)])


@pytest.mark.parametrize("reported,expected", [("Cuda compilation tools, release 13.4, V13.4.92\n", "13.4.92"),
                                               ("no version here\n", "none")])
def test_tileiras_version_without_its_pip_package(monkeypatch, tmp_path, reported, expected):
    """Where tileiras is not a pip package (a toolchain unpacked by hand, as on a machine without network), the
    cache key takes the version the binary on PATH reports, or "none" when it reports none."""
    from m2ops.kernels import autotune
    fake = tmp_path / "tileiras"
    fake.write_text(f"#!/bin/sh\nprintf '%s' '{reported}'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setattr(autotune, "_version", lambda dist: "none" if dist == "nvidia-cuda-tileiras" else "1.7.0")
    assert autotune.tileiras_version() == expected
    autotune.environment_key.cache_clear()
    try:
        assert autotune.environment_key().endswith(f"|cuda-tile 1.7.0|tileiras {expected}")
    finally:
        autotune.environment_key.cache_clear()


def test_tileiras_version_without_any_tileiras(monkeypatch, tmp_path):
    from m2ops.kernels import autotune
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nothing"))
    monkeypatch.setattr(autotune, "_version", lambda dist: "none")
    assert autotune.tileiras_version() == "none"


def test_tileiras_version_from_its_pip_package(monkeypatch):
    from m2ops.kernels import autotune
    monkeypatch.setattr(autotune, "_version", lambda dist: "13.4.92" if dist == "nvidia-cuda-tileiras" else "x")
    monkeypatch.setattr(autotune.subprocess, "run", lambda *a, **k: pytest.fail("ran the binary"))
    assert autotune.tileiras_version() == "13.4.92"
