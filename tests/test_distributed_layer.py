"""m2ops.Mamba2(cp_group=...) on spawned CPU processes (gloo): the layer on a sequence split across ranks.

The cases run in the 4-process world of test_distributed_scan.py (one spawn for both files: the session fixture
cp_results in conftest.py), on the default group or a subgroup of the first ranks.

Every rank builds the same m2ops.Mamba2 (same seed), runs it on the whole sequence with gradients, then the
context-parallel layer (same state dict) on its slice, and compares: the output is the slice of the whole
output, the returned caches are the whole call's (on every rank), the input's gradient is the slice of the whole
one and every parameter's gradient, summed over the ranks, is the whole one. Packed sequences cross rank
boundaries, so the convolution's halo must respect them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from conftest import max_rel_err, seq_idx_from_starts
from test_distributed_scan import WORLD, run_each
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


@dataclass(frozen=True)
class LayerCase:
    name: str
    cuts: tuple                                  # slice boundaries; len(cuts) - 1 ranks (a subgroup if < 4)
    layer: dict = field(default_factory=dict)    # m2ops.Mamba2 arguments besides the defaults below
    rows: tuple | None = None                    # per batch row ((start, id), ...): seq_idx, or None
    cache: bool = False                          # start from random (conv_state, ssm_state)
    final: bool = False                          # return_final_states
    flat: bool = False                           # u as (batch * seqlen, d_model) with seqlen=
    dtype: torch.dtype = torch.float64


CASES = [
    # Row 0: sequence 1 runs from rank 0 across rank 1 into rank 2; row 1 starts at id 1 (the caches belong to
    # sequence 0, so they do not apply) and a sequence starts on rank 2's first token and spans ranks 2 and 3.
    LayerCase("packed_across_ranks_with_caches", (0, 6, 13, 22, 30), rows=(((0, 0), (3, 1), (20, 2)), ((0, 1), (13, 2))),
              cache=True, final=True),
    # Without final states, a training forward takes the memory-efficient path (one mixer op); with them, or
    # use_mem_eff_path=False, the ops one after another.
    LayerCase("gate_in_scan_D_per_channel", (0, 4, 20, 24), dict(rmsnorm=False, D_has_hdim=True)),
    LayerCase("plain_path", (0, 5, 17), dict(use_mem_eff_path=False), rows=(((0, 0), (2, 1)), ((0, 3),))),
    LayerCase("flattened_float32_d_conv_2", (0, 10, 12, 30), dict(d_conv=2, ngroups=1), rows=(((0, 0), (11, 1)),
                                                                                            ((0, 0),)),
              flat=True, dtype=torch.float32),
    LayerCase("two_ranks", (0, 9, 20), rows=(((0, 0), (9, 1)), ((0, 0), (5, 1))), cache=True),
]


def _layers(case):
    import m2ops
    kw = {**dict(d_model=16, d_state=8, headdim=4, ngroups=2, chunk_size=8), **case.layer}
    torch.manual_seed(0)
    whole = m2ops.Mamba2(**kw).to(case.dtype)
    n = len(case.cuts) - 1
    split = m2ops.Mamba2(**kw, cp_group=dist.group.WORLD if n == WORLD else dist.new_group(list(range(n))))
    split = split.to(case.dtype)
    split.load_state_dict(whole.state_dict())
    return whole, split


def _run(case, rank):
    whole, split = _layers(case)  # (every rank builds the subgroup, as new_group requires)
    n = len(case.cuts) - 1
    if rank >= n:
        return
    T, b = case.cuts[-1], 2
    gen = torch.Generator().manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(case.dtype)

    u, g_out = randn(b, T, 16), randn(b, T, 16)
    seq_idx = None if case.rows is None else torch.stack(
        [seq_idx_from_starts([s for s, _ in row], T, [i for _, i in row]) for row in case.rows])
    cache = (randn(b, whole.conv_dim, whole.d_conv), randn(b, whole.nheads, whole.headdim, whole.d_state)) \
        if case.cache else None
    kw = dict(cache=cache, return_final_states=case.final)

    u_whole = u.clone().requires_grad_()
    out = whole(u_whole, seq_idx=seq_idx, **kw)
    out, caches = (out[0], out[1:]) if case.final else (out, ())
    g_caches = [randn(*c.shape) for c in caches]
    ((out * g_out).sum() + sum((c * g).sum() for c, g in zip(caches, g_caches))).backward()

    lo, hi = case.cuts[rank], case.cuts[rank + 1]
    u_mine = u[:, lo:hi].clone().requires_grad_()
    mine = u_mine.flatten(0, 1) if case.flat else u_mine
    got = split(mine, seqlen=hi - lo if case.flat else None,
                seq_idx=None if seq_idx is None else seq_idx[:, lo:hi], **kw)
    got, got_caches = (got[0], got[1:]) if case.final else (got, ())
    got = got.unflatten(0, (b, hi - lo)) if case.flat else got
    ((got * g_out[:, lo:hi]).sum() + sum((c * g).sum() for c, g in zip(got_caches, g_caches)) / n).backward()

    pg = split.cp_group
    checks = [("output", got, out[:, lo:hi]), ("grad u", u_mine.grad, u_whole.grad[:, lo:hi])]
    checks += [(f"cache {i}", c, e) for i, (c, e) in enumerate(zip(got_caches, caches))]
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=pg)
        checks.append((f"grad {name} summed over ranks", g, q.grad))
    for what, a, e in checks:
        err = max_rel_err(a, e)
        assert err <= TOL[case.dtype], f"{what}: max relative error {err:.3e}"


def _bad_short_slice(rank):
    """Rank 1's slice is shorter than d_conv: every rank must raise."""
    import m2ops

    layer = m2ops.Mamba2(d_model=16, d_state=8, headdim=4, ngroups=2, chunk_size=8, cp_group=dist.group.WORLD)
    layer = layer.double()
    u = torch.randn(1, 2 if rank == 1 else 8, 16, dtype=torch.float64)
    try:
        layer(u)
    except ValueError as e:
        return str(e)
    return None


