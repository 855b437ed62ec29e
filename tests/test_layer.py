"""m2ops.Mamba2: against a plain re-implementation of the layer (loops and the naive recurrence), loading a
state dict with mamba_ssm's names and shapes, prefill + token-by-token decode against one forward,
torch.compile(fullgraph=True), and input errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import m2ops
from m2ops.reference.naive import naive_scan

F64 = torch.float64
INF = float("inf")

# (constructor options): small sizes; d_model 16 gives d_inner 32 (expand 2)
CONFIGS = {
    "default": dict(),
    "groups_hdimD_bias": dict(ngroups=2, D_has_hdim=True, bias=True, conv_bias=False, dt_limit=(0.02, 0.3)),
    "norm_before_gate": dict(ngroups=2, norm_before_gate=True, d_conv=3),
    "no_rmsnorm": dict(rmsnorm=False),
    "mlp_part": dict(d_ssm=16, ngroups=2),  # half of d_inner is a gated MLP beside the SSM
}
SMALL = dict(d_model=16, d_state=8, headdim=8, chunk_size=8)


def make_layer(seed=0, dtype=F64, **opts):
    torch.manual_seed(seed)
    m = m2ops.Mamba2(**{**SMALL, **opts}).to(dtype)
    with torch.no_grad():  # non-trivial values where mamba_ssm initialises ones/zeros
        m.D.normal_()
        if m.rmsnorm:
            m.norm.weight.normal_(1.0, 0.3)
        if m.conv1d.bias is not None:
            m.conv1d.bias.normal_(0.0, 0.3)
        m.A_log.uniform_(-1.0, 0.7)
        m.dt_bias.normal_(-1.0, 0.5)
    return m


def plain_layer(m, u, seq_idx=None):
    """The layer written out from its definition: linear maps, a per-token convolution loop that skips other
    sequences' tokens, the naive recurrence, the gated group RMSNorm. Float64."""
    u = u.double()
    W = {k: v.detach().double() for k, v in m.state_dict().items()}
    b, T, _ = u.shape
    h, p, g, n, w = m.nheads, m.headdim, m.ngroups, m.d_state, m.d_conv
    d_mlp = m.d_inner - m.d_ssm
    zxbcdt = u @ W["in_proj.weight"].T + (W["in_proj.bias"] if "in_proj.bias" in W else 0.0)
    z0, x0, z, xBC, dt = zxbcdt.split([d_mlp, d_mlp, m.d_ssm, m.conv_dim, h], dim=-1)
    conv = torch.zeros_like(xBC)
    for t in range(T):
        for k in range(w):  # tap k reads token t - (w - 1 - k)
            s = t - (w - 1 - k)
            if s < 0:
                continue
            same = torch.ones(b, dtype=F64) if seq_idx is None else (seq_idx[:, s] == seq_idx[:, t]).double()
            conv[:, t] += same[:, None] * xBC[:, s] * W["conv1d.weight"][:, 0, k]
    if "conv1d.bias" in W:
        conv = conv + W["conv1d.bias"]
    conv = conv * torch.sigmoid(conv)
    x, B, C = conv.split([m.d_ssm, g * n, g * n], dim=-1)
    D = W["D"].view(h, p) if m.D_has_hdim else W["D"]
    y, _, _ = naive_scan(x.view(b, T, h, p), dt, -torch.exp(W["A_log"]), B.view(b, T, g, n), C.view(b, T, g, n),
                         D=D, z=None if m.rmsnorm else z.view(b, T, h, p), dt_bias=W["dt_bias"], seq_idx=seq_idx,
                         dt_softplus=True, dt_limit=m.dt_limit)
    y = y.reshape(b, T, m.d_ssm)
    if m.rmsnorm:
        gate = z * torch.sigmoid(z)
        if not m.norm_before_gate:
            y = y * gate
        yg = y.view(b, T, g, -1)
        y = (yg / torch.sqrt((yg ** 2).mean(-1, keepdim=True) + 1e-5)).reshape(b, T, -1) * W["norm.weight"]
        if m.norm_before_gate:
            y = y * gate
    if d_mlp:
        y = torch.cat([z0 * torch.sigmoid(z0) * x0, y], dim=-1)
    return y @ W["out_proj.weight"].T + (W["out_proj.bias"] if "out_proj.bias" in W else 0.0)


