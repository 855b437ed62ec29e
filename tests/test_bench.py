"""The benchmark harness on the CPU: a worker process per peer (restarted after a failure or a timeout), errors
recorded, resume keeps measured points.

Most tests here read what one bench run wrote. Those run main() in this process (its peers still run in worker
processes of their own) through the module's `bench_run`, which runs each command line once and hands the same
run to every test that asks for it. The tests of process behaviour (fresh workers, timeouts, --gpus) start the
command line itself, or a Pool."""

import contextlib
import io
import json
import shutil
import subprocess
import sys
from typing import NamedTuple

import pytest

from m2ops.bench.pool import Pool
from m2ops.bench.shapes import Shape


# One small point on the CPU; the tests add the peers and options.
_ARGS = ("--seqlens", "100", "--dstates", "16", "--nheads", "2", "--headdim", "8", "--dtype", "float32", "--runs", "2",
         "--warmup", "1", "--device", "cpu", "--chunk-size", "32")


def _bench(tmp_path, *extra):
    """`python -m m2ops.bench` in a process of its own: (results, stdout)."""
    cmd = [sys.executable, "-m", "m2ops.bench", *_ARGS, "--out", str(tmp_path), *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads((tmp_path / "results.json").read_text()), out.stdout


class Run(NamedTuple):
    results: list  # results.json
    table: str  # stdout
    err: str  # stderr
    out: object  # the --out directory (pathlib.Path)


def _bench_here(out, *extra) -> Run:
    """The bench's main() in this process (each peer still in a worker process), stdout and stderr captured."""
    from m2ops.bench.__main__ import main
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        main([*_ARGS, "--out", str(out), *extra])
    return Run(json.loads((out / "results.json").read_text()), stdout.getvalue(), stderr.getvalue(), out)


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """bench_run(*extra) -> Run of `python -m m2ops.bench <_ARGS> *extra`, run once per module for each distinct
    extra; results are read back from the file at each call, so no test sees another's changes to them. A test
    that runs the bench again in the same --out (--resume) copies the directory first."""
    runs = {}

    def run(*extra):
        if extra not in runs:
            runs[extra] = _bench_here(tmp_path_factory.mktemp("bench"), *extra)
        r = runs[extra]
        return r._replace(results=json.loads((r.out / "results.json").read_text()))

    return run


# The runs that several tests read:
# m2ops beside two peers that cannot run on the CPU (named, so recorded as failed);
_CANNOT = ("--peers", "m2ops,tilegym,mamba_ssm-c64-graph")
# m2ops and its untuned twin, the twin only at one of the two points;
_TWINS = ("--peers", "m2ops,m2ops-default", "--seqlens", "64,100", "--peer-points", "m2ops-default=100:16")
# the forward's errors against the reference and its time per kernel, at the same point;
_CHECK_KERNELS = ("--peers", "m2ops", "--check", "--kernels")
# --backward with --check: the backward mode's times and its gradient errors.
_BACKWARD = ("--peers", "m2ops", "--backward", "--check")
# and bench_run() with no options: the default peers (on the CPU: m2ops alone).


def test_bench_records_times_and_peer_errors(bench_run):
    results, table, _, _ = bench_run(*_CANNOT)
    by_peer = {r["peer"]: r for r in results}
    assert by_peer["m2ops"]["ms"] > 0
    # TileGym is not installed on the CPU machine (and needs a GPU): its failure is a row, not a crash.
    assert "error" in by_peer["tilegym"] and "ms" not in by_peer["tilegym"]
    assert "| 100 | 16 |" in table and "fails:" in table


def test_bench_compares_tuned_with_the_default(bench_run):
    """m2ops-default (no search, no stored winner) beside m2ops: both timed, and the table's ratio column."""
    results, table, _, _ = bench_run(*_TWINS)
    by_peer = {r["peer"]: r for r in results}
    assert by_peer["m2ops"]["ms"] > 0 and by_peer["m2ops-default"]["ms"] > 0
    head = next(line for line in table.splitlines() if line.startswith("| T |"))
    row = next(line for line in table.splitlines() if line.startswith("| 100 |"))
    col = head.split(" | ").index("default / tuned")
    assert float(row.split(" | ")[col]) > 0


def _job(seqlen, peer="m2ops"):
    shape = Shape(batch=1, seqlen=seqlen, nheads=2, headdim=8, ngroups=1, dstate=16, dtype="float32")
    return dict(peer=peer, shape=shape.as_dict(), chunk_size=32, runs=2, warmup=1, device="cpu")


def test_pool_serves_points_from_one_worker_and_replaces_a_failed_one():
    with Pool() as pool:
        first = pool.run("m2ops", _job(100), timeout=120)
        pid = pool.workers["m2ops"].proc.pid
        second = pool.run("m2ops", _job(200), timeout=120)
        assert "ms" in first and "ms" in second
        assert pool.workers["m2ops"].proc.pid == pid  # the same process served both points
        failed = pool.run("m2ops", dict(_job(100), chunk_size=0), timeout=120)
        assert "error" in failed and "m2ops" not in pool.workers  # a failed worker is dropped ...
        assert "ms" in pool.run("m2ops", _job(100), timeout=120)  # ... and the next point gets a fresh one
        assert pool.workers["m2ops"].proc.pid != pid


def test_fresh_pool_gives_every_point_its_own_worker():
    """--fresh: each peer and shape in a process of its own, ended after its point."""
    with Pool(fresh=True) as pool:
        procs = []
        for seqlen in (100, 200):
            r = pool.run("m2ops", _job(seqlen), timeout=120)
            assert "ms" in r and r["pid"] not in procs
            procs.append(r["pid"])
            assert "m2ops" not in pool.workers  # ended after its point
    assert len(set(procs)) == 2


def test_bench_fresh_measures_each_point_in_its_own_process(tmp_path):
    """The command line's --fresh reaches the pool: two points of one peer, two worker processes; without it, one."""
    grid = ("--seqlens", "100,200", "--peers", "m2ops")
    fresh, _ = _bench(tmp_path / "fresh", *grid, "--fresh")
    shared, _ = _bench(tmp_path / "shared", *grid)
    assert len({r["pid"] for r in fresh}) == 2 and len({r["pid"] for r in shared}) == 1


def test_pool_records_a_timeout_and_kills_the_worker():
    with Pool() as pool:
        r = pool.run("m2ops", _job(100), timeout=0.01)  # not even the imports finish
        assert r == {"error": "timeout after 0 s"} and not pool.workers
        assert "ms" in pool.run("m2ops", _job(100), timeout=120)


def test_pool_timeout_holds_while_a_worker_prints_without_a_newline():
    """A peer's progress output without a newline (a \\r progress bar) must not keep the pool waiting."""
    import time

    from m2ops.bench.pool import _Worker
    script = "import sys, time\nsys.stdin.readline()\nprint('progress 1/8', end='', flush=True)\ntime.sleep(60)"
    w = _Worker([sys.executable, "-c", script])
    t0 = time.monotonic()
    assert w.ask({"job": 1}, timeout=2) == {"error": "timeout after 2 s"}
    assert time.monotonic() - t0 < 20 and not w.alive()


def test_bench_resume_keeps_measured_points(bench_run, tmp_path):
    """The default peers' run (on the CPU: m2ops), run again with --resume in a copy of its directory."""
    run = bench_run()
    shutil.copytree(run.out, tmp_path / "out")
    first = run.results
    again = _bench_here(tmp_path / "out", "--resume").results
    assert again == first  # nothing re-run


def test_floor_is_bandwidth_bound_at_the_protocol_shape():
    s = Shape(seqlen=16384, dstate=128)
    # x and y in bf16 dominate: 2 * 16K * 80 * 64 * 2 bytes ~ 336 MB, about 0.08 ms at 4.3 TB/s (DESIGN.md §3)
    assert 0.07 < s.floor_ms() < 0.09
    assert s.bytes_moved() / 4.3e12 > s.flops() / 790e12


def test_bench_backward_mode_times_forward_and_backward(bench_run):
    results, table, _, out = bench_run(*_BACKWARD)
    (r,) = results
    assert r["mode"] == "fwd+bwd" and r["ms"] > 0
    assert r["floor_ms"] == Shape(seqlen=100, dstate=16, nheads=2, headdim=8, dtype="float32").floor_ms(backward=True)
    assert "fwd+bwd, ms" in table and (out / "results-backward.md").exists()


def test_bench_kernels_records_time_per_kernel(bench_run):
    """--kernels: each point's profile, largest first, names without specialisation suffixes; on the CPU the
    m2ops call's operators, its custom ops among them. Without it (the default peers' run): no profile."""
    results, table, _, _ = bench_run(*_CHECK_KERNELS)
    (r,) = results
    times = r["kernel_ms"]
    ranked = [ms for name, ms in times.items() if name != "(others)"]
    assert ranked and all(ms > 0 for ms in ranked) and ranked == sorted(ranked, reverse=True)
    assert len(ranked) <= 12 and any(name.startswith("m2ops::") for name in times)
    top = next(iter(times))
    assert "per kernel (--kernels)" in table and f"| 100 | 16 | m2ops | {r['ms']:.3f} | {top} " in table
    results, table, _, _ = bench_run()
    assert "kernel_ms" not in results[0] and "per kernel" not in table


def test_kernel_short_names():
    from m2ops.bench.kernels import short_name
    assert short_name("compute_out_kernel_Kt2_A4_B1") == "compute_out_kernel"
    assert short_name("_chunk_scan_fwd_kernel") == "_chunk_scan_fwd_kernel"
    assert short_name("x" * 100) == "x" * 80


def test_backward_build_returns_every_gradient():
    import torch

    from m2ops.bench.peers import build, make_inputs
    s = Shape(seqlen=40, dstate=8, nheads=2, headdim=4, dtype="float32")
    inputs = make_inputs(s, "cpu")
    grads = build("m2ops", inputs, 16, backward=True)()
    assert [tuple(g.shape) for g in grads] == [tuple(inputs[k].shape) for k in
                                                ("x", "dt", "A", "B", "C", "D", "initial_states")]
    assert all(torch.isfinite(g).all() for g in grads)


def test_bench_check_reports_m2ops_errors_against_the_reference(bench_run):
    results, table, _, _ = bench_run(*_CHECK_KERNELS)
    (r,) = results
    assert r["err_y"] < 1e-5 and r["err_final"] < 1e-5  # float32 on the CPU: the reference itself
    assert "m2ops error y / final" in table


def test_bench_spreads_rows_over_gpus(tmp_path):
    """--gpus 0,1: each row (a shape with its peers) on one GPU's workers (CUDA_VISIBLE_DEVICES), the next
    row on whichever is free; one results file and one table for all of them."""
    results, table = _bench(tmp_path, "--peers", "m2ops,m2ops-default", "--seqlens", "64,100,160", "--gpus", "0,1")
    assert len(results) == 6 and all(r["ms"] > 0 for r in results)
    by_key = {}
    for r in results:
        by_key.setdefault(r["key"], set()).add(r["gpu"])
    assert all(len(g) == 1 for g in by_key.values())  # a row's peers share a GPU
    assert set().union(*by_key.values()) == {"0", "1"}
    assert all(f"| {t} | 16 |" in table for t in (64, 100, 160))


def test_bench_rejects_bad_gpu_lists():
    import pytest

    from m2ops.bench.__main__ import parse_args
    assert parse_args(["--gpus", "0, 1"]).gpus == ["0", "1"]
    for bad in ("cuda:0", "0,0", ",", "-1"):
        with pytest.raises(SystemExit):
            parse_args(["--gpus", bad])


def test_bench_runs_a_peer_only_at_its_points(bench_run):
    """--peer-points: m2ops-default at one point of the grid, m2ops at all of them."""
    results, table, _, _ = bench_run(*_TWINS)
    assert sorted((r["peer"], r["shape"]["seqlen"]) for r in results) == [
        ("m2ops", 64), ("m2ops", 100), ("m2ops-default", 100)]
    assert all(r["ms"] > 0 for r in results)


def test_bench_parses_peer_points():
    import pytest

    from m2ops.bench.__main__ import parse_args
    a = parse_args(["--peer-points", "tilegym-tuned=64K:64,16K:128", "--peer-points", "m2ops-default=1K:512"])
    assert dict(a.peer_points) == {"tilegym-tuned": {(65536, 64), (16384, 128)}, "m2ops-default": {(1024, 512)}}
    for bad in ("tilegym-tuned", "nobody=1K:64", "tilegym-tuned=64K", "tilegym-tuned=64K:x"):
        with pytest.raises(SystemExit):
            parse_args(["--peer-points", bad])


def test_bench_backward_check_reports_gradient_errors(bench_run):
    results, table, _, _ = bench_run(*_BACKWARD)
    (r,) = results
    assert set(r["err_grads"]) == {"x", "dt", "A", "B", "C", "D", "initial_states"}
    assert r["err_grad_max"] == max(r["err_grads"].values()) < 1e-5  # float32 on the CPU: the reference itself
    assert "m2ops largest gradient error" in table


def test_check_reference_grads_match_autograd_of_the_public_function_with_groups():
    """The head-sliced reference gradients of --check --backward equal autograd through the public function
    (CPU, float64), ngroups > 1 and a head slice that does not divide the heads; a wrong gradient is caught."""
    import torch

    from m2ops import mamba_chunk_scan_combined
    from m2ops.bench.check import GRAD_NAMES, grad_errors, reference_grads, rel_err
    from m2ops.bench.peers import build, cotangents, make_inputs
    s = Shape(seqlen=70, dstate=8, nheads=6, headdim=4, ngroups=3, dtype="float32")
    inp = {k: v.double() for k, v in make_inputs(s, "cpu").items()}
    dout, dfinal = cotangents(inp)
    leaves = [inp[k].clone().requires_grad_() for k in GRAD_NAMES]
    x, dt, A, B, C, D, init = leaves
    y, fin = mamba_chunk_scan_combined(x, dt, A, B, C, 32, D=D, initial_states=init, return_final_states=True)
    want = torch.autograd.grad((y, fin), leaves, (dout, dfinal))
    got = reference_grads(inp, 32, dout, dfinal, heads_per_step=4)
    for name, g, w in zip(GRAD_NAMES, got, want):  # the reference computes in float32
        assert rel_err(g, w) < 1e-6, name
    grads = build("m2ops", make_inputs(s, "cpu"), 32, backward=True)()
    assert grad_errors(make_inputs(s, "cpu"), 32, grads, *cotangents(make_inputs(s, "cpu")))["err_grad_max"] < 1e-5
    wrong = list(grads)
    wrong[1] = wrong[1] * 1.01
    errs = grad_errors(make_inputs(s, "cpu"), 32, wrong, *cotangents(make_inputs(s, "cpu")))
    assert errs["err_grads"]["dt"] > 5e-3 and errs["err_grads"]["x"] < 1e-5


def test_check_reference_matches_the_public_function_with_groups():
    """The head-sliced reference of --check equals the public function (CPU, float32), ngroups > 1 and a
    head slice that does not divide the heads."""
    import torch

    from m2ops import mamba_chunk_scan_combined
    from m2ops.bench.check import reference
    from m2ops.bench.peers import make_inputs
    s = Shape(seqlen=70, dstate=8, nheads=6, headdim=4, ngroups=3, dtype="float32")
    inp = make_inputs(s, "cpu")
    y, fin = mamba_chunk_scan_combined(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 32, D=inp["D"],
                                       initial_states=inp["initial_states"], return_final_states=True)
    y_ref, fin_ref = reference(inp, 32, heads_per_step=4)
    torch.testing.assert_close(y_ref, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fin_ref, fin, rtol=1e-5, atol=1e-5)


def test_default_over_tuned_prefers_the_cuda_graph_pair():
    """With both graph peers present the tuner's gain is their ratio (eager calls can be host-bound)."""
    from m2ops.bench.report import markdown
    shape = dict(seqlen=1024, dstate=64, batch=1, nheads=80, headdim=64, ngroups=1, dtype="bfloat16")
    times = {"m2ops": 0.40, "m2ops-default": 0.80, "m2ops-graph": 0.10, "m2ops-default-graph": 0.11}
    results = [dict(peer=p, ms=ms, key="k", shape=shape, floor_ms=0.01) for p, ms in times.items()]
    table = markdown(results, list(times)).splitlines()
    col = table[0].split(" | ").index("default / tuned")
    assert table[2].split(" | ")[col] == "1.10"
    eager = markdown(results[:2], ["m2ops", "m2ops-default"]).splitlines()
    assert eager[2].split(" | ")[eager[0].split(" | ").index("default / tuned")] == "2.00"


def test_m2ops_choice_reads_the_tuned_configuration(tmp_path, monkeypatch):
    """m2ops_choice names the tuning cache's chunk_scan entry for the point's shape (else "default") and whether an
    eager call took a plan: what a result row needs to tell a host-bound eager time from a slow kernel."""
    from m2ops.bench.peers import m2ops_choice, make_inputs
    from m2ops.kernels import autotune, planned, scan
    from m2ops.ops import eager
    monkeypatch.setenv("M2OPS_TUNING_CACHE", str(tmp_path / "tuning.json"))
    monkeypatch.setattr(planned, "CALL_PLANS", {})
    autotune.forget()
    inp = make_inputs(Shape(seqlen=64, dstate=8, nheads=2, headdim=4, ngroups=1, dtype="float32"), "cpu")
    assert m2ops_choice(inp, 32) == {"m2ops_config": "default", "m2ops_planned": False}
    key = autotune.full_key("chunk_scan", scan.chunk_scan_shape_key(inp["x"], 32, inp["B"], None, inp["D"], None))
    other = autotune.full_key("chunk_scan", scan.chunk_scan_shape_key(inp["x"], 64, inp["B"], None, inp["D"], None))
    sub = {"path": "split", "state_block": 512, "chunk": 16}
    (tmp_path / "tuning.json").write_text(json.dumps({key: {"config": sub, "ms": 0.1},
                                                       other: {"config": {"path": "fused"}, "ms": 0.1}}))
    autotune.forget()
    assert m2ops_choice(inp, 32)["m2ops_config"] == sub
    # planned: a plan is kept under the key of this point's call (the bench's call, defaults spelled out), not
    # merely under another point's
    plan = planned.ForwardPlan(None, (), {}, False, None, (), None, None, object())
    monkeypatch.setattr(planned, "CALL_PLANS", {"another point": plan})
    assert m2ops_choice(inp, 32)["m2ops_planned"] is False
    x, dt, A, B, C, D, init = (inp[k] for k in ("x", "dt", "A", "B", "C", "D", "initial_states"))
    key32 = eager.call_key(x, dt, A, B, C, 32, D, None, None, init, None, None, False, (0.0, float("inf")), True,
                           False, first=True)
    planned.CALL_PLANS[key32] = plan
    assert m2ops_choice(inp, 32)["m2ops_planned"] is True
    assert m2ops_choice(inp, 64)["m2ops_planned"] is False
    autotune.forget()


def test_every_peer_has_a_cuda_graph_twin():
    """Each peer also runs as "<peer>-graph", which calls what the peer calls."""
    from m2ops.bench.peers import PEERS, eager_name
    eager = [p for p in PEERS if not p.endswith("-graph")]
    assert {"m2ops", "mamba_ssm-c128", "tilegym", "tilegym-tuned"} <= set(eager)
    assert all(p + "-graph" in PEERS for p in eager)
    assert eager_name("tilegym-tuned-graph") == "tilegym-tuned" and eager_name("tilegym") == "tilegym"
    assert len(PEERS) == 2 * len(eager)


def test_a_graph_peer_is_compared_with_the_m2ops_graph_replay():
    """Speedups pair eager with eager and graph replay with graph replay; a graph peer without an m2ops replay
    gets an empty cell, never a ratio against the eager call."""
    from m2ops.bench.report import markdown
    shape = dict(seqlen=1024, dstate=64, batch=1, nheads=80, headdim=64, ngroups=1, dtype="bfloat16")
    times = {"m2ops": 0.20, "m2ops-graph": 0.05, "tilegym": 0.30, "tilegym-graph": 0.10}
    results = [dict(peer=p, ms=ms, key="k", shape=shape, floor_ms=0.01) for p, ms in times.items()]
    head, _, row = markdown(results, list(times)).splitlines()
    cells = dict(zip(head.split(" | "), row.split(" | ")))
    assert cells["× vs tilegym"] == "1.50" and cells["× m2ops-graph vs tilegym-graph"] == "2.00"
    no_replay = [r for r in results if r["peer"] != "m2ops-graph"]
    head, _, row = markdown(no_replay, ["m2ops", "tilegym", "tilegym-graph"]).splitlines()
    assert dict(zip(head.split(" | "), row.split(" | ")))["× m2ops-graph vs tilegym-graph"] == ""


def test_a_graph_peer_without_a_gpu_is_a_recorded_error(bench_run):
    """On the CPU a graph twin cannot capture: its row says so, and the eager peer beside it is timed."""
    results, table, _, _ = bench_run(*_CANNOT)
    by_peer = {r["peer"]: r for r in results}
    assert by_peer["m2ops"]["ms"] > 0 and "error" in by_peer["mamba_ssm-c64-graph"]
    assert "× m2ops-graph vs mamba_ssm-c64-graph" in table


def test_every_time_is_given_as_a_multiple_of_the_floor():
    """Each peer's cell holds its ms and, in parentheses, that time over the point's floor; a failure has none."""
    from m2ops.bench.report import markdown
    shape = dict(seqlen=4096, dstate=64, batch=1, nheads=80, headdim=64, ngroups=1, dtype="bfloat16")
    results = [dict(peer="m2ops", ms=0.100, key="k", shape=shape, floor_ms=0.02),
               dict(peer="tilegym", ms=0.180, key="k", shape=shape, floor_ms=0.02),
               dict(peer="mamba_ssm-c128", error="RuntimeError: boom", key="k", shape=shape, floor_ms=0.02)]
    head, _, row = markdown(results, ["m2ops", "mamba_ssm-c128", "tilegym"]).splitlines()
    cells = dict(zip(*([c.strip() for c in line.strip("|").split("|")] for line in (head, row))))
    assert cells["m2ops ms (× floor)"] == "0.100 (5.0)" and cells["tilegym ms (× floor)"] == "0.180 (9.0)"
    assert cells["mamba_ssm-c128 ms (× floor)"].startswith("fails:") and cells["floor ms"] == "0.02"


@pytest.mark.parametrize("argv, option", [
    (["--seqlens", "4Q"], "--seqlens"),
    (["--seqlens", "0,1K"], "--seqlens"),
    (["--dstates", "64,,128"], "--dstates"),
    (["--batch", "0"], "--batch"),
    (["--nheads", "-2"], "--nheads"),
    (["--headdim", "0"], "--headdim"),
    (["--chunk-size", "0"], "--chunk-size"),
    (["--runs", "0"], "--runs"),
    (["--warmup", "-1"], "--warmup"),
    (["--timeout", "0"], "--timeout"),
    (["--ngroups", "3"], "--ngroups"),  # does not divide the default 80 heads
    (["--peers", "m2ops,nobody"], "--peers"),
    (["--peers", "m2ops,m2ops"], "--peers"),
    (["--peer-points", "nobody=1K:64"], "--peer-points"),
    (["--peer-points", "tilegym-tuned=4Q:64"], "--peer-points"),
    (["--device", "tpu"], "--device"),
])
def test_bench_rejects_a_bad_option_in_one_line(argv, option, capsys):
    from m2ops.bench.__main__ import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and f"argument {option}:" in err, err
    if option == "--peers" and "nobody" in argv[1]:
        assert "unknown peer nobody; known: m2ops," in err


def test_parse_sizes_takes_positive_sizes_with_k():
    from m2ops.bench.shapes import parse_sizes
    assert parse_sizes("1K, 4k,128") == [1024, 4096, 128]
    for bad in ("4Q", "0", "-1K", "", "1K,", "K", "1.5K"):
        with pytest.raises(ValueError, match="positive sizes"):
            parse_sizes(bad)


def test_bench_help_shows_defaults_and_cites_no_design_doc(capsys):
    from m2ops.bench.__main__ import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "DESIGN.md" not in out and "docs/benchmarks.md" in out
    for default in ("(default: 1K,4K,16K,64K,256K)", "(default: 256)", "(default: 100)", "(default: bench-results)"):
        assert default in out, default


def test_default_peers_that_cannot_run_are_skipped_with_the_reason():
    """--device cpu: the CUDA-graph and GPU-only default peers are left out, one line each; m2ops stays."""
    from m2ops.bench.__main__ import DEFAULT_PEERS, _runnable, parse_args
    lines = []
    peers, cannot = _runnable(parse_args(["--device", "cpu"]), say=lines.append)
    assert peers == ["m2ops"] and cannot == {}
    assert len(lines) == len(DEFAULT_PEERS) - 1
    assert all(line.startswith(f"python -m m2ops.bench: skipping {p}: ") and "needs a CUDA device" in line
               for p, line in zip(DEFAULT_PEERS[1:], lines))


def test_a_named_peer_that_cannot_run_is_announced_and_recorded():
    from m2ops.bench.__main__ import _runnable, parse_args
    lines = []
    peers, cannot = _runnable(parse_args(["--device", "cpu", "--peers", "m2ops,tilegym-graph"]), say=lines.append)
    assert peers == ["m2ops", "tilegym-graph"] and list(cannot) == ["tilegym-graph"]
    assert "needs a CUDA device" in cannot["tilegym-graph"]
    (line,) = lines
    assert "tilegym-graph cannot run here" in line and "named in --peers" in line


def test_unavailable_names_a_missing_package(monkeypatch):
    import importlib.util

    from m2ops.bench import peers
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert peers.unavailable("mamba_ssm-c128", "cuda") == "mamba_ssm is not installed"
    assert peers.unavailable("tilegym-tuned-graph", "cpu") == (
        "tilegym is not installed; needs a CUDA device, and this run's device is cpu")
    assert peers.unavailable("m2ops-default", "cpu") is None and peers.unavailable("m2ops-graph", "cuda") is None


def test_bench_on_the_cpu_skips_the_peers_it_cannot_run(bench_run):
    """The default peers on the CPU: m2ops is timed, the others are skipped with a line each, not recorded."""
    results, stdout, stderr, _ = bench_run()
    assert [r["peer"] for r in results] == ["m2ops"] and results[0]["ms"] > 0
    assert "skipping tilegym: " in stderr and "skipping m2ops-graph: " in stderr
    assert "fails:" not in stdout
