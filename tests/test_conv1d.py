"""The causal convolution (m2ops.causal_conv1d_fn, m2ops.causal_conv1d_update and their ops) on the CPU: the
reference against a naive float64 token loop, the public functions' options, gradients (gradcheck in float64),
the ops' registrations (opcheck), input errors, and the in-place update's writes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import m2ops
from conftest import assert_close_rel
from m2ops.meta import conv1d as meta
from m2ops.reference import conv1d as ref


# ---------------------------------------------------------------------------------------------------------
# the naive float64 loops every test compares against
# ---------------------------------------------------------------------------------------------------------

def naive_conv(x, weight, bias=None, seq_idx=None, initial_states=None, silu=False, state_len=0):
    """Token by token in float64: (y (b, c, L), final states (b, c, state_len))."""
    b, c, L = x.shape
    W = weight.shape[1]
    xd, wd = x.double(), weight.double()
    ids = torch.zeros(b, L, dtype=torch.long) if seq_idx is None else seq_idx.long()

    def value(bi, t):
        """Input and sequence id of token t of row bi (history for t < 0, id 0; zeros before it)."""
        if t >= 0:
            return xd[bi, :, t], int(ids[bi, t])
        h = W - 1 + t
        if initial_states is None or h < 0:
            return torch.zeros(c, dtype=torch.float64), 0
        return initial_states[bi, :, h].double(), 0

    y = torch.zeros(b, c, L, dtype=torch.float64)
    for bi in range(b):
        for t in range(L):
            u = bias.double().clone() if bias is not None else torch.zeros(c, dtype=torch.float64)
            for k in range(W):
                v, i = value(bi, t - (W - 1) + k)
                if i == int(ids[bi, t]):
                    u = u + wd[:, k] * v
            y[bi, :, t] = u * torch.sigmoid(u) if silu else u
    final = torch.zeros(b, c, state_len, dtype=torch.float64)
    for bi in range(b):
        for j in range(state_len):
            v, i = value(bi, L - state_len + j)
            if i == int(ids[bi, L - 1]):
                final[bi, :, j] = v
    return y, final


def naive_update(x, conv_state, weight, bias=None, silu=False, indices=None):
    """One token per row in float64: (y, new cache as float64 copy)."""
    b, c = x.shape
    W = weight.shape[1]
    state = conv_state.double().clone()
    y = torch.zeros(b, c, dtype=torch.float64)
    for r in range(b):
        slot = r if indices is None else int(indices[r])
        if slot < 0:
            continue
        window = torch.cat([state[slot, :, state.shape[2] - (W - 1):], x[r].double()[:, None]], dim=1)
        u = (window * weight.double()).sum(1) + (bias.double() if bias is not None else 0.0)
        y[r] = u * torch.sigmoid(u) if silu else u
        state[slot] = torch.cat([state[slot, :, 1:], x[r].double()[:, None]], dim=1)
    return y, state


# ---------------------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------------------

def layout(t, how):
    """Same values: "contig" (batch, channels, seqlen); "channel_last" (a transposed view of a (batch, seqlen,
    channels) buffer, as the layer has x); "slice" (channel-last inside a wider buffer, like the input
    projection's output); "strided" (every dimension strided by 2)."""
    if how == "contig":
        return t.contiguous()
    if how == "channel_last":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if how == "slice":
        b, c, L = t.shape
        big = torch.zeros(b, L, c + 5, dtype=t.dtype)
        big[:, :, 3:3 + c] = t.transpose(1, 2)
        return big[:, :, 3:3 + c].transpose(1, 2)
    big = torch.zeros(*(2 * s for s in t.shape), dtype=t.dtype)
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


def conv_inputs(b=2, c=6, L=13, W=4, dtype=torch.float32, bias=True, seq=False, init=False, seed=0,
                how="channel_last", nseqs=3, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = layout(torch.randn(b, c, L, generator=g).to(dtype), how)
    weight = (torch.randn(c, W, generator=g) / W ** 0.5).to(dtype if dtype == torch.float64 else torch.float32)
    kw = dict(x=x, weight=weight, bias=torch.randn(c, generator=g).to(weight.dtype) if bias else None,
              seq_idx=None, initial_states=None)
    if seq:
        steps = (torch.rand(b, L, generator=g) < (nseqs - 1) / max(L, 1)).long()
        kw["seq_idx"] = torch.cumsum(steps, dim=1) + torch.randint(0, 2, (b, 1), generator=g)
    if init:
        kw["initial_states"] = torch.randn(b, c, W - 1, generator=g).to(weight.dtype)
    if requires_grad:
        for k in ("x", "weight", "bias", "initial_states"):
            if kw[k] is not None:
                kw[k] = kw[k].detach().clone().requires_grad_(True)
    return kw


OUT_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


# ---------------------------------------------------------------------------------------------------------
# the reference against the naive loop
# ---------------------------------------------------------------------------------------------------------

@given(b=st.integers(1, 3), c=st.integers(1, 9), L=st.integers(1, 20), W=st.integers(1, 5),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16, torch.float16]),
       how=st.sampled_from(["contig", "channel_last", "slice", "strided"]), bias=st.booleans(), seq=st.booleans(),
       init=st.booleans(), silu=st.booleans(), extra=st.integers(0, 3), seed=st.integers(0, 1000))
