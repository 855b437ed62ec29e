"""m2ops.Mamba2(cp_group=...): the Mamba-2 layer on a sequence split across the ranks of a group.

Each rank passes its contiguous slice of the sequence, in rank order, each slice at least d_conv tokens long.
Two things cross a rank boundary; everything else (in_proj, the gate, the norm, out_proj) is per token:

- the convolution, whose first outputs read the d_conv - 1 inputs before the slice (the halo). Every rank's
  last d_conv convolution inputs and their sequence ids are gathered once; each rank takes its predecessor's
  last d_conv - 1 as the convolution's initial states, zeroed where they belong to another sequence than the
  slice's first token (rank 0 takes the conv cache, if one is given). The last rank's d_conv are the conv cache
  after the whole sequence;
- the scan, through m2ops.distributed.mamba_chunk_scan_combined (one gather of the ranks' summaries).

Both gathers are autograd-aware: each has one reduce-scatter in backward. The parameters are replicated, so
their gradients are each rank's part of the whole; a data-parallel wrapper over the group sums them, as for the
scan's A, D and dt_bias (docs/distributed.md).

With use_mem_eff_path (the default) a training forward runs m2ops.Mamba2's single mixer op, from the halo and
the state entering the slice, and keeps what it keeps (36.5 KB per token at d_model 2560); the summary that
state needs is computed from the convolution's output under activation checkpointing, so the convolution runs
twice in forward and the summary's inputs are not kept. Otherwise the ops run one after another, the plain
path of m2ops.Mamba2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..conv1d import causal_conv1d_fn
from . import group as ranks
from .scan import mamba_chunk_scan_combined, summarise
from .summary import fold, ids_as_floats, ids_from_floats, rebased

WHERE = "m2ops.Mamba2.forward (cp_group)"
FIELDS = ("d_model", "d_state", "d_conv", "headdim", "nheads", "ngroups", "chunk_size", "rmsnorm", "batch",
          "u.dtype", "seq_idx", "cache", "return_final_states", "gradients")


def forward(layer, u, seqlen=None, seq_idx=None, cu_seqlens=None, cache=None, return_final_states=False):
    """m2ops.Mamba2.forward with layer.cp_group: u is this rank's slice (see the module docstring). A group of
    one rank runs the layer's forward on whole sequences."""
    pg, rank, world = ranks.resolve(layer.cp_group)
    if world == 1:
        return layer._forward_whole(u, seqlen, seq_idx, cu_seqlens, cache, return_final_states)
    _check(layer, pg, rank, u, seqlen, seq_idx, cu_seqlens, cache, return_final_states)
    if seqlen is not None:
        u = u.reshape(-1, seqlen, layer.d_model)
    conv_cache, ssm_cache = cache if cache is not None else (None, None)

    zxbcdt = layer.in_proj(u)
    z0, x0, z, xBC, dt = layer._split(zxbcdt)
    tails = _gather_tails(layer, xBC, seq_idx, pg)  # (world, batch, d_conv, conv_dim), (world, batch, d_conv)
    halo = _halo(layer, tails, rank, seq_idx, conv_cache).to(xBC.dtype)
    if layer._mem_eff(zxbcdt, cache, return_final_states):
        out = _mem_eff_forward(layer, zxbcdt, xBC, dt, halo, seq_idx, ssm_cache, pg, rank)
        return out.flatten(0, 1) if seqlen is not None else out
    x, B, C = _conv(layer, xBC, halo, seq_idx)
    res = mamba_chunk_scan_combined(
        x, dt, layer._A(), B, C, chunk_size=layer.chunk_size, D=layer._D(),
        z=None if layer.rmsnorm else z.unflatten(-1, (layer.nheads, layer.headdim)),
        dt_bias=layer.dt_bias, initial_states=ssm_cache, seq_idx=seq_idx, dt_softplus=True,
        dt_limit=layer.dt_limit, return_final_states=return_final_states, group=pg)
    y = res[0] if return_final_states else res
    out = layer._finish(y.flatten(-2), z, z0, x0)
    if seqlen is not None:
        out = out.flatten(0, 1)
    if not return_final_states:
        return out
    return out, _final_conv_state(layer, tails), res[1]


def _conv(layer, xBC, halo, seq_idx):
    """The convolution (+ SiLU) from the halo, split into the scan's x (b, l, h, p), B and C (b, l, g, n)."""
    xBC = causal_conv1d_fn(xBC.transpose(1, 2), layer.conv1d.weight, layer.conv1d.bias, seq_idx=rebased(seq_idx),
                           initial_states=halo, activation="silu").transpose(1, 2)
    x, B, C = torch.split(xBC, [layer.d_ssm, layer.ngroups * layer.d_state, layer.ngroups * layer.d_state], dim=-1)
    return (x.unflatten(-1, (layer.nheads, layer.headdim)), B.unflatten(-1, (layer.ngroups, layer.d_state)),
            C.unflatten(-1, (layer.ngroups, layer.d_state)))


