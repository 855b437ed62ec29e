"""Correctness of one benchmark point: m2ops's y and final state against the chunked reference in float32 on
the same device and inputs (python -m m2ops.bench --check). The reference runs a few heads at a time (heads
are independent given B and C), so that its (chunks x heads x L x L) intermediates stay small at 256K tokens."""

from __future__ import annotations

import torch

from ..reference.chunked import chunk_cumsum, compute_out, fwd_pass_state


def rel_err(a, b) -> float:
    """||a - b|| / ||b||, normwise in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@torch.no_grad()
def reference(inputs: dict, chunk_size: int, heads_per_step: int = 8):
    """(y, final_states) of the forward with D and initial states, in float32."""
    x, dt, A, B, C, D, init = (inputs[k] for k in ("x", "dt", "A", "B", "C", "D", "initial_states"))
    h = x.shape[2]
    ngroups = B.shape[2]
    ys, finals = [], []
    for h0 in range(0, h, heads_per_step):
        hs = slice(h0, min(h, h0 + heads_per_step))
        xs = x[:, :, hs].float()
        if ngroups == 1:
            Bs, Cs = B.float(), C.float()
        else:  # each head of the slice with its own column of its group's B and C
            idx = torch.arange(hs.start, hs.stop, device=x.device) // (h // ngroups)
            Bs, Cs = B[:, :, idx].float(), C[:, :, idx].float()
        dt_out, cs = chunk_cumsum(dt[:, :, hs].float(), A[hs].float(), None, chunk_size, False, 0.0, float("inf"))
        states, final, _ = fwd_pass_state(xs, Bs, dt_out, cs, init[:, hs].float(), None, None)
        ys.append(compute_out(xs, dt_out, cs, Cs, Bs, states, D[hs].float(), None, None))
        finals.append(final)
    return torch.cat(ys, dim=2), torch.cat(finals, dim=1)


def errors(inputs: dict, chunk_size: int, y, final) -> dict:
    y_ref, final_ref = reference(inputs, chunk_size)
    return {"err_y": rel_err(y, y_ref), "err_final": rel_err(final, final_ref)}