# ---------------------------------------------------------------------------------------------------------
# forward against the plain re-implementation
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", CONFIGS)
def test_matches_plain_layer(config):
    m = make_layer(**CONFIGS[config])
    u = torch.randn(2, 21, 16, dtype=F64)
    torch.testing.assert_close(m(u), plain_layer(m, u), rtol=1e-9, atol=1e-9)


def test_matches_plain_layer_float32():
    m = make_layer(dtype=torch.float32, ngroups=2)
    u = torch.randn(2, 21, 16)
    torch.testing.assert_close(m(u).double(), plain_layer(m, u), rtol=1e-4, atol=1e-4)


def test_packed_sequences_restart_conv_and_scan():
    m = make_layer(ngroups=2)
    u = torch.randn(2, 19, 16, dtype=F64)
    seq_idx = torch.tensor([[0] * 5 + [1] * 9 + [2] * 5, [0] * 2 + [3] * 17])
    want = plain_layer(m, u, seq_idx)
    torch.testing.assert_close(m(u, seq_idx=seq_idx), want, rtol=1e-9, atol=1e-9)
    # cu_seqlens alone (batch 1) restarts both as well, and equals running the sequences one by one
    cu = torch.tensor([0, 5, 14, 19])
    got = m(u[:1], cu_seqlens=cu)
    alone = torch.cat([m(u[:1, s:e]) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    torch.testing.assert_close(got, alone, rtol=1e-9, atol=1e-9)


def test_flattened_input_with_seqlen():
    m = make_layer()
    u = torch.randn(2, 9, 16, dtype=F64)
    torch.testing.assert_close(m(u.flatten(0, 1), seqlen=9), m(u).flatten(0, 1), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# mamba_ssm state dicts
# ---------------------------------------------------------------------------------------------------------

def mamba_ssm_shapes(d_model, d_state, d_conv, expand, headdim, ngroups, D_has_hdim, bias, conv_bias):
    """The names and shapes of mamba_ssm 2.3.2's Mamba2 parameters (rmsnorm=True, d_ssm=None), written from its
    documented layout rather than from m2ops."""
    d_inner = expand * d_model
    nheads = d_inner // headdim
    conv_dim = d_inner + 2 * ngroups * d_state
    shapes = {
        "in_proj.weight": (2 * d_inner + 2 * ngroups * d_state + nheads, d_model),
        "conv1d.weight": (conv_dim, 1, d_conv),
        "dt_bias": (nheads,),
        "A_log": (nheads,),
        "D": (d_inner,) if D_has_hdim else (nheads,),
        "norm.weight": (d_inner,),
        "out_proj.weight": (d_model, d_inner),
    }
    if conv_bias:
        shapes["conv1d.bias"] = (conv_dim,)
    if bias:
        shapes["in_proj.bias"] = shapes["in_proj.weight"][:1]
        shapes["out_proj.bias"] = (d_model,)
    return shapes


@pytest.mark.parametrize("opts", [
    dict(d_model=16, d_state=8, d_conv=4, expand=2, headdim=8, ngroups=1, D_has_hdim=False, bias=False,
         conv_bias=True),
    dict(d_model=24, d_state=16, d_conv=3, expand=2, headdim=12, ngroups=2, D_has_hdim=True, bias=True,
         conv_bias=False),
])
def test_load_mamba_ssm_state_dict(opts):
    shapes = mamba_ssm_shapes(**opts)
    gen = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(s, generator=gen) * 0.3 for k, s in shapes.items()}
    m = m2ops.Mamba2(**opts, chunk_size=8)
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == shapes
    m.load_state_dict(sd, strict=True)
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k]), k
    # the loaded z, x, B, C, dt split order is the one the plain layer reads
    u = torch.randn(1, 10, opts["d_model"], generator=gen)
    torch.testing.assert_close(m(u).double(), plain_layer(m, u), rtol=1e-4, atol=1e-4)


