"""The SSD recurrence token by token, in float64: the ground truth the chunked reference is checked against.

Slow by design (a Python loop over tokens), on the CPU whatever the inputs' device; for tests and for the
main job's error check.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_scan(x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
               cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf"))):
    """Returns (y in float64, final state (b, h, p, n), per-sequence final states (s, h, p, n) or None).

    initial_states: (b, h, p, n), the state before token 0 (of seq_idx 0); or, with cu_seqlens packing more than
    one sequence, (num_sequences, h, p, n): sequence k starts from initial_states[k] instead of zero."""
    f = torch.float64
    b, T, h, p = x.shape
    g, n = B.shape[2:]
    x, dt, A, B, C = (t.to("cpu", f) for t in (x, dt, A, B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.to("cpu", f)
    if dt_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt), dt)
    dt = dt.clamp(*dt_limit)
    heads_of = torch.arange(h) // (h // g)  # group read by each head
    per_seq = (initial_states is not None and cu_seqlens is not None and len(cu_seqlens) > 2
               and initial_states.shape[0] == len(cu_seqlens) - 1)
    starts = initial_states.to("cpu", f) if per_seq else None  # the state each sequence restarts from
    if per_seq:
        initial_states = initial_states[:1]  # sequence 0's, before token 0
    state = initial_states.to("cpu", f).clone() if initial_states is not None else x.new_zeros(b, h, p, n)
    if seq_idx is None and cu_seqlens is not None:  # like the public function: cu_seqlens alone restarts too
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long().cpu()
        seq_idx = torch.repeat_interleave(torch.arange(len(lengths)), lengths)[None]
    owner = torch.zeros(b, dtype=torch.long)  # seq_idx the state belongs to; s_{-1} belongs to 0
    ends = set(int(e) - 1 for e in cu_seqlens[1:]) if cu_seqlens is not None else set()
    ys, seq_states = [], []
    for t in range(T):
        if seq_idx is not None:
            cur = seq_idx[:, t].long().cpu()
            same = (cur == owner).to(f)[:, None, None, None]
            state = state * same
            if per_seq:  # batch 1: a new sequence restarts from its own state
                state = state + (1 - same) * starts[int(cur[0])]
            owner = cur
        Bt, Ct = B[:, t, heads_of], C[:, t, heads_of]  # b h n
        decay = torch.exp(dt[:, t] * A.to(f))  # b h
        state = decay[..., None, None] * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ct))
        if t in ends:
            seq_states.append(state[0].clone())
    y = torch.stack(ys, dim=1)
    if D is not None:
        Df = D.to("cpu", f)
        y = y + x * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        y = y * F.silu(z.to("cpu", f))
    varlen = torch.stack(seq_states) if cu_seqlens is not None else None
    return y, state, varlen
