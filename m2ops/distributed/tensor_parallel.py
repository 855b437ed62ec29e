"""m2ops.Mamba2(process_group=...): tensor parallelism, the heads and groups split across the ranks of a group.

Rank r of W holds part r of each per-channel segment of every parameter, in the segment order of the unsharded
layer (mamba_ssm's layout):

    in_proj (column-parallel)   rows of z0, x0 (the MLP part), z, x, B, C, dt: each segment split separately
    conv1d                      channels of x, B, C
    dt_bias, A_log, D           its heads (D: or their channels, with D_has_hdim)
    norm.weight                 its channels; the norm's groups stay whole (W divides ngroups)
    out_proj (row-parallel)     input columns of the MLP part and of y; its bias is replicated

so that the layer's forward and step run unchanged on the local sizes (nheads, ngroups, d_ssm, d_inner and
conv_dim are the shard's) and the decoding caches are per-rank shards. The only exchanges are around in_proj and
out_proj. Autograd follows Megatron-LM's convention: every rank computes the same loss from the replicated
output, or with sequence_parallel its rows' share of one loss:

    in_proj's input     identity, its gradient all-reduced     (sequence_parallel: all-gather / reduce-scatter)
    out_proj's output   all-reduce, its gradient as it is      (sequence_parallel: reduce-scatter / all-gather)

The collectives are functional (torch.distributed._functional_collectives), so torch.compile traces them.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol

from . import group as ranks

WHERE = "m2ops.Mamba2"

# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old names.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


# ---- construction ----


def setup(layer, process_group, cp_group):
    """Resolve process_group and turn the layer's sizes (set from the unsharded arguments) into this rank's shard's.
    Sets layer.tp_group, tp_rank, tp_world (left None, 0, 1 for a group of one rank: nothing to exchange)."""
    if cp_group is not None:
        raise ValueError(f"{WHERE}: process_group and cp_group cannot both be given (tensor parallelism together "
                         "with context parallelism is not supported yet)")
    pg, rank, world = _resolve(process_group)
    sizes = {"nheads": layer.nheads, "ngroups": layer.ngroups, "d_inner - d_ssm": layer.d_inner - layer.d_ssm}
    if any(v % world for v in sizes.values()):
        raise ValueError(f"{WHERE}: process_group's size ({world} ranks) must divide nheads, ngroups and "
                         f"d_inner - d_ssm (each rank holds 1/{world} of them); got "
                         + ", ".join(f"{k}={v}" for k, v in sizes.items()))
    if world == 1:  # nothing to split or exchange
        return
    layer.tp_group, layer.tp_rank, layer.tp_world = pg, rank, world
    layer._tp_group_name = pg.group_name  # what the collectives take: a string torch.compile traces as a constant
    layer.nheads //= world
    layer.ngroups //= world
    layer.d_ssm //= world
    layer.d_inner //= world


def _resolve(process_group):
    """group.resolve's rules (ProcessGroup, 1-D DeviceMesh, (mesh, dim)), its errors under this argument's name."""
    try:
        return ranks.resolve(process_group)
    except (TypeError, ValueError) as e:
        raise type(e)(str(e).replace(f"{ranks.WHERE}: group", f"{WHERE}: process_group", 1)) from None


# ---- the exchanges of forward and step ----


def enter(layer, u, seqlen):
    """in_proj's input. Without sequence_parallel u is the same on every rank: returned as it is, its gradient
    summed over the group (each rank's heads contribute part of it). With sequence_parallel u is this rank's
    share of the tokens: all ranks' shares, in rank order (along dim 1 of (batch, seqlen_local, d_model); of the
    rows of the flattened (rows, d_model) form with seqlen)."""
    name = layer._tp_group_name
    if not layer.sequence_parallel:
        return _CopyToGroup.apply(u, name)
    if seqlen is not None and (u.shape[0] * layer.tp_world) % seqlen:
        raise ValueError(f"{WHERE}.forward: seqlen={seqlen} must divide the rows of all ranks' u (sequence_parallel:"
                         f" {layer.tp_world} ranks x {u.shape[0]} rows, (batch * seqlen, d_model) in all)")
    return _GatherTokens.apply(u.contiguous(), 0 if seqlen is not None else 1, name)


def leave(layer, out, seqlen, decode=False):
    """out_proj's output (this rank's partial sum, without the bias) -> the layer's: summed over the group, or
    with sequence_parallel (not at decode) reduce-scattered to this rank's tokens, split as `enter` split them;
    then out_proj's bias, once."""
    name = layer._tp_group_name
    bias = layer.out_proj.bias
    if decode or not layer.sequence_parallel:
        out = _SumOverGroup.apply(out, name)
    else:
        out = _ScatterTokens.apply(out, 0 if seqlen is not None else 1, name)
        # Each rank adds the bias to its own tokens only: its gradient is summed over the group, so that every
        # rank's copy gets the whole gradient and the replicas stay equal.
        bias = None if bias is None else _CopyToGroup.apply(bias, name)
    return out if bias is None else out + bias


