"""The custom ops' registrations (torch.library.opcheck, fake vs real metadata) and gradients of the public
function (torch.autograd.gradcheck in float64)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import Dims, make_inputs, printed_with_env, run_scan
from m2ops import ops
from m2ops.meta.shapes import g_local_dtype

INF = float("inf")

# ---------------------------------------------------------------------------------------------------------
# sample inputs of every op
# ---------------------------------------------------------------------------------------------------------

# (name, dims, chunk_size, make_inputs options, dt_softplus, dt_limit)
CASES = [
    ("plain_tail", Dims(2, 37, 4, 8, 2, 16), 16, dict(), False, (0.0, INF)),
    ("single_chunk_tail", Dims(2, 5, 4, 8, 2, 16), 16, dict(D="h"), False, (0.0, INF)),
    ("all_options", Dims(2, 45, 4, 4, 2, 8), 16,
     dict(D="hp", z=True, dt_bias=True, initial_states=True, seq_idx=True, dt_softplus=True), True, (0.05, 0.9)),
    ("exact_chunks_D_h", Dims(1, 32, 2, 4, 1, 8), 8, dict(D="h", z=True, initial_states=True), False, (0.0, INF)),
    ("varlen", Dims(1, 40, 4, 4, 2, 8), 16,
     dict(cu_seqlens=True, seq_idx=True, nseqs=4, initial_states=True, dt_bias=True, index_dtype=torch.int32),
     True, (0.0, INF)),
    ("seqlen_1", Dims(3, 1, 2, 2, 2, 4), 16, dict(D="h", z=True, seq_idx=True), False, (0.0, INF)),
]
IDS = [c[0] for c in CASES]


def stage_args(case, dtype=torch.float32, requires_grad=False):
    """The arguments of each forward op for one case, plus its outputs (detached) for the _bwd samples."""
    _, dims, L, opts, softplus, (lo, hi) = case
    inp = make_inputs(dims, dtype=dtype, seed=sum(map(ord, case[0])), **opts)
    varlen = inp["cu_seqlens"]

    def leaf(t):
        return None if t is None else t.detach().clone().requires_grad_(requires_grad and t.is_floating_point())

    cumsum_args = (leaf(inp["dt"]), leaf(inp["A"]), leaf(inp["dt_bias"]), L, softplus, lo, hi)
    with torch.no_grad():
        dt_out, dA_cumsum = ops.chunk_cumsum(*cumsum_args)
    state_args = (leaf(inp["x"]), leaf(inp["B"]), leaf(dt_out), leaf(dA_cumsum), leaf(inp["initial_states"]),
                  inp["seq_idx"], varlen)
    with torch.no_grad():
        states, final, varlen_states = ops.fwd_pass_state(*state_args)
    out_args = (leaf(inp["x"]), leaf(dt_out), leaf(dA_cumsum), leaf(inp["C"]), leaf(inp["B"]), leaf(states),
                leaf(inp["D"]), leaf(inp["z"]), inp["seq_idx"])
    with torch.no_grad():
        y = ops.compute_out(*out_args)
    scan_args = (leaf(inp["x"]), leaf(dt_out), leaf(dA_cumsum), leaf(inp["B"]), leaf(inp["C"]),
                 leaf(inp["initial_states"]), leaf(inp["D"]), leaf(inp["z"]), inp["seq_idx"])
    return dict(cumsum=cumsum_args, state=state_args, out=out_args, scan=scan_args,
                outputs=dict(dt_out=dt_out, dA_cumsum=dA_cumsum, states=states, final=final, varlen=varlen_states,
                             y=y))


def bwd_args(case, dtype=torch.float32):
    s = stage_args(case, dtype)
    o = s["outputs"]
    g = torch.Generator().manual_seed(0)

    def cot(t):
        return torch.randn(t.shape, generator=g, dtype=t.dtype)

    x, B, dt_out, dA_cumsum, _, seq_idx, _ = s["state"]
    states = o["states"]
    b, c, h = states.shape[:3]
    return dict(
        cumsum=(cot(o["dt_out"]), cot(o["dA_cumsum"]), *s["cumsum"]),
        state=(cot(states), cot(o["final"]), cot(o["varlen"]), *s["state"]),
        passing=(cot(states), cot(o["final"]), states.detach(), dA_cumsum, seq_idx,
                 g_local_dtype(x.dtype, B.dtype, dA_cumsum.dtype)),
        # (its last four arguments, gradients of x, B, dt_out and dA_cumsum, are added into)
        chunk_state=(cot(states).to(g_local_dtype(x.dtype, B.dtype, dA_cumsum.dtype)),
                     cot(dA_cumsum.new_empty((b, h, c))), x, B, dt_out, dA_cumsum, seq_idx,
                     cot(x), cot(B), cot(dt_out), cot(dA_cumsum)),
        out=(cot(o["y"]), *s["out"]),
    )


FWD_OPS = {"cumsum": torch.ops.m2ops.chunk_cumsum.default, "state": torch.ops.m2ops.fwd_pass_state.default,
           "out": torch.ops.m2ops.compute_out.default, "scan": torch.ops.m2ops.chunk_scan.default}
BWD_OPS = {"cumsum": torch.ops.m2ops.chunk_cumsum_bwd.default,
           "state": torch.ops.m2ops.fwd_pass_state_bwd.default,
           # fwd_pass_state's backward in its two stages
           "passing": torch.ops.m2ops.state_passing_bwd.default,
           "chunk_state": torch.ops.m2ops.chunk_state_bwd.default,
           "out": torch.ops.m2ops.compute_out_bwd.default}
# the arguments each op writes (adds into), by position
MUTATED = {"chunk_state": (7, 8, 9, 10)}


# ---------------------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("stage", FWD_OPS)
@pytest.mark.parametrize("requires_grad", [True, False], ids=["grad", "nograd"])
def test_opcheck_forward(stage, case, requires_grad):
    args = stage_args(case, requires_grad=requires_grad)[stage]
    torch.library.opcheck(FWD_OPS[stage], args)


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("stage", BWD_OPS)
def test_opcheck_backward_ops(stage, case):
    torch.library.opcheck(BWD_OPS[stage], bwd_args(case)[stage])


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("stage", BWD_OPS)
def test_bwd_ops_no_alias_no_mutation(stage, case):
    """No output shares an input's storage, and no input but the one an op declares it writes changes."""
    args = bwd_args(case)[stage]
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    outs = BWD_OPS[stage](*args)
    ptrs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor) and a.numel()}
    for o in outs or ():
        assert o.numel() == 0 or o.untyped_storage().data_ptr() not in ptrs
    for i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor) and i not in MUTATED.get(stage, ()):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_opcheck_float64_and_bf16():
    """The dtype rules of the fakes (float64 stays float64, bf16 accumulates in float32)."""
    for dtype in (torch.float64, torch.bfloat16):
        s = stage_args(CASES[2], dtype=dtype, requires_grad=True)
        for stage, op in FWD_OPS.items():
            torch.library.opcheck(op, s[stage])


