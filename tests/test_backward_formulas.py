"""The explicit backward formulas (m2ops/reference/chunked_backward.py) against torch.autograd.grad of the chunked
forward (m2ops/reference/chunked.py), per op, in float64 on random inputs; and the _bwd ops run them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import Dims, make_inputs
from m2ops.reference import chunked as ref
from m2ops.reference import chunked_backward as bwd

F64 = torch.float64
INF = float("inf")
TOL = 1e-9


def rel_err(got, want):
    """max |got - want| / max(max |want|, 1)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if want.numel() == 0:
        return 0.0
    return ((got - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(True)


def cotangent(t, gen):
    return torch.randn(t.shape, generator=gen, dtype=t.dtype)


def limit_between_values(u, lo_q, hi_q):
    """dt_limit bounds at the given quantiles of the processed dt values u, each placed halfway between two
    neighbouring values: some values get clamped, none sits on a bound (the clamp's kinks)."""
    s = u.flatten().sort().values
    s = s[torch.cat([torch.tensor([True]), s[1:] > s[:-1]])]  # distinct values

    def bound(q):
        if q is None or s.numel() < 2:
            return None
        k = min(int(q * (s.numel() - 1)), s.numel() - 2)
        return ((s[k] + s[k + 1]) / 2).item()

    lo, hi = bound(lo_q), bound(hi_q)
    return (0.0 if lo is None else lo), (INF if hi is None else hi)


def processed_dt(inp, softplus):
    v = inp["dt"] + (inp["dt_bias"] if inp["dt_bias"] is not None else 0.0)
    return torch.nn.functional.softplus(v, threshold=20.0) if softplus else v


def check_all_ops(inp, L, softplus, limit, seed=0):
    """Each op's explicit backward against autograd of its chunked forward, with random cotangents."""
    gen = torch.Generator().manual_seed(seed)
    seq_idx, cu = inp["seq_idx"], inp["cu_seqlens"]

    # chunk_cumsum
    args = [leaf(inp["dt"]), leaf(inp["A"]), leaf(inp["dt_bias"])]
    dt_out, dA_cumsum = ref.chunk_cumsum(*args, L, softplus, *limit)
    g_dt_out, g_cs = cotangent(dt_out, gen), cotangent(dA_cumsum, gen)
    present = [a for a in args if a is not None]
    want = torch.autograd.grad((dt_out * g_dt_out).sum() + (dA_cumsum * g_cs).sum(), present)
    got = bwd.chunk_cumsum_bwd(g_dt_out, g_cs, inp["dt"], inp["A"], inp["dt_bias"], L, softplus, *limit)
    check(got, want, args, ["dt", "A", "dt_bias"], "chunk_cumsum")

    dt_out, dA_cumsum = dt_out.detach(), dA_cumsum.detach()

    # fwd_pass_state (cotangents for all three outputs: entering states, final state, varlen states)
    args = [leaf(inp["x"]), leaf(inp["B"]), leaf(dt_out), leaf(dA_cumsum), leaf(inp["initial_states"])]
    outs = ref.fwd_pass_state(*args, seq_idx, cu)
    cots = [cotangent(o, gen) for o in outs]
    present = [a for a in args if a is not None]
    want = torch.autograd.grad(sum((o * c).sum() for o, c in zip(outs, cots)), present, allow_unused=True)
    want = [torch.zeros_like(p) if w is None else w for p, w in zip(present, want)]
    got = bwd.fwd_pass_state_bwd(*cots, inp["x"], inp["B"], dt_out, dA_cumsum, inp["initial_states"], seq_idx, cu)
    check(got, want, args, ["x", "B", "dt_out", "dA_cumsum", "initial_states"], "fwd_pass_state")
    states = outs[0].detach()
    # ... and in its two stages, from the entering states, the gradients added into given ones (without the
    # per-sequence states, which only the whole op takes)
    if cu is None:
        g_local, g_carry, g_init = bwd.state_passing_bwd(cots[0], cots[1], states, dA_cumsum, seq_idx, F64)
        bases = [cotangent(t, gen) for t in (inp["x"], inp["B"], dt_out, dA_cumsum)]
        grads = [t.clone() for t in bases]
        bwd.chunk_state_bwd(g_local, g_carry, inp["x"], inp["B"], dt_out, dA_cumsum, seq_idx, *grads)
        got = (*(g - base for g, base in zip(grads, bases)),
               g_init if inp["initial_states"] is not None else g_init.new_empty(0))
        check(got, want, args, ["x", "B", "dt_out", "dA_cumsum", "initial_states"], "fwd_pass_state in two stages")

    # compute_out
    args = [leaf(inp["x"]), leaf(dt_out), leaf(dA_cumsum), leaf(inp["C"]), leaf(inp["B"]), leaf(states),
            leaf(inp["D"]), leaf(inp["z"])]
    y = ref.compute_out(*args, seq_idx)
    g_y = cotangent(y, gen)
    present = [a for a in args if a is not None]
    want = torch.autograd.grad((y * g_y).sum(), present)
    got = bwd.compute_out_bwd(g_y, inp["x"], dt_out, dA_cumsum, inp["C"], inp["B"], states, inp["D"], inp["z"],
                              seq_idx)
    check(got, want, args, ["x", "dt_out", "dA_cumsum", "C", "B", "states", "D", "z"], "compute_out")


def check(got, want, args, names, op):
    assert len(got) == len(args), op
    want = iter(want)
    for g, a, name in zip(got, args, names):
        assert g.is_contiguous(), (op, name)
        if a is None:
            assert g.numel() == 0, (op, name, g.shape)
            continue
        err = rel_err(g, next(want))
        assert err < TOL, f"{op}: gradient of {name}: max relative error {err:.2e}"


# ---------------------------------------------------------------------------------------------------------
# hypothesis over shapes and options
# ---------------------------------------------------------------------------------------------------------

@st.composite
def cases(draw):
    varlen = draw(st.booleans())
    b = 1 if varlen else draw(st.integers(1, 3))
    g = draw(st.sampled_from([1, 1, 2, 3]))
    h = g * draw(st.integers(1, 3))
    L = draw(st.sampled_from([1, 4, 8, 16]))
    T = draw(st.integers(1, 50))
    dims = Dims(b, T, h, draw(st.integers(1, 4)), g, draw(st.integers(1, 6)))
    softplus = draw(st.booleans())
    opts = dict(D=draw(st.sampled_from([None, "h", "hp"])), z=draw(st.booleans()), dt_bias=draw(st.booleans()),
                initial_states=draw(st.booleans()), seq_idx=draw(st.booleans()), cu_seqlens=varlen,
                nseqs=draw(st.integers(1, 5)), dt_softplus=softplus, dt_large=softplus and draw(st.booleans()),
                decay=draw(st.sampled_from([(0.05, 2.0), (0.5, 8.0)])))
    lo_q = draw(st.sampled_from([None, 0.1, 0.3]))
    hi_q = draw(st.sampled_from([None, 0.7, 0.95]))
    return dims, L, softplus, opts, lo_q, hi_q, draw(st.integers(0, 2**31 - 1))


@given(cases())
def test_backward_formulas_match_autograd(case):
    dims, L, softplus, opts, lo_q, hi_q, seed = case
    inp = make_inputs(dims, dtype=F64, seed=seed, **opts)
    limit = limit_between_values(processed_dt(inp, softplus), lo_q, hi_q)
    check_all_ops(inp, L, softplus, limit, seed)


# ---------------------------------------------------------------------------------------------------------
# fixed cases that pin each hazard down
# ---------------------------------------------------------------------------------------------------------

FIXED = {
    # name: (dims, chunk, softplus, make_inputs options, (lo, hi) quantiles)
    "tail_chunk_groups": (Dims(2, 37, 6, 3, 3, 4), 16, False, dict(D="h"), (None, None)),
    "softplus_above_20_and_clamp": (Dims(2, 45, 4, 3, 2, 5), 8, True,
                                    dict(dt_bias=True, dt_large=True, z=True, D="hp"), (0.2, 0.8)),
    "seq_idx_restarts": (Dims(3, 41, 4, 2, 2, 3), 8, True,
                         dict(seq_idx=True, nseqs=5, initial_states=True, z=True, D="h"), (None, None)),
    "varlen_many_per_chunk": (Dims(1, 40, 4, 3, 1, 4), 16, False,
                              dict(cu_seqlens=True, nseqs=6, initial_states=True, dt_bias=True), (0.25, None)),
    "varlen_with_seq_idx": (Dims(1, 33, 2, 3, 2, 4), 8, True,
                            dict(cu_seqlens=True, seq_idx=True, nseqs=4, initial_states=True, z=True, D="hp"),
                            (None, 0.9)),
    "strong_decay": (Dims(2, 30, 2, 2, 1, 3), 16, False, dict(decay=(5.0, 30.0), seq_idx=True), (None, None)),
    "one_token": (Dims(2, 1, 2, 2, 1, 3), 16, True, dict(D="h", z=True, initial_states=True), (None, None)),
}


@pytest.mark.parametrize("name", list(FIXED))
def test_backward_formulas_fixed_cases(name):
    dims, L, softplus, opts, (lo_q, hi_q) = FIXED[name]
    inp = make_inputs(dims, dtype=F64, seed=7, dt_softplus=softplus, **opts)
    u = processed_dt(inp, softplus)
    limit = limit_between_values(u, lo_q, hi_q)
    if opts.get("dt_large"):
        assert (u > 20).any()
    check_all_ops(inp, L, softplus, limit)


def test_softplus_above_threshold_is_identity():
    """Values above 20 pass softplus unchanged, with gradient exactly 1, clamped or not."""
    inp = make_inputs(Dims(1, 20, 3, 2, 1, 2), dtype=F64, seed=3, dt_softplus=True, dt_large=True, dt_bias=True)
    v = inp["dt"] + inp["dt_bias"]
    assert (v > 20).any()
    g_out = torch.ones(1, 3, 3, 8, dtype=F64)
    g_dt, _, _ = bwd.chunk_cumsum_bwd(g_out, torch.zeros_like(g_out), inp["dt"], inp["A"], inp["dt_bias"], 8, True,
                                      0.0, INF)
    assert (g_dt[v > 20] == 1).all()
    check_all_ops(inp, 8, True, (0.0, INF))
    check_all_ops(inp, 8, True, limit_between_values(processed_dt(inp, True), 0.3, 0.6))


def test_strong_decay_gradients_finite():
    """Masked exponents are -inf before exp: no inf * 0 where decays overflow past a boundary (float32)."""
    inp = make_inputs(Dims(1, 50, 2, 4, 1, 8), dtype=torch.float32, seed=1, cu_seqlens=True, seq_idx=True,
                      nseqs=4, initial_states=True, decay=(5.0, 30.0))
    inp["dt"] = inp["dt"].abs() * 8
    dt_out, cs = ref.chunk_cumsum(inp["dt"], inp["A"], None, 16, False, 0.0, INF)
    outs = ref.fwd_pass_state(inp["x"], inp["B"], dt_out, cs, inp["initial_states"], inp["seq_idx"],
                              inp["cu_seqlens"])
    g = bwd.fwd_pass_state_bwd(*[torch.ones_like(o) for o in outs], inp["x"], inp["B"], dt_out, cs,
                               inp["initial_states"], inp["seq_idx"], inp["cu_seqlens"])
    g += bwd.compute_out_bwd(torch.ones_like(inp["x"]), inp["x"], dt_out, cs, inp["C"], inp["B"], outs[0], None,
                             None, inp["seq_idx"])
    for t in g:
        assert torch.isfinite(t).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_of_gradients(dtype):
    """Computed in float32 for non-float64 inputs; each gradient comes back in its input's dtype."""
    inp = make_inputs(Dims(1, 20, 2, 2, 1, 3), dtype=dtype, param_dtype=torch.float32, seed=2, D="h", z=True,
                      dt_bias=True, initial_states=True)
    dt_out, cs = ref.chunk_cumsum(inp["dt"], inp["A"], inp["dt_bias"], 8, True, 0.0, INF)
    got = bwd.chunk_cumsum_bwd(dt_out, cs, inp["dt"], inp["A"], inp["dt_bias"], 8, True, 0.0, INF)
    assert [t.dtype for t in got] == [torch.float32] * 3
    outs = ref.fwd_pass_state(inp["x"], inp["B"], dt_out, cs, inp["initial_states"], None, None)
    got = bwd.fwd_pass_state_bwd(*outs, inp["x"], inp["B"], dt_out, cs, inp["initial_states"], None, None)
    assert [t.dtype for t in got] == [dtype, dtype, torch.float32, torch.float32, torch.float32]
    got = bwd.compute_out_bwd(inp["x"], inp["x"], dt_out, cs, inp["C"], inp["B"], outs[0], inp["D"], inp["z"], None)
    assert [t.dtype for t in got] == [dtype, torch.float32, torch.float32, dtype, dtype, torch.float32,
                                      torch.float32, dtype]


def test_bwd_ops_run_the_formulas():
    """The registered _bwd ops return exactly what the formulas return."""
    inp = make_inputs(Dims(1, 30, 4, 3, 2, 4), dtype=F64, seed=5, D="hp", z=True, dt_bias=True,
                      initial_states=True, cu_seqlens=True, seq_idx=True)
    lim = (0.0, INF)
    dt_out, cs = torch.ops.m2ops.chunk_cumsum(inp["dt"], inp["A"], inp["dt_bias"], 8, True, *lim)
    pairs = [(torch.ops.m2ops.chunk_cumsum_bwd, bwd.chunk_cumsum_bwd,
              (dt_out, cs, inp["dt"], inp["A"], inp["dt_bias"], 8, True, *lim))]
    outs = torch.ops.m2ops.fwd_pass_state(inp["x"], inp["B"], dt_out, cs, inp["initial_states"], inp["seq_idx"],
                                          inp["cu_seqlens"])
    pairs.append((torch.ops.m2ops.fwd_pass_state_bwd, bwd.fwd_pass_state_bwd,
                  (*outs, inp["x"], inp["B"], dt_out, cs, inp["initial_states"], inp["seq_idx"], inp["cu_seqlens"])))
    pairs.append((torch.ops.m2ops.state_passing_bwd, bwd.state_passing_bwd,
                  (outs[0], outs[1], outs[0] * 0.5, cs, inp["seq_idx"], F64)))
    pairs.append((torch.ops.m2ops.compute_out_bwd, bwd.compute_out_bwd,
                  (inp["x"], inp["x"], dt_out, cs, inp["C"], inp["B"], outs[0], inp["D"], inp["z"], inp["seq_idx"])))
    g_local, g_carry, _ = bwd.state_passing_bwd(outs[0], outs[1], outs[0] * 0.5, cs, inp["seq_idx"], F64)
    for op, fn, args in pairs:
        for a, b in zip(op(*args), fn(*args)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # chunk_state_bwd adds into its last four arguments
    accs = [(t.clone(), t.clone()) for t in (inp["x"], inp["B"], dt_out, cs)]
    torch.ops.m2ops.chunk_state_bwd(g_local, g_carry, inp["x"], inp["B"], dt_out, cs, inp["seq_idx"],
                                    *(a for a, _ in accs))
    bwd.chunk_state_bwd(g_local, g_carry, inp["x"], inp["B"], dt_out, cs, inp["seq_idx"], *(b for _, b in accs))
    for a, b in accs:
        torch.testing.assert_close(a, b, rtol=0, atol=0)
