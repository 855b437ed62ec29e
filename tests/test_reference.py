"""The public function (CPU: the chunked PyTorch reference) against the token-by-token float64 recurrence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import (TOL, Dims, assert_close_rel, derived_seq_idx, make_inputs, seq_major_copy, run_naive,
                      run_scan, state_dtype, strided_copy, transposed_copy)
from m2ops.reference.naive import naive_scan

CHUNK_SIZES = [16, 32, 64, 128, 256]
DEFAULT_LIMIT = (0.0, float("inf"))
DT_LIMITS = [DEFAULT_LIMIT, (0.05, 0.8), (0.0, 0.4), (0.2, float("inf"))]
MODES = ["plain", "seq_idx", "cu_seqlens", "cu_seqlens+seq_idx"]


def check_outputs(out, inputs, chunk_size, flags, tol):
    """out: what the public function returned for these flags; compared with naive_scan, entry by entry, in
    the documented order y, final_states, varlen_states."""
    x = inputs["x"]
    y_ref, final_ref, varlen_ref = run_naive(inputs, flags.get("dt_softplus", False),
                                             flags.get("dt_limit", DEFAULT_LIMIT))
    want = 1 + flags.get("return_final_states", False) + flags.get("return_varlen_states", False)
    if want == 1:
        assert isinstance(out, torch.Tensor), type(out)
        out = (out,)
    else:
        assert isinstance(out, tuple) and len(out) == want, (type(out), len(out))
    y, rest = out[0], list(out[1:])
    sdt = state_dtype(inputs["dt"].dtype)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    assert_close_rel(y, y_ref, tol, "y")
    if flags.get("return_final_states", False):
        final = rest.pop(0)
        assert final.shape == final_ref.shape and final.dtype == sdt
        assert_close_rel(final, final_ref, TOL[sdt], "final_states")
    if flags.get("return_varlen_states", False):
        varlen = rest.pop(0)
        assert varlen.shape == varlen_ref.shape and varlen.dtype == sdt
        assert_close_rel(varlen, varlen_ref, TOL[sdt], "varlen_states")
    assert not rest


# ---------------------------------------------------------------------------------------------------------
# float64 against naive, every option, hypothesis-generated
# ---------------------------------------------------------------------------------------------------------

@st.composite
def seqlens(draw, chunk_size, max_len=300):
    """0-2 full chunks plus a remainder (0 = an exact multiple), at least 1 and at most max_len tokens."""
    full = draw(st.integers(0, 2))
    rest = draw(st.integers(0, chunk_size - 1))
    return max(1, min(full * chunk_size + rest, max_len))


@st.composite
def problems(draw):
    chunk_size = draw(st.sampled_from(CHUNK_SIZES))
    dstate = draw(st.sampled_from([1, 2, 8, 16, 64, 128, 512]))
    big = dstate >= 128  # keep batch * nheads * headdim * dstate small
    mode = draw(st.sampled_from(MODES))
    batch = 1 if mode.startswith("cu") else draw(st.integers(1, 2 if big else 3))
    ngroups = draw(st.sampled_from([1, 2] if big else [1, 2, 3]))
    nheads = ngroups * draw(st.integers(1, 1 if big else 3))
    headdim = draw(st.sampled_from([1, 2, 4] if big else [1, 3, 4, 8]))
    seqlen = draw(seqlens(chunk_size))
    dims = Dims(batch, seqlen, nheads, headdim, ngroups, dstate)
    softplus = draw(st.booleans())
    opts = dict(
        D=draw(st.sampled_from([None, "h", "hp"])),
        z=draw(st.booleans()),
        dt_bias=draw(st.booleans()),
        dt_softplus=softplus,
        dt_large=draw(st.booleans()),
        initial_states=draw(st.booleans()),
        seq_idx="seq_idx" in mode,
        seq_start=draw(st.sampled_from([0, 1])) if mode == "seq_idx" else 0,
        cu_seqlens=mode.startswith("cu"),
        nseqs=draw(st.integers(1, 5)),
        index_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
    flags = dict(
        dt_softplus=softplus,
        dt_limit=draw(st.sampled_from(DT_LIMITS)),
        return_final_states=draw(st.booleans()),
        return_varlen_states=mode.startswith("cu") and draw(st.booleans()),
    )
    return dims, chunk_size, opts, flags


@given(problems())
def test_matches_naive_float64(problem):
    dims, chunk_size, opts, flags = problem
    inputs = make_inputs(dims, dtype=torch.float64, **opts)
    out = run_scan(inputs, chunk_size, **flags)
    check_outputs(out, inputs, chunk_size, flags, TOL[torch.float64])


# ---------------------------------------------------------------------------------------------------------
# low precision: output dtype, float32 states, per-dtype tolerance
# ---------------------------------------------------------------------------------------------------------

@st.composite
def low_precision_problems(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    # mixed: x/B/C/z in dtype, dt/A/D/dt_bias/initial_states in float32 (the usual model setting)
    param_dtype = draw(st.sampled_from([dtype, torch.float32]))
    chunk_size = draw(st.sampled_from(CHUNK_SIZES))
    seqlen = draw(seqlens(chunk_size))
    mode = draw(st.sampled_from(MODES))
    batch = 1 if mode.startswith("cu") else draw(st.integers(1, 2))
    ngroups = draw(st.sampled_from([1, 2]))
    dims = Dims(batch, seqlen, 2 * ngroups, draw(st.sampled_from([4, 8])), ngroups,
                draw(st.sampled_from([16, 64])))
    softplus = draw(st.booleans())
    opts = dict(D=draw(st.sampled_from([None, "h", "hp"])), z=draw(st.booleans()), dt_bias=draw(st.booleans()),
                dt_softplus=softplus, initial_states=draw(st.booleans()), seq_idx="seq_idx" in mode,
                cu_seqlens=mode.startswith("cu"), seed=draw(st.integers(0, 2**31 - 1)))
    flags = dict(dt_softplus=softplus, dt_limit=draw(st.sampled_from(DT_LIMITS)), return_final_states=True,
                 return_varlen_states=mode.startswith("cu"))
    return dtype, param_dtype, dims, chunk_size, opts, flags


@given(low_precision_problems())
def test_low_precision_matches_naive(problem):
    dtype, param_dtype, dims, chunk_size, opts, flags = problem
    inputs = make_inputs(dims, dtype=dtype, param_dtype=param_dtype, **opts)
    out = run_scan(inputs, chunk_size, **flags)
    assert out[0].dtype == dtype
    assert all(s.dtype == torch.float32 for s in out[1:])
    check_outputs(out, inputs, chunk_size, flags, TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_long_chunks(dtype):
    """The tolerance holds at the longest chunk with the strongest decay of the generated range."""
    inputs = make_inputs(Dims(1, 600, 4, 8, 2, 64), dtype=dtype, param_dtype=torch.float32, seed=3, D="hp",
                         z=True, dt_bias=True, dt_softplus=True, initial_states=True, seq_idx=True)
    flags = dict(dt_softplus=True, return_final_states=True)
    check_outputs(run_scan(inputs, 256, **flags), inputs, 256, flags, TOL[dtype])


# ---------------------------------------------------------------------------------------------------------
# return tuple, options one by one (deterministic, so a failure names the option)
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("return_final_states", [False, True])
@pytest.mark.parametrize("return_varlen_states", [False, True])
@pytest.mark.parametrize("with_seq_idx", [False, True])
def test_return_tuple_order(return_final_states, return_varlen_states, with_seq_idx):
    # nseqs 3 over 50 tokens: the final state (of the last sequence) differs from every varlen state but the
    # last, so a swapped order fails the value comparison.
    inputs = make_inputs(Dims(1, 50, 2, 4, 1, 8), seed=11, initial_states=True, cu_seqlens=True, nseqs=3,
                         seq_idx=with_seq_idx)
    flags = dict(return_final_states=return_final_states, return_varlen_states=return_varlen_states)
    out = run_scan(inputs, 16, **flags)
    check_outputs(out, inputs, 16, flags, TOL[torch.float64])


@pytest.mark.parametrize("option", ["D_h", "D_hp", "z", "dt_bias", "softplus", "softplus_large", "dt_limit",
                                    "initial_states", "seq_idx", "seq_idx_start_1", "cu_seqlens",
                                    "cu_seqlens_seq_idx"])
@pytest.mark.parametrize("seqlen,chunk_size", [(1, 16), (16, 16), (45, 16), (70, 32), (130, 64)])
def test_each_option(option, seqlen, chunk_size):
    opts, flags = dict(seed=seqlen), dict(return_final_states=True)
    batch = 1 if option.startswith("cu") else 2
    if option == "D_h":
        opts["D"] = "h"
    elif option == "D_hp":
        opts["D"] = "hp"
    elif option in ("z", "dt_bias", "initial_states", "seq_idx"):
        opts[option] = True
    elif option == "softplus":
        opts["dt_softplus"] = flags["dt_softplus"] = True
    elif option == "softplus_large":
        opts.update(dt_softplus=True, dt_large=True, dt_bias=True)
        flags["dt_softplus"] = True
    elif option == "dt_limit":
        flags["dt_limit"] = (0.1, 0.5)
    elif option == "seq_idx_start_1":  # initial_states belong to sequence 0: dropped when row starts at 1
        opts.update(seq_idx=True, seq_start=1, initial_states=True, nseqs=1)
    elif option == "cu_seqlens":
        opts.update(cu_seqlens=True, nseqs=4, initial_states=True)
        flags["return_varlen_states"] = True
    elif option == "cu_seqlens_seq_idx":
        opts.update(cu_seqlens=True, seq_idx=True, nseqs=4, initial_states=True)
        flags["return_varlen_states"] = True
    inputs = make_inputs(Dims(batch, seqlen, 4, 4, 2, 8), **opts)
    check_outputs(run_scan(inputs, chunk_size, **flags), inputs, chunk_size, flags, TOL[torch.float64])


def test_softplus_identity_branch_is_hit():
    """dt_large puts dt + dt_bias above 20, where softplus is the identity (the naive recurrence agrees)."""
    inputs = make_inputs(Dims(1, 40, 2, 4, 1, 8), seed=5, dt_bias=True, dt_softplus=True, dt_large=True)
    assert ((inputs["dt"] + inputs["dt_bias"]) > 20).any()
    flags = dict(dt_softplus=True, return_final_states=True)
    check_outputs(run_scan(inputs, 16, **flags), inputs, 16, flags, TOL[torch.float64])


def test_default_dt_limit_clamps_negative_dt():
    """With the default dt_limit=(0, inf), negative dt (without softplus) acts as dt = 0."""
    inputs = make_inputs(Dims(2, 40, 2, 4, 1, 8), seed=6, D="h", initial_states=True)
    assert (inputs["dt"] < 0).any() and (inputs["dt"] > 0).any()
    clamped = dict(inputs, dt=inputs["dt"].clamp(min=0))
    y, s = run_scan(inputs, 16, return_final_states=True)
    y0, s0 = run_scan(clamped, 16, return_final_states=True)
    torch.testing.assert_close(y, y0)
    torch.testing.assert_close(s, s0)
    # and it matters: without the clamp the result would differ
    y_unclamped, _, _ = naive_scan(**{k: v for k, v in inputs.items()}, dt_limit=(-1e9, 1e9))
    assert (y - y_unclamped).abs().max() > 1e-3


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_chunk_size_does_not_change_result(chunk_size):
    inputs = make_inputs(Dims(1, 300, 2, 4, 1, 16), seed=7, dt_softplus=True, seq_idx=True, initial_states=True)
    flags = dict(dt_softplus=True, return_final_states=True)
    check_outputs(run_scan(inputs, chunk_size, **flags), inputs, chunk_size, flags, TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_strong_decay_varlen_states_finite(dtype):
    """Decays of e^-100 and beyond per token: nothing overflows (in particular past a packed sequence's end
    inside its last chunk, where the within-chunk cumulative sum difference is positive)."""
    inputs = make_inputs(Dims(1, 50, 4, 8, 2, 16), dtype=dtype, seed=1, cu_seqlens=True, nseqs=3, initial_states=True,
                         decay=(5.0, 30.0))
    inputs["dt"] = inputs["dt"].abs() * 8
    flags = dict(return_final_states=True, return_varlen_states=True)
    check_outputs(run_scan(inputs, 16, **flags), inputs, 16, flags, TOL[dtype])


def test_naive_derives_seq_idx_from_cu_seqlens():
    """The ground truth itself: cu_seqlens alone restarts the state like the matching seq_idx does."""
    inputs = make_inputs(Dims(1, 30, 2, 4, 1, 8), seed=2, cu_seqlens=True, nseqs=3, initial_states=True)
    a = naive_scan(**inputs)
    b = naive_scan(**dict(inputs, seq_idx=derived_seq_idx(inputs["cu_seqlens"], 30)))
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=0, atol=0)
    no_restart = naive_scan(**dict(inputs, cu_seqlens=None))[0]
    assert (a[0] - no_restart).abs().max() > 1e-6


# ---------------------------------------------------------------------------------------------------------
# non-contiguous inputs
# ---------------------------------------------------------------------------------------------------------

LAYOUTS = {"strided": strided_copy, "transposed": transposed_copy, "seq_major": seq_major_copy}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("D", ["h", "hp"])
def test_noncontiguous_inputs(layout, varlen, D):
    inputs = make_inputs(Dims(1 if varlen else 2, 45, 4, 4, 2, 8), seed=4, D=D, z=True, dt_bias=True,
                         initial_states=True, seq_idx=True, cu_seqlens=varlen, dt_softplus=True)
    flags = dict(dt_softplus=True, return_final_states=True, return_varlen_states=varlen)
    want = run_scan(inputs, 16, **flags)
    moved = {k: LAYOUTS[layout](v) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    for k in ("x", "dt", "B", "C", "z"):
        assert not moved[k].is_contiguous(), k
        torch.testing.assert_close(moved[k], inputs[k], rtol=0, atol=0)
    got = run_scan(moved, 16, **flags)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    check_outputs(got, inputs, 16, flags, TOL[torch.float64])