def layer_worker(rank: int, world: int) -> dict:
    """The layer's cases on one rank of test_distributed_scan's world: {"layer:" + name: None or the failure}."""
    out = run_each(CASES, _run, rank)
    out["bad:short_slice"] = _bad_short_slice(rank)
    return {"layer:" + k: v for k, v in out.items()}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_layer_equals_one_process(cp_results, case):
    key = "layer:" + case.name
    failures = [f"rank {r}:\n{res[key]}" for r, res in enumerate(cp_results) if res[key] is not None]
    assert not failures, "\n".join(failures)


def test_short_slice_raises_on_every_rank(cp_results):
    for r, res in enumerate(cp_results):
        want = "must hold at least d_conv=4 tokens" if r == 1 else "rank(s) [1] of the group failed"
        got = res["layer:bad:short_slice"]
        assert got is not None and want in got, f"rank {r}: {got!r}"


@pytest.mark.parametrize("kw, kind, words", [
    (dict(u=torch.randn(2, 8, 15)), ValueError, "u must be of last dimension d_model=16"),
    (dict(u=torch.randn(2, 8, 16).long()), TypeError, "u must be a floating-point tensor"),
    (dict(seq_idx=torch.zeros(2, 5, dtype=torch.long)), ValueError, r"seq_idx must be an integer tensor of shape \(batch"),
    (dict(cache=(torch.zeros(2, 3, 4), torch.zeros(2, 8, 4, 8))), ValueError, r"cache\[0\] \(conv_state\) must be"),
    (dict(cu_seqlens=torch.tensor([0, 8])), ValueError, "cu_seqlens must be None with cp_group"),
])
def test_slice_checks_are_the_layers(kw, kind, words):
    """A rank's slice goes through m2ops.Mamba2's own checks of u, seq_idx and cache (one process: the part before
    the ranks compare their calls)."""
    import m2ops
    from m2ops.distributed import context_layer

    layer = m2ops.Mamba2(16, d_state=8, headdim=4, ngroups=2)
    args = {**dict(u=torch.randn(2, 8, 16), seqlen=None, seq_idx=None, cu_seqlens=None, cache=None), **kw}
    with pytest.raises(kind, match=words):
        context_layer._check_local(layer, **args)
