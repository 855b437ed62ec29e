"""The backward of the three chunked ops as explicit PyTorch formulas: the specification the backward kernels
implement, and the backward of every op on the reference path.

Notation as in chunked.py (b batch, h heads of which r share each of g groups, c chunks, l and s positions in
a chunk, p headdim, n dstate); cs = dA_cumsum, dt = dt_out, S_c the state entering chunk c, and gX the
gradient of the loss with respect to X. Everything is computed in the compute dtype (float32, or float64 for
float64 inputs); each gradient is returned in its input's dtype.

chunk_cumsum. v = dt_raw (+ dt_bias), u = softplus(v) (or v), d = clamp(u, dt_min, dt_max), cs_l = sum_{k<=l}
d_k A. A cumsum's gradient is the reverse cumsum, R_l = sum_{i>=l} gcs_i, so
    gd = gdt_out + R A,        gA = sum_{b,c,l} R d,
    gu = gd [dt_min <= u <= dt_max]                            (torch.clamp: the gradient passes at the bounds)
    gv = gu sigmoid(v) for v <= 20, gu above                   (softplus with threshold 20 is the identity there)
    gdt_raw = gv,              gdt_bias = sum_{b,t} gv.
Padded tail positions of d are constants (0): their gradients are dropped.

fwd_pass_state. w_l = exp(cs_L - cs_l) dt_l m_l (m: token l in the sequence of the chunk's last token) and
carry_c = exp(cs_L) k_c (k: the entering state belongs to that sequence); S_{c+1} = carry_c S_c + local_c
with local_c = sum_l w_l x_l (x) B_l; states[c] = S_c, final = S_C. Reverse recurrence, from gS_C = gfinal:
    glocal_c = gS_{c+1},   gcarry_c = <gS_{c+1}, S_c>,   gS_c = gstates[c] + carry_c gS_{c+1},   ginit = gS_0,
then  gx_l = w_l glocal B_l,  gB_l = sum_{r,p} w_l x_l glocal,  gw_l = <glocal, x_l (x) B_l>,
      gdt_l = gw_l exp(cs_L - cs_l) m_l,  gcs_l -= gw_l w_l,  gcs_L += sum_l gw_l w_l + gcarry carry.
Varlen states (batch 1): V_s = e_s S_{c(s)} + sum_l v_sl x_l (x) B_l over the tokens of sequence s in its last
chunk c(s), e_s = exp(cs_end) o_s, v_sl = exp(cs_end - cs_l) dt_l: the same formulas with cs_end = cs at the
sequence's last token, and gstates[c(s)] += e_s gV_s before the reverse recurrence (several sequences may
share a chunk: their contributions add).

compute_out. y0_l = sum_s W_ls x_s + i_l (C_l . S_c), W_ls = exp(cs_l - cs_s) dt_s (C_l . B_s) on the causal,
same-sequence mask, i_l = exp(cs_l) [token l belongs to the entering state's sequence]; y1 = y0 + D x;
y = y1 silu(z). With gy1 = gy silu(z):
    gz = gy y1 silu'(z),   silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z))),   gD = sum gy1 x,   gx = gy1 D + ...
    inter:  gS_c = sum_l i_l gy1_l (x) C_l,   gC_l += i_l sum_{r,p} gy1_l S_c,   gcs_l += i_l <gy1_l, S_c C_l>
    intra:  gW_ls = <gy1_l, x_s>,  gx_s += sum_l W_ls gy1_l,  gcb_ls = sum_r gW_ls exp(cs_l - cs_s) dt_s,
            gC_l += sum_s gcb_ls B_s,  gB_s += sum_l gcb_ls C_l,  gdt_s = sum_l gW_ls exp(cs_l - cs_s) (C_l . B_s),
            gcs_l += sum_s gW_ls W_ls,  gcs_s -= sum_l gW_ls W_ls      (d exp(cs_l - cs_s) = exp(..) (dcs_l - dcs_s))
Masks are applied before exp (masked_fill with -inf), so masked entries are exact zeros and never inf * 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..meta.shapes import compute_dtype
from .chunked import by_group, seq_chunks, to_chunks

_NEG_INF = float("-inf")


def _finish(grads, inputs, dtypes):
    """Each gradient contiguous, in its input's dtype, and never sharing storage with an input (custom ops
    may not return their inputs)."""
    taken = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()}
    out = []
    for g, dt in zip(grads, dtypes):
        g = g.to(dt).contiguous()
        out.append(g.clone() if g.numel() and g.untyped_storage().data_ptr() in taken else g)
    return tuple(out)


def _unchunk(t, T):
    """(b, c, l, ...) -> (b, T, ...): drop the padded tail."""
    return t.flatten(1, 2)[:, :T]


# ---------------------------------------------------------------------------------------------------------
# chunk_cumsum
# ---------------------------------------------------------------------------------------------------------

def chunk_cumsum_bwd(g_dt_out, g_dA_cumsum, dt, A, dt_bias, chunk_size, dt_softplus, dt_min, dt_max):
    """Gradients of dt, A and dt_bias (an empty tensor like g_dt_out when dt_bias is None)."""
    acc = compute_dtype(dt.dtype)
    b, T, h = dt.shape
    v = dt.to(acc)
    if dt_bias is not None:
        v = v + dt_bias.to(acc)
    u = F.softplus(v, threshold=20.0) if dt_softplus else v
    d = to_chunks(u.clamp(dt_min, dt_max), chunk_size).permute(0, 3, 1, 2)  # b h c l
    gcs = g_dA_cumsum.to(acc)
    rev = gcs.flip(-1).cumsum(-1).flip(-1)  # gradient of each term d_l A of the cumsum: sum over i >= l
    g_A = (rev * d).sum((0, 2, 3))
    g_d = g_dt_out.to(acc) + rev * A.to(acc)[:, None, None]
    g_u = _unchunk(g_d.permute(0, 2, 3, 1), T)  # b t h, padded tail dropped
    g_v = g_u * ((u >= dt_min) & (u <= dt_max))
    if dt_softplus:
        g_v = g_v * torch.where(v > 20.0, torch.ones_like(v), torch.sigmoid(v))
    if dt_bias is None:
        return _finish((g_v, g_A, g_dt_out.new_empty((0,))), (g_dt_out, g_dA_cumsum, dt, A),
                       (dt.dtype, A.dtype, g_dt_out.dtype))
    return _finish((g_v, g_A, g_v.sum((0, 1))), (g_dt_out, g_dA_cumsum, dt, A, dt_bias),
                   (dt.dtype, A.dtype, dt_bias.dtype))


# ---------------------------------------------------------------------------------------------------------
# fwd_pass_state
# ---------------------------------------------------------------------------------------------------------

def chunk_end_decays(cs, seq_idx, L):
    """(decay, carry): exp(cs_L - cs_l), zero off the sequence of the chunk's last token, (b, h, c, l); and
    the entering state's decay across each chunk, exp(cs_L), zero where the chunk's last token starts another
    sequence, (b, h, c)."""
    last = cs[..., -1:]
    arg = last - cs
    carry = torch.exp(last[..., 0])
    if seq_idx is not None:
        seq, prev = seq_chunks(seq_idx, L)
        arg = arg.masked_fill((seq != seq[..., -1:]).unsqueeze(1), _NEG_INF)
        carry = carry * (seq[..., -1] == prev).unsqueeze(1)
    return torch.exp(arg), carry


def token_weight_grads(g_w, decay, w, g_carry, carry):
    """Gradients of dt_out and dA_cumsum from those of the token weights w = decay dt (g_w, (b, h, c, l)) and
    of the carries (g_carry, (b, h, c)): dw = w (dcs_L - dcs_l), dcarry = carry dcs_L."""
    gw_w = g_w * w
    g_last = gw_w.sum(-1) + g_carry * carry
    g_cs = torch.cat([-gw_w[..., :-1], g_last[..., None] - gw_w[..., -1:]], dim=-1)
    return g_w * decay, g_cs


def fwd_pass_state_bwd(g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, initial_states, seq_idx,
                       cu_seqlens):
    """Gradients of x, B, dt_out, dA_cumsum and initial_states (an empty tensor like g_states when it is
    None): the entering states recomputed (the forward recurrence), the varlen states' gradients folded in,
    then state_passing_bwd and chunk_state_bwd."""
    b, T, h, p = x.shape
    L = dt_out.shape[-1]
    nc = dt_out.shape[2]
    acc = dt_out.dtype
    xc = to_chunks(x.to(acc), L)  # b c l h p
    Bc = to_chunks(B.to(acc), L)  # b c l g n
    cs = dA_cumsum.to(acc)
    decay, carry = chunk_end_decays(cs, seq_idx, L)  # b h c l, b h c
    w_t = (decay * dt_out.to(acc)).permute(0, 2, 3, 1)  # b c l h
    # the forward recurrence again: the backward needs every entering state S_c
    local = torch.einsum("bclgrp,bclgn->bcgrpn", by_group(xc * w_t[..., None], B.shape[2], 3), Bc).flatten(2, 3)
    s = initial_states.to(acc) if initial_states is not None else x.new_zeros((b, h, p, B.shape[-1]), dtype=acc)
    entering = []
    for c in range(nc):
        entering.append(s)
        s = carry[:, :, c, None, None] * s + local[:, c]
    states = torch.stack(entering, dim=1) if nc else x.new_zeros((b, 0, h, p, B.shape[-1]), dtype=acc)

    g_st = g_states.to(acc)
    g_x, g_B = torch.zeros_like(xc), torch.zeros_like(Bc)
    g_dt, g_cs = torch.zeros_like(decay), torch.zeros_like(decay)
    if cu_seqlens is not None and g_varlen.numel():
        g_st = g_st.clone()
        _varlen_states_bwd(g_varlen.to(acc), xc, Bc, dt_out.to(acc), cs, states, cu_seqlens,
                           g_st, g_x, g_B, g_dt, g_cs)
    g_local, g_carry, g_init = state_passing_bwd(g_st, g_final, states, cs, seq_idx, acc)
    grads = (_unchunk(g_x, T).contiguous(), _unchunk(g_B, T).contiguous(), g_dt, g_cs)
    chunk_state_bwd(g_local, g_carry, x.to(acc), B.to(acc), dt_out.to(acc), cs, seq_idx, *grads)
    inputs = (g_states, g_final, g_varlen, x, B, dt_out, dA_cumsum, initial_states)
    dtypes = (x.dtype, B.dtype, dt_out.dtype, dA_cumsum.dtype)
    if initial_states is None:
        return _finish(grads + (g_states.new_empty((0,)),), inputs, dtypes + (g_states.dtype,))
    return _finish(grads + (g_init,), inputs, dtypes + (initial_states.dtype,))


def state_passing_bwd(g_states, g_final, states, dA_cumsum, seq_idx, g_local_dtype):
    """The reverse recurrence, from gS_C = g_final: (g_local (b, c, h, p, n) in g_local_dtype, the gradient of
    each chunk's local state; g_carry (b, h, c), of each chunk's carry; g_init (b, h, p, n), of the initial
    state), the last two in dA_cumsum's dtype. states: the entering states (b, c, h, p, n)."""
    acc = dA_cumsum.dtype
    nc = dA_cumsum.shape[2]
    _, carry = chunk_end_decays(dA_cumsum, seq_idx, dA_cumsum.shape[-1])
    states, g_st = states.to(acc), g_states.to(acc)
    gS = g_final.to(acc)
    g_local = [None] * nc
    g_carry = [None] * nc
    for c in reversed(range(nc)):
        g_local[c] = gS
        g_carry[c] = (gS * states[:, c]).sum((-2, -1))  # b h
        gS = g_st[:, c] + carry[:, :, c, None, None] * gS
    b, h, p, n = g_final.shape
    g_local = torch.stack(g_local, dim=1) if nc else g_final.new_zeros((b, 0, h, p, n), dtype=acc)
    g_carry = torch.stack(g_carry, dim=2) if nc else g_final.new_zeros((b, h, 0), dtype=acc)
    return _finish((g_local, g_carry, gS), (g_states, g_final, states, dA_cumsum), (g_local_dtype, acc, acc))


