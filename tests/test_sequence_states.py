"""Per-sequence initial states (cu_seqlens with initial_states of shape (num_sequences, nheads, headdim, dstate)):
the float64 token loop against separate per-sequence runs, the public function against the token loop, and the
gradient of the start states (gradcheck)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TOL, Dims, assert_close_rel, make_inputs, state_dtype
from m2ops import mamba_chunk_scan_combined
from m2ops.reference.naive import naive_scan

CHUNK_SIZES = [4, 8, 16, 64]


def with_starts(inputs, seed=1):
    """inputs with one random start state per packed sequence."""
    nseq = inputs["cu_seqlens"].shape[0] - 1
    h, p, n = inputs["x"].shape[2], inputs["x"].shape[3], inputs["B"].shape[3]
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randn(nseq, h, p, n, generator=gen, dtype=torch.float64)
    return {**inputs, "initial_states": starts.to(inputs["dt"].dtype)}


def test_naive_per_sequence_is_separate_runs():
    """The token loop with start states equals running each sequence alone from its own state."""
    inputs = with_starts(make_inputs(Dims(1, 41, 4, 3, 2, 5), seed=3, cu_seqlens=True, nseqs=5, z=True, D="h"))
    cu = inputs["cu_seqlens"]
    y, final, varlen = naive_scan(**inputs)
    for k in range(cu.shape[0] - 1):
        s, e = int(cu[k]), int(cu[k + 1])
        part = {key: (v[:, s:e] if key in ("x", "dt", "B", "C", "z") else v) for key, v in inputs.items()}
        part.update(cu_seqlens=None, initial_states=inputs["initial_states"][k:k + 1])
        y_k, final_k, _ = naive_scan(**part)
        torch.testing.assert_close(y[:, s:e], y_k, rtol=0, atol=1e-12)
        torch.testing.assert_close(varlen[k], final_k[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(final[0], varlen[-1], rtol=0, atol=0)


@st.composite
def problems(draw):
    chunk = draw(st.sampled_from(CHUNK_SIZES))
    T = draw(st.integers(2, 3 * chunk + 5))
    g = draw(st.sampled_from([1, 2]))
    dims = Dims(1, T, g * draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3])), g,
                draw(st.sampled_from([1, 4])))
    opts = dict(D=draw(st.sampled_from([None, "h", "hp"])), z=draw(st.booleans()), dt_bias=draw(st.booleans()),
                dt_softplus=draw(st.booleans()), seq_idx=draw(st.booleans()),
                index_dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    nseqs = draw(st.integers(2, min(T, 9)))
    return chunk, dims, opts, nseqs, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=60)
@given(problems(), st.sampled_from([torch.float64, torch.float32]))
def test_public_function_against_naive(problem, dtype):
    chunk, dims, opts, nseqs, seed = problem
    softplus = opts.pop("dt_softplus")
    inputs = with_starts(make_inputs(dims, dtype=dtype, seed=seed, cu_seqlens=True, nseqs=nseqs, dt_softplus=softplus,
                                     **opts), seed=seed + 1)
    y, final, varlen = mamba_chunk_scan_combined(chunk_size=chunk, **inputs, dt_softplus=softplus,
                                                 return_final_states=True, return_varlen_states=True)
    y_ref, final_ref, varlen_ref = naive_scan(**inputs, dt_softplus=softplus)
    sdt = state_dtype(dtype)
    assert y.dtype == dtype and final.dtype == sdt and varlen.dtype == sdt
    assert varlen.shape == varlen_ref.shape and final.shape == final_ref.shape
    assert_close_rel(y, y_ref, TOL[dtype], "y")
    assert_close_rel(final, final_ref, TOL[sdt], "final_states")
    assert_close_rel(varlen, varlen_ref, TOL[sdt], "varlen_states")


@pytest.mark.parametrize("lengths,chunk", [([1, 1, 1, 1], 4), ([4, 4, 8], 4), ([3, 9, 1, 2], 4), ([1, 30], 8),
                                           ([17, 15], 16)])
def test_boundaries(lengths, chunk):
    """Starts on chunk boundaries, inside chunks, several in one chunk, one-token sequences."""
    T = sum(lengths)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    inputs = with_starts({**make_inputs(Dims(1, T, 2, 3, 1, 4), seed=T, z=True), "cu_seqlens": cu})
    y, varlen = mamba_chunk_scan_combined(chunk_size=chunk, **inputs, return_varlen_states=True)
    y_ref, _, varlen_ref = naive_scan(**inputs)
    assert_close_rel(y, y_ref, 1e-10, "y")
    assert_close_rel(varlen, varlen_ref, 1e-10, "varlen_states")


def test_zero_starts_after_the_first_are_the_batch_form():
    """Start states that are zero past sequence 0 give the batch form's result (initial_states[0] before token 0)."""
    inputs = with_starts(make_inputs(Dims(1, 30, 2, 3, 1, 4), seed=5, cu_seqlens=True, nseqs=4, D="h"))
    starts = inputs["initial_states"].clone()
    starts[1:] = 0
    y, v = mamba_chunk_scan_combined(chunk_size=8, **{**inputs, "initial_states": starts}, return_varlen_states=True)
    y_b, v_b = mamba_chunk_scan_combined(chunk_size=8, **{**inputs, "initial_states": starts[:1]},
                                         return_varlen_states=True)
    torch.testing.assert_close(y, y_b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(v, v_b, rtol=1e-12, atol=1e-12)


def test_wrong_number_of_start_states():
    inputs = make_inputs(Dims(1, 20, 2, 3, 1, 4), seed=1, cu_seqlens=True, nseqs=3)
    inputs["initial_states"] = torch.zeros(2, 2, 3, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match="initial_states.*num_sequences"):
        mamba_chunk_scan_combined(chunk_size=8, **inputs)


def test_gradcheck():
    """Gradients of every float input, the per-sequence start states included (float64, CPU reference)."""
    inputs = with_starts(make_inputs(Dims(1, 13, 2, 2, 1, 3), seed=7, cu_seqlens=True, nseqs=3, D="h", z=True,
                                     dt_bias=True, dt_softplus=True), seed=8)
    names = [k for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states") if inputs[k] is not None]
    args = [inputs[k].clone().requires_grad_(True) for k in names]

    def fn(*tensors):
        kw = {**inputs, **dict(zip(names, tensors))}
        y, varlen = mamba_chunk_scan_combined(chunk_size=4, **kw, dt_softplus=True, return_varlen_states=True)
        return y, varlen

    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-6, rtol=1e-5)


def _start_state_out_args(lens, chunk, z, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, h, g, p, n = sum(lens), 4, 2, 3, 5
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    return (torch.randn(1, T, h, p, generator=gen, dtype=dtype), torch.randn(1, T, g, n, generator=gen, dtype=dtype),
            torch.randn(1, T, h, p, generator=gen, dtype=dtype) if z else None,
            torch.randn(len(lens), h, p, n, generator=gen, dtype=dtype),
            (-torch.rand(1, h, -(-T // chunk), chunk, generator=gen, dtype=dtype)).cumsum(-1), cu)


START_CASES = {"inside_and_across": ([3, 9, 1, 12], 4, True), "on_boundaries": ([4, 8, 4], 4, False),
               "one_sequence": ([7], 4, True)}


@pytest.mark.parametrize("case", START_CASES)
def test_start_state_out_op(case):
    """m2ops::start_state_out and its backward op: opcheck (schema, fake, autograd registration), gradcheck in
    float64, and its output against sequence k's start state carried token by token to its first chunk's tokens."""
    from m2ops import ops
    args = _start_state_out_args(*START_CASES[case])
    torch.library.opcheck(ops.start_state_out, args)
    g_out = torch.randn_like(args[0])
    torch.library.opcheck(ops.start_state_out_bwd, (g_out, *args[1:]))
    leaves = [a.clone().requires_grad_(True) if a is not None and a.is_floating_point() else a for a in args]
    assert torch.autograd.gradcheck(lambda *t: ops.start_state_out(*t), leaves, eps=1e-6, atol=1e-6, rtol=1e-5)
    # the term itself, one token at a time: h_k decayed by exp(cs_t - cs_{s_k - 1}) within the chunk, through C_t
    y, C, z, init, cs, cu = args
    L, want = cs.shape[-1], y.clone()
    for k in range(1, init.shape[0]):
        s, e = int(cu[k]), int(cu[k + 1])
        c = s // L
        for t in range(s, min(e, c * L + L)):
            before = cs[0, :, c, s - c * L - 1] if s > c * L else torch.zeros_like(cs[0, :, c, 0])
            decay = torch.exp(cs[0, :, c, t - c * L] - before)  # (h,)
            Ch = C[0, t].repeat_interleave(init.shape[1] // C.shape[2], dim=0)  # (h, n)
            term = decay[:, None] * torch.einsum("hn,hpn->hp", Ch, init[k])
            want[0, t] += term * (torch.nn.functional.silu(z[0, t]) if z is not None else 1)
    torch.testing.assert_close(ops.start_state_out(*args), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name,bad,error", [
    ("y", lambda t: t[0], ValueError), ("y", lambda t: t.to(torch.int32), TypeError),
    ("C", lambda t: t[:, :-1], ValueError), ("C", lambda t: t[:, :, :1].expand(-1, -1, 3, -1), ValueError),
    ("z", lambda t: t[..., :-1], ValueError), ("initial_states", lambda t: t[1:], ValueError),
    ("initial_states", lambda t: t.to(torch.int64), TypeError), ("dA_cumsum", lambda t: t[..., :-1, :], ValueError),
    ("cu_seqlens", lambda t: t.float(), TypeError), ("cu_seqlens", lambda t: t[None], ValueError)])
def test_start_state_out_names_a_wrong_argument(name, bad, error, device):
    """Each argument of m2ops::start_state_out with a wrong shape or dtype raises naming it, on the real and the
    fake path (a meta tensor runs the fake implementation, as torch.compile's tracing does)."""
    from m2ops import ops
    names = ("y", "C", "z", "initial_states", "dA_cumsum", "cu_seqlens")
    args = dict(zip(names, _start_state_out_args([3, 9, 1, 12], 4, True)))
    args[name] = bad(args[name])
    args = {k: v.to(device) for k, v in args.items()}
    with pytest.raises(error, match=rf"m2ops::start_state_out: {name} must be"):
        ops.start_state_out(*args.values())


def test_start_state_out_names_an_argument_on_another_device():
    from m2ops import ops
    args = list(_start_state_out_args([3, 9, 1, 12], 4, True))
    args[3] = args[3].to("meta")
    with pytest.raises(ValueError, match="m2ops::start_state_out: initial_states must be on the same device"):
        ops.start_state_out(*args)
