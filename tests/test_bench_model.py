"""python -m m2ops.bench.model on the CPU: --smoke runs a tiny transformers Mamba2ForCausalLM without and with
m2ops, prints the table and writes the JSON fields the GPU run will fill; --help works; patch() is undone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from m2ops.bench import model as bench_model  # noqa: E402


def test_smoke_run_writes_json(tmp_path):
    out = tmp_path / "model.json"
    cmd = [sys.executable, "-m", "m2ops.bench.model", "--smoke", "--device", "cpu", "--out", str(out)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| forward, 1 x 40 tokens (ms) |" in proc.stdout and "decode (ms/token)" in proc.stdout
    r = json.loads(out.read_text())

    assert r["config"]["smoke"] is True and r["config"]["device"] == "cpu" and r["config"]["dtype"] == "float32"
    assert r["config"]["nheads"] == 8 and r["config"]["params"] > 0
    assert {"torch", "transformers", "device_name", "m2ops_backend"} <= set(r["env"])
    path = r["transformers_path"]
    assert set(path["functions"]) == set(bench_model.FUNCTIONS) and path["summary"]
    # on this machine transformers has no mamba_ssm / causal_conv1d: its PyTorch fallback, detected as such
    if not path.get("is_mamba_2_ssm_available", True):
        assert path["functions"]["mamba2_chunk_scan"] == "transformers PyTorch fallback"

    assert set(r["results"]) == {"transformers", "m2ops"}
    for impl, res in r["results"].items():
        fwd, gen = res["forward"], res["generate"]
        assert fwd["median_ms"] > 0 and len(fwd["runs_ms"]) == 2 and fwd["tokens_per_s"] > 0
        assert gen["median_ms"] > 0 and gen["generate_1_median_ms"] > 0 and len(gen["runs_ms"]) == 2
        assert gen["decode_ms_per_token"] is not None
        assert "profiled" in res
    # the profiler shows m2ops ops only after patch(): the scan in the forward, also the decode op in generate
    m2_seen = r["results"]["m2ops"]["profiled"]
    assert "m2ops::chunk_cumsum" in m2_seen["forward"] and "m2ops::state_update_inplace" in m2_seen["generate"]
    assert not any(k.startswith("m2ops::") for k in r["results"]["transformers"]["profiled"]["forward"])

    # float32 on the CPU: both implementations compute the same logits and tokens
    assert r["checks"]["last_logits_rel_diff"] < 1e-4
    assert r["checks"]["same_greedy_tokens"] is True and r["checks"]["greedy_tokens_agreeing_prefix"] == 4
    assert r["markdown"].startswith("Mamba2ForCausalLM d_model=64")


def test_in_process_run_unpatches(capsys):
    import m2ops.integrations.transformers as m2tf
    with torch.random.fork_rng():  # main() seeds the global generator
        r = bench_model.main(["--smoke", "--device", "cpu", "--modes", "forward", "--impls", "m2ops", "--runs",
                              "1", "--no-profile"])
    assert not m2tf.is_patched()
    assert set(r["results"]) == {"m2ops"} and "generate" not in r["results"]["m2ops"]
    assert "| forward, 1 x 40 tokens (ms) |" in capsys.readouterr().out


def test_help_and_bad_options(capsys):
    with pytest.raises(SystemExit) as e:
        bench_model.parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--d-model", "--n-layers", "--seqlen", "--new-tokens", "--vocab", "--smoke", "--out"):
        assert opt in text
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--smoke", "--device", "cpu", "--modes", "backward"])
    with pytest.raises(SystemExit):
        bench_model.parse_args(["--device", "cpu", "--headdim", "48"])  # 48 does not divide 5120


def test_defaults_are_the_realistic_model():
    a = bench_model.parse_args(["--device", "cpu"])
    assert (a.d_model, a.n_layers, a.headdim, a.d_state, a.expand, a.ngroups, a.chunk_size, a.vocab) == \
        (2560, 4, 64, 128, 2, 1, 256, 50280)
    assert (a.batch, a.seqlen, a.new_tokens, a.gen_prompt) == (1, 4096, 64, 4096)


def test_detects_a_package_bound_by_transformers():
    """transformers binds mamba_ssm's function inside its wrapper when mamba_ssm imports; the report names it
    (simulated here: the CPU machine has no mamba_ssm)."""
    import functools
    import importlib

    mod = importlib.import_module(bench_model.MODULE)

    def mamba_chunk_scan_combined(*args, **kwargs):
        return None
    mamba_chunk_scan_combined.__module__ = "mamba_ssm.ops.triton.ssd_combined"
    mamba_chunk_scan_combined.__qualname__ = "mamba_chunk_scan_combined"

    def wrapper(implementation, torch_function):
        @functools.wraps(torch_function)
        def wrapped(*args, **kwargs):
            return implementation(*args, **kwargs)
        return wrapped

    torch_fn = getattr(mod.mamba2_chunk_scan, "__wrapped__", mod.mamba2_chunk_scan)
    assert bench_model._describe(wrapper(mamba_chunk_scan_combined, torch_fn), mod) == \
        "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined"
    assert bench_model._describe(wrapper(torch_fn, torch_fn), mod) == "transformers PyTorch fallback"
    import m2ops.integrations.transformers as m2tf
    assert bench_model._describe(m2tf.chunk_scan, mod) == "m2ops"
