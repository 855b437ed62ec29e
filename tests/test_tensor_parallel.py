"""m2ops.Mamba2(process_group=...) on spawned CPU processes (gloo): the heads and groups split across ranks.

The cases run in the 4-rank world that conftest.py's cp_results spawns once for the distributed test files; the
2-rank cases run on the subgroup of ranks 0 and 1. Every rank builds the same one-rank m2ops.Mamba2 (same seed, float64) and runs it on
the whole input with gradients, then the tensor-parallel layer loaded with load_full_state_dict of the same
state dict on the same input (with sequence_parallel, its share of the tokens), and compares: the output (the
rank's share), the caches (the rank's shard of the whole caches), the input's gradient (the rank's share) and
every parameter's gradient (the rank's shard of the whole gradient; out_proj's replicated bias the whole one).

Each rank's loss is the whole output's term (or, with sequence_parallel, its rows' term) plus its own caches'
term: Megatron-LM's convention, under which the sum over ranks of the sharded terms is the one-rank loss.

Also here: FSDP2 (fully_shard) on a plain m2ops.Mamba2 over 2-rank CPU meshes, and the errors that need no
other process (a one-process fake group).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from conftest import max_rel_err, seq_idx_from_starts
from test_distributed_scan import run_each

TOL = 1e-10
B, T, D_MODEL = 2, 12, 16


@dataclass(frozen=True)
class TPCase:
    name: str
    ranks: int                                   # 2: the subgroup of ranks 0 and 1; 4: the default group
    layer: dict = field(default_factory=dict)    # m2ops.Mamba2 arguments besides the defaults of _layers
    sp: bool = False                             # sequence_parallel
    flat: bool = False                           # u as (batch * seqlen, d_model) with seqlen=
    packed: bool = False                         # seq_idx: sequences restart inside each row
    final: bool = False                          # return_final_states, then `step` over a few tokens


CASES = [
    TPCase("two_ranks_mem_eff", 2),
    TPCase("two_ranks_sequence_parallel_bias", 2, dict(bias=True), sp=True, packed=True),
    TPCase("two_ranks_mlp_part_plain_path", 2, dict(d_ssm=16, use_mem_eff_path=False), sp=True),
    TPCase("two_ranks_gate_in_scan_D_per_channel", 2, dict(rmsnorm=False, D_has_hdim=True), packed=True),
    TPCase("two_ranks_final_states_and_step", 2, dict(bias=True), packed=True, final=True),
    TPCase("four_ranks_flattened_sequence_parallel", 4, dict(ngroups=4, bias=True), sp=True, flat=True,
           packed=True),
    TPCase("four_ranks_mlp_part_final_states_and_step", 4, dict(ngroups=4, d_ssm=16, D_has_hdim=True), sp=True,
           final=True),
    TPCase("four_ranks_plain_path_flattened", 4, dict(ngroups=4, use_mem_eff_path=False, rmsnorm=False),
           flat=True),
]


def _layers(case, pg):
    import m2ops
    kw = {**dict(d_model=D_MODEL, d_state=8, headdim=4, ngroups=2, chunk_size=8), **case.layer}
    torch.manual_seed(0)
    full = m2ops.Mamba2(**kw).double()
    tp = m2ops.Mamba2(**kw, process_group=pg, sequence_parallel=case.sp).double()
    tp.load_full_state_dict(full.state_dict())
    return full, tp


def _part(t, dim, segments, r, n):
    """Rank r's part of each of the consecutive segments of t along dim (independent of the layer's code)."""
    starts = [sum(segments[:i]) + r * s // n for i, s in enumerate(segments)]
    return torch.cat([t.narrow(dim, a, s // n) for a, s in zip(starts, segments)], dim)


def _run(case, rank, groups):
    from m2ops.distributed import tensor_parallel

    n = case.ranks
    if rank >= n:
        return
    full, tp = _layers(case, groups[n])
    assert (tp.tp_rank, tp.tp_world) == (rank, n) and tp.nheads * n == full.nheads
    gen = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    u, g_out = randn(B, T, D_MODEL), randn(B, T, D_MODEL)
    seq_idx = torch.stack([seq_idx_from_starts([0, 5], T), seq_idx_from_starts([0, 3, 8], T)]) \
        if case.packed else None
    kw = dict(seq_idx=seq_idx, return_final_states=case.final)

    u_full = u.clone().requires_grad_()
    out = full(u_full, **kw)
    out, caches = (out[0], out[1:]) if case.final else (out, ())
    g_caches = [randn(*c.shape) for c in caches]
    ((out * g_out).sum() + sum((c * g).sum() for c, g in zip(caches, g_caches))).backward()

    def share(t):  # this rank's tokens with sequence_parallel, in the form the layer takes
        t = t.flatten(0, 1) if case.flat else t
        if not case.sp:
            return t
        dim = 0 if case.flat else 1
        return t.narrow(dim, rank * t.shape[dim] // n, t.shape[dim] // n)

    def cache_shards(conv, ssm):
        gn = full.ngroups * full.d_state
        return _part(conv, 1, [full.d_ssm, gn, gn], rank, n), _part(ssm, 1, [full.nheads], rank, n)

    u_mine = share(u).clone().requires_grad_()
    got = tp(u_mine, seqlen=T if case.flat else None, **kw)
    got, got_caches = (got[0], got[1:]) if case.final else (got, ())
    g_mine = cache_shards(*g_caches) if case.final else ()
    ((got * share(g_out)).sum() + sum((c * g).sum() for c, g in zip(got_caches, g_mine))).backward()

    checks = [("output", got, share(out)), ("grad u", u_mine.grad, share(u_full.grad))]
    if case.final:
        checks += [(f"cache {i}", c, e) for i, (c, e) in enumerate(zip(got_caches, cache_shards(*caches)))]
    # The whole gradients, sharded as the parameters were (the forward's equality checks that layout).
    grads = tensor_parallel.shard_state_dict(tp, {k: p.grad for k, p in full.named_parameters()})
    checks += [(f"grad {k}", p.grad, grads[k]) for k, p in tp.named_parameters()]
    if case.final:
        checks += _decode(full, tp, caches, got_caches, cache_shards, randn)
    whole = tp.full_state_dict()  # (every exchange before the first assertion: a failing rank leaves none waiting)
    for what, a, e in checks:
        err = max_rel_err(a, e)
        assert err <= TOL, f"{what}: max relative error {err:.3e}"
    assert all(torch.equal(whole[k], v) for k, v in full.state_dict().items()), "full_state_dict differs"


def _decode(full, tp, caches, got_caches, cache_shards, randn):
    """Three step() tokens after the prompt: the outputs equal, the caches the shards of the whole ones."""
    checks = []
    with torch.no_grad():
        conv, ssm = (c.detach().clone() for c in caches)
        conv_r, ssm_r = (c.detach().clone() for c in got_caches)
        for i in range(3):
            x = randn(B, 1, D_MODEL)
            y, conv, ssm = full.step(x, conv, ssm)
            y_r, conv_r, ssm_r = tp.step(x, conv_r, ssm_r)
            # (step updates the caches in place: compare copies of this step's)
            checks += [(f"step {i} output", y_r, y), *zip((f"step {i} conv_state", f"step {i} ssm_state"),
                                                          (conv_r.clone(), ssm_r.clone()), cache_shards(conv, ssm))]
    return checks


# ---- FSDP2 on the plain layer ----


def _fsdp(rank, mesh):
    """fully_shard over a 2-rank mesh, each rank its own batch: the gradients (gathered) are the mean of the
    one-rank gradients of both batches."""
    import m2ops
    from torch.distributed.fsdp import fully_shard

    kw = dict(d_model=D_MODEL, d_state=8, headdim=4, ngroups=2, chunk_size=8, bias=True)
    torch.manual_seed(0)
    full = m2ops.Mamba2(**kw).double()
    torch.manual_seed(0)
    layer = fully_shard(m2ops.Mamba2(**kw).double(), mesh=mesh)
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(B, T, D_MODEL, generator=gen, dtype=torch.float64),
                torch.randn(B, T, D_MODEL, generator=gen, dtype=torch.float64)) for _ in range(2)]
    expected = {k: torch.zeros_like(p) for k, p in full.named_parameters()}
    for i, (u, g) in enumerate(batches):
        full.zero_grad()
        out = full(u)
        (out * g).sum().backward()
        if i == mesh.get_local_rank():
            expected_out = out.detach()
        for k, p in full.named_parameters():
            expected[k] += p.grad / 2
    u, g = batches[mesh.get_local_rank()]
    out = layer(u)
    (out * g).sum().backward()
    assert max_rel_err(out, expected_out) <= TOL, "output"
    for k, p in layer.named_parameters():
        err = max_rel_err(p.grad.full_tensor(), expected[k])
        assert err <= TOL, f"grad {k}: max relative error {err:.3e} (against the mean over the two batches)"


# ---- errors ----


def _bad_groups(rank, groups):
    """Every rank of the pair must raise at construction, before any exchange."""
    import m2ops
    if rank >= 2:
        return None
    try:
        m2ops.Mamba2(D_MODEL, d_state=8, headdim=4, ngroups=1, process_group=groups[2])
    except ValueError as e:
        return str(e)
    return None


def _compiled(rank, groups):
    """The exchanges trace with torch.compile(fullgraph=True): a column-parallel then row-parallel product."""
    import m2ops
    from m2ops.distributed import tensor_parallel
    if rank >= 2:
        return
    tp = m2ops.Mamba2(D_MODEL, d_state=8, headdim=4, ngroups=2, bias=True, process_group=groups[2]).double()

    def f(u, w):
        return tensor_parallel.leave(tp, torch.nn.functional.linear(tensor_parallel.enter(tp, u, None), w), None)

    gen = torch.Generator().manual_seed(3)
    u = torch.randn(B, T // 2, D_MODEL, generator=gen, dtype=torch.float64)
    w = torch.randn(D_MODEL, D_MODEL, generator=gen, dtype=torch.float64) * (rank + 1)
    results = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        u_, w_ = u.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(u_, w_)
        out.square().sum().backward()
        results.append((out, u_.grad, w_.grad, tp.out_proj.bias.grad.clone()))
        tp.out_proj.bias.grad = None
    for what, a, e in zip(("output", "grad u", "grad w", "grad bias"), results[1], results[0]):
        assert max_rel_err(a, e) <= TOL, what


def _worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    groups = {2: dist.new_group([0, 1]), 4: dist.group.WORLD}
    pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "dp"))  # dp meshes {0, 1} and {2, 3}
    results = run_each(CASES, _run, rank, groups)
    results["bad:ngroups_1_on_2_ranks"] = _bad_groups(rank, groups)
    results["fsdp2"] = _failure(_fsdp, rank, pairs["dp"])
    results["compiled"] = _failure(_compiled, rank, groups)
    return results


def _failure(fn, *args):
    """None, or the traceback of fn(*args)'s exception."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 (reported to the test)
        return traceback.format_exc()
    return None


