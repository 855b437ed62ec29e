"""m2ops.distributed.mamba_chunk_scan_combined on the CPU: 4 processes with gloo, spawned once (also for the
layer's cases of test_distributed_layer.py).

Every case builds the whole sequence's inputs on every rank (same seed), runs the plain one-process call with
gradients, then the context-parallel call on each rank's slice, and compares: y is the slice of the plain y,
the final state the plain one (and the same bits on every rank), the sliced inputs' gradients are slices of the
plain ones, and the replicated inputs' gradients summed over the group (all_reduce) are the plain ones. Groups
of 2 and 3 ranks are subgroups of the 4 (the other ranks skip those cases). Bad calls must raise on every rank.

The workers write one JSON file per rank (case -> None or the failure); the tests read them.
"""

from __future__ import annotations

import datetime
import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import Dims, make_inputs, max_rel_err, seq_idx_from_starts

WORLD = 4
SLICED = ("x", "dt", "B", "C", "z")
SHARED = ("A", "D", "dt_bias", "initial_states")
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


@dataclass(frozen=True)
class Case:
    """A call split at `cuts` (slice boundaries; len(cuts) - 1 ranks). rows: explicit packed sequences, per batch
    row a tuple of (start, id) pairs; group: how the group is passed."""
    name: str
    cuts: tuple
    options: dict = field(default_factory=dict)  # make_inputs options
    flags: dict = field(default_factory=dict)    # dt_softplus, dt_limit
    dtype: torch.dtype = torch.float64
    dims: Dims = Dims(batch=2, seqlen=0, nheads=4, headdim=8, ngroups=2, dstate=16)
    chunk: int = 8
    rows: tuple | None = None
    group: str = "sub"  # "sub": the first len(cuts) - 1 ranks; "all": None; "mesh": a 1-D DeviceMesh of the 4;
    #                     "mesh2d": (mesh, "cp") of a 2 x 2 (dp, cp) mesh
    compiled: bool = False


EVERYTHING = dict(D="hp", z=True, dt_bias=True, initial_states=True)
CASES = [
    Case("two_ranks_plain", (0, 13, 30)),
    Case("two_ranks_everything", (0, 21, 30), dict(EVERYTHING, seq_idx=True, nseqs=4),
         dict(dt_softplus=True, dt_limit=(0.05, 1.2))),
    Case("two_ranks_D_per_head_float32", (0, 9, 40), dict(D="h", z=True, initial_states=True), dtype=torch.float32),
    Case("three_ranks_sequence_across_three", (0, 5, 9, 20), dict(EVERYTHING, seq_idx=True),
         rows=(((0, 0), (3, 1), (12, 2)), ((0, 0), (5, 1), (15, 3)))),
    Case("three_ranks_one_group", (0, 11, 12, 25), dict(EVERYTHING),
         dims=Dims(batch=1, seqlen=0, nheads=6, headdim=4, ngroups=1, dstate=8), flags=dict(dt_softplus=True)),
    # Row 0: one sequence over all four ranks. Row 1: its first id is not 0 (initial_states belongs to sequence
    # 0, so no rank sees it), sequences start exactly at the rank boundaries 7 and 8, and one spans ranks 2 and 3.
    Case("four_ranks_packed", (0, 7, 8, 19, 30), dict(EVERYTHING, seq_idx=True),
         rows=(((0, 0),), ((0, 2), (7, 3), (8, 5), (25, 6))), flags=dict(dt_softplus=True), group="all"),
    Case("four_ranks_empty_slice", (0, 10, 10, 21, 30), dict(EVERYTHING, seq_idx=True),
         rows=(((0, 0), (4, 1)), ((0, 0), (10, 1), (22, 2))), group="all"),
    Case("four_ranks_int32_ids_float32", (0, 16, 40, 41, 64), dict(EVERYTHING, seq_idx=True, nseqs=5,
                                                                index_dtype=torch.int32), dtype=torch.float32,
         chunk=16, group="all"),
    Case("four_ranks_device_mesh", (0, 3, 17, 18, 33), dict(D="h", initial_states=True), group="mesh"),
    Case("device_mesh_dim_of_2d_mesh", (0, 14, 23), dict(EVERYTHING, seq_idx=True), group="mesh2d"),
    Case("two_ranks_compiled", (0, 12, 27), dict(EVERYTHING, seq_idx=True), dict(dt_softplus=True),
         compiled=True),
]


def _global_inputs(case: Case):
    T = case.cuts[-1]
    inputs = make_inputs(case.dims.but(seqlen=T), dtype=case.dtype, seed=len(case.name), **case.options)
    inputs.pop("cu_seqlens")
    if case.rows is not None:
        rows = [seq_idx_from_starts([s for s, _ in row], T, [i for _, i in row]) for row in case.rows]
        inputs["seq_idx"] = torch.stack(rows).to(inputs["seq_idx"].dtype)
    return inputs