def chunk_state_bwd(g_local, g_carry, x, B, dt_out, dA_cumsum, seq_idx, g_x, g_B, g_dt, g_cs):
    """Through each chunk's local state sum_l w_l x_l (x) B_l and its carry, from state_passing_bwd's g_local
    and g_carry: adds the gradients of x, B, dt_out and dA_cumsum into g_x (b, T, h, p), g_B (b, T, g, n), g_dt
    and g_cs (b, h, c, L), in place (each sum formed in the accumulation dtype, rounded once)."""
    b, T, h, p = x.shape
    g = B.shape[2]
    L = dt_out.shape[-1]
    acc = dt_out.dtype
    xc = to_chunks(x.to(acc), L)  # b c l h p
    Bc = to_chunks(B.to(acc), L)  # b c l g n
    decay, carry = chunk_end_decays(dA_cumsum.to(acc), seq_idx, L)
    w = decay * dt_out.to(acc)
    w_t = w.permute(0, 2, 3, 1)  # b c l h
    gl = by_group(g_local.to(acc), g, 2)  # b c g r p n
    gLB = torch.einsum("bcgrpn,bclgn->bclgrp", gl, Bc).flatten(3, 4)  # b c l h p: sum_n glocal B_l
    g_B2 = torch.einsum("bcgrpn,bclgrp->bclgn", gl, by_group(xc * w_t[..., None], g, 3))
    g_w = (gLB * xc).sum(-1).permute(0, 3, 1, 2)  # b h c l
    g_dt2, g_cs2 = token_weight_grads(g_w, decay, w, g_carry.to(acc), carry)
    for grad, part in ((g_x, _unchunk(gLB * w_t[..., None], T)), (g_B, _unchunk(g_B2, T)), (g_dt, g_dt2),
                       (g_cs, g_cs2)):
        grad.copy_(grad.to(acc) + part)