def _mem_eff_forward(layer, zxbcdt, xBC, dt, halo, seq_idx, ssm_cache, pg, rank):
    """use_mem_eff_path: m2ops.Mamba2's single mixer op (which keeps only zxbcdt and the scan's output) from the
    halo and the state entering this slice. That state needs this rank's summary, hence the convolution's
    output: computed here under activation checkpointing, so that none of it is kept (its backward recomputes
    it), and again inside the op."""
    packed = checkpoint(_summary, layer, xBC, dt, halo, seq_idx, use_reentrant=False)
    rows = ranks.gather(packed, pg)
    shape = (xBC.shape[0], layer.nheads, layer.headdim, layer.d_state)
    entering, _ = fold(rows, rank, ssm_cache, shape, False)
    # (the parent's op takes a conv cache of d_conv inputs and reads its last d_conv - 1: the halo)
    return layer._mixer_mem_eff(zxbcdt, rebased(seq_idx), None, F.pad(halo, (1, 0)), entering)


def _summary(layer, xBC, dt, halo, seq_idx):
    x, B, C = _conv(layer, xBC, halo, seq_idx)
    return summarise(x, dt, layer._A(), B, C, layer.chunk_size, dt_bias=layer.dt_bias, seq_idx=seq_idx,
                     dt_softplus=True, dt_limit=layer.dt_limit)


# ---- the halo ----


def _gather_tails(layer, xBC, seq_idx, pg):
    """Every rank's last d_conv convolution inputs (float32, exact for the layer's dtypes) and their ids."""
    b, _, c = xBC.shape
    K = layer.d_conv
    acc = torch.float64 if xBC.dtype == torch.float64 else torch.float32
    ids = seq_idx[:, -K:] if seq_idx is not None else xBC.new_zeros((b, K), dtype=torch.int64)
    rows = ranks.gather(torch.cat([xBC[:, -K:].to(acc).flatten(), ids_as_floats(ids, acc).flatten()]), pg)
    values, pieces = rows.split([b * K * c, b * K * 3], dim=1)
    return values.view(-1, b, K, c), ids_from_floats(pieces.view(-1, b, K, 3))


def _halo(layer, tails, rank, seq_idx, conv_cache):
    """The convolution's initial states (batch, conv_dim, d_conv - 1): the d_conv - 1 inputs before this
    slice where they are of the slice's first sequence, else zeros."""
    values, ids = tails
    first = seq_idx[:, :1].long() if seq_idx is not None else ids.new_zeros((ids.shape[1], 1))
    if rank == 0:  # the conv cache belongs to sequence 0, as in m2ops.Mamba2
        b, _, c = values.shape[1:]
        halo = (conv_cache[:, :, 1:].transpose(1, 2) if conv_cache is not None
                else values.new_zeros((b, layer.d_conv - 1, c)))
        same = (first == 0).expand(-1, layer.d_conv - 1)
        # Tied to the gathered tails by a zero-sized sum: rank 0's backward then takes part in their exchange.
        halo = halo + values[:, :0].sum()
    else:
        halo, same = values[rank - 1][:, 1:], ids[rank - 1][:, 1:] == first
    return (halo * same[..., None].to(halo.dtype)).transpose(1, 2)


def _final_conv_state(layer, tails):
    """The conv cache after the whole sequence (batch, conv_dim, d_conv): the last rank's last d_conv inputs,
    zeros where they belong to an earlier sequence than its last token (m2ops.Mamba2's layout)."""
    values, ids = tails
    same = (ids[-1] == ids[-1][:, -1:]).to(values.dtype)
    return (values[-1] * same[..., None]).transpose(1, 2).to(layer.conv1d.weight.dtype)


# ---- checks ----


def _check(layer, pg, rank, u, seqlen, seq_idx, cu_seqlens, cache, return_final_states):
    """This rank's inputs, then (unless tracing, capturing or M2OPS_CHECK_VALUES=0) every rank's agreement;
    a failure on any rank raises on every rank."""
    error = None
    try:
        _check_local(layer, u, seqlen, seq_idx, cu_seqlens, cache)
    except (TypeError, ValueError) as e:  # (the layer's messages without their prefix: WHERE names the call)
        error = type(e)(f"{WHERE} (rank {rank} of the group): {str(e).removeprefix('m2ops.Mamba2.forward: ')}")

    def describe():
        needs_grad = torch.is_grad_enabled() and (u.requires_grad or any(p.requires_grad for p in layer.parameters()))
        return [layer.d_model, layer.d_state, layer.d_conv, layer.headdim, layer.nheads, layer.ngroups,
                layer.chunk_size, int(layer.rmsnorm), u.numel() // (seqlen or u.shape[1]) // layer.d_model,
                ranks.dtype_code(u), -1 if seq_idx is None else ranks.dtype_code(seq_idx), int(cache is not None),
                int(return_final_states), int(needs_grad)]
    ranks.agree(pg, rank, error, describe, u.device if isinstance(u, torch.Tensor) else "cpu",
                ranks.checks_exchanged(u), names=FIELDS, where=WHERE)


def _check_local(layer, u, seqlen, seq_idx, cu_seqlens, cache):
    """The layer's own checks of u, seq_idx and cache for this rank's slice, and what a slice needs besides."""
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens must be None with cp_group (pass seq_idx: packed sequences may span ranks)")
    layer._check_u(u, seqlen)
    L = u.shape[1] if seqlen is None else seqlen
    if L < layer.d_conv:
        raise ValueError(f"u must hold at least d_conv={layer.d_conv} tokens on every rank (the convolution's "
                         f"halo comes from the rank before); got {L}")
    layer._check_ids_and_cache(u.shape[0] if seqlen is None else u.shape[0] // seqlen, L, seq_idx, cache)
