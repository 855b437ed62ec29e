"""The benchmark harness on the CPU: subprocess per point, errors recorded, resume keeps measured points."""

import json
import subprocess
import sys

from m2ops.bench.shapes import Shape


def _bench(tmp_path, *extra):
    cmd = [sys.executable, "-m", "m2ops.bench", "--seqlens", "100", "--dstates", "16", "--nheads", "2",
           "--headdim", "8", "--dtype", "float32", "--runs", "2", "--warmup", "1", "--device", "cpu",
           "--chunk-size", "32", "--out", str(tmp_path), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads((tmp_path / "results.json").read_text()), out.stdout


def test_bench_records_times_and_peer_errors(tmp_path):
    results, table = _bench(tmp_path, "--peers", "m2ops,tilegym")
    by_peer = {r["peer"]: r for r in results}
    assert by_peer["m2ops"]["ms"] > 0
    # TileGym is not installed on the CPU machine (and needs a GPU): its failure is a row, not a crash.
    assert "error" in by_peer["tilegym"] and "ms" not in by_peer["tilegym"]
    assert "| 100 | 16 |" in table and "fails:" in table


def test_bench_resume_keeps_measured_points(tmp_path):
    first, _ = _bench(tmp_path, "--peers", "m2ops")
    again, _ = _bench(tmp_path, "--peers", "m2ops", "--resume")
    assert again == first  # nothing re-run


def test_floor_is_bandwidth_bound_at_the_protocol_shape():
    s = Shape(seqlen=16384, dstate=128)
    # x and y in bf16 dominate: 2 * 16K * 80 * 64 * 2 bytes ~ 336 MB, about 0.08 ms at 4.3 TB/s (DESIGN.md §3)
    assert 0.07 < s.floor_ms() < 0.09
    assert s.bytes_moved() / 4.3e12 > s.flops() / 790e12