@pytest.fixture(scope="module")
def results(cp_results):
    """This file's results by rank, from the 4 ranks that conftest.py's cp_results spawns once for the distributed
    test files (its worker runs _worker and keys the results "tp:<name>")."""
    return [{k[3:]: v for k, v in r.items() if k.startswith("tp:")} for r in cp_results]


def _assert_passed(results, key):
    failures = [f"rank {r}:\n{res[key]}" for r, res in enumerate(results) if res[key] is not None]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_equals_one_rank(results, case):
    _assert_passed(results, case.name)


def test_fsdp2_gradients_are_the_mean_over_ranks(results):
    _assert_passed(results, "fsdp2")


def test_exchanges_compile_fullgraph(results):
    _assert_passed(results, "compiled")


def test_groups_not_dividing_raise_on_every_rank(results):
    for r in (0, 1):
        got = results[r]["bad:ngroups_1_on_2_ranks"]
        assert got is not None and "process_group's size (2 ranks) must divide" in got and "ngroups=1" in got, got


# ---- without other processes ----


def test_errors_in_one_process():
    """A fake group of 2 ranks in this process (no exchange happens: each error comes before one)."""
    import m2ops
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("torch.distributed already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        with pytest.raises(ValueError, match=r"process_group's size \(2 ranks\) must divide .*nheads=1"):
            m2ops.Mamba2(D_MODEL, headdim=32, process_group=dist.group.WORLD)
        with pytest.raises(TypeError, match=r"m2ops.Mamba2: process_group must be None, a torch.distributed"):
            m2ops.Mamba2(D_MODEL, headdim=4, ngroups=2, process_group="tp")
        layer = m2ops.Mamba2(D_MODEL, d_state=8, headdim=4, ngroups=2, process_group=dist.group.WORLD)
        assert (layer.nheads, layer.ngroups, layer.d_ssm, layer.conv_dim) == (4, 1, 16, 32)
        with pytest.raises(ValueError, match=r"seqlen=5 must divide the rows of all ranks' u"):
            layer(torch.randn(3, D_MODEL), seqlen=5)
    finally:
        dist.destroy_process_group()


def test_process_group_with_cp_group_raises():
    import m2ops
    with pytest.raises(ValueError, match=r"process_group and cp_group cannot both be given"):
        m2ops.Mamba2(D_MODEL, headdim=4, process_group=object(), cp_group=object())


def test_load_full_state_dict_is_strict():
    import m2ops
    torch.manual_seed(0)
    a, b = m2ops.Mamba2(D_MODEL, d_state=8, headdim=4), m2ops.Mamba2(D_MODEL, d_state=8, headdim=4)
    b.load_full_state_dict(a.state_dict())
    assert all(torch.equal(v, a.state_dict()[k]) for k, v in b.full_state_dict().items())
    sd = a.state_dict()
    with pytest.raises(ValueError, match=r"missing \['A_log'\], unexpected \['A'\]"):
        b.load_full_state_dict({("A" if k == "A_log" else k): v for k, v in sd.items()})
    with pytest.raises(ValueError, match=r"state_dict\['dt_bias'\] must be a tensor of the unsharded layer's shape"):
        b.load_full_state_dict({**sd, "dt_bias": sd["dt_bias"][:3]})