def _leaves(inputs):
    return {k: (v.detach().clone().requires_grad_(v.is_floating_point()) if v is not None else None)
            for k, v in inputs.items()}


def _run_case(case: Case, rank: int, groups):
    import m2ops
    from m2ops.distributed import mamba_chunk_scan_combined as cp_scan

    n_ranks = len(case.cuts) - 1
    if case.group == "mesh2d":  # two context-parallel pairs, {0, 1} and {2, 3}, each on the whole sequence
        group, pg = (groups["mesh2d"], "cp"), groups["mesh2d"].get_group("cp")
        rank = dist.get_rank(pg)
    elif rank >= n_ranks:
        return
    else:
        group = {"sub": groups.get(n_ranks), "all": None, "mesh": groups.get("mesh")}[case.group]
        pg = groups[n_ranks] if n_ranks < WORLD else dist.group.WORLD
    inputs = _global_inputs(case)
    full = _leaves(inputs)
    y, final = m2ops.mamba_chunk_scan_combined(chunk_size=case.chunk, **full, **case.flags, return_final_states=True)
    gen = torch.Generator().manual_seed(1)
    g_y = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype)
    g_final = torch.randn(final.shape, generator=gen, dtype=torch.float64).to(final.dtype)
    ((y * g_y).sum() + (final * g_final).sum()).backward()

    lo, hi = case.cuts[rank], case.cuts[rank + 1]
    mine = _leaves({k: (v[:, lo:hi] if k in SLICED + ("seq_idx",) and v is not None else v)
                    for k, v in inputs.items()})
    call = torch.compile(cp_scan, fullgraph=True, backend="aot_eager") if case.compiled else cp_scan
    y_r, final_r = call(chunk_size=case.chunk, **mine, **case.flags, return_final_states=True, group=group)
    # Each rank's loss holds the final state's term once per rank: 1/n of it each sums to the plain loss.
    ((y_r * g_y[:, lo:hi]).sum() + (final_r * g_final).sum() / n_ranks).backward()

    tol = TOL[case.dtype]
    checks = [("y", y_r, y[:, lo:hi]), ("final_states", final_r, final)]
    checks += [(f"grad {k}", mine[k].grad, full[k].grad[:, lo:hi]) for k in SLICED if mine[k] is not None]
    for k in SHARED:
        if mine[k] is not None:
            g = mine[k].grad.clone()
            dist.all_reduce(g, group=pg)
            checks.append((f"grad {k} summed over ranks", g, full[k].grad))
    for what, got, expected in checks:
        assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}"
        err = max_rel_err(got, expected)
        assert err <= tol, f"{what}: max relative error {err:.3e} > {tol:.0e}"
    finals = [torch.empty_like(final_r) for _ in range(n_ranks)]
    dist.all_gather(finals, final_r.detach().contiguous(), group=pg)
    assert all(torch.equal(f, finals[0]) for f in finals), "final_states differ between ranks"


# ---- bad calls: each must raise on every rank (or on the ranks named), and leave the ranks in step ----

BAD = {
    # name: the part of every rank's error message, or {rank: that rank's part, None: the rank returns normally};
    # what each call changes is in _run_bad
    "nheads_differ": "nheads must be the same on every rank",
    "dtype_differs": "x.dtype must be the same on every rank",
    "shape_error_on_one_rank": {3: "(rank 3 of the group): dt must be of shape", 0: "rank(s) [3] of the group failed",
                                1: "rank(s) [3]", 2: "rank(s) [3]"},
    "initial_states_on_some_ranks": "initial_states must be the same on every rank",
    "gradients_on_some_ranks": "gradients must be the same on every rank",
    "chunk_size_differs": "chunk_size must be the same on every rank",
    "decreasing_ids_on_one_rank": {2: "seq_idx must be non-decreasing", 0: "rank(s) [2]", 1: "rank(s) [2]",
                                   3: "rank(s) [2]"},
    "group_not_a_group": "group must be None, a torch.distributed ProcessGroup",
    "group_without_this_rank": {2: "group must contain this process", 3: "group must contain this process",
                                0: None, 1: None},
    "two_dim_mesh": "group must be a 1-D DeviceMesh or (mesh, dim)",
}