def test_reference_matches_naive(b, c, L, W, dtype, how, bias, seq, init, silu, extra, seed):
    kw = conv_inputs(b, c, L, W, dtype, bias, seq, init, seed, how)
    S = W - 1 + extra
    y, final = ref.causal_conv1d(**kw, silu=silu, final_state_len=S)
    want_y, want_final = naive_conv(**kw, silu=silu, state_len=S)
    assert y.dtype == dtype and y.shape == (b, c, L) and y.transpose(1, 2).is_contiguous()
    assert final.dtype == dtype and final.shape == (b, c, S) and final.is_contiguous()
    assert_close_rel(y, want_y, OUT_TOL[dtype], "y")
    torch.testing.assert_close(final, want_final.to(dtype), rtol=0, atol=0)  # copies of inputs, in x's dtype


def test_varlen_final_states():
    """cu_seqlens: the convolution restarts at each packed sequence, one final state per sequence; sequence 0
    continues initial_states."""
    kw = conv_inputs(1, 5, 17, 4, torch.float32, True, False, True, seed=4)
    cu = torch.tensor([0, 2, 9, 17], dtype=torch.int32)
    y, final = m2ops.causal_conv1d_fn(**kw, return_final_states=True, activation="swish", cu_seqlens=cu,
                                      state_len=4)
    seq_idx = torch.tensor([[0] * 2 + [1] * 7 + [2] * 8])
    want_y, _ = naive_conv(kw["x"], kw["weight"], kw["bias"], seq_idx, kw["initial_states"], silu=True)
    assert_close_rel(y, want_y, 2e-6, "y")
    assert final.shape == (3, 5, 4)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        init = kw["initial_states"] if s == 0 else None
        _, want = naive_conv(kw["x"][:, :, s:e], kw["weight"], None, None, init, state_len=4)
        torch.testing.assert_close(final[n], want[0].float(), rtol=0, atol=0)
    same = m2ops.causal_conv1d_fn(**{**kw, "seq_idx": seq_idx}, activation="silu", cu_seqlens=cu)
    torch.testing.assert_close(same, y, rtol=0, atol=0)


def test_options_of_the_public_function():
    kw = conv_inputs(2, 4, 9, 3, torch.float32, True, True, True, seed=5)
    out = torch.full((2, 4, 2), float("nan"))
    y, final = m2ops.causal_conv1d_fn(**kw, return_final_states=True, final_states_out=out)
    assert final is out
    want_y, want_final = naive_conv(**kw, state_len=2)
    assert_close_rel(y, want_y, 2e-6, "y")
    torch.testing.assert_close(out, want_final.float(), rtol=0, atol=0)
    # nn.Conv1d's (channels, 1, width) weight; positional arguments in causal_conv1d_fn's order
    y2 = m2ops.causal_conv1d_fn(kw["x"], kw["weight"][:, None], kw["bias"], kw["seq_idx"], kw["initial_states"])
    torch.testing.assert_close(y2, y, rtol=0, atol=0)