def _all_reduce(t, name):
    return funcol.wait_tensor(funcol.all_reduce(t.contiguous(), "sum", name))


class _CopyToGroup(torch.autograd.Function):
    """Identity; backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.name), None


class _SumOverGroup(torch.autograd.Function):
    """Sum over the group; backward passes the gradient as it is (every rank holds the whole one)."""

    @staticmethod
    def forward(ctx, x, name):
        return _all_reduce(x, name)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherTokens(torch.autograd.Function):
    """All ranks' shares along `dim`, in rank order; backward sums the gradient over the group and keeps this
    rank's share (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, dim, name):
        ctx.dim, ctx.name = dim, name
        return funcol.wait_tensor(_all_gather(x, dim, name))

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(_reduce_scatter(grad.contiguous(), "sum", ctx.dim, ctx.name)), None, None


class _ScatterTokens(torch.autograd.Function):
    """The sum over the group, this rank's share along `dim` of it (a reduce-scatter); backward gathers the
    shares' gradients."""

    @staticmethod
    def forward(ctx, x, dim, name):
        ctx.dim, ctx.name = dim, name
        return funcol.wait_tensor(_reduce_scatter(x.contiguous(), "sum", dim, name))

    @staticmethod
    def backward(ctx, grad):
        return funcol.wait_tensor(_all_gather(grad.contiguous(), ctx.dim, ctx.name)), None, None


# ---- state dicts ----


def _layout(layer):
    """{name: (dim, the unsharded segment lengths along dim)} of the sharded parameters; rank r holds part r
    of each segment, in segment order. Parameters not named (out_proj.bias) are replicated."""
    W = layer.tp_world
    mlp, ssm = (layer.d_inner - layer.d_ssm) * W, layer.d_ssm * W
    bc, h = layer.ngroups * layer.d_state * W, layer.nheads * W
    xbc = [ssm, bc, bc]
    per_head = [ssm if layer.D_has_hdim else h]
    return {"in_proj.weight": (0, [mlp, mlp, ssm, *xbc, h]), "in_proj.bias": (0, [mlp, mlp, ssm, *xbc, h]),
            "conv1d.weight": (0, xbc), "conv1d.bias": (0, xbc), "dt_bias": (0, [h]), "A_log": (0, [h]),
            "D": (0, per_head), "norm.weight": (0, [ssm]), "out_proj.weight": (1, [mlp, ssm])}


def shard_state_dict(layer, state_dict):
    """An unsharded state dict (the one-rank layer's, or mamba_ssm's) -> this rank's shard of each tensor.
    Strict: every key of the layer, nothing else, each of its unsharded shape (ValueError naming the key)."""
    where = f"{WHERE}.load_full_state_dict"
    own = layer.state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if missing or unexpected:
        raise ValueError(f"{where}: state_dict must hold exactly the layer's keys; missing {missing}, "
                       f"unexpected {unexpected}")
    layout, W, r = _layout(layer), layer.tp_world, layer.tp_rank
    out = {}
    for key, local in own.items():
        full = state_dict[key]
        dim, segments = layout.get(key, (None, None))
        shape = list(local.shape)
        if dim is not None:
            shape[dim] = sum(segments)
        if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(shape):
            raise ValueError(f"{where}: state_dict[{key!r}] must be a tensor of the unsharded layer's shape "
                             f"{tuple(shape)}; got {tuple(getattr(full, 'shape', ())) or type(full).__name__}")
        if dim is None:
            out[key] = full
            continue
        starts = [sum(segments[:i]) + r * (n // W) for i, n in enumerate(segments)]
        out[key] = torch.cat([full.narrow(dim, s, n // W) for s, n in zip(starts, segments)], dim)
    return out


def full_state_dict(layer):
    """The unsharded state dict, gathered from every rank's shards (a collective: every rank of the group calls
    it). One all-gather per sharded tensor."""
    own = {k: v.detach() for k, v in layer.state_dict().items()}
    if layer.tp_group is None:
        return {k: v.clone() for k, v in own.items()}
    layout, W, name = _layout(layer), layer.tp_world, layer._tp_group_name
    out = {}
    for key, local in own.items():
        if key not in layout:
            out[key] = local.clone()
            continue
        dim, segments = layout[key]
        rows = funcol.wait_tensor(_all_gather(local.movedim(dim, 0).contiguous(), 0, name))
        by_rank = [piece.split([n // W for n in segments]) for piece in rows.chunk(W)]
        whole = [by_rank[r][i] for i in range(len(segments)) for r in range(W)]
        out[key] = torch.cat(whole).movedim(0, dim).contiguous()
    return out