def test_init_like_mamba_ssm():
    torch.manual_seed(0)
    m = m2ops.Mamba2(d_model=64, d_state=8, headdim=8, dt_min=0.01, dt_max=0.05, A_init_range=(2, 4))
    dt = F.softplus(m.dt_bias.detach())
    assert (dt >= 0.01 - 1e-6).all() and (dt <= 0.05 + 1e-6).all()
    A = torch.exp(m.A_log.detach())
    assert (A >= 2).all() and (A <= 4).all()
    assert torch.equal(m.D.detach(), torch.ones(16)) and m.D.dtype == torch.float32
    assert all(getattr(p, "_no_weight_decay", False) for p in (m.dt_bias, m.A_log, m.D))


# ---------------------------------------------------------------------------------------------------------
# decoding: prefill + step equals one forward
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", ["default", "groups_hdimD_bias", "no_rmsnorm", "mlp_part"])
@pytest.mark.parametrize("prompt_len", [2, 13])  # shorter and longer than d_conv
def test_prefill_then_decode_equals_forward(config, prompt_len):
    m = make_layer(**CONFIGS[config])
    u = torch.randn(2, prompt_len + 6, 16, dtype=F64)
    want = m(u)
    out, conv_state, ssm_state = m(u[:, :prompt_len], return_final_states=True)
    torch.testing.assert_close(out, want[:, :prompt_len], rtol=1e-10, atol=1e-10)
    conv_state, ssm_state = conv_state.detach(), ssm_state.detach()
    for t in range(prompt_len, u.shape[1]):
        before = (conv_state.clone(), ssm_state.clone())
        out_t, conv_new, ssm_new = m.step(u[:, t:t + 1], conv_state, ssm_state)
        torch.testing.assert_close(out_t, want[:, t:t + 1], rtol=1e-10, atol=1e-10)
        # in place, as mamba_ssm's step: the same tensors come back, advanced by one token
        assert conv_new is conv_state and ssm_new is ssm_state
        assert torch.equal(conv_state[..., :-1], before[0][..., 1:]) and not torch.equal(ssm_state, before[1])


def test_decode_from_empty_cache_equals_forward():
    m = make_layer(ngroups=2)
    u = torch.randn(3, 7, 16, dtype=F64)
    want = m(u)
    conv_state, ssm_state = m.allocate_inference_cache(3, dtype=F64)
    assert conv_state.shape == (3, m.conv_dim, m.d_conv) and ssm_state.shape == (3, m.nheads, m.headdim, m.d_state)
    for t in range(7):
        out, conv_state, ssm_state = m.step(u[:, t:t + 1], conv_state, ssm_state)
        torch.testing.assert_close(out, want[:, t:t + 1], rtol=1e-10, atol=1e-10)


def test_chunked_prefill_with_cache_equals_forward():
    m = make_layer(ngroups=2)
    u = torch.randn(2, 20, 16, dtype=F64)
    want = m(u)
    a, conv_state, ssm_state = m(u[:, :7], return_final_states=True)
    b = m(u[:, 7:], cache=(conv_state, ssm_state))
    torch.testing.assert_close(torch.cat([a, b], 1), want, rtol=1e-10, atol=1e-10)


def test_varlen_prefill_gives_per_sequence_caches():
    """A packed prompt (cu_seqlens) returns one cache per sequence; decoding them as a batch continues each
    sequence as if it had been run alone."""
    m = make_layer(ngroups=2)
    lengths, extra = [2, 9, 5], 3
    full = [torch.randn(1, L + extra, 16, dtype=F64) for L in lengths]
    packed = torch.cat([f[:, :L] for f, L in zip(full, lengths)], dim=1)
    cu = torch.tensor([0, 2, 11, 16])
    _, conv_state, ssm_state = m(packed, cu_seqlens=cu, return_final_states=True)
    assert conv_state.shape[0] == 3 and ssm_state.shape[0] == 3
    wants = [m(f) for f in full]
    for t in range(extra):
        tok = torch.cat([f[:, L + t:L + t + 1] for f, L in zip(full, lengths)], dim=0)
        out, conv_state, ssm_state = m.step(tok, conv_state, ssm_state)
        for i, (w, L) in enumerate(zip(wants, lengths)):
            torch.testing.assert_close(out[i:i + 1], w[:, L + t:L + t + 1], rtol=1e-10, atol=1e-10)