def test_prefill_then_decode_equals_one_call():
    """The final states of a prompt (state_len = width, the mamba_ssm cache) seed causal_conv1d_update, whose
    tokens then reproduce the convolution over the whole sequence."""
    kw = conv_inputs(2, 6, 12, 4, torch.float32, True, False, True, seed=6)
    full = m2ops.causal_conv1d_fn(**kw, activation="silu")
    _, cache = m2ops.causal_conv1d_fn(**{**kw, "x": kw["x"][:, :, :7]}, activation="silu",
                                      return_final_states=True, state_len=4)
    for t in range(7, 12):
        y = m2ops.causal_conv1d_update(kw["x"][:, :, t], cache, kw["weight"], kw["bias"], activation="silu")
        torch.testing.assert_close(y, full[:, :, t], rtol=1e-6, atol=1e-6)
    # a (width - 1) cache and (batch, channels, 1) tokens do the same
    _, small = m2ops.causal_conv1d_fn(**{**kw, "x": kw["x"][:, :, :7]}, activation="silu", return_final_states=True)
    y = m2ops.causal_conv1d_update(kw["x"][:, :, 7:8], small, kw["weight"], kw["bias"], activation="silu")
    torch.testing.assert_close(y[..., 0], full[:, :, 7], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# the decode update
# ---------------------------------------------------------------------------------------------------------

@given(b=st.integers(1, 4), c=st.integers(1, 9), W=st.integers(1, 5), extra=st.integers(0, 3),
       dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
       state_dtype=st.sampled_from([torch.float32, torch.bfloat16]), indexed=st.booleans(), bias=st.booleans(),
       silu=st.booleans(), seed=st.integers(0, 1000))
def test_update_matches_naive(b, c, W, extra, dtype, state_dtype, indexed, bias, silu, seed):
    g = torch.Generator().manual_seed(seed)
    S = max(W - 1, 1) + extra
    slots = b + 3 if indexed else b
    x = torch.randn(b, c, generator=g).to(dtype)
    state = torch.randn(slots, c, S, generator=g).to(state_dtype)
    weight, bb = torch.randn(c, W, generator=g), torch.randn(c, generator=g) if bias else None
    idx = torch.randperm(slots, generator=g)[:b].to(torch.int32) if indexed else None
    if indexed and b > 1:
        idx[0] = -1  # a skipped row
    before = state.clone()
    want_y, want_state = naive_update(x, before, weight, bb, silu, idx)
    y = m2ops.causal_conv1d_update(x, state, weight, bb, "silu" if silu else None, conv_state_indices=idx)
    assert y.dtype == dtype and y.shape == (b, c)
    assert_close_rel(y, want_y, OUT_TOL[dtype] if dtype != torch.float64 else 1e-12, "y")
    torch.testing.assert_close(state.double(), want_state.to(state_dtype).double(), rtol=0, atol=0)


def test_update_writes_only_named_slots():
    g = torch.Generator().manual_seed(7)
    state = torch.randn(6, 3, 4, generator=g)
    before = state.clone()
    x, w = torch.randn(3, 3, generator=g), torch.randn(3, 4, generator=g)
    idx = torch.tensor([4, -1, 1])
    y = m2ops.causal_conv1d_update(x, state, w, conv_state_indices=idx)
    for s in (0, 2, 3, 5):
        assert torch.equal(state[s], before[s]), s
    assert torch.equal(y[1], torch.zeros(3))
    assert torch.equal(state[4], torch.cat([before[4, :, 1:], x[0, :, None]], dim=1))
    assert torch.equal(state[1], torch.cat([before[1, :, 1:], x[2, :, None]], dim=1))


# ---------------------------------------------------------------------------------------------------------
# gradients, opcheck, torch.compile
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [dict(seq=False, init=False, silu=False, S=0), dict(seq=True, init=True, silu=True, S=3),
                                  dict(seq=True, init=True, silu=True, S=6, W=3, L=4)])
def test_gradients_float64(opts):
    kw = conv_inputs(2, 3, opts.get("L", 7), opts.get("W", 4), torch.float64, True, opts["seq"], opts["init"],
                     seed=8, requires_grad=True)
    names = [k for k in ("x", "weight", "bias", "initial_states") if kw[k] is not None]

    def fn(*tensors):
        args = {**kw, **dict(zip(names, tensors))}
        if opts["S"] == 0:
            return m2ops.causal_conv1d_fn(**args, activation="silu" if opts["silu"] else None)
        return m2ops.causal_conv1d_fn(**args, activation="silu" if opts["silu"] else None, return_final_states=True,
                                      state_len=opts["S"])

    assert torch.autograd.gradcheck(fn, tuple(kw[k] for k in names))


