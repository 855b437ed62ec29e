"""Gradients of the public function against the token-by-token recurrence's (float64), and a compiled training
step (forward, backward, optimizer step) around the op."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from m2ops import mamba_chunk_scan_combined
from m2ops.meta.validate import seq_idx_from_cu_seqlens
from m2ops.reference.naive import naive_scan

F64 = torch.float64


def _inputs(seed, b=2, T=45, h=4, p=3, g=2, n=5, D="h", z=True, bias=True, init=True):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (torch.randn(*s, generator=gen, dtype=F64) * scale).requires_grad_()

    # dt kept away from the clamp bounds and the softplus threshold so both sides are smooth there.
    dt_raw = torch.randn(b, T, h, generator=gen, dtype=F64)
    dt_raw = torch.where(dt_raw.abs() < 0.1, dt_raw + 0.3, dt_raw)
    return dict(x=r(b, T, h, p), dt=dt_raw.requires_grad_(), A=(-torch.rand(h, generator=gen, dtype=F64) - 0.2).requires_grad_(),
                B=r(b, T, g, n, scale=0.5), C=r(b, T, g, n, scale=0.5),
                D=None if D is None else r(*((h,) if D == "h" else (h, p))),
                z=r(b, T, h, p) if z else None, dt_bias=r(h, scale=0.2) if bias else None,
                initial_states=r(b, h, p, n, scale=0.3) if init else None)


def _grads(outs, weights, leaves):
    loss = sum((o * w).sum() for o, w in zip(outs, weights))
    got = torch.autograd.grad(loss, [leaves[k] for k in leaves])
    return dict(zip(leaves, got))


CASES = {
    "plain": dict(),
    "D per headdim, softplus, clamp": dict(D="hp", dt_softplus=True, dt_limit=(0.05, 1.5)),
    "seq_idx": dict(seq_idx=True, dt_softplus=True),
    "varlen states": dict(cu_seqlens=True, dt_softplus=True),
    "no options": dict(D=None, z=False, bias=False, init=False),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("chunk_size", [8, 16])
def test_reference_gradients_match_the_recurrence(name, chunk_size):
    opts = dict(CASES[name])
    make = {k: opts.pop(k) for k in ("D", "z", "bias", "init") if k in opts}
    use_seq, use_cu = opts.pop("seq_idx", False), opts.pop("cu_seqlens", False)
    inp = _inputs(hash(name) % 1000, b=1 if use_cu else 2, **make)
    T = inp["x"].shape[1]
    seq_idx = cu = None
    if use_cu:
        cu = torch.tensor([0, 7, 8, 30, T])
    if use_seq:
        seq_idx = torch.zeros(2, T, dtype=torch.int32)
        seq_idx[:, 11:] = 1
        seq_idx[1, 30:] = 2
    leaves = {k: v for k, v in inp.items() if v is not None}

    ours = mamba_chunk_scan_combined(**inp, chunk_size=chunk_size, seq_idx=seq_idx, cu_seqlens=cu,
                                     return_final_states=True, return_varlen_states=use_cu, **opts)
    naive_seq = seq_idx if seq_idx is not None else (seq_idx_from_cu_seqlens(cu, T) if use_cu else None)
    y, final, varlen = naive_scan(**inp, seq_idx=naive_seq, cu_seqlens=cu, **opts)
    theirs = (y, final) + ((varlen,) if use_cu else ())
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(t.shape, generator=gen, dtype=F64) for t in theirs]
    g_ours = _grads(ours, weights, leaves)
    g_naive = _grads(theirs, weights, leaves)
    for k in leaves:
        scale = g_naive[k].abs().max().clamp_min(1.0)
        err = ((g_ours[k] - g_naive[k]).abs().max() / scale).item()
        assert err < 1e-9, f"gradient of {k}: max rel. error {err:.2e}"


class TinySSM(nn.Module):
    """A projection, the scan with learnable A (via A_log), D and dt_bias, and an output projection."""

    def __init__(self, d_model=16, nheads=4, headdim=4, dstate=8):
        super().__init__()
        self.h, self.p, self.n = nheads, headdim, dstate
        self.inp = nn.Linear(d_model, nheads * headdim * 2 + 2 * dstate + nheads)
        self.A_log = nn.Parameter(torch.linspace(0.0, 1.0, nheads))
        self.D = nn.Parameter(torch.ones(nheads))
        self.dt_bias = nn.Parameter(torch.full((nheads,), -1.0))
        self.out = nn.Linear(nheads * headdim, d_model)

    def forward(self, u):
        b, T, _ = u.shape
        hp = self.h * self.p
        x, z, B, C, dt = self.inp(u).split([hp, hp, self.n, self.n, self.h], dim=-1)
        y = mamba_chunk_scan_combined(x.reshape(b, T, self.h, self.p), dt, -torch.exp(self.A_log),
                                      B.reshape(b, T, 1, self.n), C.reshape(b, T, 1, self.n), chunk_size=16,
                                      D=self.D, z=z.reshape(b, T, self.h, self.p), dt_bias=self.dt_bias,
                                      dt_softplus=True)
        return self.out(y.reshape(b, T, hp))


def test_compiled_training_step_matches_eager(reset_dynamo):
    torch.manual_seed(0)
    eager = TinySSM()
    compiled = copy.deepcopy(eager)
    data = [torch.randn(2, 37, 16) for _ in range(3)]

    def make_step(model, compile_it):
        params = list(model.parameters())
        velocity = [torch.zeros_like(p) for p in params]

        def update():  # SGD with momentum, written out: torch.optim's step() breaks the graph by design
            with torch.no_grad():
                for p, v in zip(params, velocity):
                    v.mul_(0.9).add_(p.grad)
                    p.sub_(0.05 * v)

        fwd = torch.compile(model, fullgraph=True) if compile_it else model
        upd = torch.compile(update, fullgraph=True) if compile_it else update

        def step(u):
            for p in params:
                p.grad = None
            loss = fwd(u).square().mean()
            loss.backward()  # runs the backward graph AOTAutograd compiled with the forward
            upd()
            return loss.detach()
        return step

    step_e, step_c = make_step(eager, False), make_step(compiled, True)
    for u in data:
        le, lc = step_e(u), step_c(u)
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(pc, pe, rtol=1e-4, atol=1e-5, msg=f"parameter {name} after 3 steps")