# ---------------------------------------------------------------------------------------------------------
# fake vs real: shapes, dtypes and (significant) strides of every output, on a grid of cases
# ---------------------------------------------------------------------------------------------------------

def _significant(t):
    return [(size, stride) for size, stride in zip(t.shape, t.stride()) if size > 1]


def _check_fake_matches_real(op, args):
    real = op(*args)
    with FakeTensorMode() as mode:
        fake = op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    real = real if isinstance(real, tuple) else () if real is None else (real,)
    fake = fake if isinstance(fake, tuple) else () if fake is None else (fake,)
    assert len(real) == len(fake)
    for i, (r, f) in enumerate(zip(real, fake)):
        assert r.shape == f.shape, (op, i, r.shape, f.shape)
        assert r.dtype == f.dtype, (op, i, r.dtype, f.dtype)
        assert _significant(r) == _significant(f), (op, i, r.shape, r.stride(), f.stride())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fake_matches_real(case, dtype):
    s = stage_args(case, dtype=dtype)
    for stage, op in FWD_OPS.items():
        _check_fake_matches_real(op, s[stage])
    b = bwd_args(case, dtype=dtype)
    for stage, op in BWD_OPS.items():
        _check_fake_matches_real(op, b[stage])


def test_bwd_ops_return_empty_for_absent_optionals():
    b = bwd_args(CASES[0])  # no dt_bias, initial_states, D, z
    assert BWD_OPS["cumsum"](*b["cumsum"])[2].numel() == 0
    assert BWD_OPS["state"](*b["state"])[4].numel() == 0
    g = BWD_OPS["out"](*b["out"])
    assert g[6].numel() == 0 and g[7].numel() == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("bad", ["shape", "dtype", "device"])