def test_backward_formulas_match_autograd():
    """The explicit backward (reference.causal_conv1d_bwd) against autograd through the forward, float64."""
    kw = conv_inputs(2, 5, 11, 4, torch.float64, True, True, True, seed=9, requires_grad=True)
    y, final = ref.causal_conv1d(**kw, silu=True, final_state_len=5)
    g = torch.Generator().manual_seed(0)
    gy, gf = torch.randn(y.shape, generator=g, dtype=y.dtype), torch.randn(final.shape, generator=g, dtype=y.dtype)
    leaves = [kw[k] for k in ("x", "weight", "bias", "initial_states")]
    want = torch.autograd.grad((y * gy).sum() + (final * gf).sum(), leaves)
    detached = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    got = ref.causal_conv1d_bwd(gy, gf, **detached, silu=True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


FWD_CASES = {
    "plain": dict(),
    "all": dict(seq=True, init=True, silu=True, S=4),
    "width2_short": dict(W=2, L=1, init=True, silu=False, S=3),
}


def _fwd_args(case, requires_grad=False):
    o = FWD_CASES[case]
    kw = conv_inputs(2, 5, o.get("L", 9), o.get("W", 4), torch.float32, True, o.get("seq", False),
                     o.get("init", False), seed=10, requires_grad=requires_grad)
    return (kw["x"], kw["weight"], kw["bias"], kw["seq_idx"], kw["initial_states"], o.get("silu", False), o.get("S", 0))


@pytest.mark.parametrize("case", list(FWD_CASES))
def test_opcheck(case):
    args = _fwd_args(case, requires_grad=True)
    torch.library.opcheck(torch.ops.m2ops.causal_conv1d.default, args)
    y, final = torch.ops.m2ops.causal_conv1d(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args))
    g = torch.Generator().manual_seed(1)
    bwd = (torch.randn(y.shape, generator=g), torch.randn(final.shape, generator=g),
           *(a.detach() if isinstance(a, torch.Tensor) else a for a in args[:-1]))
    torch.library.opcheck(torch.ops.m2ops.causal_conv1d_bwd.default, bwd)


@pytest.mark.parametrize("indexed", [False, True])
def test_opcheck_update(indexed):
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, 5, generator=g), torch.randn(5, 4, generator=g), torch.randn(5, generator=g)
    state = torch.randn(5 if indexed else 3, 5, 4, generator=g)
    idx = torch.tensor([2, -1, 0], dtype=torch.int32) if indexed else None
    torch.library.opcheck(torch.ops.m2ops.causal_conv1d_update.default, (x, state, w, b, True, idx))


def test_compile_fullgraph(reset_dynamo):
    kw = conv_inputs(2, 6, 10, 4, torch.float32, True, True, True, seed=11)

    def fn(x, weight, bias, seq_idx, initial_states, cache):
        y, fin = m2ops.causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, True, activation="silu",
                                        state_len=4)
        return y, fin, m2ops.causal_conv1d_update(y[:, :, -1], cache, weight, bias, activation="silu")

    cache_a, cache_b = torch.randn(2, 6, 4), None
    cache_b = cache_a.clone()
    got = torch.compile(fn, fullgraph=True)(**kw, cache=cache_a)
    want = fn(**kw, cache=cache_b)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache_a, cache_b, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# input errors: the argument named, nothing written
# ---------------------------------------------------------------------------------------------------------

def _good():
    return conv_inputs(2, 4, 6, 3, torch.float32, True, True, True, seed=12)


