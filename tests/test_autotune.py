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
    full_env = {**os.environ, "M2OPS_AUTOTUNE": "1", "M2OPS_TUNING_CACHE": str(tmp_path / "tuning.json"), **env}
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


# ---- the tuner wired into the chunk_scan launcher (no GPU needed for these) ----

def test_kernel_chunk_size(monkeypatch):
    """The chunk size the public function runs a call at: a caller's 64 or 128 on chunks of 256 from
    SUPER_CHUNK_DEFAULT_SEQLEN tokens where the kernels serve the device; the caller's own elsewhere (other
    sizes, shorter sequences, the CPU reference, a device the kernels do not serve)."""
    pytest.importorskip("cuda.tile")
    import torch
    from m2ops.kernels import launch
    from m2ops.ops import dispatch
    T, cuda = launch.SUPER_CHUNK_DEFAULT_SEQLEN, torch.device("cuda", 0)
    assert dispatch.kernel_chunk_size(128, T, torch.device("cpu")) == 128
    monkeypatch.setattr(dispatch, "_kernels_serve", lambda device_type, index: device_type == "cuda")
    for L in (64, 128):
        assert dispatch.kernel_chunk_size(L, T, cuda) == launch.SUPER_CHUNK == 256
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
    from m2ops.kernels import launch
    from m2ops.kernels.common import STATE_BLOCKS
    cpu = torch.device("cpu")
    monkeypatch.setattr(launch, "_sm_count", lambda device: 132)  # an H200's SMs, without a GPU
    default, cands = launch.chunk_scan_configs(1, 16384, 80, 64, 128, 256, cpu)
    assert default in cands
    assert {c["path"] for c in cands} == {"split", "fused"}
    assert [c["state_block"] for c in cands if c["path"] == "split" and "chunk" not in c] == list(STATE_BLOCKS)
    # the two-op path on other chunk sizes: 256 cut into 64 or 128, 128 into 64, 64 no further; a caller's 128
    # or 64 also carried into chunks of 256, unless the sequence fits in one of its chunks
    for L, subs in ((256, [64, 128]), (128, [64, 256]), (64, [256])):
        _, cs = launch.chunk_scan_configs(1, 16384, 80, 64, 128, L, cpu)
        assert sorted(c["chunk"] for c in cs if "chunk" in c) == subs
    _, cs = launch.chunk_scan_configs(1, 100, 80, 64, 128, 128, cpu)
    assert sorted(c["chunk"] for c in cs if "chunk" in c) == [64]
    # without search a caller's 64 or 128 runs on chunks of 256 from SUPER_CHUNK_DEFAULT_SEQLEN tokens on (measured
    # faster there), its own chunk size below; 256 stays 256
    for L in (64, 128):
        long_default, cs = launch.chunk_scan_configs(1, launch.SUPER_CHUNK_DEFAULT_SEQLEN, 80, 64, 128, L, cpu)
        assert long_default == {"path": "split", "state_block": launch.forward_state_block(), "chunk": 256}
        assert long_default in cs
        short_default, _ = launch.chunk_scan_configs(1, launch.SUPER_CHUNK_DEFAULT_SEQLEN - 1, 80, 64, 128, L, cpu)
        assert "chunk" not in short_default
        # (not for a training forward given that chunk size, whose backward reuses states kept at it; the public
        # function gives it 256 already, ops.dispatch.kernel_chunk_size)
        kept_default, kept_cs = launch.chunk_scan_configs(1, launch.SUPER_CHUNK_DEFAULT_SEQLEN, 80, 64, 128, L, cpu,
                                                          keep_states=True)
        assert "chunk" not in kept_default and long_default in kept_cs
    assert "chunk" not in launch.chunk_scan_configs(1, 65536, 80, 64, 128, 256, cpu)[0]
    assert "chunk" not in launch.chunk_scan_configs(1, 65536, 80, 64, 128, 32, cpu)[0]  # (32: not measured)
    # dstate 256: the fused kernels cannot run, so they are no candidates
    default, cands = launch.chunk_scan_configs(1, 16384, 80, 64, 256, 256, cpu)
    assert default["path"] == "split" and all(c["path"] == "split" for c in cands)
    # short sequences default to the two-op kernels too (measured faster there since v19), and the fused
    # kernels stay a candidate for the tuner; forced, the default is fused
    default, cands = launch.chunk_scan_configs(1, 1024, 80, 64, 128, 256, cpu)
    assert default["path"] == "split" and any(c["path"] == "fused" for c in cands)
    monkeypatch.setattr(launch, "SEGMENTS_OVERRIDE", True)
    default, _ = launch.chunk_scan_configs(1, 1024, 80, 64, 128, 256, cpu)
    assert default["path"] == "fused"


def test_chunk_scan_shape_key_buckets_seqlen():
    pytest.importorskip("cuda.tile")
    import torch
    from m2ops.kernels import launch
    x = torch.zeros(1, 3000, 4, 16, dtype=torch.bfloat16)
    B = torch.zeros(1, 3000, 2, 32, dtype=torch.bfloat16)
    k1 = launch.chunk_scan_shape_key(x, 64, B, None, None, None)
    k2 = launch.chunk_scan_shape_key(torch.zeros(1, 4096, 4, 16, dtype=torch.bfloat16), 64, B, None, None, None)
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