@pytest.mark.parametrize("stage,name,i", [("passing", "states", 2), ("chunk_state", "g_x", 7),
                                          ("chunk_state", "g_B", 8), ("chunk_state", "g_dt_out", 9),
                                          ("chunk_state", "g_dA_cumsum", 10)])
def test_state_bwd_stages_name_a_wrong_argument(stage, name, i, bad, device):
    """The entering states of state_passing_bwd and the gradients chunk_state_bwd adds into are checked by name,
    on the real and the fake path (a meta tensor runs the fake implementation, as torch.compile's tracing does);
    "meta" is the other device."""
    if bad == "device" and device == "meta":
        pytest.skip("meta is the other device")
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in bwd_args(CASES[0])[stage]]
    args[i] = {"shape": lambda t: t[:, :-1], "dtype": lambda t: t.to(torch.int32),
               "device": lambda t: t.to("meta")}[bad](args[i])
    op = BWD_OPS[stage]
    with pytest.raises(TypeError if bad == "dtype" else ValueError, match=rf"{op.name()}: {name} must be"):
        op(*args)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_state_bwd_stages_compose_to_the_op(case):
    """state_passing_bwd then chunk_state_bwd give fwd_pass_state_bwd's gradients, added into the given ones
    (the cases without per-sequence states, which only the whole op takes)."""
    b = bwd_args(case)
    g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, init, seq_idx, cu = b["state"]
    if cu is not None:
        pytest.skip("per-sequence states: the whole op only")
    want = BWD_OPS["state"](*b["state"])
    states = b["passing"][2]
    g_local, g_carry, g_init = BWD_OPS["passing"](g_states, g_final, states, dA_cumsum, seq_idx,
                                                  g_local_dtype(x.dtype, B.dtype, dA_cumsum.dtype))
    bases = [torch.randn(t.shape, dtype=t.dtype) for t in (x, B, dt_out, dA_cumsum)]
    got = [t.clone() for t in bases]
    assert BWD_OPS["chunk_state"](g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, *got) is None
    for g, w, base in zip(got, want[:4], bases):
        torch.testing.assert_close(g, w + base)
    if init is not None:
        torch.testing.assert_close(g_init.to(init.dtype), want[4])


# ---------------------------------------------------------------------------------------------------------
# gradcheck of the public function (float64)
# ---------------------------------------------------------------------------------------------------------

def _inv_softplus(v):
    return v + torch.log(-torch.expm1(-v))


