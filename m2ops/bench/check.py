"""Correctness of one benchmark point against the chunked reference in float32 on the same device and inputs
(python -m m2ops.bench --check): m2ops's y and final state, or with --backward its gradients of x, dt, A, B,
C, D and the initial state. The reference runs a few heads at a time (heads are independent given B and C;
B's and C's gradients are summed over the slices), so that its (chunks x heads x L x L) intermediates stay
small at 256K tokens."""

from __future__ import annotations

import torch

from ..reference.chunked import chunk_cumsum, compute_out, fwd_pass_state


def rel_err(a, b) -> float:
    """||a - b|| / ||b||, normwise in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "initial_states")


def _slices(h: int, heads_per_step: int):
    return [slice(h0, min(h, h0 + heads_per_step)) for h0 in range(0, h, heads_per_step)]


def _group_columns(t, hs: slice, nheads: int):
    """B or C for the heads of slice hs: the tensor itself with one group, else each head's group column."""
    ngroups = t.shape[2]
    if ngroups == 1:
        return t
    idx = torch.arange(hs.start, hs.stop, device=t.device) // (nheads // ngroups)
    return t[:, :, idx]


def _forward(x, dt, A, B, C, D, init, chunk_size):
    """The reference forward of one head slice (float32 tensors): y and the final state."""
    dt_out, cs = chunk_cumsum(dt, A, None, chunk_size, False, 0.0, float("inf"))
    states, final, _ = fwd_pass_state(x, B, dt_out, cs, init, None, None)
    return compute_out(x, dt_out, cs, C, B, states, D, None, None), final


@torch.no_grad()
def reference(inputs: dict, chunk_size: int, heads_per_step: int = 8):
    """(y, final_states) of the forward with D and initial states, in float32."""
    x, dt, A, B, C, D, init = (inputs[k].float() for k in GRAD_NAMES)
    h = x.shape[2]
    ys, finals = [], []
    for hs in _slices(h, heads_per_step):
        y, final = _forward(x[:, :, hs], dt[:, :, hs], A[hs], _group_columns(B, hs, h), _group_columns(C, hs, h),
                            D[hs], init[:, hs], chunk_size)
        ys.append(y)
        finals.append(final)
    return torch.cat(ys, dim=2), torch.cat(finals, dim=1)


def reference_grads(inputs: dict, chunk_size: int, dout, dfinal, heads_per_step: int = 8):
    """The float32 reference's gradients of GRAD_NAMES for output cotangents (dout, dfinal), in that order."""
    x, dt, A, B, C, D, init = (inputs[k].detach().float() for k in GRAD_NAMES)
    B, C = B.requires_grad_(), C.requires_grad_()
    h = x.shape[2]
    per_head = {k: [] for k in ("x", "dt", "A", "D", "initial_states")}
    for hs in _slices(h, heads_per_step):
        leaves = dict(x=x[:, :, hs], dt=dt[:, :, hs], A=A[hs], D=D[hs], initial_states=init[:, hs])
        leaves = {k: v.clone().requires_grad_() for k, v in leaves.items()}
        with torch.enable_grad():
            y, final = _forward(leaves["x"], leaves["dt"], leaves["A"], _group_columns(B, hs, h),
                                _group_columns(C, hs, h), leaves["D"], leaves["initial_states"], chunk_size)
            torch.autograd.backward((y, final), (dout[:, :, hs].float(), dfinal[:, hs].float()))
        for k, v in leaves.items():
            per_head[k].append(v.grad)
    dims = dict(x=2, dt=2, A=0, D=0, initial_states=1)
    grads = {k: torch.cat(v, dim=dims[k]) for k, v in per_head.items()}
    grads.update(B=B.grad, C=C.grad)
    return tuple(grads[k] for k in GRAD_NAMES)


def errors(inputs: dict, chunk_size: int, y, final) -> dict:
    y_ref, final_ref = reference(inputs, chunk_size)
    return {"err_y": rel_err(y, y_ref), "err_final": rel_err(final, final_ref)}


def grad_errors(inputs: dict, chunk_size: int, grads, dout, dfinal) -> dict:
    """Each gradient's normwise relative error against the reference's, and the largest of them."""
    ref = reference_grads(inputs, chunk_size, dout, dfinal)
    each = {name: rel_err(g, r) for name, g, r in zip(GRAD_NAMES, grads, ref)}
    return {"err_grads": each, "err_grad_max": max(each.values())}
