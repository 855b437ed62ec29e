"""Input validation of the causal convolution's public functions: every error names the argument and what was
expected. Shapes, dtypes, devices and plain values only (traceable by torch.compile), except check_cu_seqlens and
check_update_indices, which read tensor contents and run in eager mode only (validate.should_check_values).
"""

from __future__ import annotations

import torch

from .validate import FLOAT_DTYPES, INDEX_DTYPES

WHERE_FN = "m2ops.causal_conv1d_fn"
WHERE_UPDATE = "m2ops.causal_conv1d_update"
ACTIVATIONS = (None, "silu", "swish")


def _fail(where, kind, name, expected, got):
    raise kind(f"{where}: {name} must be {expected}; got {got}")


def _tensor(where, name, t, dtypes, kind):
    if not isinstance(t, torch.Tensor):
        _fail(where, TypeError, name, "a torch.Tensor", type(t).__name__)
    if t.dtype not in dtypes:
        _fail(where, TypeError, name, f"a tensor of {kind} dtype ({', '.join(str(d) for d in dtypes)})", t.dtype)


def _shape(where, name, t, expected, desc):
    if tuple(t.shape) != tuple(expected):
        _fail(where, ValueError, name, f"of shape {desc} = {tuple(expected)}", tuple(t.shape))


def _same_device(where, x, named):
    for name, t in named:
        if t is not None and t.device != x.device:
            _fail(where, ValueError, name, f"on the same device as x ({x.device})", t.device)


def _weight_and_bias(where, weight, bias, c):
    _tensor(where, "weight", weight, FLOAT_DTYPES, "floating")
    if weight.dim() != 2 or weight.shape[0] != c or weight.shape[1] < 1:
        _fail(where, ValueError, "weight", f"of shape (channels, width) = ({c}, width) with width >= 1",
              tuple(weight.shape))
    if bias is not None:
        _tensor(where, "bias", bias, FLOAT_DTYPES, "floating")
        _shape(where, "bias", bias, (c,), "(channels,)")


def check_activation(activation, where):
    """The activation's name: None (identity), "silu" or "swish" (the same); returns whether it is SiLU."""
    if not (activation is None or isinstance(activation, str)) or activation not in ACTIVATIONS:
        _fail(where, ValueError, "activation", "None, 'silu' or 'swish'", repr(activation))
    return activation is not None


def check_conv_inputs(x, weight, bias, seq_idx, initial_states, return_final_states, cu_seqlens, state_len):
    """Raise TypeError or ValueError for the first argument of causal_conv1d_fn that does not fit (weight is
    already (channels, width))."""
    w = WHERE_FN
    _tensor(w, "x", x, FLOAT_DTYPES, "floating")
    if x.dim() != 3:
        _fail(w, ValueError, "x", "3-dimensional (batch, channels, seqlen)", tuple(x.shape))
    b, c, L = x.shape
    if b < 1 or c < 1 or L < 1:
        _fail(w, ValueError, "x", "non-empty in every dimension (batch, channels, seqlen)", tuple(x.shape))
    _weight_and_bias(w, weight, bias, c)
    width = weight.shape[1]
    if seq_idx is not None:
        _tensor(w, "seq_idx", seq_idx, INDEX_DTYPES, "integer")
        _shape(w, "seq_idx", seq_idx, (b, L), "(batch, seqlen)")
    if initial_states is not None:
        _tensor(w, "initial_states", initial_states, FLOAT_DTYPES, "floating")
        _shape(w, "initial_states", initial_states, (b, c, width - 1), "(batch, channels, width - 1)")
    if cu_seqlens is not None:
        _tensor(w, "cu_seqlens", cu_seqlens, INDEX_DTYPES, "integer")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            _fail(w, ValueError, "cu_seqlens", "1-dimensional (num_sequences + 1,) with at least 2 entries",
                  tuple(cu_seqlens.shape))
        if b != 1:
            _fail(w, ValueError, "x", "of batch 1 when cu_seqlens packs sequences along seqlen", f"batch {b}")
    if not isinstance(return_final_states, bool):
        _fail(w, TypeError, "return_final_states", "a bool", type(return_final_states).__name__)
    if state_len is not None and (isinstance(state_len, bool) or not isinstance(state_len, int) or state_len < 1):
        _fail(w, ValueError, "state_len", "None or an int >= 1", repr(state_len))
    _same_device(w, x, (("weight", weight), ("bias", bias), ("seq_idx", seq_idx),
                        ("initial_states", initial_states), ("cu_seqlens", cu_seqlens)))


def check_update_inputs(x, conv_state, weight, bias, conv_state_indices):
    """The one-token update's rules (x is already (batch, channels)); errors name the argument."""
    w = WHERE_UPDATE
    _tensor(w, "x", x, FLOAT_DTYPES, "floating")
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        _fail(w, ValueError, "x", "of shape (batch, channels) or (batch, channels, 1), non-empty", tuple(x.shape))
    b, c = x.shape
    _weight_and_bias(w, weight, bias, c)
    width = weight.shape[1]
    _tensor(w, "conv_state", conv_state, FLOAT_DTYPES, "floating")
    slots = b if conv_state_indices is None else "slots"
    if (conv_state.dim() != 3 or conv_state.shape[1] != c or conv_state.shape[2] < max(width - 1, 1)
            or (conv_state_indices is None and conv_state.shape[0] != b) or conv_state.shape[0] < 1):
        _fail(w, ValueError, "conv_state",
              f"of shape ({'batch' if conv_state_indices is None else 'slots'}, channels, state_len) = ({slots}, {c}, "
              f"state_len) with state_len >= max(width - 1, 1) = {max(width - 1, 1)}", tuple(conv_state.shape))
    if conv_state_indices is not None:
        _tensor(w, "conv_state_indices", conv_state_indices, INDEX_DTYPES, "integer")
        _shape(w, "conv_state_indices", conv_state_indices, (b,), "(batch,)")
    _same_device(w, x, (("conv_state", conv_state), ("weight", weight), ("bias", bias),
                        ("conv_state_indices", conv_state_indices)))


def check_update_indices(conv_state_indices, slots: int):
    """conv_state_indices must name slots below conv_state's first dimension (negative: skip the row)."""
    if conv_state_indices is not None and conv_state_indices.numel() > 0:
        top = int(conv_state_indices.max())
        if top >= slots:
            _fail(WHERE_UPDATE, ValueError, "conv_state_indices",
                  f"below conv_state.shape[0] = {slots} (negative entries skip their row)", f"index {top}")


def check_cu_seqlens(cu_seqlens, seqlen: int):
    """cu_seqlens must run from 0 to seqlen, strictly increasing (reads its contents: eager mode only)."""
    cu = cu_seqlens.cpu()
    if int(cu[0]) != 0 or int(cu[-1]) != seqlen or bool((cu[1:] <= cu[:-1]).any()):
        _fail(WHERE_FN, ValueError, "cu_seqlens", f"strictly increasing from 0 to seqlen={seqlen}", cu.tolist())


def check_final_states_out(final_states_out, expected):
    """final_states_out, when given: a floating tensor of the final states' shape."""
    if final_states_out is None:
        return
    _tensor(WHERE_FN, "final_states_out", final_states_out, FLOAT_DTYPES, "floating")
    _shape(WHERE_FN, "final_states_out", final_states_out, expected,
           "(batch or num_sequences, channels, state_len)")