def _varlen_states_bwd(gV, xc, Bc, dt_out, cs, states, cu_seqlens, g_st, g_x, g_B, g_dt, g_cs):
    """Adds the gradients through varlen_states (batch 1) into g_st (b c h p n), g_x (b c l h p),
    g_B (b c l g n), g_dt and g_cs (b h c l), in place. The forward is chunked.varlen_states."""
    L = dt_out.shape[-1]
    h, g = dt_out.shape[1], Bc.shape[3]
    starts, last_tok = cu_seqlens[:-1].long(), cu_seqlens[1:].long() - 1
    chunk = torch.div(last_tok, L, rounding_mode="floor")
    pos = chunk[:, None] * L + torch.arange(L, device=chunk.device)  # (s, l) padded token positions
    inside = (pos >= starts[:, None]) & (pos <= last_tok[:, None])
    cs_f = cs[0].permute(1, 2, 0).reshape(-1, h)  # (c*l, h)
    dt_f = dt_out[0].permute(1, 2, 0).reshape(-1, h)
    cs_end = cs_f[last_tok]  # (s, h)
    E = torch.exp((cs_end[:, None] - cs_f[pos]).masked_fill(~inside[..., None], _NEG_INF))  # (s, l, h)
    v = E * dt_f[pos]
    x_tok = xc[0].flatten(0, 1)[pos]  # (s, l, h, p)
    B_tok = Bc[0].flatten(0, 1)[pos]  # (s, l, g, n)
    owns = (starts < chunk * L) | (starts == 0)
    e = torch.exp(cs_end) * owns[:, None]  # (s, h)
    S = states[0, chunk]  # (s, h, p, n)

    g_st[0].index_add_(0, chunk, e[..., None, None] * gV)
    g_end = (gV * S).sum((-2, -1)) * e  # through e = exp(cs_end)
    gVg = by_group(gV, g, 1)  # s g r p n
    gVB = torch.einsum("sgrpn,slgn->slgrp", gVg, B_tok).flatten(2, 3)  # (s, l, h, p)
    g_x_tok = gVB * v[..., None]
    g_B_tok = torch.einsum("sgrpn,slgrp->slgn", gVg, by_group(x_tok * v[..., None], g, 2))
    g_v = (gVB * x_tok).sum(-1)  # (s, l, h)
    gv_v = g_v * v
    g_end = g_end + gv_v.sum(1)

    flat = pos.flatten()
    g_x.view(-1, *g_x.shape[3:]).index_add_(0, flat, g_x_tok.flatten(0, 1))
    g_B.view(-1, *g_B.shape[3:]).index_add_(0, flat, g_B_tok.flatten(0, 1))
    g_dt_f = torch.zeros_like(dt_f).index_add_(0, flat, (g_v * E).flatten(0, 1))
    g_cs_f = torch.zeros_like(cs_f).index_add_(0, flat, -gv_v.flatten(0, 1)).index_add_(0, last_tok, g_end)
    nc = cs.shape[2]
    g_dt[0] += g_dt_f.reshape(nc, L, h).permute(2, 0, 1)
    g_cs[0] += g_cs_f.reshape(nc, L, h).permute(2, 0, 1)


