"""python -m m2ops.bench.layer on the CPU: the smoke run times every mode of m2ops.Mamba2, compares it with itself
in float32, records why an absent peer is skipped, and bad options stop it with one line naming the option."""

from __future__ import annotations

import json

import pytest

from m2ops.bench import layer as bench_layer


def test_smoke_run(tmp_path):
    out = tmp_path / "layer.json"
    result = bench_layer.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["markdown"] == result["markdown"]
    r = result["results"]["m2ops"]
    shape = r["2x40"]
    assert shape["forward"]["median_ms"] > 0 and shape["train"]["median_ms"] > 0
    # float32 on the CPU against float32 on the CPU, same weights: the same computation
    assert shape["out_rel_err"] < 1e-6 and shape["grad_u_rel_err"] < 1e-6
    assert r["decode1"]["eager_us"] > 0 and r["decode3"]["eager_us"] > 0
    for peer in ("mamba_ssm", "mamba_ssm-memeff"):
        why = bench_layer.peer_status(peer)
        if why is not None:
            assert result["results"][peer] == {"skipped": why}
    assert "forward 2x40 (ms)" in result["markdown"]


@pytest.mark.parametrize("argv, named", [(["--shapes", "4"], "--shapes"), (["--impls", "nope"], "--impls"),
                                         (["--modes", "nope"], "--modes"), (["--decode-batches", "0"],
                                                                            "--decode-batches"),
                                         (["--runs", "0"], "--runs")])
def test_bad_options(argv, named, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_layer.parse_args(["--smoke", *argv])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in last and "error" in last