def test_seq_idx_prefill_caches_belong_to_last_sequence():
    m = make_layer()
    u = torch.randn(1, 12, 16, dtype=F64)
    seq_idx = torch.tensor([[0] * 10 + [1] * 2])
    _, conv_state, ssm_state = m(u[:, :11], seq_idx=seq_idx[:, :11], return_final_states=True)
    out, _, _ = m.step(u[:, 11:12], conv_state, ssm_state)
    torch.testing.assert_close(out, m(u[:, 10:12])[:, 1:], rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------------------------------------------------
# torch.compile
# ---------------------------------------------------------------------------------------------------------

def test_compile_fullgraph_forward_backward(reset_dynamo):
    m = make_layer(dtype=torch.float32, ngroups=2)
    u = torch.randn(2, 21, 16)
    seq_idx = torch.tensor([[0] * 8 + [1] * 13, [0] * 21])

    def loss_and_grads(fn):
        m.zero_grad()
        x = u.clone().requires_grad_(True)
        out = fn(x, seq_idx=seq_idx)
        (out.square().mean()).backward()
        return out.detach(), x.grad, {k: p.grad.clone() for k, p in m.named_parameters()}

    want = loss_and_grads(m)
    got = loss_and_grads(torch.compile(m, fullgraph=True))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for k in want[2]:
        torch.testing.assert_close(got[2][k], want[2][k], rtol=1e-4, atol=1e-5, msg=k)


def test_compile_fullgraph_step(reset_dynamo):
    m = make_layer(dtype=torch.float32)
    u = torch.randn(2, 1, 16)
    caches = m.allocate_inference_cache(2)
    caches = (torch.randn_like(caches[0]), torch.randn_like(caches[1]))
    with torch.no_grad():
        got = torch.compile(m.step, fullgraph=True)(u, *(c.clone() for c in caches))  # (updated in place)
        want = m.step(u, *(c.clone() for c in caches))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument():
    m = make_layer(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"Mamba2.forward: u must be 3-dimensional"):
        m(torch.randn(5, 16))
    with pytest.raises(ValueError, match=r"Mamba2.forward: u must be of last dimension d_model=16"):
        m(torch.randn(1, 5, 15))
    with pytest.raises(TypeError, match=r"Mamba2.forward: u must be a floating-point tensor"):
        m(torch.zeros(1, 5, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"Mamba2.forward: cache\[1\] \(ssm_state\) must be of shape"):
        m(torch.randn(1, 5, 16), cache=(torch.zeros(1, m.conv_dim, 4), torch.zeros(1, 2, 3, 4)))
    with pytest.raises(ValueError, match=r"Mamba2.forward: seq_idx must be an integer tensor of shape"):
        m(torch.randn(1, 5, 16), seq_idx=torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"causal_conv1d_fn: cu_seqlens must be strictly increasing"):
        m(torch.randn(1, 5, 16), cu_seqlens=torch.tensor([0, 3, 2, 5]))
    conv_state, ssm_state = m.allocate_inference_cache(2)
    with pytest.raises(ValueError, match=r"Mamba2.step: hidden_states must be of shape \(batch, 1, d_model\)"):
        m.step(torch.randn(2, 3, 16), conv_state, ssm_state)
    with pytest.raises(ValueError, match=r"Mamba2.step: conv_state must be of shape"):
        m.step(torch.randn(2, 1, 16), conv_state[:, :, :3], ssm_state)
    with pytest.raises(ValueError, match=r"Mamba2.step: ssm_state must be of shape"):
        m.step(torch.randn(2, 1, 16), conv_state, ssm_state[:1])
    with pytest.raises(ValueError, match=r"process_group needs an initialized torch.distributed"):
        m2ops.Mamba2(16, headdim=4, process_group=object())
    with pytest.raises(ValueError, match=r"headdim=7 must divide"):
        m2ops.Mamba2(16, headdim=7)
