"""m2ops::state_update (one decoding token, functional: m2ops.selective_state_update_functional) against one step
of the float64 naive recurrence, its registration (opcheck), the public wrapper's mamba_ssm-style broadcast
arguments, and its input errors. The in-place form (m2ops.selective_state_update): test_state_update_inplace.py."""

from __future__ import annotations

import pytest
import torch

import m2ops
from conftest import TOL, assert_close_rel
from m2ops.reference.naive import naive_scan

INF = float("inf")


def decode_inputs(b=3, h=4, p=8, g=2, n=16, dtype=torch.float32, D=None, z=False, dt_bias=False, softplus=True,
                  seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = dict(
        state=randn(b, h, p, n).to(state_dtype),
        x=randn(b, h, p).to(dtype),
        dt=(randn(b, h) * 1.5 - (1.0 if softplus else 0.0)).to(dtype),  # some negative: the clamp matters
        A=-torch.exp(randn(h) * 0.5).to(dtype),
        B=randn(b, g, n, scale=n ** -0.25).to(dtype),
        C=randn(b, g, n, scale=n ** -0.25).to(dtype),
        D={None: None, "h": randn(h), "hp": randn(h, p)}[D],
        z=randn(b, h, p).to(dtype) if z else None,
        dt_bias=randn(h).to(dtype) if dt_bias else None,
    )
    if out["D"] is not None:
        out["D"] = out["D"].to(dtype)
    if requires_grad:
        for v in out.values():
            if v is not None:
                v.requires_grad_(True)
    return out


def naive_step(inp, dt_softplus, dt_limit):
    """The naive recurrence over one token, seeded with the state: (y (b, h, p), new state)."""
    y, final, _ = naive_scan(inp["x"][:, None], inp["dt"][:, None], inp["A"], inp["B"][:, None], inp["C"][:, None],
                             D=inp["D"], z=None if inp["z"] is None else inp["z"][:, None], dt_bias=inp["dt_bias"],
                             initial_states=inp["state"], dt_softplus=dt_softplus, dt_limit=dt_limit)
    return y[:, 0], final


CASES = {
    "plain": (dict(), False, (0.0, INF)),
    "all_options": (dict(D="hp", z=True, dt_bias=True), True, (0.0, INF)),
    "D_h_limit": (dict(D="h", dt_bias=True, g=1), True, (0.05, 0.5)),
    "groups_eq_heads": (dict(g=4, z=True), True, (0.0, INF)),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_matches_naive_step(case, dtype):
    opts, softplus, limit = CASES[case]
    inp = decode_inputs(dtype=dtype, softplus=softplus, **opts)
    before = {k: v.clone() for k, v in inp.items() if v is not None}
    y, new_state = m2ops.selective_state_update_functional(**inp, dt_softplus=softplus, dt_limit=limit)
    want_y, want_state = naive_step(inp, softplus, limit)
    assert y.dtype == dtype and y.shape == inp["x"].shape
    assert new_state.dtype == inp["state"].dtype and new_state.shape == inp["state"].shape
    assert_close_rel(y, want_y, TOL[dtype], "y")
    assert_close_rel(new_state, want_state, TOL[torch.float64 if dtype == torch.float64 else torch.float32],
                     "state")
    for k, v in before.items():  # functional: nothing written
        assert torch.equal(inp[k], v), k


def test_many_steps_equal_scan():
    """Token-by-token updates reproduce the chunked scan's outputs and final state."""
    gen = torch.Generator().manual_seed(3)
    b, T, h, p, g, n = 2, 11, 4, 4, 2, 8
    x, z = torch.randn(b, T, h, p, generator=gen), torch.randn(b, T, h, p, generator=gen)
    dt = torch.randn(b, T, h, generator=gen)
    A = -torch.rand(h, generator=gen) - 0.5
    B, C = torch.randn(b, T, g, n, generator=gen), torch.randn(b, T, g, n, generator=gen)
    D, bias, s0 = torch.randn(h), torch.randn(h), torch.randn(b, h, p, n, generator=gen)
    y_scan, final = m2ops.mamba_chunk_scan_combined(x, dt, A, B, C, 4, D=D, z=z, dt_bias=bias, initial_states=s0,
                                                    dt_softplus=True, dt_limit=(0.01, 2.0), return_final_states=True)
    state, ys = s0, []
    for t in range(T):
        y, state = m2ops.selective_state_update_functional(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D=D,
                                                           z=z[:, t], dt_bias=bias, dt_softplus=True,
                                                           dt_limit=(0.01, 2.0))
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys, 1), y_scan, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


def test_mamba_ssm_broadcast_arguments():
    """mamba_ssm's callers expand A, dt and dt_bias over headdim (and dstate); the wrapper takes them."""
    inp = decode_inputs(D="h", dt_bias=True)
    h, p, n = inp["A"].shape[0], inp["x"].shape[2], inp["B"].shape[2]
    want = m2ops.selective_state_update_functional(**inp, dt_softplus=True)
    got = m2ops.selective_state_update_functional(
        inp["state"], inp["x"], inp["dt"][..., None].expand(-1, -1, p), inp["A"][:, None, None].expand(h, p, n),
        inp["B"], inp["C"], D=inp["D"][:, None].expand(h, p), dt_bias=inp["dt_bias"][:, None].expand(h, p),
        dt_softplus=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"selective_state_update: A must have one value per head"):
        m2ops.selective_state_update_functional(inp["state"], inp["x"], inp["dt"], torch.randn(h, p, n), inp["B"],
                                                inp["C"])


def test_gradients_float64():
    inp = decode_inputs(dtype=torch.float64, D="hp", z=True, dt_bias=True, b=2, h=2, p=3, g=1, n=4,
                        requires_grad=True)
    names = [k for k, v in inp.items() if v is not None]

    def fn(*tensors):
        kw = dict(zip(names, tensors))
        return m2ops.selective_state_update_functional(**kw, dt_softplus=True, dt_limit=(0.0, INF))

    assert torch.autograd.gradcheck(fn, tuple(inp[k] for k in names))


@pytest.mark.parametrize("case", ["plain", "all_options", "D_h_limit"])
def test_opcheck(case):
    opts, softplus, (lo, hi) = CASES[case]
    inp = decode_inputs(dtype=torch.float32, softplus=softplus, requires_grad=True, b=2, h=4, p=4, n=8, **opts)
    args = (inp["state"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"], inp["z"], inp["dt_bias"],
            softplus, lo, hi)
    torch.library.opcheck(torch.ops.m2ops.state_update.default, args)
    y, s = torch.ops.m2ops.state_update(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    g = torch.Generator().manual_seed(0)
    bwd_args = (torch.randn(y.shape, generator=g), torch.randn(s.shape, generator=g),
                *(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    torch.library.opcheck(torch.ops.m2ops.state_update_bwd.default, bwd_args)


def test_compile_fullgraph(reset_dynamo):
    inp = decode_inputs(D="h", z=True, dt_bias=True)
    fn = lambda **kw: m2ops.selective_state_update_functional(**kw, dt_softplus=True)  # noqa: E731
    got = torch.compile(fn, fullgraph=True)(**inp)
    want = fn(**inp)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def _bad(**changes):
    inp = decode_inputs(D="h", z=True, dt_bias=True)
    inp.update(changes)
    return inp


@pytest.mark.parametrize("name,changes,kind", [
    ("x", dict(x=torch.randn(3, 4)), ValueError),
    ("x", dict(x=torch.zeros(3, 4, 8, dtype=torch.int32)), TypeError),
    ("state", dict(state=torch.randn(3, 4, 8, 15)), ValueError),
    ("state", dict(state="state"), TypeError),
    ("dt", dict(dt=torch.randn(3, 5)), ValueError),
    ("A", dict(A=torch.randn(5)), ValueError),
    ("B", dict(B=torch.randn(3, 3, 16)), ValueError),
    ("C", dict(C=torch.randn(3, 2, 8)), ValueError),
    ("D", dict(D=torch.randn(4, 3)), ValueError),
    ("z", dict(z=torch.randn(3, 4, 7)), ValueError),
    ("dt_bias", dict(dt_bias=torch.randn(3)), ValueError),
    ("dt_bias", dict(dt_bias=torch.zeros(4, dtype=torch.int64)), TypeError),
    ("dt_softplus", dict(dt_softplus=1), TypeError),
    ("dt_limit", dict(dt_limit=(1.0, 0.5)), ValueError),
    ("dt_limit", dict(dt_limit=0.5), TypeError),
])
def test_bad_inputs_name_the_argument(name, changes, kind):
    inp = _bad(**changes)
    kw = dict(dt_softplus=inp.pop("dt_softplus", True), dt_limit=inp.pop("dt_limit", (0.0, INF)))
    with pytest.raises(kind, match=rf"m2ops.selective_state_update: {name} must"):
        m2ops.selective_state_update_functional(**inp, **kw)


def test_kernels_serve_is_the_one_decision(monkeypatch):
    """dispatch.kernels_serve decides kernels or reference from the device's availability, the chunk size and the
    dtypes; an op's CUDA implementation runs its launcher exactly where it says so, else the reference (exercised
    on CPU tensors by forcing the device's availability and standing in a launcher)."""
    import types

    from m2ops.ops import dispatch
    from m2ops.reference import state_update as ref

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(dispatch, "_kernels_serve", lambda device_type, index: device_type == "cuda")
    bf, f64 = torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.float64)
    assert dispatch.kernels_serve(cuda, 64, (bf, None)) and dispatch.kernels_serve(cuda, None, (bf,))
    assert not dispatch.kernels_serve(cuda, 48, (bf,))  # a chunk size without kernels
    assert not dispatch.kernels_serve(cuda, 64, (bf, f64))  # float64
    assert not dispatch.kernels_serve(torch.device("cpu"), 64, (bf,))

    launched = []
    fake = types.ModuleType("m2ops.kernels")
    fake.state_update = lambda *a: launched.append(a) or ref.state_update(*a)
    monkeypatch.setitem(__import__("sys").modules, "m2ops.kernels", fake)
    monkeypatch.setattr(m2ops, "kernels", fake, raising=False)
    monkeypatch.setattr(dispatch, "_kernels_serve", lambda device_type, index: True)  # the CPU tensors "served"
    impl = dispatch.cuda_impl("state_update", ref.state_update, lambda state, x, *_: (None, (state, x), True))
    for dtype, served in ((torch.float32, True), (torch.float64, False)):
        inp = decode_inputs(D="h", z=True, dt_bias=True)
        args = (inp["state"].to(dtype), inp["x"].to(dtype), inp["dt"], inp["A"], inp["B"], inp["C"], inp["D"],
                inp["z"], inp["dt_bias"], True, 0.0, INF)
        before = len(launched)
        got = impl(*args)
        assert (len(launched) > before) is served
        for a, b in zip(got, ref.state_update(*args)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
