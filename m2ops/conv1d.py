"""m2ops.causal_conv1d_fn and m2ops.causal_conv1d_update: the causal depthwise convolution of the Mamba-2 layer
(+ SiLU), for a prompt and for one decoding token, with causal_conv1d's (the causal-conv1d package's) arguments.

Each reads top-down: checks (meta/conv_validate.py), then one op (ops/conv1d.py: cuTile kernels on CUDA, the
PyTorch reference elsewhere).
"""

from __future__ import annotations

import torch

from .meta import conv_validate as check
from .meta.validate import seq_idx_from_cu_seqlens, should_check_values
from .ops import conv1d as ops
from .reference.conv1d import varlen_final_states


def _as_2d_weight(weight):
    """nn.Conv1d's depthwise weight (channels, 1, width) as (channels, width); anything else unchanged."""
    if isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.shape[1] == 1:
        return weight[:, 0]
    return weight


def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                     final_states_out=None, activation=None, *, cu_seqlens=None, state_len=None):
    """Causal depthwise convolution over seqlen, with optional SiLU.

    Args:
        x: (batch, channels, seqlen). Fastest as the Mamba-2 layer has it: a transposed view of a (batch, seqlen,
            channels) tensor (channels contiguous); other layouts are copied to that one on CUDA.
        weight: (channels, width) (or nn.Conv1d's (channels, 1, width)); tap width-1 multiplies the current token.
        bias: optional (channels,).
        seq_idx: optional (batch, seqlen) integer sequence id of each token: a tap never reads a token of another
            id (the convolution restarts where the id changes).
        initial_states: optional (batch, channels, width - 1): the inputs before x (zeros when absent); they count
            as sequence id 0.
        return_final_states: also return the last state_len inputs of each row (history included, zeros where
            they belong to an earlier sequence than the last token): the initial_states of a call that continues
            the sequence, or the decoding cache of causal_conv1d_update.
        final_states_out: optional tensor the final states are copied into (and returned as).
        activation: None, "silu" or "swish".
        cu_seqlens: optional (num_sequences + 1,) boundaries of sequences packed in batch row 0: the convolution
            restarts at each (seq_idx is derived when not given) and the final states are per sequence,
            (num_sequences, channels, state_len); sequence 0 continues initial_states.
        state_len: the final states' length (default width - 1; width gives the cache layout of mamba_ssm's
            Mamba2, whose first entry the update shifts out unread).

    Returns:
        y (batch, channels, seqlen) in x's dtype (laid out channel-last: a transposed view of a (batch, seqlen,
        channels) tensor), or (y, final_states) with return_final_states.
    """
    weight = _as_2d_weight(weight)
    silu = check.check_activation(activation, check.WHERE_FN)
    check.check_conv_inputs(x, weight, bias, seq_idx, initial_states, return_final_states, cu_seqlens, state_len)
    L, width = x.shape[2], weight.shape[1]
    S = (width - 1 if state_len is None else state_len) if return_final_states else 0
    if cu_seqlens is not None:
        if should_check_values(cu_seqlens):
            check.check_cu_seqlens(cu_seqlens, L)
        if seq_idx is None:
            seq_idx = seq_idx_from_cu_seqlens(cu_seqlens, L)
    if return_final_states:
        nrows = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        check.check_final_states_out(final_states_out, (nrows, x.shape[1], S))
    y, final = ops.causal_conv1d(x, weight, bias, seq_idx, initial_states, silu, S if cu_seqlens is None else 0)
    if not return_final_states:
        return y
    if cu_seqlens is not None:
        final = varlen_final_states(x, initial_states, cu_seqlens, S, width)
    if final_states_out is not None:
        final = final_states_out.copy_(final)
    return y, final


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None):
    """One decoding token of the convolution; updates conv_state in place (as causal-conv1d does).

    Args:
        x: (batch, channels) or (batch, channels, 1): the token's input.
        conv_state: (batch, channels, state_len) with state_len >= width - 1, the last state_len inputs (oldest
            first); with conv_state_indices, (slots, channels, state_len) holding one cache per slot. Its entries
            move one place towards the front and x becomes the last (in conv_state's dtype).
        weight: (channels, width) (or (channels, 1, width)); bias: optional (channels,).
        activation: None, "silu" or "swish".
        cache_seqlens: not supported (circular caches); must be None.
        conv_state_indices: optional (batch,) integer slot of each row; a negative index skips the row (its y is 0
            and no slot is written).

    Returns:
        y like x.
    """
    if cache_seqlens is not None:
        raise ValueError(f"{check.WHERE_UPDATE}: cache_seqlens must be None (circular caches are not supported); "
                         f"got a {type(cache_seqlens).__name__}")
    weight = _as_2d_weight(weight)
    silu = check.check_activation(activation, check.WHERE_UPDATE)
    one_token = isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[-1] == 1
    x2 = x[..., 0] if one_token else x
    check.check_update_inputs(x2, conv_state, weight, bias, conv_state_indices)
    if should_check_values(conv_state_indices):
        check.check_update_indices(conv_state_indices, conv_state.shape[0])
    y = ops.causal_conv1d_update(x2, conv_state, weight, bias, silu, conv_state_indices)
    return y.unsqueeze(-1) if one_token else y
