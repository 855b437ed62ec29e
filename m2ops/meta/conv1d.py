"""Shapes and layouts of the causal convolution ops (m2ops::causal_conv1d, its backward, causal_conv1d_update), and
their fake implementations, written once for the reference, the kernels' launchers and torch.compile.

Layout: x is (batch, channels, seqlen); in the Mamba-2 layer it is a transposed view of the input projection's
(batch, seqlen, channels) output, channels contiguous. y and the gradient of x are returned in that layout
whatever x's (conv_output): the layer reads them back as (batch, seqlen, channels) without a copy, and the kernels
tile (tokens, channels) with channels the contiguous dimension.
"""

from __future__ import annotations

# Widths the cuTile kernels are built for (other widths run the reference).
KERNEL_WIDTHS = (2, 3, 4)
# conv_state lengths the update kernel holds in one tile (longer states run the reference).
KERNEL_MAX_STATE_LEN = 8


def conv_output(x):
    """A fresh (batch, channels, seqlen) tensor like x laid out channel-last: the transposed view of a contiguous
    (batch, seqlen, channels) buffer."""
    b, c, L = x.shape
    return x.new_empty((b, L, c)).transpose(1, 2)


def _empty_like_optional(t, ref):
    """The gradient of an optional input: its shape, or an empty tensor like ref when the input is absent."""
    return ref.new_empty((0,)) if t is None else t.new_empty(t.shape)


def causal_conv1d(x, weight, bias, seq_idx, initial_states, silu, final_state_len):
    b, c, _ = x.shape
    return conv_output(x), x.new_empty((b, c, final_state_len))


def causal_conv1d_bwd(g_y, g_final, x, weight, bias, seq_idx, initial_states, silu):
    return (conv_output(x), weight.new_empty(weight.shape), _empty_like_optional(bias, g_y),
            _empty_like_optional(initial_states, g_y))


def causal_conv1d_update(x, conv_state, weight, bias, silu, conv_state_indices):
    return x.new_empty(x.shape)