# ---------------------------------------------------------------------------------------------------------
# compute_out
# ---------------------------------------------------------------------------------------------------------

def gate_grads(g_y, y1, z):
    """y = y1 silu(z): (g_z, g_y1), with silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))."""
    sz = torch.sigmoid(z)
    return g_y * y1 * (sz * (1 + z * (1 - sz))), g_y * (z * sz)


def skip_grads(g_y1, x, D):
    """y1 = y0 + D x, D of shape (h,) or (h, p): (the x gradient D g_y1, g_D summed over batch and tokens)."""
    Dv = D[:, None] if D.dim() == 1 else D
    g_D = (g_y1 * x).sum((0, 1))  # (h, p)
    return g_y1 * Dv, (g_D.sum(-1) if D.dim() == 1 else g_D)


def compute_out_bwd(g_y, x, dt_out, dA_cumsum, C, B, states, D, z, seq_idx):
    """Gradients of x, dt_out, dA_cumsum, C, B, states, D and z (the last two an empty tensor like g_y when
    absent). Recomputes the (L x L) weights, and the pre-gate output when z is given."""
    b, T, h, p = x.shape
    g = B.shape[2]
    L = dt_out.shape[-1]
    acc = dt_out.dtype
    xa = x.to(acc)
    xc = by_group(to_chunks(xa, L), g, 3)  # b c l g r p
    Bc = to_chunks(B.to(acc), L)  # b c l g n
    Cc = to_chunks(C.to(acc), L)
    Sg = by_group(states.to(acc), g, 2)  # b c g r p n
    cs = dA_cumsum.to(acc)
    dt = dt_out.to(acc)
    mask = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    inter_arg = cs
    if seq_idx is not None:
        seq, prev = seq_chunks(seq_idx, L)
        mask = mask & (seq[..., :, None] == seq[..., None, :]).unsqueeze(1)  # b 1 c l s
        inter_arg = cs.masked_fill((seq != prev[..., None]).unsqueeze(1), _NEG_INF)
    inter = by_group(torch.exp(inter_arg), g, 1)  # b g r c l
    decay = torch.exp((cs[..., :, None] - cs[..., None, :]).masked_fill(~mask, _NEG_INF))  # b h c l s
    cb = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc).unsqueeze(2)  # b g 1 c l s
    Wd = by_group(decay * dt[..., None, :], g, 1)  # b g r c l s: exp(cs_l - cs_s) dt_s
    W = Wd * cb
    CS = torch.einsum("bclgn,bcgrpn->bclgrp", Cc, Sg)  # C_l . S_c per head and p
    inter_t = inter.permute(0, 3, 4, 1, 2)[..., None]  # b c l g r 1

    gy = g_y.to(acc)
    g_z = g_D = None
    Da = None if D is None else D.to(acc)
    if z is not None:
        # y1, the output before the gate, again (in the compute dtype, as the forward had it).
        y1 = torch.einsum("bgrcls,bcsgrp->bclgrp", W, xc) + inter_t * CS
        y1 = y1.reshape(b, -1, h, p)[:, :T]
        if Da is not None:
            y1 = y1 + xa * (Da[:, None] if Da.dim() == 1 else Da)
        g_z, gy = gate_grads(gy, y1, z.to(acc))
    g_x_D = None
    if Da is not None:
        g_x_D, g_D = skip_grads(gy, xa, Da)

    dY = by_group(to_chunks(gy, L), g, 3)  # b c l g r p, zero on the padded tail
    # inter-chunk term: i_l C_l . S_c
    g_S = torch.einsum("bclgrp,bclgn->bcgrpn", dY * inter_t, Cc).flatten(2, 3)
    g_C = torch.einsum("bclgrp,bcgrpn->bclgn", dY * inter_t, Sg)
    g_cs = ((dY * CS).sum(-1) * inter.permute(0, 3, 4, 1, 2)).permute(0, 3, 4, 1, 2)  # b g r c l
    # intra-chunk term: sum_s W_ls x_s
    g_W = torch.einsum("bclgrp,bcsgrp->bgrcls", dY, xc)
    g_x = torch.einsum("bgrcls,bclgrp->bcsgrp", W, dY)
    g_cb = (g_W * Wd).sum(2)  # b g c l s
    g_C = g_C + torch.einsum("bgcls,bcsgn->bclgn", g_cb, Bc)
    g_B = torch.einsum("bgcls,bclgn->bcsgn", g_cb, Cc)
    g_dt = (g_W * cb * by_group(decay, g, 1)).sum(-2)  # b g r c s
    gWW = g_W * W  # gradient of the exponent cs_l - cs_s
    g_cs = g_cs + gWW.sum(-1) - gWW.sum(-2)

    g_x = g_x.flatten(3, 4).reshape(b, -1, h, p)[:, :T]
    if g_x_D is not None:
        g_x = g_x + g_x_D
    grads = [g_x, g_dt.flatten(1, 2), g_cs.flatten(1, 2), _unchunk(g_C, T), _unchunk(g_B, T), g_S]
    dtypes = [x.dtype, dt_out.dtype, dA_cumsum.dtype, C.dtype, B.dtype, states.dtype]
    for grad, t in ((g_D, D), (g_z, z)):
        grads.append(g_y.new_empty((0,)) if t is None else grad)
        dtypes.append(g_y.dtype if t is None else t.dtype)
    return _finish(grads, (g_y, x, dt_out, dA_cumsum, C, B, states, D, z), dtypes)