def _gradcheck_inputs(dims, D_shape, *, dt_limit, seed, cu_seqlens=False, seq_idx=True):
    """Inputs whose processed dt = clamp(softplus(dt + dt_bias), dt_limit) stays at least 0.05 away from the
    clamp bounds (and from the softplus threshold), so that finite differences never cross a kink. About a
    quarter of the entries are clamped at each bound."""
    inp = make_inputs(dims, dtype=torch.float64, seed=seed, D=D_shape, z=True, dt_bias=True,
                      initial_states=True, seq_idx=seq_idx, cu_seqlens=cu_seqlens, nseqs=3, dt_softplus=True,
                      decay=(0.2, 1.0))
    lo, hi = dt_limit
    g = torch.Generator().manual_seed(seed + 1)
    u = torch.rand(inp["dt"].shape, generator=g, dtype=torch.float64)
    r = torch.rand(inp["dt"].shape, generator=g, dtype=torch.float64)
    below = lo * (0.2 + 0.5 * r)               # clamped up to lo
    inside = lo + 0.05 + (hi - lo - 0.1) * r   # untouched
    above = hi + 0.1 + 0.8 * r                 # clamped down to hi
    target = torch.where(u < 0.25, below, torch.where(u < 0.75, inside, above))
    inp["dt"] = _inv_softplus(target) - inp["dt_bias"]
    return inp


GRAD_ARGS = ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"]


def _gradcheck(inputs, chunk_size, flags, wrt=GRAD_ARGS):
    names = [k for k in wrt if inputs[k] is not None]
    leaves = [inputs[k].detach().clone().requires_grad_(True) for k in names]

    def fn(*ts):
        out = run_scan(dict(inputs, **dict(zip(names, ts))), chunk_size, **flags)
        return out

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("D_shape", ["h", "hp"])
def test_gradcheck_all_inputs(D_shape):
    limit = (0.2, 1.2)
    inputs = _gradcheck_inputs(Dims(2, 11, 2, 3, 1, 4), D_shape, dt_limit=limit, seed=3)
    # the clamp is active on both sides, and no entry sits near a bound
    d = torch.nn.functional.softplus(inputs["dt"] + inputs["dt_bias"])
    assert (d < limit[0]).any() and (d > limit[1]).any() and ((d > limit[0]) & (d < limit[1])).any()
    assert ((d - limit[0]).abs().min() > 0.03) and ((d - limit[1]).abs().min() > 0.03)
    _gradcheck(inputs, 4, dict(dt_softplus=True, dt_limit=limit))


def test_gradcheck_final_states():
    limit = (0.1, 1.0)
    inputs = _gradcheck_inputs(Dims(2, 9, 2, 2, 2, 3), "h", dt_limit=limit, seed=4)
    _gradcheck(inputs, 4, dict(dt_softplus=True, dt_limit=limit, return_final_states=True))


def test_gradcheck_final_states_only():
    """Gradients reach x, dt, A, B and initial_states through the final state alone."""
    limit = (0.1, 1.0)
    inputs = _gradcheck_inputs(Dims(1, 10, 2, 2, 1, 3), None, dt_limit=limit, seed=5)
    names = ["x", "dt", "A", "B", "initial_states", "dt_bias"]
    leaves = [inputs[k].detach().clone().requires_grad_(True) for k in names]

    def fn(*ts):
        return run_scan(dict(inputs, **dict(zip(names, ts))), 4, dt_softplus=True, dt_limit=limit,
                        return_final_states=True)[1]

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_gradcheck_varlen_states():
    limit = (0.1, 1.0)
    inputs = _gradcheck_inputs(Dims(1, 13, 2, 2, 1, 3), "hp", dt_limit=limit, seed=6, cu_seqlens=True,
                               seq_idx=False)
    assert inputs["cu_seqlens"].numel() == 4
    _gradcheck(inputs, 4, dict(dt_softplus=True, dt_limit=limit, return_final_states=True,
                               return_varlen_states=True))


def test_gradcheck_default_limit_no_softplus():
    """Without softplus, negative dt is clamped to 0 by the default dt_limit: zero gradient there."""
    inputs = make_inputs(Dims(2, 7, 2, 2, 1, 3), seed=8, D="h", initial_states=True, seq_idx=True)
    dt = inputs["dt"]
    inputs["dt"] = dt + torch.where(dt >= 0, 0.05, -0.05)  # at least 0.05 away from the kink at 0
    assert (inputs["dt"] < 0).any()
    _gradcheck(inputs, 4, dict(return_final_states=True), wrt=["x", "dt", "A", "B", "C", "D", "initial_states"])