def _run_bad(name: str, rank: int, groups):
    from m2ops.distributed import mamba_chunk_scan_combined as cp_scan

    dims = Dims(batch=1, seqlen=6, nheads=4, headdim=4, ngroups=1, dstate=8)
    kw = dict(chunk_size=4, group=None)
    if name == "nheads_differ" and rank == 1:
        dims = dims.but(nheads=2)
    inputs = make_inputs(dims, dtype=torch.float32 if name == "dtype_differs" and rank == 2 else torch.float64,
                         initial_states=not (name == "initial_states_on_some_ranks" and rank == 0), seq_idx=True,
                         requires_grad=name == "gradients_on_some_ranks" and rank == 3)
    inputs.pop("cu_seqlens")
    if name == "shape_error_on_one_rank" and rank == 3:
        inputs["dt"] = inputs["dt"][:, :-1]
    if name == "chunk_size_differs" and rank == 0:
        kw["chunk_size"] = 8
    if name == "decreasing_ids_on_one_rank" and rank == 2:
        inputs["seq_idx"] = torch.tensor([[3, 3, 2, 2, 4, 4]])
    if name == "group_not_a_group":
        kw["group"] = "cp"
    if name == "group_without_this_rank":
        kw["group"] = groups[2]
    if name == "two_dim_mesh":
        kw["group"] = groups["mesh2d"]
    try:
        cp_scan(**inputs, **kw)
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _entry(rank: int, world: int, store_dir: str, worker):
    """One spawned rank: a gloo group of `world` through a file store, worker(rank, world) -> results, written as
    JSON for the parent."""
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = worker(rank, world)
    with open(os.path.join(store_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def spawn_world(worker, world: int, seconds: float = 240) -> list[dict]:
    """Run worker (a module-level function, so that spawned processes can import it) on `world` CPU ranks;
    returns each rank's results. A hang fails the test after `seconds` instead of hanging the suite."""
    with tempfile.TemporaryDirectory() as store_dir:
        ctx = mp.spawn(_entry, args=(world, store_dir, worker), nprocs=world, join=False)
        deadline = time.monotonic() + seconds
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"the spawned ranks did not finish in {seconds} s (a hang in a collective?)")
        out = []
        for r in range(world):
            with open(os.path.join(store_dir, f"rank{r}.json")) as f:
                out.append(json.load(f))
        return out


def run_each(cases, run, rank, *args) -> dict:
    """{case name: None or the failure's traceback}, running run(case, rank, *args) for each case."""
    results = {}
    for case in cases:
        try:
            run(case, rank, *args)
            results[case.name] = None
        except Exception:  # noqa: BLE001 (reported to the test)
            results[case.name] = traceback.format_exc()
    return results


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    groups = {2: dist.new_group([0, 1]), 3: dist.new_group([0, 1, 2]),
              "mesh": init_device_mesh("cpu", (WORLD,)),
              "mesh2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))}
    results = run_each(CASES, _run_case, rank, groups)
    for name in BAD:
        results["bad:" + name] = _run_bad(name, rank, groups)
        dist.barrier()
    results["in_step_after_bad_calls"] = run_each(CASES[:1], _run_case, rank, groups)[CASES[0].name]
    from test_distributed_layer import layer_worker  # the layer's cases share this world (one spawn),
    from test_tensor_parallel import _worker as tp_worker  # and the tensor-parallel layer's
    results.update(layer_worker(rank, world))
    results.update({"tp:" + k: v for k, v in tp_worker(rank, world).items()})
    return results


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_equals_one_process(cp_results, case):
    failures = [f"rank {r}:\n{res[case.name]}" for r, res in enumerate(cp_results) if res[case.name] is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_call_raises_on_every_rank(cp_results, name):
    expected = BAD[name]
    for r, res in enumerate(cp_results):
        want = expected.get(r) if isinstance(expected, dict) else expected
        got = res["bad:" + name]
        if want is None:
            assert got is None, f"rank {r} raised: {got}"
        else:
            assert got is not None and want in got, f"rank {r}: expected an error with {want!r}; got {got!r}"


def test_ranks_in_step_after_bad_calls(cp_results):
    failures = [f"rank {r}:\n{res['in_step_after_bad_calls']}" for r, res in enumerate(cp_results)
                if res["in_step_after_bad_calls"] is not None]
    assert not failures, "\n".join(failures)


def test_group_of_one_is_the_plain_call():
    """Without other ranks the call is the plain one, bit for bit (a one-process gloo group in this process)."""
    import m2ops
    from m2ops.distributed import mamba_chunk_scan_combined as cp_scan

    inputs = make_inputs(Dims(seqlen=20), **EVERYTHING, seq_idx=True)
    inputs.pop("cu_seqlens")
    if dist.is_initialized():
        pytest.skip("torch.distributed already initialized in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
        try:
            got = cp_scan(chunk_size=8, **inputs, return_final_states=True)
        finally:
            dist.destroy_process_group()
    expected = m2ops.mamba_chunk_scan_combined(chunk_size=8, **inputs, return_final_states=True)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_needs_initialized_distributed():
    from m2ops.distributed import mamba_chunk_scan_combined as cp_scan

    if dist.is_initialized():
        pytest.skip("torch.distributed initialized in this process")
    inputs = make_inputs(Dims(seqlen=4))
    inputs.pop("cu_seqlens")
    with pytest.raises(ValueError, match="init_process_group"):
        cp_scan(chunk_size=4, **inputs)
