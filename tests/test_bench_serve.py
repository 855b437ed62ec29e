"""python -m m2ops.bench.serve on the CPU: the smoke run times the chunked-prefill call (with and without start
states) and the in-place decode by slot, checks the no-start-states call against the call it times, records why an
absent peer is skipped, and bad options stop it with one line naming the option."""

from __future__ import annotations

import json

import pytest

from m2ops.bench import serve as bench_serve


def test_smoke_run(tmp_path):
    out = tmp_path / "serve.json"
    result = bench_serve.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["markdown"] == result["markdown"]
    pre = result["results"]["prefill"]
    assert sum(pre["lengths"]) == 60 and len(pre["lengths"]) == 5 and max(pre["lengths"]) <= 30
    for name in ("m2ops", "m2ops-no-starts"):
        assert pre[name]["eager"]["median_ms"] > 0
    assert pre["m2ops-no-starts"]["y_rel_err"] == 0 and pre["m2ops-no-starts"]["states_rel_err"] == 0
    for b in (1, 3):
        assert result["results"][f"decode {b}, 16"]["m2ops"]["eager_us"] > 0
    _, why = bench_serve.peer()
    if why is not None:
        assert result["peer_skipped"] == why and "mamba_ssm" not in pre
    assert "Chunked prefill" in result["markdown"] and "| 3, 16 |" in result["markdown"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lengths_sum_to_tokens(seed):
    args = bench_serve.parse_args(["--smoke", "--seed", str(seed), "--sequences", "7", "--tokens", "100",
                                   "--max-len", "20"])
    lens = bench_serve.lengths(args)
    assert len(lens) == 7 and sum(lens) == 100 and min(lens) >= 1 and max(lens) <= 20


@pytest.mark.parametrize("argv, named", [(["--modes", "nope"], "--modes"), (["--runs", "0"], "--runs"),
                                         (["--decode-batches", "x"], "--decode-batches"),
                                         (["--tokens", "1000"], "--tokens")])
def test_bad_options(argv, named, capsys):
    with pytest.raises(SystemExit) as stop:
        bench_serve.parse_args(["--smoke", *argv])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in last and "error" in last