def test_backward_zero_gradient_where_clamped():
    limit = (0.2, 1.2)
    inputs = _gradcheck_inputs(Dims(1, 20, 2, 3, 1, 4), "h", dt_limit=limit, seed=9)
    dt = inputs["dt"].detach().clone().requires_grad_(True)
    y = run_scan(dict(inputs, dt=dt), 8, dt_softplus=True, dt_limit=limit)
    y.sum().backward()
    d = torch.nn.functional.softplus(inputs["dt"] + inputs["dt_bias"])
    clamped = (d < limit[0]) | (d > limit[1])
    assert clamped.any() and (dt.grad[clamped] == 0).all()
    assert (dt.grad[~clamped] != 0).any()


def test_backward_strong_decay_finite():
    """Gradients stay finite where per-token decays underflow (varlen states included)."""
    inputs = make_inputs(Dims(1, 50, 2, 4, 1, 8), dtype=torch.float32, seed=1, cu_seqlens=True, nseqs=3,
                         initial_states=True, decay=(5.0, 30.0), requires_grad=True)
    with torch.no_grad():
        inputs["dt"].abs_().mul_(8)
    y, s, v = run_scan(inputs, 16, return_final_states=True, return_varlen_states=True)
    (y.sum() + s.sum() + v.sum()).backward()
    for k in ("x", "dt", "A", "B", "C", "initial_states"):
        assert torch.isfinite(inputs[k].grad).all(), k
    assert torch.isfinite(y.detach()).all()


def test_backward_under_torch_dispatch_mode():
    """The backward works, and gives the same gradients, with a TorchDispatchMode active around forward and
    backward (as FlopCounterMode, DebugMode and opcheck put one)."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs = make_inputs(Dims(1, 40, 2, 4, 1, 8), dtype=torch.float32, seed=2, D="h", z=True, dt_bias=True,
                         initial_states=True, cu_seqlens=True, requires_grad=True)
    leaves = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]

    def grads():
        y, s, v = run_scan(inputs, 16, dt_softplus=True, return_final_states=True, return_varlen_states=True)
        return torch.autograd.grad((y * y).sum() + s.sum() + v.sum(), leaves)

    want = grads()
    with FlopCounterMode(display=False):
        got = grads()
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_chunk_scan_is_the_two_ops(case):
    """m2ops::chunk_scan = fwd_pass_state then compute_out, in values and in gradients of every input."""
    s = stage_args(case, dtype=torch.float64, requires_grad=True)
    y, final = ops.chunk_scan(*s["scan"])
    x, dt_out, dA, B, C, init, D, z, seq_idx = s["scan"]
    states, final2, _ = ops.fwd_pass_state(x, B, dt_out, dA, init, seq_idx, None)
    y2 = ops.compute_out(x, dt_out, dA, C, B, states, D, z, seq_idx)
    torch.testing.assert_close(y, y2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final, final2, rtol=1e-12, atol=1e-12)
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(y.shape, generator=g, dtype=y.dtype)
    gf = torch.randn(final.shape, generator=g, dtype=final.dtype)
    leaves = [t for t in s["scan"] if isinstance(t, torch.Tensor) and t.requires_grad]
    got = torch.autograd.grad((y * gy).sum() + (final * gf).sum(), leaves)
    want = torch.autograd.grad((y2 * gy).sum() + (final2 * gf).sum(), leaves)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("value, keep", [(None, True), ("0", True), ("", True), ("1", False)])
def test_recompute_states_environment_variable(value, keep):
    """M2OPS_RECOMPUTE_STATES=1 turns off keeping the forward's bfloat16 states for the backward (read at
    import, in a fresh interpreter)."""
    out = printed_with_env("from m2ops.ops import eager; print(eager.KEEP_STATES)", "M2OPS_RECOMPUTE_STATES", value)
    assert out == str(keep)