BAD_FN = [
    (dict(x=torch.randn(2, 4)), ValueError, "x must be 3-dimensional"),
    (dict(x=torch.zeros(2, 4, 6, dtype=torch.int32)), TypeError, "x must be a tensor of floating"),
    (dict(weight=torch.randn(5, 3)), ValueError, "weight must be of shape"),
    (dict(bias=torch.randn(3)), ValueError, "bias must be of shape"),
    (dict(seq_idx=torch.zeros(2, 6)), TypeError, "seq_idx must be a tensor of integer"),
    (dict(seq_idx=torch.zeros(2, 5, dtype=torch.long)), ValueError, "seq_idx must be of shape"),
    (dict(initial_states=torch.randn(2, 4, 3)), ValueError, "initial_states must be of shape"),
    (dict(activation="relu"), ValueError, "activation must be None, 'silu' or 'swish'"),
    (dict(state_len=0, return_final_states=True), ValueError, "state_len must be None or an int >= 1"),
    (dict(return_final_states=1), TypeError, "return_final_states must be a bool"),
    (dict(cu_seqlens=torch.tensor([0, 6])), ValueError, "x must be of batch 1"),
    (dict(return_final_states=True, final_states_out=torch.empty(2, 4, 3)), ValueError,
     "final_states_out must be of shape"),
]


@pytest.mark.parametrize("changes,kind,message", BAD_FN, ids=[m.split(" must")[0] + str(i) for i, (_, _, m) in
                                                             enumerate(BAD_FN)])
def test_function_errors_name_the_argument(changes, kind, message):
    kw = {**_good(), **changes}
    with pytest.raises(kind, match=f"m2ops.causal_conv1d_fn: {message}"):
        m2ops.causal_conv1d_fn(**kw)


def test_cu_seqlens_values_checked():
    kw = conv_inputs(1, 4, 6, 3, torch.float32, seed=13)
    with pytest.raises(ValueError, match="cu_seqlens must be strictly increasing from 0 to seqlen=6"):
        m2ops.causal_conv1d_fn(**kw, cu_seqlens=torch.tensor([0, 4, 4, 6]))


def _update_args():
    g = torch.Generator().manual_seed(14)
    return dict(x=torch.randn(3, 4, generator=g), conv_state=torch.randn(5, 4, 3, generator=g),
                weight=torch.randn(4, 3, generator=g), bias=torch.randn(4, generator=g),
                conv_state_indices=torch.tensor([4, 0, -1]))


BAD_UPDATE = [
    (dict(x=torch.randn(3, 4, 2)), ValueError, "x must be of shape"),
    (dict(conv_state=torch.randn(5, 4, 1)), ValueError, "conv_state must be of shape"),
    (dict(conv_state=torch.randn(5, 3, 3)), ValueError, "conv_state must be of shape"),
    (dict(conv_state_indices=None), ValueError, "conv_state must be of shape"),
    (dict(conv_state_indices=torch.tensor([0, 1])), ValueError, "conv_state_indices must be of shape"),
    (dict(conv_state_indices=torch.tensor([0.0, 1.0, 2.0])), TypeError, "conv_state_indices must be a tensor of "),
    (dict(conv_state_indices=torch.tensor([0, 5, 1])), ValueError, "conv_state_indices must be below"),
    (dict(weight=torch.randn(4, 3, 2)), ValueError, "weight must be of shape"),
    (dict(bias=torch.randn(2)), ValueError, "bias must be of shape"),
    (dict(activation="gelu"), ValueError, "activation must be"),
    (dict(cache_seqlens=torch.tensor([1, 2, 3])), ValueError, "cache_seqlens must be None"),
]


@pytest.mark.parametrize("changes,kind,message", BAD_UPDATE, ids=[str(i) for i in range(len(BAD_UPDATE))])
def test_update_errors_name_the_argument_and_write_nothing(changes, kind, message):
    kw = {**_update_args(), **changes}
    before = kw["conv_state"].clone()
    with pytest.raises(kind, match=f"m2ops.causal_conv1d_update: {message}"):
        m2ops.causal_conv1d_update(**kw)
    assert torch.equal(kw["conv_state"], before)


def test_output_layout_rule():
    """y and g_x are channel-last whatever x's layout (meta.conv1d.conv_output), the final states contiguous."""
    for how in ("contig", "channel_last", "strided"):
        kw = conv_inputs(2, 3, 5, 4, torch.float32, how=how, seed=15, requires_grad=True)
        y, final = m2ops.causal_conv1d_fn(**kw, return_final_states=True)
        assert y.stride() == meta.conv_output(kw["x"]).stride() and final.is_contiguous()
        (gx,) = torch.autograd.grad(y.sum(), kw["x"])
        assert gx.transpose(1, 2).is_contiguous()
