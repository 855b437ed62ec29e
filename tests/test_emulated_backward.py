"""The backward kernels (m2ops/kernels/backward.py) on the emulator against the reference backward formulas:
chunk_cumsum_bwd, fwd_pass_state_bwd (whole and in its two stages, state_passing_bwd and chunk_state_bwd; with gcarry
in the walk or apart from it), compute_out_bwd.

The kernels' own code on the CPU through tests/tile_emulator.py, against the reference: what that catches and
misses, and the tolerances, in tests/emulated_cases.py (the helpers shared by tests/test_emulated_*.py). Skipped
when cuda.tile is not installed (the kernels cannot even be imported then).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

pytest.importorskip("cuda.tile", reason="cuda.tile (cuda-tile) is not installed")
pytestmark = pytest.mark.slow  # minutes on a 2-core machine: outside the quick subset (-m "not slow")

from emulated_cases import BWD_TOL, SWEEP, cases, emulated_launches  # noqa: E402  (puts tests/gpu on sys.path)
from gpu_cases import make_case, reference_forward, rel_err  # noqa: E402
from knobs import knobs  # noqa: E402
from m2ops.meta.shapes import g_local_dtype  # noqa: E402
from tile_emulator import emulated_kernels  # noqa: E402


CUMSUM_BWD_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _cotangent(t, gen):
    return torch.randn(t.shape, generator=gen, dtype=torch.float32)


@given(cases())
@SWEEP
def test_backward_kernels(kw):
    """chunk_cumsum_bwd and fwd_pass_state_bwd against the reference backward formulas."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(**kw)
    _, fin_ref, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(kw["seed"])
    lo, hi = case["dt_limit"]
    args = (_cotangent(mid["dt_out"], gen), _cotangent(mid["dA_cumsum"], gen), case["dt"], case["A"],
            case["dt_bias"], case["chunk_size"], case["dt_softplus"], float(lo), float(hi))
    want = ref_bwd.chunk_cumsum_bwd(*args)
    with emulated_kernels():
        got = backward.chunk_cumsum_bwd(*args)
    _assert_no_aliasing(args, got)
    # g_A and g_dt_bias are one float32 sum per head over every token, whose random-signed terms cancel: 1e-4.
    for name, a, b, tol in zip(("g_dt", "g_A", "g_dt_bias"), got, want,
                               (CUMSUM_BWD_TOL[case["dt"].dtype], 1e-4, 1e-4)):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) <= tol, f"{name}: {rel_err(a, b):.3e}"

    args = (_cotangent(mid["states"], gen), _cotangent(fin_ref, gen), fin_ref.new_zeros((0, *fin_ref.shape[1:])),
            case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"], case["initial_states"], case["seq_idx"], None)
    want = ref_bwd.fwd_pass_state_bwd(*args)
    dtype = case["x"].dtype
    base = [_cotangent(t, gen).to(t.dtype) for t in (case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"])]
    with emulated_kernels():
        got = backward.fwd_pass_state_bwd(*args)
        # in its two stages from the entering states, the gradients added into another op's (as chunk_scan's
        # backward calls them)
        got_staged, stage1 = _staged(backward, args, mid["states"], base)
    _assert_no_aliasing(args, got)
    want_stage1 = ref_bwd.state_passing_bwd(args[0], args[1], mid["states"], mid["dA_cumsum"], case["seq_idx"],
                                            stage1[0].dtype)
    for name, a, b in zip(("g_local", "g_carry", "g_init"), stage1, want_stage1):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
        assert rel_err(a, b) <= BWD_TOL[dtype], f"state_passing_bwd's {name}: {rel_err(a, b):.3e}"
    want_staged = (*(w.float() + a.float() for w, a in zip(want, base)), want[4])
    for name, a, b, c, d in zip(("g_x", "g_B", "g_dt_out", "g_dA_cumsum", "g_init"), got, want, got_staged,
                                want_staged):
        # A token's g_dt is one tf32 dot product over headdim x dstate terms, whose cancellation a sequence of
        # one or a few tokens does not average out (4.3e-3 at one token, headdim 64, dstate 100).
        tol = BWD_TOL[dtype] * (2 if dtype == torch.float32 and name in ("g_dt_out", "g_dA_cumsum") else 1)
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
        assert rel_err(a, b) <= tol, f"{name}: {rel_err(a, b):.3e}"
        assert c.shape == d.shape and c.is_contiguous(), name
        assert rel_err(c.float(), d.float()) <= tol, f"{name} (in two stages): {rel_err(c, d):.3e}"


def _staged(backward, args, states, base):
    """fwd_pass_state_bwd's gradients through the launchers of its two stages as the scan's backward calls them,
    from the given entering states, added into bases (gradients of x, B, dt_out and dA_cumsum; or zeros); and
    the first stage's outputs."""
    g_states, g_final, _, x, B, dt_out, dA_cumsum, initial_states, seq_idx, _ = args
    stage1 = backward.state_passing_bwd(g_states, g_final, states, dA_cumsum, seq_idx,
                                        g_local_dtype(x.dtype, B.dtype, dA_cumsum.dtype))
    grads = ([t.clone() for t in base] if base is not None
             else [torch.zeros_like(t) for t in (x, B, dt_out, dA_cumsum)])
    backward.chunk_state_bwd(stage1[0], stage1[1], x, B, dt_out, dA_cumsum, seq_idx, *grads)
    g_init = stage1[2].to(initial_states.dtype) if initial_states is not None else g_states.new_empty((0,))
    return (*grads, g_init), stage1


def _assert_no_aliasing(args, outputs):
    """The launchers are the CUDA implementations of custom ops, whose outputs may alias neither an input nor
    each other (torch raises at dispatch otherwise, which the CPU reference path never shows)."""
    assert not torch._C._any_output_is_alias_to_input_or_output(args, {}, tuple(outputs))


def test_backward_kernels_with_mixed_input_dtypes():
    """x in float16 with B and C in bfloat16 (the kernels compute in their promotion, float32): every gradient
    of fwd_pass_state_bwd and compute_out_bwd comes back in the dtype the reference gives, within tolerance."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(seqlen=200, nheads=4, ngroups=2, headdim=16, dstate=32, chunk_size=64, dtype=torch.float16,
                     initial_states=True, D="h", z=True, device="cpu", seed=5)
    case["B"], case["C"] = case["B"].to(torch.bfloat16), case["C"].to(torch.bfloat16)
    y_ref, fin_ref, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(5)
    state_args = (_cotangent(mid["states"], gen), _cotangent(fin_ref, gen), fin_ref.new_zeros((0, *fin_ref.shape[1:])),
                  case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"], case["initial_states"], None, None)
    out_args = (torch.randn(y_ref.shape, generator=gen).to(y_ref.dtype), case["x"], mid["dt_out"], mid["dA_cumsum"],
                case["C"], case["B"], mid["states"], case["D"], case["z"], None)
    for fn, args in (("fwd_pass_state_bwd", state_args), ("compute_out_bwd", out_args)):
        want = getattr(ref_bwd, fn)(*args)
        with emulated_kernels():
            got = getattr(backward, fn)(*args)
        for i, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape and a.dtype == b.dtype, (fn, i, a.dtype, b.dtype)
            assert rel_err(a, b) <= BWD_TOL[torch.float16], f"{fn} output {i}: {rel_err(a, b):.3e}"


@given(cases())
@SWEEP
def test_compute_out_backward_kernels(kw):
    """compute_out_bwd (every gradient, D and z included) against the reference backward formulas."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(**kw)
    y_ref, _, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(kw["seed"])
    g_y = torch.randn(y_ref.shape, generator=gen).to(y_ref.dtype).to(y_ref.device)
    args = (g_y, case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"], case["D"],
            case["z"], case["seq_idx"])
    want = ref_bwd.compute_out_bwd(*args)
    with emulated_kernels():
        got = backward.compute_out_bwd(*args)
    _assert_no_aliasing(args, got)
    dtype = case["x"].dtype
    for name, a, b in zip(("g_x", "g_dt_out", "g_dA_cumsum", "g_C", "g_B", "g_states", "g_D", "g_z"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype and a.is_contiguous(), name
        assert rel_err(a, b) <= BWD_TOL[dtype], f"{name}: {rel_err(a, b):.3e}"


@pytest.mark.parametrize("seqlen,chunk,seq_idx", [(300, 64, False), (200, 128, True), (64, 256, False)])
def test_unwritten_scratch_is_never_read(monkeypatch, seqlen, chunk, seq_idx):
    """compute_out_bwd's and chunk_state_bwd's per-writer slots are not initialised (the sums read only the slots
    written, the blocks of each chunk that hold tokens): with every new float32 buffer filled with NaN, the
    gradients still match the reference formulas. A tail chunk and chunks with unused token blocks included."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(seqlen=seqlen, nheads=4, ngroups=2, headdim=16, dstate=32, chunk_size=chunk,
                     dtype=torch.bfloat16, initial_states=True, D="h", z=False, seq_idx=seq_idx, device="cpu",
                     seed=3)
    y_ref, fin_ref, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(3)
    g_y = torch.randn(y_ref.shape, generator=gen).to(y_ref.dtype)
    out_args = (g_y, case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"], case["D"],
                None, case["seq_idx"])
    state_args = (_cotangent(mid["states"], gen), _cotangent(fin_ref, gen), fin_ref.new_zeros((0, *fin_ref.shape[1:])),
                  case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"], case["initial_states"], case["seq_idx"],
                  None)
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.dtype == torch.float32 else t
    for fn, args in (("compute_out_bwd", out_args), ("fwd_pass_state_bwd", state_args)):
        want = getattr(ref_bwd, fn)(*args)
        with emulated_kernels(), monkeypatch.context() as m:
            m.setattr(backward.torch, "empty", poisoned)
            got = getattr(backward, fn)(*args)
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.isfinite(a).all(), (fn, i)
            assert rel_err(a, b) <= BWD_TOL[torch.bfloat16], f"{fn} output {i}: {rel_err(a, b):.3e}"


@pytest.mark.parametrize("dtype,seq_idx,given_states,carry_block,dstate", [
    (torch.bfloat16, True, True, 512, 64), (torch.float32, False, False, None, 32),
    (torch.bfloat16, False, False, 1024, 32), (torch.bfloat16, True, True, None, 20)])
def test_state_carry_grad_apart_from_the_walk(monkeypatch, dtype, seq_idx, given_states, carry_block, dstate):
    """separate_carry_grad forced on (the config): state_passing_bwd walks without gcarry and state_carry_grad
    forms it afterwards; every gradient of fwd_pass_state_bwd matches the reference's as with gcarry in the
    walk, also from the forward's bfloat16 entering states (the eager path's). state_carry_grad's loop takes 2
    full blocks (dstate 64: 1024 elements in blocks of 512), one (carry_block's choice) or one half past its end
    (512 elements in a block of 1024), and the walk's block divides the state (unchecked loads); at dstate 20 (320
    elements) the walk's one block is partial (checked loads)."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(dtype=dtype, device="cpu", chunk_size=64, seqlen=300, nheads=4, ngroups=2, headdim=16,
                     dstate=dstate, initial_states=True, seq_idx=seq_idx, nseqs=3, seed=21)
    case["A"] = case["A"] * 0.02  # slow decay: carries near 1, so that gcarry's share of g_dA_cumsum counts
    _, fin_ref, _, mid = reference_forward(case)
    gen = torch.Generator().manual_seed(21)
    args = (_cotangent(mid["states"], gen), _cotangent(fin_ref, gen), fin_ref.new_zeros((0, *fin_ref.shape[1:])),
            case["x"], case["B"], mid["dt_out"], mid["dA_cumsum"], case["initial_states"], case["seq_idx"], None)
    want = ref_bwd.fwd_pass_state_bwd(*args)
    states = mid["states"].to(torch.bfloat16) if given_states else None
    knobs(monkeypatch, separate_carry_grad=True)
    if carry_block is not None:  # else backward.carry_block's choice
        monkeypatch.setattr(backward, "carry_block", lambda state_elems: carry_block)
    with emulated_launches() as launches:
        got = _staged(backward, args, states, None)[0] if given_states else backward.fwd_pass_state_bwd(*args)
    assert "state_carry_grad_kernel" in [name for name, _, _ in launches]
    # the walk's constants end its arguments: BLK, HAS_SEQ, GC, CHK (unchecked where the block divides the state)
    (walk_args,) = [a for name, _, a in launches if name == "state_passing_bwd_kernel"]
    assert walk_args[-2:] == (False, dstate == 20)
    tol = BWD_TOL[dtype] * (2 if given_states else 1)  # bfloat16 entering states: one more rounding
    for name, a, b in zip(("g_x", "g_B", "g_dt_out", "g_dA_cumsum", "g_init"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) <= tol, f"{name}: {rel_err(a, b):.3e}"


def test_separate_carry_grad_rule(monkeypatch):
    """gcarry leaves the walk for walk blocks up to SEPARATE_CARRY_MAX_BLOCK unless SEPARATE_CARRY_GRAD forces
    a way."""
    from m2ops.kernels import backward
    knobs(monkeypatch, separate_carry_grad=None)
    top = backward.SEPARATE_CARRY_MAX_BLOCK
    assert backward.separate_carry_grad(top) and not backward.separate_carry_grad(2 * top)
    assert [backward.carry_block(n) for n in (100, 512, 4096, 8192, 64 * 96)] == [512, 512, 4096, 4096, 4096]
    for forced in (True, False):
        knobs(monkeypatch, separate_carry_grad=forced)
        assert backward.separate_carry_grad(top) is forced and backward.separate_carry_grad(2 * top) is forced


@pytest.mark.parametrize("D", ["h", "hp"])
def test_gated_d_gradient_from_float32(D):
    """With z, the kernels' G (the gated output gradient) is rounded to bfloat16 for their products; D's gradient,
    one sum over every token per head (or channel), is formed from the float32 G instead, so that it is as
    accurate as a float32 sum of the same rounded inputs (the rounded G gave about 1e-3)."""
    from m2ops.kernels import backward
    from m2ops.reference import chunked_backward as ref_bwd
    case = make_case(seqlen=512, nheads=4, ngroups=1, headdim=32, dstate=16, chunk_size=64, dtype=torch.bfloat16,
                     D=D, z=True, device="cpu", seed=11)
    y_ref, _, _, mid = reference_forward(case)
    g_y = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(3)).to(y_ref.dtype)
    args = (g_y, case["x"], mid["dt_out"], mid["dA_cumsum"], case["C"], case["B"], mid["states"], case["D"],
            case["z"], None)
    want = ref_bwd.compute_out_bwd(*args)[6]
    with emulated_kernels():
        got = backward.compute_out_bwd(*args)[6]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) <= 1e-5, f"g_D: {rel_err(got, want):.3e}"


@pytest.mark.parametrize("seq_idx", [False, True], ids=["one_sequence", "seq_idx"])
def test_a_and_dt_bias_gradients_against_float64(seq_idx):
    """A's and dt_bias's gradients are sums over every token of dA_cumsum's gradient (times dt), whose row and
    column parts each come to ~100x the result: out_bwd_dcbw forms both parts from one float32 tile so that they
    cancel as in exact arithmetic. The public eager path on the emulator (bfloat16, D, z, dt_bias with softplus,
    initial state; one sequence, or three through seq_idx) against the reference in float64 on the same rounded
    inputs: g_A and g_dt_bias within 1e-2 (one sequence: 5.0e-3 and 4.8e-4; the column parts from out_bwd_dx's
    bfloat16-rounded products gave 4.0e-1 for g_A)."""
    from m2ops import mamba_chunk_scan_combined
    from m2ops.ops import eager
    case = make_case(batch=1, seqlen=1024, nheads=4, ngroups=1, headdim=64, dstate=64, chunk_size=256,
                     dtype=torch.bfloat16, D="h", z=True, initial_states=True, seq_idx=seq_idx, nseqs=3, device="cpu",
                     seed=0)
    leaves = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
    gen = torch.Generator().manual_seed(0)
    got = {k: case[k].detach().requires_grad_() for k in leaves}
    with emulated_kernels():
        y, fin = eager.scan_combined(got["x"], got["dt"], got["A"], got["B"], got["C"], case["chunk_size"], got["D"],
                                     got["z"], got["dt_bias"], got["initial_states"], case["seq_idx"], case["dt_softplus"],
                                     *map(float, case["dt_limit"]))
        g_y, g_fin = torch.randn(y.shape, generator=gen).to(y.dtype), torch.randn(fin.shape, generator=gen)
        torch.autograd.backward((y, fin), (g_y, g_fin))
    want = {k: case[k].detach().double().requires_grad_() for k in leaves}
    y64, fin64 = mamba_chunk_scan_combined(**{**case, **want}, return_final_states=True)
    torch.autograd.backward((y64, fin64), (g_y.double(), g_fin.double()))
    for name in ("A", "dt_bias"):
        err = rel_err(got[name].grad.double(), want[name].grad)
        assert err <= 1e-2, f"g_{name}: {err:.3e} against float64"
